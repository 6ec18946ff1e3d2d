//! SYNs since attach, per rule. The kernel counts new TCP connections (SYN
//! without ACK, offered and admitted) only in its statistics rings, which
//! hold seconds (docs/algorithms.md section 2): the agent adds every
//! settled bucket to running totals exactly once, well within the ring's
//! span, and keeps them in the run directory (`syn-totals.json`) with the
//! epoch it has counted through. `status`, another process, reads the file
//! and adds what the ring holds since, so it shows the totals up to now.
//!
//! A restarted agent that adopts the pins (`--keep`) continues from the
//! file: the buckets still in the ring are counted, nothing twice. What
//! fell out of the ring while no agent ran is lost, and said so
//! (`uncounted_ns`). A rule keeps its totals while its counter record does
//! (its name unchanged: `dataplane::plan_states`); a new record starts from
//! zero, as its kernel counters do.

use crate::{
    dataplane::{
        pins::{run_file, AttachId},
        state::AttachState,
        Maps,
    },
    profile::StatsSettings,
    system::clock::monotonic_ns,
};
use anyhow::Result;
use flowctl_common::{
    stats::{epoch_of, StatsSum},
    GLOBAL_COUNTER_INDEX,
};
use serde::{Deserialize, Serialize};
use std::{ops::Range, time::Duration};

/// The name the unmatched traffic's record has in the totals (its record
/// number tells it from a rule of that name).
pub const UNMATCHED: &str = "unmatched";

/// `syn-totals.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SynTotals {
    /// The ring's bucket width the epochs are in.
    pub bucket_ns: u64,
    /// Every bucket before this epoch is in the totals (0: none counted).
    pub through_epoch: u64,
    pub records: Vec<RecordSyns>,
}

/// One counter record's SYNs since attach.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordSyns {
    pub rule: String,
    pub record: u32,
    /// SYNs (without ACK) offered to the rule.
    pub seen: u64,
    /// Of them, admitted (a dry-run rule's would-drops pass, so count here).
    pub passed: u64,
    /// Time whose buckets left the ring before anyone counted them: the
    /// totals miss what arrived then.
    pub uncounted_ns: u64,
}

impl RecordSyns {
    pub fn dropped(&self) -> u64 {
        self.seen.saturating_sub(self.passed)
    }
}

/// The epochs to count next and how many fell out of the ring uncounted:
/// from where the totals stopped (`through`, 0: never) to `end`, limited to
/// the complete buckets the ring still holds at epoch `cur`.
fn next_span(through: u64, cur: u64, end: u64, buckets: u32) -> (Range<u64>, u64) {
    let oldest = cur.saturating_sub(buckets.saturating_sub(1) as u64).max(1);
    let missed = if through != 0 && through < oldest { oldest - through } else { 0 };
    let start = through.max(oldest);
    (start..end.max(start), missed)
}

impl SynTotals {
    pub fn path(id: &AttachId) -> std::path::PathBuf {
        id.run_dir().join(run_file::SYN_TOTALS)
    }

    /// The totals on file (empty when there are none, or they are of
    /// another ring shape).
    pub fn load(id: &AttachId, shape: &StatsSettings) -> Self {
        std::fs::read(Self::path(id))
            .ok()
            .and_then(|b| serde_json::from_slice::<Self>(&b).ok())
            .filter(|t| t.bucket_ns == shape.bucket_ns)
            .unwrap_or(Self { bucket_ns: shape.bucket_ns, ..Self::default() })
    }

