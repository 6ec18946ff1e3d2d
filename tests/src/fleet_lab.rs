//! The three-agent fleet the global rules' end-to-end test, the fleet demo
//! and the fleet benchmark (8c) share (docs/fleet.md, "Global limits"): one
//! per-source global rule (L = 300/s, B = 30, `default_share = "none"`,
//! lease 2 s, refresh 500 ms), one source address that every lab's client
//! sends from (one key for the whole fleet), the rule's counters on each
//! lab read from one `flowctl status --json`, and [`Fleet`]: a real Redis
//! in its own namespace, three labs each linked to it, and an agent per
//! lab on a profile naming Redis over that lab's link. Everything goes on
//! drop (agents, then labs, then Redis by PID), also when a caller panics.

use crate::{
    agent::Agent,
    cli::{attachment, flowctl},
    lab::{sh, Lab},
    redis::{Access, Redis},
    tempfile::TempFile,
};
use serde_json::Value;

/// The global rule's name, port, L and B (per source, across the fleet).
pub const RULE: &str = "shared";
pub const DPORT: u16 = 7000;
pub const RATE: u64 = 300;
pub const BURST: u64 = 30;
/// The source every lab's client sends from: one key for the fleet.
pub const SRC: &str = "10.250.0.9";

/// The fleet's profile, reaching Redis by `store`.
pub fn profile(store: &Access) -> String {
    format!(
        r#"[settings]
key_table_entries = 16384
source_cache_entries = 16384
global_key_entries = 4096

[fleet]
{}lease = "2s"
refresh = "500ms"

[[rule]]
name = "{RULE}"
proto = "udp"
dport = {DPORT}
rate = "{RATE}/s"
burst = {BURST}
key = "src"
scope = "global"
default_share = "none"
"#,
        store.fleet_keys()
    )
}

/// Gives `lab`'s client the fleet's source address, [`SRC`].
pub fn add_source(lab: &Lab) {
    sh(&["ip", "-n", &lab.ns_cli, "addr", "add", &format!("{SRC}/32"), "dev", &lab.veth_cli]);
}

/// Each lab's attachment, from one `status --json`.
pub fn attachments(labs: &[Lab]) -> Result<Vec<Value>, String> {
    let out = flowctl(&["status", "--json"]);
    let v: Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("status --json: {e}"))?;
    let all = v.as_array().ok_or("status --json: not a list")?;
    labs.iter()
        .map(|lab| {
            all.iter()
                .find(|a| a["iface"] == lab.veth_srv.as_str())
                .cloned()
                .ok_or_else(|| format!("{} not in status", lab.veth_srv))
        })
        .collect()
}

/// The rule's (offered, passed) packets in one attachment (the kernel's
/// counters).
pub fn rule_counters(attachment: &Value) -> Result<(u64, u64), String> {
    let r = attachment["rules"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["rule"] == RULE))
        .ok_or("the rule is not in status")?;
    let n = |k: &str| r[k].as_u64().ok_or_else(|| format!("{k} in status"));
    Ok((n("offered_pkts")?, n("passed_pkts")?))
}

/// The rule's (offered, passed) packets on each lab, from one `status
/// --json`.
pub fn counters(labs: &[Lab]) -> Result<Vec<(u64, u64)>, String> {
    attachments(labs)?.iter().map(rule_counters).collect()
}

/// The rate of the lease an attachment holds for [`SRC`] (0 without one).
pub fn lease_rate(attachment: &Value) -> u64 {
    attachment["leases"]["rules"][0]["leases"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["key"] == SRC))
        .and_then(|l| l["rate"].as_u64())
        .unwrap_or(0)
}

/// Whether the agent on `lab` reaches Redis and sees all three hosts.
pub fn store_sees_fleet(lab: &Lab) -> bool {
    attachment(&lab.veth_srv).is_some_and(|a| {
        let s = &a["leases"]["store"];
        s["up"] == true && s["hosts"].as_u64() == Some(3)
    })
}

/// Redis in a namespace of its own, three labs linked to it, and an agent
/// per lab on [`profile`] (Redis at its address on that lab's link), each
/// lab's client with [`SRC`]. Fields drop in order: agents first.
pub struct Fleet {
    pub agents: Vec<Agent>,
    pub profiles: Vec<TempFile>,
    pub labs: Vec<Lab>,
    pub redis: Redis,
}

impl Fleet {
    /// Redis tagged `redis_tag`, labs `LAB_TAG0..2` on 10.201.S.0/24 for S
    /// in `subnets` (also their links' subnets to Redis); returns once
    /// every agent is ready.
    pub fn start(redis_tag: &str, lab_tag: &str, subnets: [u8; 3]) -> Self {
        Self::start_with(redis_tag, lab_tag, &subnets, profile)
    }

    /// [`start`](Self::start) with one lab per subnet and each agent on
    /// `profile(how it reaches Redis)`.
    pub fn start_with(
        redis_tag: &str,
        lab_tag: &str,
        subnets: &[u8],
        profile: impl Fn(&Access) -> String,
    ) -> Self {
        let mut redis = Redis::start(redis_tag);
        let labs: Vec<Lab> = subnets
            .iter()
            .enumerate()
            .map(|(i, &s)| Lab::new(&format!("{lab_tag}{i}"), s))
            .collect();
        let mut agents = Vec::new();
        let mut profiles = Vec::new();
        for (lab, &s) in labs.iter().zip(subnets) {
            add_source(lab);
            let access = redis.link(lab, s);
            let p = TempFile::profile(&profile(&access));
            agents.push(Agent::start(lab, p.path(), &[]));
            profiles.push(p);
        }
        Self { agents, profiles, labs, redis }
    }

    /// Stops every agent (SIGINT: each detaches and must exit successfully).
    pub fn stop_agents(&mut self) {
        for a in self.agents.drain(..) {
            a.stop();
        }
    }
}
