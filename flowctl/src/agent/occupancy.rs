//! How full the key tables are, approximately: the agent counts each table
//! now and then with batched lookups, and between walks adds the kernel's
//! insert counters. A walk of a 1M-entry table takes about 0.3 s of CPU
//! here (docs/benchmarks.md), so walks are spaced to spend at most
//! `WALK_CPU_SHARE` of one core: every 30 s on small tables, every couple
//! of minutes on two full 1M-entry tables. LRU evictions are not
//! counted, so between walks the estimate can only run high, and it is
//! capped at the table's capacity. Every place that shows it says so.

use crate::{
    dataplane::{self, pins::AttachId, state::AttachState, Maps},
    system::clock::monotonic_ns,
};
use anyhow::Result;
use flowctl_common::{
    map_names, AgentRecord, BucketKey, QuotaRing, SrcEntry, SrcKey, GLOBAL_COUNTER_INDEX,
};
use serde::Serialize;
use std::time::Duration;

/// Walks are at least this far apart.
pub const MIN_WALK_PERIOD: Duration = Duration::from_secs(30);
/// Share of one core the walks may take.
pub const WALK_CPU_SHARE: f64 = 0.005;

/// When to walk again after a walk that took `took`.
pub fn next_walk_after(took: Duration) -> Duration {
    MIN_WALK_PERIOD.max(took.div_f64(WALK_CPU_SHARE))
}

/// Key-table inserts by every rule of the attachment (an isolated rule's
/// go into its own table), and source-cache inserts.
fn inserts(maps: &Maps, state: &AttachState) -> (u64, u64) {
    let configs = maps.active_rules(state.rules.len()).unwrap_or_default();
    let shared = |i: usize| {
        configs.get(i).is_none_or(|c| c.bucket_table != flowctl_common::bucket_table::OWN)
    };
    let keys = state
        .rules
        .iter()
        .enumerate()
        .filter(|(i, _)| shared(*i))
        .filter_map(|(_, r)| maps.counters(r.record).ok())
        .map(|c| c.key_inserts)
        .sum();
    let sources = maps.counters(GLOBAL_COUNTER_INDEX).map(|c| c.source_inserts).unwrap_or(0);
    (keys, sources)
}

/// Counts every table into `rec` (the agent, spaced by `next_walk_after`).
pub fn walk(id: &AttachId, maps: &Maps, state: &AttachState, rec: &mut AgentRecord) -> Result<()> {
    use core::mem::size_of;
    let (ki, si) = inserts(maps, state);
    rec.keys_walked =
        dataplane::count_entries(id, map_names::KEYS, size_of::<BucketKey>(), size_of::<u64>())?;
    rec.sources_walked = dataplane::count_entries(
        id,
        map_names::SRC_CACHE,
        size_of::<SrcKey>(),
        size_of::<SrcEntry>(),
    )?;
    rec.quotas_walked = dataplane::count_entries(
        id,
        map_names::QUOTAS,
        size_of::<BucketKey>(),
        size_of::<QuotaRing>(),
    )?;
    rec.key_inserts_at_walk = ki;
    rec.source_inserts_at_walk = si;
    rec.walked_ns = monotonic_ns();
    Ok(())
}

/// One table's approximate occupancy.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TableFill {
    pub table: &'static str,
    /// Entries at the last walk plus inserts since, capped at `capacity`.
    pub entries: u64,
    pub capacity: u64,
    /// Seconds since the walk the estimate starts from.
    pub walked_s_ago: f64,
}

/// The estimate from a fresh agent record (see `fresh_record`); `None` when
/// the agent has not walked the tables yet.
pub fn estimate(maps: &Maps, state: &AttachState, rec: &AgentRecord) -> Option<Vec<TableFill>> {
    if rec.walked_ns == 0 {
        return None;
    }
    let now = monotonic_ns();
    let (ki, si) = inserts(maps, state);
    let ago = now.saturating_sub(rec.walked_ns) as f64 / 1e9;
    let fill = |table, walked: u64, since: u64, cap: u32| TableFill {
        table,
        entries: walked.saturating_add(since).min(cap as u64),
        capacity: cap as u64,
        walked_s_ago: ago,
    };
    Some(vec![
        fill(
            "keys",
            rec.keys_walked,
            ki.saturating_sub(rec.key_inserts_at_walk),
            state.key_table_entries,
        ),
        fill(
            "sources",
            rec.sources_walked,
            si.saturating_sub(rec.source_inserts_at_walk),
            state.source_cache_entries,
        ),
        fill("quotas", rec.quotas_walked, 0, state.quota_table_entries),
    ])
}

/// The agent's record, when a reader should trust it now: written within
/// the grace period (a stopping agent clears it). `None`: "agent not
/// running", never the stopped agent's last values.
pub fn fresh_record(maps: &Maps) -> Option<AgentRecord> {
    let (rec, g) = (maps.agent_record().ok()?, maps.global().ok()?);
    (rec.updated_ns != 0
        && monotonic_ns().saturating_sub(rec.updated_ns) <= g.grace_ns.max(1_000_000_000))
    .then_some(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_are_spaced_by_their_cost() {
        assert_eq!(next_walk_after(Duration::from_millis(10)), MIN_WALK_PERIOD);
        assert_eq!(next_walk_after(Duration::from_millis(650)), Duration::from_secs(130));
    }
}
