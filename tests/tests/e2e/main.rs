//! The real `flowctl` binary on veth pairs in network namespaces, with real
//! traffic, a module per feature; the harness (the agent, traffic, cgroups,
//! a downstream) is in `flowctl_tests`. Bounds come from timestamps the
//! harness records, never from exact counts or sleeps. Root only; serial.
//!
//! The kernel matrix runs a subset by test name (`E2E_SUBSET` in
//! xtask/src/tiers.rs): a test keeps its name wherever it moves.

mod bbr;
mod breakers;
mod coexistence;
mod fleet_limits;
mod fleet_profiles;
mod fleet_quotas;
mod floods;
mod klimiter;
mod lifecycle;
mod limits;
mod lists;
mod observability;
mod shaping;

use bbr::*;
use breakers::*;
use coexistence::*;
use fleet_limits::*;
use fleet_profiles::*;
use fleet_quotas::*;
use floods::*;
use klimiter::*;
use lifecycle::*;
use limits::*;
use lists::*;
use observability::*;
use shaping::*;

/// One UDP rule on port 7000, 100/s with a burst of 20 per source: the
/// profile of most tests that need one.
const UDP_RULE: &str = "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n\
[[rule]]\nname = \"udp\"\nproto = \"udp\"\ndport = 7000\nrate = \"100/s\"\nburst = 20\nkey = \"src\"\n";

/// The tests and what each needs (flowctl_tests::need): root for the
/// namespaces and the agent; the breakers' tests a cgroup v2 hierarchy,
/// `bpf_set_retval` (5.18), python3 clients and nftables counters.
fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        udp_limit_holds_within_bounds_then_detaches: [Root],
        keep_survives_sigkill_and_restart_adopts_state: [Root],
        apply_through_the_agent_is_all_or_nothing: [Root],
        error_paths_say_how_to_fix: [Root],
        tcp_connection_rate_within_bounds: [Root],
        tcp_connection_quota: [Root],
        booked_retransmissions_give_tcp_clients_the_rate: [Root],
        warm_up_ramps_real_traffic_and_status_shows_it: [Root],
        shaper_paces_tcp_and_udp_senders: [Root, Qdisc("fq"), Command("tc"), Command("nstat")],
        shapers_are_refused_whole_without_fq: [Root, NoQdisc("fq"), Command("tc")],
        wrk_through_nginx_gets_the_configured_connection_rate: [Root, Command("nginx"), Command("wrk")],
        a_million_source_syn_flood_spares_new_clients: [Root],
        a_flood_spread_over_prefixes_is_held_by_a_nested_prefix_limit: [Root],
        a_flooded_rule_is_lent_a_sketch_and_spares_other_keys: [Root],
        an_isolated_rule_keeps_its_keys_through_a_flood_and_a_restart: [Root],
        a_million_prefix_list_blocks_and_updates_atomically: [Root],
        a_destination_list_guards_the_addresses_it_names: [Root],
        foreign_xdp_program_is_not_replaced: [Root],
        flowctl_and_xdp_filter_share_an_interface: [Root, Freplace, Command("xdp-filter"), Command("nsenter")],
        one_agent_per_attachment_and_layout_versions_are_checked: [Root],
        an_older_layouts_data_plane_is_taken_over_without_a_gap: [Root],
        the_previous_layouts_release_is_taken_over_without_a_gap: [Root, EnvFile("FLOWCTL_PREVIOUS_BIN")],
        a_new_agent_waits_for_a_stopping_one: [Root],
        detach_leaves_nothing_behind: [Root],
        the_agent_tells_its_service_manager_ready_watchdog_and_stopping: [Root],
        detach_stops_the_agent_before_its_egress_filters_go: [Root, Command("tc")],
        metrics_endpoint_matches_status: [Root, Command("promtool")],
        top_once_json_agrees_with_traffic: [Root],
        top_keys_finds_the_heaviest_sources: [Root],
        status_counts_connections_since_attach: [Root],
        json_logs_carry_every_status_line_once: [Root],
        kernel_events_reach_the_agents_log_when_asked: [Root],
        status_and_top_take_netns_and_show_would_drops: [Root],
        top_runs_in_a_terminal_and_restores_it: [Root, Command("tmux")],
        top_fits_small_terminals_and_agrees_with_json: [Root, Command("tmux")],
        bbr_refuses_connections_beyond_the_limit_and_fails_open: [Root],
        klimiter_cuts_low_priority_first_and_holds_on_garbage: [Root],
        klimiter_holds_an_egress_level_by_cutting_low_priority_first: [Root],
        breaker_sre_fails_fast_at_the_predicted_share_and_recovers: [Root, CgroupV2, Kernel(5, 18), Command("python3"), Command("nft")],
        breaker_state_opens_on_timeouts_probes_and_closes: [Root, CgroupV2, Kernel(5, 18), Command("python3"), Command("nft")],
        global_limit_holds_across_three_agents_through_redis: [Root, Command("redis-server"), Command("redis-cli")],
        global_quota_moves_between_hosts_without_being_spent_twice: [Root, Command("redis-server"), Command("redis-cli")],
        fleet_profiles_roll_out_and_bad_ones_are_rejected_whole: [Root, Command("etcd"), Command("etcdctl")],
        fleet_profiles_outlive_etcd_and_restart_from_the_disk_copy: [Root, Command("etcd"), Command("etcdctl")],
        fleet_profiles_relist_after_a_compaction_and_never_go_back: [Root, Command("etcd"), Command("etcdctl")],
        fleet_profiles_need_the_right_password: [Root, Command("etcd"), Command("etcdctl")],
        fleet_profiles_over_tls_with_client_certificates: [Root, Command("etcd"), Command("etcdctl"), Command("openssl")],
    ]);
}
