//! The short verbs: detach, apply, status, check, explain.

use crate::{
    agent::{apply_and_record, require_root, socket::Request},
    dataplane::{
        self,
        pins::{self, AttachId},
        state::AttachState,
        Maps,
    },
    profile::{self, human_bytes},
};
use anyhow::{bail, Context, Result};
use flowctl_common::{reason, RuleCounters, GLOBAL_COUNTER_INDEX};
use std::{net::IpAddr, path::Path};

fn enter(netns: &Option<String>) -> Result<()> {
    if let Some(ns) = netns {
        crate::system::netns::enter_netns(ns)?;
    }
    Ok(())
}

pub fn detach(iface: &str, netns: &Option<String>) -> Result<()> {
    require_root()?;
    enter(netns)?;
    let id = AttachId::of(iface)?;
    if pins::agent_running(&id) {
        eprintln!("note: an agent is running for {iface}; it will exit when it notices (or stop it with Ctrl-C)");
    }
    // Egress filters a killed agent left (kernels without TCX) go too.
    drop(dataplane::Egress::for_attachment(&id));
    if dataplane::detach(&id)? {
        out!("detached from {iface}");
    } else {
        out!("nothing attached to {iface}");
    }
    Ok(())
}

pub fn apply(iface: &str, path: &Path, netns: &Option<String>) -> Result<()> {
    // Validate first: a bad profile is rejected whole, before anything is touched.
    let set = profile::load(path)?;
    require_root()?;
    crate::agent::kernel_check(&set, path)?;
    enter(netns)?;
    let id = AttachId::of(iface)?;
    let abs = std::fs::canonicalize(path)?;
    if let Some(resp) =
        crate::agent::socket::call(&id, &Request::Apply { profile: abs.display().to_string() })?
    {
        if resp.ok {
            out!("{}", resp.message);
            return Ok(());
        }
        bail!("{}", resp.message);
    }
    // No agent: apply to the kept data plane directly, holding the lock so an
    // agent cannot start halfway.
    if !set.breakers.is_empty() {
        bail!("{}: the profile has breakers, which live with an agent, and no agent is running for {iface} (nothing was applied); start one with `flowctl attach {iface} --profile {}`", path.display(), path.display());
    }
    let Some(_lock) = pins::lock_attachment(&id)? else {
        bail!("an agent holds the lock for {iface} but does not answer on its socket; try again");
    };
    let Some(mut state) = AttachState::load(&id)? else {
        bail!(
            "nothing is attached to {iface}: use `flowctl attach {iface} --profile {}`",
            path.display()
        );
    };
    let mut maps = Maps::open(&id)?;
    apply_and_record(&mut maps, &mut state, &set, path)?;
    out!("applied {} rules to the kept data plane on {iface} (no agent running)", set.rules.len());
    Ok(())
}

/// `apply --cgroup`: to the agent holding that cgroup's breakers (a
/// breakers-only agent, or an interface agent whose profile has breakers).
pub fn apply_cgroup(cgroup: &Path, path: &Path) -> Result<()> {
    profile::load(path)?;
    require_root()?;
    let point = crate::agent::breakers::CgroupPoint::resolve(Some(cgroup))?;
    let abs = std::fs::canonicalize(path)?;
    let sock = point.run_dir().join("agent.sock");
    match crate::agent::socket::call_at(&sock, &Request::Apply { profile: abs.display().to_string() })? {
        Some(resp) if resp.ok => {
            out!("{}", resp.message);
            Ok(())
        }
        Some(resp) => bail!("{}", resp.message),
        None => bail!(
            "no agent holds the breakers of cgroup {}: breakers live with their agent; start one with `flowctl attach --cgroup {} --profile {}`",
            point.path.display(),
            cgroup.display(),
            path.display()
        ),
    }
}

