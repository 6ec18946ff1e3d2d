//! `flowctl status`: attachments, memory, per-rule counters (packets and,
//! from the statistics rings, SYNs since attach), breakers.

use crate::{
    agent::{breakers::published_all, socket::socket_path, syn_totals},
    cli::{
        format::{breaker_lines, counter_table, counters_json, syn_json, syn_line},
        Only,
    },
    dataplane::{self, pins, state::AttachState, Maps},
    profile::human_bytes,
};
use anyhow::Result;
use flowctl_common::{RuleCounters, GLOBAL_COUNTER_INDEX};

pub fn status(json: bool, netns: &Option<String>) -> Result<()> {
    let only = Only::resolve(None, netns)?;
    let atts = pins::list_attachments();
    let mut out = Vec::new();
    for id in atts {
        let state = AttachState::load(&id)?;
        if !only.is_all() && !state.as_ref().is_some_and(|s| only.shows(&id, &s.iface)) {
            continue;
        }
        let maps = Maps::open(&id);
        let mut rules = Vec::new();
        let mut syns = None;
        let (generation, global) = match &maps {
            Ok(m) => {
                if let Some(st) = &state {
                    let t = syn_totals::now(m, st).ok();
                    for (i, r) in st.rules.iter().enumerate() {
                        let mut j =
                            counters_json(&r.name, &m.counters(r.record).unwrap_or_default());
                        syn_json(&mut j, t.as_ref().and_then(|t| t.rule(&r.name, r.record)));
                        if let Ok(Some(w)) = m.warm_up(i, r.record) {
                            j["warm_up"] = serde_json::json!({
                                "share": w.share,
                                "cold_factor": w.cold_factor,
                                "warm_up_s": w.warm_up_ns as f64 / 1e9,
                            });
                        }
                        // The flood sketch lent to the rule (agent/flood.rs).
                        let lent = m.control.get(&r.record, 0).map(|c| c.sketch).unwrap_or(0);
                        j["flood_sketch"] = match lent {
                            0 => serde_json::Value::Null,
                            n => (n - 1).into(),
                        };
                        // An isolated rule's own table (dataplane/own_tables.rs).
                        let own = m.rule_tables.as_ref().and_then(|t| t.entries(r.record).ok());
                        if let Some(Some(entries)) = own {
                            j["own_table_entries"] = entries.into();
                        }
                        rules.push(j);
                    }
                    syns = t;
                }
                (
                    m.global().map(|g| g.generation).unwrap_or(0),
                    m.counters(GLOBAL_COUNTER_INDEX).unwrap_or_default(),
                )
            }
            Err(_) => (0, RuleCounters::default()),
        };
        let shapers = match &maps {
            Ok(m) => shapers_json(&id, m),
            Err(_) => Vec::new(),
        };
        let holder = pins::lock_holder(&id);
        let mut unmatched = counters_json("unmatched", &global);
        syn_json(
            &mut unmatched,
            syns.as_ref().and_then(|t| t.rule(syn_totals::UNMATCHED, GLOBAL_COUNTER_INDEX)),
        );
        out.push(serde_json::json!({
            "iface": state.as_ref().map(|s| s.iface.clone()),
            "netns": state.as_ref().and_then(|s| s.netns.clone()),
            "netns_inode": id.netns_ino,
            "ifindex": id.ifindex,
            "mode": state.as_ref().map(|s| s.mode.clone()),
            "agent_running": pins::agent_running(&id),
            // Who holds the attachment's lock (an agent, or briefly an
            // agent-less apply or a detach), and what it says it does
            // (starting, serving, stopping, applying, detaching).
            "agent_pid": holder.as_ref().and_then(|h| h.pid),
            "agent_phase": holder.as_ref().map(|h| h.phase.clone()),
            // The agent binds its socket once attached and applied, and removes
            // any stale one first: lock held + socket present = serving.
            "agent_ready": pins::agent_running(&id) && socket_path(&id).exists(),
            "profile": state.as_ref().map(|s| s.profile_path.clone()),
            "generation": generation,
            "kernel_memory_bytes": dataplane::pinned_memlock(&id),
            "rules": rules,
            "unmatched": unmatched,
            // [[list]]s: their prefixes in the kernel's trie, and who names them.
            "lists": state.as_ref().map(|s| s.lists.clone()).unwrap_or_default(),
            // [[shaper]] tables: what they paced (the agent runs them).
            "shapers": shapers,
            // attach --multiprog: the libxdp dispatcher's components in run
            // order, flowctl's marked (null: flowctl runs on its own link,
            // or the interface is in a namespace this command is not in).
            "dispatcher": dispatcher_json(&id, state.as_ref().and_then(|s| s.netns.as_deref())),
            // SYNs (new TCP connections) since attach, every record's.
            "syn_totals": syns.as_ref().map(|t| {
                let total = t.total();
                serde_json::json!({
                    "seen": total.seen,
                    "passed": total.passed,
                    "dropped": total.dropped(),
                    "uncounted_s": total.uncounted_ns as f64 / 1e9,
                })
            }),
            // A profile from etcd: what is applied, the newest seen, the error.
            "etcd": pins::agent_running(&id).then(|| crate::fleet::etcd::follower::published(&id.run_dir())).flatten(),
            // Global rules: the store, and the leases this host holds.
            "leases": state.as_ref().and_then(|s| crate::agent::leases::published(s, pins::agent_running(&id))),
        }));
    }
    // Breakers belong to cgroups, not namespaces: shown unless one is asked for.
    let breakers = if only.is_all() { published_all() } else { Vec::new() };
    if json {
        // Interface attachments as before; cgroup attachments (breakers)
        // follow, told apart by their `cgroup` field.
        let mut all: Vec<serde_json::Value> = out;
        for b in &breakers {
            all.push(serde_json::to_value(b)?);
        }
        out!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    if out.is_empty() && breakers.is_empty() {
        out!("no flowctl attachments{}", only.describe(netns));
        return Ok(());
    }
    for c in &breakers {
        out!(
            "cgroup {} (id {}) breakers, agent pid {}, profile {}",
            c.cgroup,
            c.cgroup_id,
            c.pid,
            c.profile
        );
        for line in breaker_lines(c) {
            out!("  {line}");
        }
    }
    for a in &out {
        out!(
            "{} (netns {}{}, ifindex {}) mode {} agent {} generation {} kernel memory {}",
            a["iface"].as_str().unwrap_or("?"),
            a["netns_inode"],
            a["netns"].as_str().map(|n| format!(" `{n}`")).unwrap_or_default(),
            a["ifindex"],
            a["mode"].as_str().unwrap_or("?"),
            if a["agent_phase"] == crate::system::lock::phase::STOPPING {
                "stopping"
            } else if a["agent_running"].as_bool() == Some(true) {
                "running"
            } else {
                "not running (kept data plane)"
            },
            a["generation"],
            human_bytes(a["kernel_memory_bytes"].as_u64().unwrap_or(0)),
        );
        if let Ok(e) =
            serde_json::from_value::<crate::fleet::etcd::follower::Published>(a["etcd"].clone())
        {
            for line in crate::cli::rollout::agent_lines(&e) {
                out!("  {line}");
            }
        }
        if let Ok(p) =
            serde_json::from_value::<crate::agent::leases::Published>(a["leases"].clone())
        {
            for line in crate::cli::format::lease_lines(&p) {
                out!("  {line}");
            }
        }
        let rows: Vec<&serde_json::Value> =
            a["rules"].as_array().unwrap().iter().chain(std::iter::once(&a["unmatched"])).collect();
        for line in counter_table(&rows) {
            out!("  {line}");
        }
        for r in a["rules"].as_array().unwrap() {
            if let Some(entries) = r["own_table_entries"].as_u64() {
                out!(
                    "  rule `{}`: isolated, its buckets in a table of its own ({entries} keys)",
                    r["rule"].as_str().unwrap_or("?")
                );
            }
            if let Some(sketch) = r["flood_sketch"].as_u64() {
                out!(
                    "  rule `{}`: flooded; its keys without a bucket are decided by flood sketch {sketch} ({} packets so far)",
                    r["rule"].as_str().unwrap_or("?"),
                    r["sketched_pkts"]
                );
            }
            let w = &r["warm_up"];
            if let Some(share) = w["share"].as_f64() {
                out!(
                    "  rule `{}`: warm-up at {:.0}% of its rate (cold_factor {}, warm_up {}s)",
                    r["rule"].as_str().unwrap_or("?"),
                    share * 100.0,
                    w["cold_factor"],
                    w["warm_up_s"].as_f64().unwrap_or(0.0)
                );
            }
        }
        for l in a["lists"].as_array().into_iter().flatten() {
            let rules: Vec<&str> =
                l["rules"].as_array().into_iter().flatten().filter_map(|r| r.as_str()).collect();
            out!(
                "  list `{}`: {} prefixes from {}, named by {}",
                l["name"].as_str().unwrap_or("?"),
                l["prefixes"],
                l["file"].as_str().unwrap_or("the profile"),
                if rules.is_empty() {
                    "no rule".to_string()
                } else {
                    format!("rule `{}`", rules.join("`, `"))
                }
            );
        }
        if let Some(chain) = a["dispatcher"].as_array() {
            let parts: Vec<String> = chain
                .iter()
                .map(|c| {
                    format!(
                        "{}{} (prio {}, id {})",
                        c["name"].as_str().unwrap_or("?"),
                        if c["flowctl"] == true { " [flowctl]" } else { "" },
                        c["run_prio"],
                        c["prog_id"]
                    )
                })
                .collect();
            out!("  XDP dispatcher (libxdp): {}", parts.join(" -> "));
            if !chain.iter().any(|c| c["flowctl"] == true) {
                out!("  WARNING: flowctl's component is not in this dispatcher: the rules are not enforced (detach and attach again)");
            }
        }
        if let Some(line) = syn_line(&a["syn_totals"]) {
            out!("  {line}");
        }
        for s in a["shapers"].as_array().into_iter().flatten() {
            out!("  {}", shaper_line(s));
        }
    }
    Ok(())
}

/// The attachment's `[[shaper]]` tables (from its active profile) with
/// what the kernel counted for each since the agent installed them.
/// The interface's dispatcher chain, asked over rtnetlink from the
/// interface's own namespace (a thread enters it when it is not this one).
fn dispatcher_json(id: &pins::AttachId, netns: Option<&str>) -> Option<serde_json::Value> {
    use crate::system::netns;
    if !dataplane::multiprog::is_component(id) {
        return None;
    }
    let chain = if netns::current_netns_ino().ok() == Some(id.netns_ino) {
        dataplane::multiprog::chain(id).ok()
    } else {
        let (ns, id) = (netns?.to_string(), *id);
        std::thread::spawn(move || {
            netns::enter_netns(&ns).ok()?;
            // The name may have been given to another namespace since the
            // attachment was made (its pins carry the inode): then the
            // chain shown would be another interface's.
            (netns::current_netns_ino().ok()? == id.netns_ino).then_some(())?;
            dataplane::multiprog::chain(&id).ok()
        })
        .join()
        .ok()
        .flatten()
    };
    chain.map(|c| serde_json::json!(c))
}

fn shapers_json(id: &pins::AttachId, m: &Maps) -> Vec<serde_json::Value> {
    let path = id.run_dir().join(pins::run_file::PROFILE);
    let Ok(set) = crate::profile::load_recorded(&path) else { return Vec::new() };
    let mut out = Vec::new();
    for (i, s) in set.shapers.iter().enumerate() {
        let c = m.shaper_counters(i as u32).unwrap_or_default();
        let backlog_ns = if s.per_flow() { 0 } else { m.shaper_backlog_ns(i as u32).unwrap_or(0) };
        out.push(serde_json::json!({
            "shaper": s.name,
            "dst": s.dst_text,
            "rate": s.rate_text,
            "per": if s.per_flow() { "flow" } else { "aggregate" },
            "dry_run": s.dry_run(),
            "offered_pkts": c.offered_pkts,
            "offered_bytes": c.offered_bytes,
            "delayed_pkts": c.delayed_pkts,
            "mean_delay_ms": if c.delayed_pkts == 0 { 0.0 } else { c.delay_ns as f64 / c.delayed_pkts as f64 / 1e6 },
            "horizon_drops": c.horizon_drops,
            "horizon_drop_bytes": c.horizon_drop_bytes,
            "flow_table_full": c.table_full,
            // How far ahead departures are booked now: the queue's time depth
            // (an aggregate shaper's; 0 per flow).
            "backlog_ms": backlog_ns as f64 / 1e6,
        }));
    }
    out
}

fn shaper_line(s: &serde_json::Value) -> String {
    let dry = if s["dry_run"].as_bool() == Some(true) { " (dry-run: would)" } else { "" };
    format!(
        "shaper `{}` to {} at {} per {}{dry}: {} packets, {} delayed (mean {:.2} ms), {} dropped past the horizon, backlog {:.1} ms",
        s["shaper"].as_str().unwrap_or("?"),
        s["dst"].as_str().unwrap_or("?"),
        s["rate"].as_str().unwrap_or("?"),
        s["per"].as_str().unwrap_or("?"),
        s["offered_pkts"],
        s["delayed_pkts"],
        s["mean_delay_ms"].as_f64().unwrap_or(0.0),
        s["horizon_drops"],
        s["backlog_ms"].as_f64().unwrap_or(0.0),
    )
}
