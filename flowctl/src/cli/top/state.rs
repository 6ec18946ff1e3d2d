//! What `flowctl top` shows, computed from two reads of the pinned counters:
//! the state, kept apart from the view (tokio-console's split). Also the
//! `--once --json` schema (docs/top.md).

use crate::{
    dataplane::{
        pins::{self, AttachId},
        state::AttachState,
        Maps,
    },
    profile,
};
use anyhow::Result;
use flowctl_common::{reason, RuleCounters};
use serde::Serialize;
use std::{collections::HashMap, time::Instant};

/// Version of the JSON schema; bumped on any incompatible change.
pub const SCHEMA: u32 = 1;

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Top {
    pub schema: u32,
    /// Seconds between the two counter reads the rates come from.
    pub interval_s: f64,
    pub attachments: Vec<Attachment>,
    /// Circuit breakers of every cgroup attachment with a running agent, as
    /// the agent publishes them (docs/top.md).
    pub breakers: Vec<crate::agent::breakers::Published>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Attachment {
    /// Which attachment (the history's key; not in the JSON, which names
    /// it by `iface` and `netns`).
    #[serde(skip)]
    pub id: AttachId,
    /// The shape of its statistics rings, which the history reads.
    #[serde(skip)]
    pub stats: profile::StatsSettings,
    pub iface: String,
    pub netns: Option<String>,
    pub mode: String,
    pub uptime_s: u64,
    pub agent_running: bool,
    /// Fields only the agent computes (CPU signal, control loops), from its
    /// pinned record: "n/a" while it has no CPU signal, "agent not running"
    /// when its record is older than the grace period, never a stale value.
    pub cpu: String,
    /// The CPU EMA in per-mille, when the agent publishes one.
    pub cpu_permille: Option<u32>,
    /// Approximate key-table occupancy (last walk + inserts since, capped;
    /// see `key_tables_note`); absent without a running agent.
    pub key_tables: Option<Vec<crate::agent::occupancy::TableFill>>,
    pub key_tables_note: String,
    /// KLimiter's last step: per baseline the level, threshold, band,
    /// coefficients and shares; per entry the ratio and why it last changed.
    /// Absent without baselines or without a running agent.
    pub klimiter: Option<crate::agent::klimiter::PublishedStep>,
    /// Global rules: the lease store and this host's leases (absent
    /// without global rules or without a running agent).
    pub leases: Option<crate::agent::leases::Published>,
    pub rules: Vec<RuleRow>,
    /// `[[shaper]]` tables of the active profile, with their rates over
    /// the interval.
    pub shapers: Vec<ShaperRow>,
}

/// One shaper over the interval (docs/profile.md, "Shapers").
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ShaperRow {
    pub shaper: String,
    pub dst: String,
    pub rate: String,
    /// "aggregate" or "flow".
    pub per: String,
    pub dry_run: bool,
    pub offered_pps: f64,
    pub offered_bps: f64,
    /// Offered less dropped past the horizon (in dry-run: what would be).
    pub sent_pps: f64,
    /// Held back (stamped to leave later than they came).
    pub delayed_pps: f64,
    /// Mean delay of the packets held back in the interval.
    pub mean_delay_ms: f64,
    pub horizon_drop_pps: f64,
    /// How far ahead an aggregate shaper has booked departures now (0 per
    /// flow): the queue's time depth.
    pub backlog_ms: f64,
    pub horizon_drops_total: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RuleRow {
    /// The rule's counter record (its statistics ring's index).
    #[serde(skip)]
    pub record: u32,
    pub rule: String,
    #[serde(rename = "match")]
    pub match_: String,
    pub key: String,
    pub limit: String,
    pub offered_pps: f64,
    pub offered_bps: f64,
    pub passed_pps: f64,
    pub passed_bps: f64,
    pub dropped_pps: f64,
    /// Packets a dry-run limit would have dropped, per second (they pass).
    pub would_drop_pps: f64,
    /// Dropped / offered over the interval, 0 to 100.
    pub drop_pct: f64,
    pub admission_ratio: f64,
    /// New TCP connections (SYN without ACK) offered and admitted per
    /// second, and FIN/RST segments per second, over the last complete
    /// second of the kernel's statistics ring.
    pub syn_offered_ps: f64,
    pub syn_passed_ps: f64,
    pub fin_rst_ps: f64,
    /// The BBR limiter of a rule that has one, as the agent last decided
    /// (absent for rules without BBR, and without a running agent).
    pub bbr: Option<BbrRow>,
    /// The reason with most drops over the interval ("" when none).
    pub top_reason: String,
    /// Totals since attach, for cross-checks.
    pub offered_total: u64,
    pub passed_total: u64,
    pub dropped_total: u64,
    pub would_drop_total: u64,
    pub offered_bytes_total: u64,
    pub passed_bytes_total: u64,
    /// Drops by reason: every reason with a drop since attach, by
    /// `flowctl_common::reason::NAMES` order.
    pub drops: Vec<ReasonDrops>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ReasonDrops {
    pub reason: &'static str,
    /// Over the interval.
    pub pps: f64,
    /// Since attach.
    pub total: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BbrRow {
    /// Most completions in one bucket of the window.
    pub max_pass: u32,
    /// Smallest mean round trip of a bucket, ms (0: no data yet).
    pub min_rt_ms: u32,
    /// Established connections not yet completed.
    pub in_flight: u32,
    /// The limit (null: no data yet, so no limit).
    pub max_in_flight: Option<u32>,
    /// The in-flight test is on (CPU over threshold, or cooling down).
    pub overloaded: bool,
}

#[cfg(test)]
impl RuleRow {
    /// A rule of the views' tests: `offered` and `dropped` pps, the rest
    /// plain.
    pub fn example(name: &str, offered: f64, dropped: f64) -> Self {
        RuleRow {
            record: 0,
            rule: name.into(),
            match_: "udp from any to port 53".into(),
            key: "src".into(),
            limit: "100/s".into(),
            offered_pps: offered,
            offered_bps: offered * 800.0,
            passed_pps: offered - dropped,
            passed_bps: 0.0,
            dropped_pps: dropped,
            would_drop_pps: 0.0,
            drop_pct: if offered > 0.0 { 100.0 * dropped / offered } else { 0.0 },
            admission_ratio: 1.0,
            syn_offered_ps: 0.0,
            syn_passed_ps: 0.0,
            fin_rst_ps: 0.0,
            bbr: None,
            top_reason: if dropped > 0.0 { "rate".into() } else { String::new() },
            offered_total: 0,
            passed_total: 0,
            dropped_total: 0,
            would_drop_total: 0,
            offered_bytes_total: 0,
            passed_bytes_total: 0,
            drops: vec![],
        }
    }
}

/// One read of every attachment's counters.
pub struct Sample {
    at: Instant,
    counters: HashMap<(u64, u32, String), RuleCounters>,
    /// Each attachment's shapers' counters, by slot.
    shapers: HashMap<(u64, u32), Vec<flowctl_common::shaper::ShaperCounters>>,
}

pub fn sample() -> Sample {
    let mut counters = HashMap::new();
    let mut shapers = HashMap::new();
    for id in pins::list_attachments() {
        let (Ok(Some(state)), Ok(maps)) = (AttachState::load(&id), Maps::open(&id)) else {
            continue;
        };
        for r in &state.rules {
            if let Ok(c) = maps.counters(r.record) {
                counters.insert((id.netns_ino, id.ifindex, r.name.clone()), c);
            }
        }
        let used = (0..flowctl_common::shaper::MAX_SHAPERS as u32)
            .take_while(|&i| maps.shapers.get(&i, 0).is_ok_and(|c| c.family != 0));
        let c: Vec<_> = used.map(|i| maps.shaper_counters(i).unwrap_or_default()).collect();
        shapers.insert((id.netns_ino, id.ifindex), c);
    }
    Sample { at: Instant::now(), counters, shapers }
}

/// Rates between two samples, with the rule details from each attachment's
/// active profile.
pub fn compute(before: &Sample, after: &Sample, only: &crate::cli::Only) -> Result<Top> {
    let dt = after.at.duration_since(before.at).as_secs_f64().max(1e-9);
    let mut attachments = Vec::new();
    for id in pins::list_attachments() {
        let Some(state) = AttachState::load(&id)? else { continue };
        if !only.shows(&id, &state.iface) {
            continue;
        }
        attachments.push(attachment(&id, &state, before, after, dt)?);
    }
    // Breakers belong to cgroups, not interfaces or namespaces: shown
    // unless one of those is asked for.
    let breakers = if only.is_all() { crate::agent::breakers::published_all() } else { Vec::new() };
    Ok(Top { schema: SCHEMA, interval_s: dt, attachments, breakers })
}

fn attachment(
    id: &AttachId,
    state: &AttachState,
    before: &Sample,
    after: &Sample,
    dt: f64,
) -> Result<Attachment> {
    let agent = pins::agent_running(id);
    let set = profile::load_recorded(&id.run_dir().join(pins::run_file::PROFILE)).ok();
    let maps = Maps::open(id)?;
    // What only the agent knows, read once: `None` when it is not running.
    let agent_rec = crate::agent::occupancy::fresh_record(&maps);
    let now_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut rules = Vec::new();
    for r in &state.rules {
        let key = (id.netns_ino, id.ifindex, r.name.clone());
        let (Some(a), Some(b)) = (before.counters.get(&key), after.counters.get(&key)) else {
            continue;
        };
        let d = |f: fn(&RuleCounters) -> u64| (f(b).saturating_sub(f(a))) as f64 / dt;
        let dropped: Vec<u64> = (0..reason::COUNT)
            .map(|i| b.dropped_pkts[i].saturating_sub(a.dropped_pkts[i]))
            .collect();
        let dropped_n: u64 = dropped.iter().sum();
        let offered_n = b.offered_pkts.saturating_sub(a.offered_pkts);
        let top_reason = dropped
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .max_by_key(|(_, n)| **n)
            .map(|(i, _)| reason::NAMES[i].to_string())
            .unwrap_or_default();
        let ctl = maps.control.get(&r.record, 0).unwrap_or_default();
        let (second, secs) = ring_second(&maps, state, r.record);
        let rule = set.as_ref().and_then(|s| s.rules.iter().find(|x| x.name == r.name));
        let bbr = (rule.is_some_and(|x| x.bbr.is_some())
            && agent_rec.is_some()
            && ctl.flags & flowctl_common::control_flags::BBR_ACTIVE != 0)
            .then(|| BbrRow {
                max_pass: ctl.bbr_max_pass,
                min_rt_ms: ctl.bbr_min_rt_ms,
                in_flight: ctl.bbr_inflight,
                max_in_flight: (ctl.bbr_max_inflight != u32::MAX).then_some(ctl.bbr_max_inflight),
                overloaded: ctl.bbr_overloaded != 0,
            });
        let drops = (0..reason::COUNT)
            .filter(|&i| b.dropped_pkts[i] > 0)
            .map(|i| ReasonDrops {
                reason: reason::NAMES[i],
                pps: dropped[i] as f64 / dt,
                total: b.dropped_pkts[i],
            })
            .collect();
        rules.push(RuleRow {
            record: r.record,
            rule: r.name.clone(),
            match_: rule.map(|x| x.match_text()).unwrap_or_default(),
            key: rule.map(|x| x.key_name()).unwrap_or_default(),
            limit: rule.map(crate::cli::format::limit_text).unwrap_or_default(),
            offered_pps: d(|c| c.offered_pkts),
            offered_bps: d(|c| c.offered_bytes) * 8.0,
            passed_pps: d(|c| c.passed_pkts),
            passed_bps: d(|c| c.passed_bytes) * 8.0,
            dropped_pps: dropped_n as f64 / dt,
            would_drop_pps: d(|c| c.would_drop_pkts),
            drop_pct: if offered_n == 0 {
                0.0
            } else {
                100.0 * dropped_n as f64 / offered_n as f64
            },
            admission_ratio: ctl.admission_ratio(),
            syn_offered_ps: second.syn_offered as f64 / secs,
            syn_passed_ps: second.syn_passed as f64 / secs,
            fin_rst_ps: second.fin_rst as f64 / secs,
            bbr,
            top_reason,
            offered_total: b.offered_pkts,
            passed_total: b.passed_pkts,
            dropped_total: b.dropped_total(),
            would_drop_total: b.would_drop_pkts,
            offered_bytes_total: b.offered_bytes,
            passed_bytes_total: b.passed_bytes,
            drops,
        });
    }
    Ok(Attachment {
        id: *id,
        stats: state.stats,
        iface: state.iface.clone(),
        netns: state.netns.clone(),
        mode: state.mode.clone(),
        uptime_s: now_unix.saturating_sub(state.attached_at_unix),
        agent_running: agent,
        cpu: cpu_text(agent_rec.as_ref()),
        cpu_permille: agent_rec.map(|r| r.cpu_permille).filter(|c| *c != flowctl_common::NO_CPU_SIGNAL),
        key_tables: agent_rec.and_then(|r| crate::agent::occupancy::estimate(&maps, state, &r)),
        klimiter: crate::agent::klimiter::published(state, agent_rec.is_some()),
        leases: crate::agent::leases::published(state, agent_rec.is_some()),
        key_tables_note: "approximate: entries at the agent's last walk plus inserts since (evictions not counted), capped at capacity".into(),
        rules,
        shapers: shaper_rows(id, set.as_ref(), &maps, before, after, dt),
    })
}

/// The active profile's shapers with their rates between the samples.
fn shaper_rows(
    id: &AttachId,
    set: Option<&profile::RuleSet>,
    maps: &Maps,
    before: &Sample,
    after: &Sample,
    dt: f64,
) -> Vec<ShaperRow> {
    let (Some(set), Some(a), Some(b)) = (
        set,
        before.shapers.get(&(id.netns_ino, id.ifindex)),
        after.shapers.get(&(id.netns_ino, id.ifindex)),
    ) else {
        return Vec::new();
    };
    let mut rows = Vec::new();
    for (i, s) in set.shapers.iter().enumerate() {
        let (Some(a), Some(b)) = (a.get(i), b.get(i)) else { continue };
        let d = |f: fn(&flowctl_common::shaper::ShaperCounters) -> u64| f(b).saturating_sub(f(a));
        let (offered, dropped, delayed) =
            (d(|c| c.offered_pkts), d(|c| c.horizon_drops), d(|c| c.delayed_pkts));
        let backlog_ns =
            if s.per_flow() { 0 } else { maps.shaper_backlog_ns(i as u32).unwrap_or(0) };
        rows.push(ShaperRow {
            shaper: s.name.clone(),
            dst: s.dst_text.clone(),
            rate: s.rate_text.clone(),
            per: if s.per_flow() { "flow" } else { "aggregate" }.into(),
            dry_run: s.dry_run(),
            offered_pps: offered as f64 / dt,
            offered_bps: d(|c| c.offered_bytes) as f64 * 8.0 / dt,
            sent_pps: offered.saturating_sub(dropped) as f64 / dt,
            delayed_pps: delayed as f64 / dt,
            mean_delay_ms: if delayed == 0 {
                0.0
            } else {
                d(|c| c.delay_ns) as f64 / delayed as f64 / 1e6
            },
            horizon_drop_pps: dropped as f64 / dt,
            backlog_ms: backlog_ns as f64 / 1e6,
            horizon_drops_total: b.horizon_drops,
        });
    }
    rows
}

/// The CPU signal as the agent last published it (`None`: no fresh
/// record), or why there is none.
pub fn cpu_text(agent: Option<&flowctl_common::AgentRecord>) -> String {
    match agent {
        None => "agent not running".into(),
        Some(r) if r.cpu_permille != flowctl_common::NO_CPU_SIGNAL => {
            format!(
                "{:.1}% ({})",
                r.cpu_permille as f64 / 10.0,
                crate::controllers::cpu::CpuSource::name_of(r.cpu_source)
            )
        }
        Some(_) => "n/a".into(),
    }
}

/// A rule's statistics over the complete buckets of the last second of its
/// ring (zero if the ring cannot be read), and the seconds they span.
fn ring_second(
    maps: &Maps,
    state: &AttachState,
    record: u32,
) -> (flowctl_common::stats::StatsSum, f64) {
    let shape = state.stats;
    let span = (1_000_000_000u64.div_ceil(shape.bucket_ns.max(1))) as u32;
    maps.stats_rate_window(record, &shape, crate::system::clock::monotonic_ns(), span)
        .unwrap_or((Default::default(), 1.0))
}

/// Sort orders the view offers (the `s` key cycles them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortBy {
    Profile,
    Offered,
    Dropped,
    DropPct,
}

impl SortBy {
    pub fn next(self) -> Self {
        match self {
            Self::Profile => Self::Offered,
            Self::Offered => Self::Dropped,
            Self::Dropped => Self::DropPct,
            Self::DropPct => Self::Profile,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Profile => "profile order",
            Self::Offered => "offered pps",
            Self::Dropped => "dropped pps",
            Self::DropPct => "drop %",
        }
    }

    pub fn apply(self, rows: &mut [RuleRow]) {
        let key = |r: &RuleRow| match self {
            Self::Profile => 0.0,
            Self::Offered => -r.offered_pps,
            Self::Dropped => -r.dropped_pps,
            Self::DropPct => -r.drop_pct,
        };
        rows.sort_by(|a, b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal));
    }
}
