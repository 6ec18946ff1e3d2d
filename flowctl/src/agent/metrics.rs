//! Prometheus metrics: `flowctl attach ... --metrics [ADDR]` serves the
//! exposition at `http://ADDR/metrics` (default 127.0.0.1:9464).
//!
//! Each scrape reads the pinned maps and the attachment state afresh, so the
//! numbers are the kernel's, never a cache of the agent's. prometheus-client
//! does the encoding (names, escaping, `# TYPE`/`# HELP`); tiny_http is the
//! small HTTP server, on its own thread, so a slow scraper never delays the
//! agent's heartbeat. With `--netns` the agent lives in that namespace, but
//! the address is bound in the namespace it was started in ([`Endpoint`]);
//! the body's format follows the scraper's `Accept` (`exposition`).

use super::exposition;
use crate::dataplane::{self, pins::AttachId, state::AttachState, Maps};
use anyhow::{anyhow, Context, Result};
use flowctl_common::{reason, GLOBAL_COUNTER_INDEX};
use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use std::{net::SocketAddr, sync::atomic::AtomicU64};

pub const DEFAULT_ADDR: &str = "127.0.0.1:9464";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabel {
    rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BookingLabels {
    rule: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    rule: String,
    /// 1 to `MAX_NESTED_LIMITS`: the `[[rule.limit]]` in profile order.
    limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabels {
    rule: String,
    verdict: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SynLabels {
    rule: String,
    verdict: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BaselineLabel {
    baseline: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BaselineRuleLabel {
    baseline: String,
    rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TableLabel {
    table: String,
}

/// What one agent's endpoint exports: its interface attachment, its
/// cgroup's breakers, or both.
#[derive(Clone, Copy, Debug)]
pub struct Scope {
    pub iface: Option<AttachId>,
    pub cgroup_id: Option<u64>,
}

/// The exposition text of a scope, read now (pins for the interface, the
/// published state for breakers).
pub fn render_scope(scope: &Scope) -> Result<String> {
    let mut reg = <Registry>::default();
    if let Some(id) = &scope.iface {
        register_attachment(&mut reg, id)?;
        if let Some(p) = crate::fleet::etcd::follower::published(&id.run_dir()) {
            register_etcd(&mut reg, &p);
        }
    }
    if let Some(cg) = scope.cgroup_id {
        if let Some(p) =
            crate::agent::breakers::published_all().into_iter().find(|p| p.cgroup_id == cg)
        {
            register_breakers(&mut reg, &p);
        }
    }
    let mut out = String::new();
    encode(&mut out, &reg).map_err(|e| anyhow!("encoding metrics: {e}"))?;
    Ok(out)
}

/// The exposition text for one attachment, read from its pins now.
pub fn render(id: &AttachId) -> Result<String> {
    render_scope(&Scope { iface: Some(*id), cgroup_id: None })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BreakerLabel {
    breaker: String,
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BreakerStateLabel {
    breaker: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BreakerCounterLabel {
    breaker: String,
    outcome: String,
}

/// Breakers' metrics from the agent's published state (the agent's own
/// windows and decisions; the counters are the kernel's totals).
fn register_breakers(reg: &mut Registry, p: &crate::agent::breakers::Published) {
    let state = Family::<BreakerStateLabel, Gauge>::default();
    let drop = Family::<BreakerLabel, Gauge<f64, AtomicU64>>::default();
    let window = Family::<BreakerCounterLabel, Gauge>::default();
    let totals = Family::<BreakerCounterLabel, Counter>::default();
    let changed = Family::<BreakerLabel, Gauge<f64, AtomicU64>>::default();
    for b in &p.breakers {
        let l = BreakerLabel { breaker: b.name.clone(), mode: b.mode.clone() };
        for s in ["closed", "throttling", "open", "half-open"] {
            state
                .get_or_create(&BreakerStateLabel { breaker: b.name.clone(), state: s.into() })
                .set((b.state == s) as i64);
        }
        drop.get_or_create(&l).set(b.drop_probability);
        let w = &b.window.outcomes;
        for (k, v) in [
            ("requests", w.requests),
            ("accepts", w.accepts),
            ("refused_by_peer", w.refused_by_peer),
            ("timeouts", w.timeouts),
            ("refused_locally", w.refused_locally),
            ("would_refuse", w.would_refuse),
        ] {
            window
                .get_or_create(&BreakerCounterLabel { breaker: b.name.clone(), outcome: k.into() })
                .set(v as i64);
        }
        for (k, v) in &b.totals {
            totals
                .get_or_create(&BreakerCounterLabel { breaker: b.name.clone(), outcome: k.clone() })
                .inc_by(*v);
        }
        if let Some(t) = &b.last_transition {
            changed.get_or_create(&l).set(t.unix_ms as f64 / 1e3);
        }
    }
    reg.register("flowctl_breaker_state", "Circuit breaker state (1 for the current one)", state);
    reg.register(
        "flowctl_breaker_drop_probability",
        "Share of new connections the breaker refuses now",
        drop,
    );
    reg.register("flowctl_breaker_window", "Outcomes in the breaker's rolling window", window);
    reg.register(
        "flowctl_breaker_connects",
        "connect() outcomes to the breaker's target since it was created",
        totals,
    );
    reg.register(
        "flowctl_breaker_last_transition_seconds",
        "Unix time of the breaker's last state change",
        changed,
    );
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    error: String,
}

/// A profile from etcd: what is applied against the newest, the store's
/// health, rejections, and the current error (with its key, line and
/// column) as a label.
/// A gauge holding `v`.
fn gauge(v: i64) -> Gauge {
    let g = <Gauge>::default();
    g.set(v);
    g
}

fn register_etcd(reg: &mut Registry, p: &crate::fleet::etcd::follower::Published) {
    let applied = p.applied.unwrap_or_default();
    let latest = p.latest.unwrap_or_default();
    reg.register(
        "flowctl_etcd_applied_generation",
        "Generation of the etcd profile enforced",
        gauge(applied.generation as i64),
    );
    reg.register(
        "flowctl_etcd_applied_revision",
        "etcd revision of the profile enforced",
        gauge(applied.revision),
    );
    reg.register(
        "flowctl_etcd_latest_generation",
        "Newest generation seen in etcd",
        gauge(latest.generation as i64),
    );
    reg.register(
        "flowctl_etcd_from_disk_copy",
        "1 while enforcing the disk copy, not a profile read from etcd",
        gauge(p.from_disk_copy as i64),
    );
    let up = matches!(p.store, crate::fleet::etcd::watch::Store::Watching { .. });
    reg.register("flowctl_etcd_store_up", "1 while the agent watches etcd", gauge(up as i64));
    let rejected = <Counter>::default();
    rejected.inc_by(p.rejected_total);
    reg.register("flowctl_etcd_profiles_rejected", "Profiles from etcd rejected whole", rejected);
    let error = Family::<ErrorLabel, Gauge>::default();
    if let Some(e) = &p.error {
        error.get_or_create(&ErrorLabel { error: e.clone() }).set(1);
    }
    reg.register(
        "flowctl_etcd_profile_error",
        "Why the newest etcd profile is not enforced (key:line:col: reason)",
        error,
    );
}

/// Global rules' leases, as the agent publishes them (`leases.json`).
fn register_leases(reg: &mut Registry, p: &crate::agent::leases::Published) {
    let rtt = Gauge::<f64, AtomicU64>::default();
    if let Some(ms) = p.store.rtt_ms {
        rtt.set(ms / 1e3);
    }
    reg.register(
        "flowctl_global_store_up",
        "1 while the lease store (Redis) answers",
        gauge(p.store.up as i64),
    );
    // A state set: one series per state, 1 for the one the store is in.
    let state = Family::<StateLabel, Gauge>::default();
    for s in crate::agent::leases::STORE_STATES {
        state.get_or_create(&StateLabel { state: s.into() }).set((p.store.state == s) as i64);
    }
    reg.register(
        "flowctl_global_store_state",
        "The lease store's state: unknown (not asked yet), ok, unreachable, learning (it lost its state; grants echo what hosts hold for one lease)",
        state,
    );
    reg.register(
        "flowctl_global_store_rtt_seconds",
        "Round trip of the last lease store call",
        rtt,
    );
    if let Some(n) = p.store.hosts {
        reg.register(
            "flowctl_global_hosts",
            "Live hosts in the lease store (heartbeats)",
            gauge(n as i64),
        );
    }
    let keys = Family::<RuleLabel, Gauge>::default();
    let granted = Family::<RuleLabel, Gauge>::default();
    let demand = Family::<RuleLabel, Gauge>::default();
    let quota = Family::<RuleLabel, Gauge>::default();
    let spent = Family::<RuleLabel, Gauge>::default();
    let allowance = Family::<RuleLabel, Gauge<f64, AtomicU64>>::default();
    for r in &p.rules {
        let l = RuleLabel { rule: r.rule.clone() };
        if let Some(a) = r.default_allowance {
            allowance.get_or_create(&l).set(a);
        }
        keys.get_or_create(&l).set(r.leases.iter().filter(|k| k.rate.is_some()).count() as i64);
        granted.get_or_create(&l).set(r.leases.iter().filter_map(|k| k.rate).sum::<u64>() as i64);
        demand.get_or_create(&l).set(r.leases.iter().filter_map(|k| k.demand).sum::<u64>() as i64);
        if r.quota.is_some() {
            quota
                .get_or_create(&l)
                .set(r.leases.iter().filter_map(|k| k.quota).sum::<u64>() as i64);
            spent
                .get_or_create(&l)
                .set(r.leases.iter().filter_map(|k| k.quota_used).sum::<u64>() as i64);
        }
    }
    reg.register(
        "flowctl_global_granted_quota",
        "Sum of this host's quota shares of a global rule, units per window",
        quota,
    );
    reg.register(
        "flowctl_global_quota_spent",
        "Quota units a global rule's leased keys spent here in their windows",
        spent,
    );
    reg.register(
        "flowctl_global_default_allowance_ratio",
        "Live hosts times a global rule's default share, over its limit: what the fleet may admit above the limit while hosts wait for a key's first lease (1 or more: the whole limit again)",
        allowance,
    );
    reg.register(
        "flowctl_global_leased_keys",
        "Keys of a global rule this host holds a lease for",
        keys,
    );
    reg.register(
        "flowctl_global_granted_rate",
        "Sum of this host's grants of a global rule, units/s",
        granted,
    );
    reg.register(
        "flowctl_global_demand_rate",
        "Units/s offered here by a global rule's leased keys",
        demand,
    );
    let counts = [
        ("flowctl_global_store_failures", "Lease store calls that failed", p.failures),
        (
            "flowctl_global_leases_expired",
            "Leases that ended here before a refresh came",
            p.expired,
        ),
        ("flowctl_global_over_cap", "Hot keys refused a lease (at the cap)", p.over_cap),
        (
            "flowctl_global_epoch_changes",
            "Times the store's epoch changed (it lost its state)",
            p.epoch_changes,
        ),
    ];
    for (name, help, n) in counts {
        reg.register(name, help, gauge(n as i64));
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShaperLabel {
    shaper: String,
}

/// The attachment's `[[shaper]]` tables (named by its active profile):
/// the kernel's counts since the agent installed them, and the aggregate
/// shapers' backlog.
fn register_shapers(reg: &mut Registry, id: &AttachId, maps: &Maps) {
    let path = id.run_dir().join(dataplane::pins::run_file::PROFILE);
    let Ok(set) = crate::profile::load_recorded(&path) else { return };
    if set.shapers.is_empty() {
        return;
    }
    let offered = Family::<ShaperLabel, Counter>::default();
    let offered_bytes = Family::<ShaperLabel, Counter>::default();
    let delayed = Family::<ShaperLabel, Counter>::default();
    let delay = Family::<ShaperLabel, Counter<f64, AtomicU64>>::default();
    let dropped = Family::<ShaperLabel, Counter>::default();
    let backlog = Family::<ShaperLabel, Gauge<f64, AtomicU64>>::default();
    for (i, s) in set.shapers.iter().enumerate() {
        let c = maps.shaper_counters(i as u32).unwrap_or_default();
        let l = ShaperLabel { shaper: s.name.clone() };
        offered.get_or_create(&l).inc_by(c.offered_pkts);
        offered_bytes.get_or_create(&l).inc_by(c.offered_bytes);
        delayed.get_or_create(&l).inc_by(c.delayed_pkts);
        delay.get_or_create(&l).inc_by(c.delay_ns as f64 / 1e9);
        dropped.get_or_create(&l).inc_by(c.horizon_drops);
        if !s.per_flow() {
            backlog
                .get_or_create(&l)
                .set(maps.shaper_backlog_ns(i as u32).unwrap_or(0) as f64 / 1e9);
        }
    }
    reg.register("flowctl_shaper_packets", "Packets to the shaper's target", offered);
    reg.register("flowctl_shaper_bytes", "Bytes to the shaper's target", offered_bytes);
    reg.register(
        "flowctl_shaper_delayed_packets",
        "Packets the shaper held back (dry-run: would have)",
        delayed,
    );
    reg.register("flowctl_shaper_delay_seconds", "Sum of the delays the shaper stamped", delay);
    reg.register(
        "flowctl_shaper_horizon_drops",
        "Packets dropped past the shaper's horizon (dry-run: would have been)",
        dropped,
    );
    reg.register(
        "flowctl_shaper_backlog_seconds",
        "How far ahead an aggregate shaper has booked departures",
        backlog,
    );
}

fn register_attachment(reg: &mut Registry, id: &AttachId) -> Result<()> {
    let maps = Maps::open(id)?;
    register_shapers(reg, id, &maps);
    let state = AttachState::load(id)?.ok_or_else(|| anyhow!("no state for the attachment"))?;
    let offered = Family::<RuleLabel, Counter>::default();
    let offered_bytes = Family::<RuleLabel, Counter>::default();
    let packets = Family::<VerdictLabels, Counter>::default();
    let bytes = Family::<VerdictLabels, Counter>::default();
    let insert_failures = Family::<RuleLabel, Counter>::default();
    let key_inserts = Family::<RuleLabel, Counter>::default();
    let syn_bookings = Family::<BookingLabels, Counter>::default();
    let limit_refusals = Family::<LimitLabels, Counter>::default();
    let ratio = Family::<RuleLabel, Gauge<f64, AtomicU64>>::default();
    let bbr_in_flight = Family::<RuleLabel, Gauge<i64>>::default();
    let bbr_max_in_flight = Family::<RuleLabel, Gauge<i64>>::default();
    let bbr_max_pass = Family::<RuleLabel, Gauge<i64>>::default();
    let bbr_min_rt = Family::<RuleLabel, Gauge<i64>>::default();
    let bbr_overloaded = Family::<RuleLabel, Gauge<i64>>::default();
    // What only the agent knows, read once: `None` when it is not running.
    let agent_rec = crate::agent::occupancy::fresh_record(&maps);
    let agent_fresh = agent_rec.is_some();
    let unmatched = Family::<KindLabel, Counter>::default();
    for r in &state.rules {
        let c = maps.counters(r.record)?;
        let rule = RuleLabel { rule: r.name.clone() };
        offered.get_or_create(&rule).inc_by(c.offered_pkts);
        offered_bytes.get_or_create(&rule).inc_by(c.offered_bytes);
        insert_failures.get_or_create(&rule).inc_by(c.insert_failures);
        key_inserts.get_or_create(&rule).inc_by(c.key_inserts);
        if c.booked_syns + c.redeemed_syns > 0 {
            let b = |outcome: &str| BookingLabels { rule: r.name.clone(), outcome: outcome.into() };
            syn_bookings.get_or_create(&b("booked")).inc_by(c.booked_syns);
            syn_bookings.get_or_create(&b("redeemed")).inc_by(c.redeemed_syns);
        }
        for (i, n) in c.limit_refusals.iter().enumerate().filter(|(_, n)| **n > 0) {
            let l = LimitLabels { rule: r.name.clone(), limit: (i + 1).to_string() };
            limit_refusals.get_or_create(&l).inc_by(*n);
        }
        let l = |verdict: &str, reason: &str| VerdictLabels {
            rule: r.name.clone(),
            verdict: verdict.into(),
            reason: reason.into(),
        };
        packets.get_or_create(&l("passed", "")).inc_by(c.passed_pkts);
        bytes.get_or_create(&l("passed", "")).inc_by(c.passed_bytes);
        packets.get_or_create(&l("would_drop", "")).inc_by(c.would_drop_pkts);
        bytes.get_or_create(&l("would_drop", "")).inc_by(c.would_drop_bytes);
        for (i, name) in reason::NAMES.iter().enumerate().take(reason::QUOTA + 1) {
            packets.get_or_create(&l("dropped", name)).inc_by(c.dropped_pkts[i]);
            bytes.get_or_create(&l("dropped", name)).inc_by(c.dropped_bytes[i]);
        }
        let ctl = maps.control.get(&r.record, 0)?;
        ratio.get_or_create(&rule).set(ctl.admission_ratio());
        // BBR's numbers are the agent's: only while it runs.
        if agent_fresh && ctl.flags & flowctl_common::control_flags::BBR_ACTIVE != 0 {
            bbr_in_flight.get_or_create(&rule).set(ctl.bbr_inflight as i64);
            if ctl.bbr_max_inflight != u32::MAX {
                bbr_max_in_flight.get_or_create(&rule).set(ctl.bbr_max_inflight as i64);
            }
            bbr_max_pass.get_or_create(&rule).set(ctl.bbr_max_pass as i64);
            bbr_min_rt.get_or_create(&rule).set(ctl.bbr_min_rt_ms as i64);
            bbr_overloaded.get_or_create(&rule).set(ctl.bbr_overloaded as i64);
        }
    }
    // SYNs since attach: the agent's totals plus the ring since (as status).
    let syns = Family::<SynLabels, Counter>::default();
    if let Ok(t) = crate::agent::syn_totals::now(&maps, &state) {
        for r in &state.rules {
            let s = t.rule(&r.name, r.record).cloned().unwrap_or_default();
            for (verdict, v) in [("passed", s.passed), ("dropped", s.dropped())] {
                syns.get_or_create(&SynLabels { rule: r.name.clone(), verdict: verdict.into() })
                    .inc_by(v);
            }
        }
    }
    let g = maps.counters(GLOBAL_COUNTER_INDEX)?;
    for (kind, v) in [
        ("non_ip", g.non_ip_pkts),
        ("malformed", g.malformed_pkts),
        ("fragment", g.fragment_pkts),
        ("all", g.offered_pkts),
    ] {
        unmatched.get_or_create(&KindLabel { kind: kind.into() }).inc_by(v);
    }
    let memory = Gauge::<i64>::default();
    memory.set(dataplane::pinned_memlock(id) as i64);
    let generation = Gauge::<i64>::default();
    generation.set(maps.global()?.generation as i64);
    let rules = Gauge::<i64>::default();
    rules.set(state.rules.len() as i64);

    // Agent-computed values only while the agent's record is fresh: a
    // stopped agent's last numbers are left out, not exported as current.
    let agent_up = Gauge::<i64>::default();
    agent_up.set(agent_fresh as i64);
    reg.register(
        "flowctl_agent_up",
        "1 while the agent publishes its state (heartbeat within the grace period)",
        agent_up,
    );
    if let Some(fills) =
        agent_rec.and_then(|r| crate::agent::occupancy::estimate(&maps, &state, &r))
    {
        let entries = Family::<TableLabel, Gauge<i64>>::default();
        let capacity = Family::<TableLabel, Gauge<i64>>::default();
        for f in fills {
            let l = TableLabel { table: f.table.into() };
            entries.get_or_create(&l).set(f.entries as i64);
            capacity.get_or_create(&l).set(f.capacity as i64);
        }
        reg.register(
            "flowctl_key_table_entries",
            "Approximate entries per table: the agent's last walk plus inserts since, evictions not counted, capped at capacity",
            entries,
        );
        reg.register("flowctl_key_table_capacity", "Entries each table can hold", capacity);
    }
    if let Some(r) = agent_rec.filter(|r| r.cpu_permille != flowctl_common::NO_CPU_SIGNAL) {
        let cpu = Gauge::<i64>::default();
        cpu.set(r.cpu_permille as i64);
        reg.register("flowctl_cpu_permille", "The agent's CPU signal (EMA), per mille", cpu);
    }
    if let Some(p) = crate::agent::leases::published(&state, agent_fresh) {
        register_leases(reg, &p);
    }
    if let Some(k) = crate::agent::klimiter::published(&state, agent_fresh) {
        let level = Family::<BaselineLabel, Gauge<f64, AtomicU64>>::default();
        let threshold = Family::<BaselineLabel, Gauge<f64, AtomicU64>>::default();
        let coef = Family::<BaselineRuleLabel, Gauge<f64, AtomicU64>>::default();
        let share = Family::<BaselineRuleLabel, Gauge<f64, AtomicU64>>::default();
        for b in &k.baselines {
            let l = BaselineLabel { baseline: b.name.clone() };
            if let Some(v) = b.level {
                level.get_or_create(&l).set(v);
            }
            threshold.get_or_create(&l).set(b.threshold);
            for e in &b.entries {
                let l = BaselineRuleLabel { baseline: b.name.clone(), rule: e.rule.clone() };
                if let Some(c) = e.coefficient {
                    coef.get_or_create(&l).set(c);
                }
                if let Some(s) = e.share {
                    share.get_or_create(&l).set(s);
                }
            }
        }
        reg.register(
            "flowctl_baseline_level",
            "KLimiter: a downstream resource's level (absent while its source fails)",
            level,
        );
        reg.register(
            "flowctl_baseline_threshold",
            "KLimiter: the level it is kept under",
            threshold,
        );
        reg.register(
            "flowctl_baseline_coefficient",
            "KLimiter: estimated level per admitted unit/s of a rule",
            coef,
        );
        reg.register(
            "flowctl_baseline_share",
            "KLimiter: a rule's share of the baseline's level",
            share,
        );
    }
    reg.register("flowctl_offered_packets", "Packets that matched the rule", offered);
    reg.register("flowctl_offered_bytes", "Bytes that matched the rule", offered_bytes);
    reg.register("flowctl_packets", "Packets by rule, verdict and drop reason", packets);
    reg.register("flowctl_bytes", "Bytes by rule, verdict and drop reason", bytes);
    reg.register(
        "flowctl_syns",
        "TCP SYNs without ACK (new connections) since attach, by rule and verdict (a dry-run's would-drops pass)",
        syns,
    );
    reg.register(
        "flowctl_key_insert_failures",
        "Bucket inserts the kernel refused",
        insert_failures,
    );
    reg.register("flowctl_key_inserts", "Buckets the rule created in the key table", key_inserts);
    reg.register(
        "flowctl_syn_bookings",
        "book_retransmits: refused SYNs that booked a token (booked), retransmissions admitted on one (redeemed)",
        syn_bookings,
    );
    reg.register(
        "flowctl_limit_refusals",
        "Packets a nested limit ([[rule.limit]], numbered from 1) refused; also counted as rate drops",
        limit_refusals,
    );
    reg.register(
        "flowctl_bbr_in_flight",
        "BBR: established connections not yet completed",
        bbr_in_flight,
    );
    reg.register(
        "flowctl_bbr_max_in_flight",
        "BBR: the in-flight limit (absent until the window has data)",
        bbr_max_in_flight,
    );
    reg.register(
        "flowctl_bbr_max_pass",
        "BBR: most completions in one bucket of the window",
        bbr_max_pass,
    );
    reg.register(
        "flowctl_bbr_min_rt_milliseconds",
        "BBR: smallest mean connection lifetime of a bucket",
        bbr_min_rt,
    );
    reg.register("flowctl_bbr_overloaded", "BBR: 1 while the in-flight test is on", bbr_overloaded);
    reg.register("flowctl_admission_ratio", "Share of new flows the rule admits (1 = all)", ratio);
    reg.register(
        "flowctl_unmatched_packets",
        "Packets no rule matched, by kind (all = every one)",
        unmatched,
    );
    reg.register("flowctl_kernel_memory_bytes", "Kernel memory the pinned maps lock", memory);
    reg.register("flowctl_profile_generation", "Applies since attach", generation);
    reg.register("flowctl_rules", "Rules in the active profile", rules);
    Ok(())
}

/// The metrics endpoint's socket. An interface agent binds it in the
/// namespace `flowctl attach` was started in, not the interface's
/// (`--netns`), so the host's Prometheus can reach it (a socket keeps the
/// namespace it was made in; `system::netns::Origin`).
pub struct Endpoint {
    addr: SocketAddr,
    server: tiny_http::Server,
}

impl Endpoint {
    pub fn bind(addr: SocketAddr) -> Result<Self> {
        if !addr.ip().is_loopback() {
            crate::system::log::warning(format_args!(
                "metrics on {addr} are reachable from outside this host"
            ));
        }
        let server = tiny_http::Server::http(addr).map_err(|e| {
            anyhow!("serving metrics on {addr}: {e} (pick another with --metrics ADDR)")
        })?;
        Ok(Self { addr, server })
    }

    /// Serves `/metrics` from a thread of its own, in the format the
    /// scraper's `Accept` asks for (`exposition`).
    pub fn serve(self, scope: Scope) -> Result<std::thread::JoinHandle<()>> {
        let Self { addr, server } = self;
        std::thread::Builder::new()
            .name("flowctl-metrics".into())
            .spawn(move || {
                for req in server.incoming_requests() {
                    let resp = if req.url() == "/metrics" {
                        let accept = req
                            .headers()
                            .iter()
                            .find(|h| h.field.equiv("Accept"))
                            .map(|h| h.value.as_str().to_string());
                        let format = exposition::negotiate(accept.as_deref());
                        match render_scope(&scope) {
                            Ok(body) => tiny_http::Response::from_string(format.body(body))
                                .with_header(
                                    format!("Content-Type: {}", format.content_type())
                                        .parse::<tiny_http::Header>()
                                        .expect("static header"),
                                ),
                            Err(e) => tiny_http::Response::from_string(format!("{e:#}\n"))
                                .with_status_code(500),
                        }
                    } else {
                        tiny_http::Response::from_string("see /metrics\n").with_status_code(404)
                    };
                    let _ = req.respond(resp);
                }
            })
            .with_context(|| format!("starting the metrics thread for {addr}"))
    }
}

#[cfg(test)]
mod tests {
    /// Every metric the shipped Grafana dashboard queries is one flowctl
    /// exports (names as `render` registers them, with `_total` on counters).
    #[test]
    fn dashboard_queries_exported_metrics() {
        let exported = [
            "flowctl_offered_packets_total",
            "flowctl_offered_bytes_total",
            "flowctl_packets_total",
            "flowctl_bytes_total",
            "flowctl_key_insert_failures_total",
            "flowctl_admission_ratio",
            "flowctl_unmatched_packets_total",
            "flowctl_kernel_memory_bytes",
            "flowctl_profile_generation",
            "flowctl_rules",
            "flowctl_key_table_entries",
            "flowctl_key_table_capacity",
            "flowctl_agent_up",
            "flowctl_key_inserts_total",
            "flowctl_cpu_permille",
            "flowctl_bbr_in_flight",
            "flowctl_bbr_max_in_flight",
            "flowctl_bbr_max_pass",
            "flowctl_bbr_min_rt_milliseconds",
            "flowctl_bbr_overloaded",
            "flowctl_baseline_level",
            "flowctl_baseline_threshold",
            "flowctl_baseline_coefficient",
            "flowctl_baseline_share",
            "flowctl_breaker_state",
            "flowctl_breaker_drop_probability",
            "flowctl_breaker_window",
            "flowctl_breaker_connects_total",
            "flowctl_breaker_last_transition_seconds",
        ];
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/grafana/flowctl.json"
        ))
        .unwrap();
        let dash: serde_json::Value =
            serde_json::from_str(&text).expect("the dashboard is valid JSON");
        let mut seen = 0;
        for p in dash["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().unwrap() {
                let expr = t["expr"].as_str().unwrap();
                for word in expr
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| w.starts_with("flowctl_"))
                {
                    assert!(
                        exported.contains(&word),
                        "the dashboard queries `{word}`, which flowctl does not export"
                    );
                    seen += 1;
                }
            }
        }
        assert!(seen >= 10);
    }

    #[test]
    fn the_lease_store_state_renders_as_a_state_set() {
        use crate::agent::leases::{Published, PublishedStore};
        let p = Published {
            updated_ns: 0,
            host: "h".into(),
            store: PublishedStore {
                url: "redis://10.0.0.1:6379".into(),
                health: "unreachable: no answer".into(),
                state: "unreachable".into(),
                up: false,
                rtt_ms: Some(2.5),
                hosts: Some(3),
            },
            batches: 0,
            replies: 0,
            failures: 0,
            expired: 0,
            over_cap: 0,
            epoch_changes: 0,
            grant_errors: 0,
            rules: Vec::new(),
        };
        let mut reg = <super::Registry>::default();
        super::register_leases(&mut reg, &p);
        let mut out = String::new();
        super::encode(&mut out, &reg).unwrap();
        for line in [
            r#"flowctl_global_store_state{state="unreachable"} 1"#,
            r#"flowctl_global_store_state{state="ok"} 0"#,
            r#"flowctl_global_store_state{state="learning"} 0"#,
            r#"flowctl_global_store_state{state="unknown"} 0"#,
            "flowctl_global_store_up 0",
            "flowctl_global_hosts 3",
        ] {
            assert!(out.contains(line), "{line} in:\n{out}");
        }
    }

    #[test]
    fn breakers_render_state_probability_windows_and_totals() {
        use crate::agent::breakers::{Published, PublishedBreaker, PublishedWindow, Transition};
        let b = PublishedBreaker {
            name: "db".into(),
            target: "10.0.0.5:5432".into(),
            cgroup: None,
            mode: "sre".into(),
            dry_run: false,
            errno: "ECONNREFUSED".into(),
            state: "throttling".into(),
            drop_probability: 0.5,
            window: PublishedWindow {
                seconds: 3.0,
                outcomes: flowctl_common::breaker::Outcomes {
                    requests: 40,
                    accepts: 5,
                    refused_by_peer: 35,
                    timeouts: 0,
                    refused_locally: 12,
                    would_refuse: 0,
                },
            },
            totals: [("calls".to_string(), 52u64), ("refused_locally".to_string(), 12)]
                .into_iter()
                .collect(),
            probes: None,
            last_transition: Some(Transition {
                from: "closed".into(),
                to: "throttling".into(),
                unix_ms: 1_500,
                reason: String::new(),
            }),
        };
        let p = Published {
            cgroup: "/sys/fs/cgroup".into(),
            cgroup_id: 1,
            pid: 1,
            profile: String::new(),
            updated_unix_ms: 0,
            breakers: vec![b],
        };
        let mut reg = <super::Registry>::default();
        super::register_breakers(&mut reg, &p);
        let mut out = String::new();
        super::encode(&mut out, &reg).unwrap();
        for line in [
            r#"flowctl_breaker_state{breaker="db",state="throttling"} 1"#,
            r#"flowctl_breaker_state{breaker="db",state="open"} 0"#,
            r#"flowctl_breaker_drop_probability{breaker="db",mode="sre"} 0.5"#,
            r#"flowctl_breaker_window{breaker="db",outcome="requests"} 40"#,
            r#"flowctl_breaker_connects_total{breaker="db",outcome="refused_locally"} 12"#,
            r#"flowctl_breaker_last_transition_seconds{breaker="db",mode="sre"} 1.5"#,
        ] {
            assert!(out.lines().any(|l| l == line), "missing `{line}` in:\n{out}");
        }
    }
}