pub fn check(path: &Path) -> Result<()> {
    let set = profile::load(path)?;
    out!("{}: ok, {} rules, {} breakers", path.display(), set.rules.len(), set.breakers.len());
    if !set.rules.is_empty() {
        out!(
        "kernel memory: {} preallocated (budget {}; key table {} entries, source cache {} entries)",
        human_bytes(set.settings.kernel_memory_bytes()),
        human_bytes(set.settings.memory_budget),
        set.settings.key_table_entries,
        set.settings.source_cache_entries
        );
    }
    for r in &set.rules {
        out!("  {:<20} {:<40} {}", r.name, r.match_text(), limit_text(r));
    }
    for b in &set.breakers {
        out!("  breaker {:<12} {:<40} {}", b.name, b.target.to_string(), breaker_text(b));
    }
    Ok(())
}

fn breaker_text(b: &profile::breaker::Breaker) -> String {
    use crate::profile::breaker::BreakerMode;
    let mode = match &b.mode {
        BreakerMode::Sre { k_milli, min_requests, max_drop_ppm } => {
            format!(
                "sre K={} min {min_requests} cap {}",
                *k_milli as f64 / 1000.0,
                *max_drop_ppm as f64 / 1e6
            )
        }
        BreakerMode::State(c) => format!(
            "state failure>{} min {} sleep {}s probes {}",
            c.failure_ppm as f64 / 1e6,
            c.min_requests,
            c.sleep_ns as f64 / 1e9,
            c.probes
        ),
    };
    format!(
        "{mode}, window {}s/{}, {}{}{}",
        b.window_ns as f64 / 1e9,
        b.buckets,
        profile::breaker::errno_name(b.errno),
        b.cgroup.as_ref().map(|c| format!(", cgroup {c}")).unwrap_or_default(),
        if b.dry_run { " (dry-run)" } else { "" }
    )
}

pub fn limit_text(r: &profile::Rule) -> String {
    if r.action == flowctl_common::action::PASS {
        return "pass (exempt)".into();
    }
    let mut parts = Vec::new();
    if r.interval_fp != 0 {
        parts.push(format!("{} {} burst {}", r.rate_text, r.unit_name(), r.burst));
    }
    if let Some(q) = r.quota_text() {
        parts.push(format!("quota {q}"));
    }
    format!(
        "{} per {}{}",
        parts.join(", "),
        r.key_name(),
        if r.action == flowctl_common::action::DRY_RUN { " (dry-run)" } else { "" }
    )
}

pub fn status(json: bool) -> Result<()> {
    let atts = pins::list_attachments();
    let mut out = Vec::new();
    for id in atts {
        let state = AttachState::load(&id)?;
        let maps = Maps::open(&id);
        let mut rules = Vec::new();
        let (generation, global) = match &maps {
            Ok(m) => {
                if let Some(st) = &state {
                    for r in &st.rules {
                        rules.push((r.name.clone(), m.counters(r.record).unwrap_or_default()));
                    }
                }
                (
                    m.global().map(|g| g.generation).unwrap_or(0),
                    m.counters(GLOBAL_COUNTER_INDEX).unwrap_or_default(),
                )
            }
            Err(_) => (0, RuleCounters::default()),
        };
        out.push(serde_json::json!({
            "iface": state.as_ref().map(|s| s.iface.clone()),
            "netns": state.as_ref().and_then(|s| s.netns.clone()),
            "netns_inode": id.netns_ino,
            "ifindex": id.ifindex,
            "mode": state.as_ref().map(|s| s.mode.clone()),
            "agent_running": pins::agent_running(&id),
            // The agent binds its socket once attached and applied, and removes
            // any stale one first: lock held + socket present = serving.
            "agent_ready": pins::agent_running(&id) && crate::agent::socket::socket_path(&id).exists(),
            "profile": state.as_ref().map(|s| s.profile_path.clone()),
            "generation": generation,
            "kernel_memory_bytes": dataplane::pinned_memlock(&id),
            "rules": rules.iter().map(|(n, c)| counters_json(n, c)).collect::<Vec<_>>(),
            "unmatched": counters_json("unmatched", &global),
        }));
    }
    let breakers = crate::agent::breakers::published_all();
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
        out!("no flowctl attachments");
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
        for line in crate::cli::top::view::breaker_lines(c) {
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
            if a["agent_running"].as_bool() == Some(true) {
                "running"
            } else {
                "not running (kept data plane)"
            },
            a["generation"],
            human_bytes(a["kernel_memory_bytes"].as_u64().unwrap_or(0)),
        );
        out!(
            "  {:<20} {:>12} {:>12} {:>12} {:>12}",
            "rule",
            "offered",
            "passed",
            "dropped",
            "would-drop"
        );
        for r in a["rules"].as_array().unwrap().iter().chain(std::iter::once(&a["unmatched"])) {
            out!(
                "  {:<20} {:>12} {:>12} {:>12} {:>12}",
                r["rule"].as_str().unwrap_or(""),
                r["offered_pkts"].to_string(),
                r["passed_pkts"].to_string(),
                r["dropped_pkts"].to_string(),
                r["would_drop_pkts"].to_string()
            );
        }
    }
    Ok(())
}