    /// Written to a temporary file and renamed: readers never see half.
    pub fn save(&self, id: &AttachId) -> Result<()> {
        let path = Self::path(id);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(self)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// Brings the totals of `records` (rule name, record) up to epoch `end`
    /// (exclusive) with `read`, which sums a record's ring over epochs;
    /// `cur` is the epoch now. Records no longer in the set are forgotten.
    pub fn advance(
        &mut self,
        records: &[(String, u32)],
        buckets: u32,
        cur: u64,
        end: u64,
        mut read: impl FnMut(u32, Range<u64>) -> Result<StatsSum>,
    ) -> Result<()> {
        let (span, missed) = next_span(self.through_epoch, cur, end, buckets);
        let old = std::mem::take(&mut self.records);
        for (rule, record) in records {
            let mut r = old
                .iter()
                .find(|o| o.record == *record && o.rule == *rule)
                .cloned()
                .unwrap_or_else(|| RecordSyns {
                    rule: rule.clone(),
                    record: *record,
                    ..Default::default()
                });
            let existed = old.iter().any(|o| o.record == *record && o.rule == *rule);
            if existed {
                r.uncounted_ns += missed * self.bucket_ns;
            }
            if !span.is_empty() {
                let s = read(*record, span.clone())?;
                r.seen += s.syn_offered;
                r.passed += s.syn_passed;
            }
            self.records.push(r);
        }
        self.through_epoch = self.through_epoch.max(span.end);
        Ok(())
    }

    /// A rule's totals (`None`: not counted, no such record).
    pub fn rule(&self, rule: &str, record: u32) -> Option<&RecordSyns> {
        self.records.iter().find(|r| r.record == record && r.rule == rule)
    }

    /// The attachment's: every record's summed (the largest gap).
    pub fn total(&self) -> RecordSyns {
        let mut t = RecordSyns::default();
        for r in &self.records {
            t.seen += r.seen;
            t.passed += r.passed;
            t.uncounted_ns = t.uncounted_ns.max(r.uncounted_ns);
        }
        t
    }
}

/// The records whose SYNs are counted: every rule's and the unmatched
/// traffic's.
fn records_of(state: &AttachState) -> Vec<(String, u32)> {
    let mut v: Vec<(String, u32)> =
        state.rules.iter().map(|r| (r.name.clone(), r.record)).collect();
    v.push((UNMATCHED.to_string(), GLOBAL_COUNTER_INDEX));
    v
}

fn ring_read(
    maps: &Maps,
    shape: StatsSettings,
) -> impl FnMut(u32, Range<u64>) -> Result<StatsSum> + '_ {
    move |record, epochs| maps.stats_epochs(record, &shape, epochs)
}

/// The agent's loop: counts the settled buckets (one bucket behind the
/// current one, so a CPU still finishing a packet of it is not missed)
/// and saves the totals with the epoch they reach (a small file on tmpfs,
/// rewritten each period: a reader must never find the epoch older than
/// the ring, or it would report seconds the agent did count as lost).
pub struct SynCounter {
    totals: SynTotals,
    saved: Option<SynTotals>,
}

impl SynCounter {
    /// Continues the totals on file (a re-adopted data plane's).
    pub fn new(state: &AttachState) -> Self {
        Self { totals: SynTotals::load(&state.id, &state.stats), saved: None }
    }

    /// How often it runs: a quarter of the ring's span, at most 1 s.
    pub fn period(shape: &StatsSettings) -> Duration {
        let span = shape.bucket_ns.saturating_mul(shape.buckets as u64);
        Duration::from_nanos((span / 4).clamp(1_000_000, 1_000_000_000))
    }

    pub fn tick(&mut self, maps: &Maps, state: &AttachState) -> Result<()> {
        let shape = state.stats;
        let cur = epoch_of(monotonic_ns(), shape.bucket_ns);
        self.totals.advance(
            &records_of(state),
            shape.buckets,
            cur,
            cur.saturating_sub(1),
            ring_read(maps, shape),
        )?;
        if self.saved.as_ref() != Some(&self.totals) {
            self.totals.save(&state.id)?;
            self.saved = Some(self.totals.clone());
        }
        Ok(())
    }
}

/// The totals up to now, for `status`: the file's, plus what the ring holds
/// past them (the current bucket included). Works with and without an
/// agent (a kept data plane's file stops where its agent stopped; the
/// ring's seconds since are added, earlier ones are uncounted).
pub fn now(maps: &Maps, state: &AttachState) -> Result<SynTotals> {
    let shape = state.stats;
    let mut t = SynTotals::load(&state.id, &shape);
    let cur = epoch_of(monotonic_ns(), shape.bucket_ns);
    t.advance(&records_of(state), shape.buckets, cur, cur + 1, ring_read(maps, shape))?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_start_where_the_totals_stopped_within_what_the_ring_holds() {
        // Ring of 10: at epoch 100 the complete buckets held are 91..100.
        assert_eq!(next_span(0, 100, 99, 10), (91..99, 0), "never counted: all the ring holds");
        assert_eq!(next_span(95, 100, 99, 10), (95..99, 0));
        assert_eq!(next_span(99, 100, 99, 10), (99..99, 0), "nothing new");
        assert_eq!(next_span(80, 100, 99, 10), (91..99, 11), "80..91 left the ring");
        assert_eq!(next_span(0, 3, 2, 10), (1..2, 0), "epochs start at 1");
        assert_eq!(next_span(99, 100, 101, 10), (99..101, 0), "status: up to the current one");
    }

    /// A ring of one record whose bucket `e` holds `e` SYNs, `e / 2` passed.
    fn ring(_record: u32, epochs: Range<u64>) -> Result<StatsSum> {
        let mut s = StatsSum::default();
        for e in epochs {
            s.syn_offered += e;
            s.syn_passed += e / 2;
        }
        Ok(s)
    }

    fn sum(r: Range<u64>) -> u64 {
        r.sum()
    }

    #[test]
    fn every_bucket_counts_once_across_ticks_and_a_restart() {
        let recs = vec![("conn".to_string(), 0u32)];
        let mut t = SynTotals { bucket_ns: 100, ..Default::default() };
        t.advance(&recs, 10, 20, 19, ring).unwrap();
        t.advance(&recs, 10, 20, 19, ring).unwrap();
        assert_eq!(t.rule("conn", 0).unwrap().seen, sum(11..19), "twice the same: once");
        t.advance(&recs, 10, 25, 24, ring).unwrap();
        assert_eq!(t.rule("conn", 0).unwrap().seen, sum(11..24));
        assert_eq!(t.through_epoch, 24);
        // A restarted agent 5 epochs later continues from the file's epoch.
        let mut again: SynTotals =
            serde_json::from_slice(&serde_json::to_vec(&t).unwrap()).unwrap();
        again.advance(&recs, 10, 30, 29, ring).unwrap();
        let r = again.rule("conn", 0).unwrap();
        assert_eq!((r.seen, r.uncounted_ns), (sum(11..29), 0));
        assert_eq!(r.passed, (11..29).map(|e| e / 2).sum::<u64>());
        assert_eq!(r.dropped(), r.seen - r.passed);
        // One 20 epochs later: 29..41 left the ring (it holds 41..50).
        again.advance(&recs, 10, 50, 49, ring).unwrap();
        let r = again.rule("conn", 0).unwrap();
        assert_eq!(r.seen, sum(11..29) + sum(41..49));
        assert_eq!(r.uncounted_ns, 12 * 100);
    }

    #[test]
    fn a_new_record_starts_from_zero_and_a_gone_one_is_forgotten() {
        let mut t = SynTotals { bucket_ns: 100, ..Default::default() };
        t.advance(&[("a".into(), 0)], 10, 20, 19, ring).unwrap();
        // "a" removed, "b" added on record 1; later "a" again on record 0.
        t.advance(&[("b".into(), 1)], 10, 22, 21, ring).unwrap();
        assert!(t.rule("a", 0).is_none());
        assert_eq!(t.rule("b", 1).unwrap().seen, sum(19..21));
        t.advance(&[("b".into(), 1), ("a".into(), 0)], 10, 23, 22, ring).unwrap();
        assert_eq!(t.rule("a", 0).unwrap().seen, 21, "only what came after");
        let total = t.total();
        assert_eq!(total.seen, sum(19..22) + 21);
    }

    #[test]
    fn the_period_is_well_inside_the_ring() {
        let s = |bucket_ns, buckets| StatsSettings { bucket_ns, buckets, ..Default::default() };
        assert_eq!(SynCounter::period(&s(100_000_000, 100)), Duration::from_secs(1));
        assert_eq!(SynCounter::period(&s(10_000_000, 10)), Duration::from_millis(25));
    }
}