fn counters_json(name: &str, c: &RuleCounters) -> serde_json::Value {
    let mut by_reason = serde_json::Map::new();
    for (i, n) in reason::NAMES.iter().enumerate() {
        if c.dropped_pkts[i] > 0 {
            by_reason.insert(n.to_string(), c.dropped_pkts[i].into());
        }
    }
    serde_json::json!({
        "rule": name,
        "offered_pkts": c.offered_pkts, "offered_bytes": c.offered_bytes,
        "passed_pkts": c.passed_pkts, "passed_bytes": c.passed_bytes,
        "dropped_pkts": c.dropped_total(), "dropped_by_reason": by_reason,
        "would_drop_pkts": c.would_drop_pkts,
        "insert_failures": c.insert_failures,
        "non_ip_pkts": c.non_ip_pkts, "malformed_pkts": c.malformed_pkts, "fragment_pkts": c.fragment_pkts,
        "unparsed_pkts": c.unparsed_pkts,
    })
}

pub fn explain(
    iface: &str,
    proto: &str,
    src: &str,
    dport: Option<u16>,
    netns: &Option<String>,
) -> Result<()> {
    enter(netns)?;
    let id = AttachId::of(iface)?;
    let state =
        AttachState::load(&id)?.with_context(|| format!("nothing is attached to {iface}"))?;
    let set = profile::load(&id.run_dir().join("profile.toml"))?;
    let proto_n: u8 = match proto {
        "tcp" => 6,
        "udp" => 17,
        "icmp" => 1,
        "icmpv6" => 58,
        p => p.parse().with_context(|| format!("unknown protocol `{p}`"))?,
    };
    let src: IpAddr = src.parse().with_context(|| format!("`{src}` is not an IP address"))?;
    let port = if proto_n == 6 || proto_n == 17 { dport } else { None };
    let maps = Maps::open(&id)?;
    match maps.classify(&src, proto_n, port)? {
        None => out!("no rule matches: the packet passes unlimited"),
        Some(i) => {
            let r = set
                .rules
                .get(i as usize)
                .context("kernel rule index outside the active profile")?;
            let st = state.rules.get(i as usize);
            out!("rule   {} (#{}, line {} of the active profile)", r.name, i + 1, r.line);
            out!("match  {}", r.match_text());
            out!("action {}", r.action_name());
            if r.action != flowctl_common::action::PASS {
                if r.interval_fp != 0 {
                    out!("limit  {} {} with burst {}", r.rate_text, r.unit_name(), r.burst);
                }
                if let Some(q) = r.quota_text() {
                    out!("quota  {q}");
                }
                out!("key    {}", r.key_name());
            }
            if let Some(st) = st {
                out!("state  id {} record {}", st.state_id, st.record);
            }
        }
    }
    Ok(())
}
