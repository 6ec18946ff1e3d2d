//! The flood loop: lends the pool's flood sketches (`FLOWCTL_SKETCHES`) to
//! rules whose new keys would turn the tables over, and takes them back
//! when the flood ends (docs/design.md, "The flood sketch").
//!
//! Every `PERIOD` it reads each eligible rule's buckets created
//! (`key_inserts + source_claims`) and packets its sketch decided
//! (`sketched_pkts`). A rule is **flooded** when it creates buckets faster
//! than the smaller of the key table and the source cache turns over in
//! `TURNOVER`. A flooded rule is lent a sketch, zeroed first, when the
//! sketch can hold its flood within the false-refusal target
//! (`sketch::flood_capacity`, `FALSE_REFUSAL_TARGET`): beyond that a sketch
//! would refuse more new legitimate keys than the buckets and the debt
//! table do, so the rule keeps them, and the agent says so. While any rule
//! holds a sketch the global control record's `FLOOD` flag is set, so new
//! sources get no cache entry (`classify::flooded`).
//!
//! A sketch is taken back when its rule's keys without a bucket come slower
//! than half the threshold for `CALM`, or when they come faster than twice
//! what the sketch holds (then it is held off for `HOLD_OFF`). Taken back,
//! it first drains for one burst (`SKETCH_DRAINING`): it decides nothing,
//! the flag is cleared, and new buckets start no earlier than its
//! estimate, so a key it refused does not come out with a full bucket; a
//! flood that resumes meanwhile gets it back as it is. This loop is the
//! only writer of the records' `sketch` fields, of their draining flag and
//! of the flood flag; it clears all of them when it starts (a previous
//! agent's) and when the agent stops, and the kernel ignores them once the
//! agent's heartbeat is older than the grace period.

use crate::{
    dataplane::{batch, state::AttachState, Maps},
    profile::{Rule, RuleSet},
    system::{clock::monotonic_ns, log},
};
use anyhow::{Context, Result};
use flowctl_common::{key_kind, sketch, unit, GLOBAL_COUNTER_INDEX, MAX_RULE_RECORDS};
use std::time::{Duration, Instant};

/// How often the loop reads the counters.
pub const PERIOD: Duration = Duration::from_millis(250);
/// A rule is flooded when it would turn the smaller table over this fast.
pub const TURNOVER: Duration = Duration::from_secs(60);
/// Below half the threshold this long, a rule's flood is over.
pub const CALM: Duration = Duration::from_secs(30);
/// After a sketch is taken back because its flood outgrew it.
pub const HOLD_OFF: Duration = Duration::from_secs(60);
/// The share of new keys' first packets a lent sketch may refuse.
pub const FALSE_REFUSAL_TARGET: f64 = 0.01;

/// One eligible rule's state.
struct Watched {
    name: String,
    record: u32,
    /// Unit packets per second of keys without a bucket that a sketch holds
    /// within the target.
    capacity: f64,
    /// Buckets and sketched packets counted at the last read.
    created: u64,
    sketched: u64,
    lent: Option<u32>,
    /// Taken back, deciding nothing: freed at this time (`SKETCH_DRAINING`).
    draining_until: Option<Instant>,
    /// The rule's burst: how long after its last admission a cell can still
    /// hold a TAT in the future.
    burst: Duration,
    calm_since: Option<Instant>,
    held_off_until: Option<Instant>,
    /// Said once per episode that the flood is beyond a sketch.
    said_beyond: bool,
}

pub struct FloodLoop {
    rules: Vec<Watched>,
    /// New buckets per second that make a rule flooded.
    threshold: f64,
    last: Option<Instant>,
    flagged: bool,
    said_pool_full: bool,
}

/// Whether a rule can be lent a sketch: a local rule that keeps a bucket
/// per key of many (not one for the whole rule), counting packets or
/// connections, without the stages that keep their own buckets (nested
/// limits, warm-up, a global limit).
pub fn eligible(rule: &Rule) -> bool {
    rule.interval_fp != 0
        && !rule.block
        && rule.key_kind != key_kind::RULE
        && (rule.unit == unit::PACKETS || rule.unit == unit::CONNECTIONS)
        && rule.global.is_none()
        && rule.limits.is_empty()
        && rule.warm_up.is_none()
}

/// The creation rate that makes a rule flooded for tables of these sizes.
pub fn threshold(key_table_entries: u32, source_cache_entries: u32) -> f64 {
    key_table_entries.min(source_cache_entries) as f64 / TURNOVER.as_secs_f64()
}

/// What a sketch of the pool holds of `rule`'s flood (unit packets per
/// second of keys without a bucket) within the target.
pub fn capacity(rule: &Rule) -> f64 {
    let increment = flowctl_common::gcra::increment_ns(rule.interval_fp, 1);
    sketch::flood_capacity(
        sketch::SKETCH_COLUMNS,
        increment,
        rule.burst.max(1),
        FALSE_REFUSAL_TARGET,
    )
}

impl FloodLoop {
    /// The loop for `set` as applied in `state`, with every sketch taken
    /// back and the flag cleared.
    pub fn start(maps: &mut Maps, state: &AttachState, set: &RuleSet) -> Result<Self> {
        let rules = set
            .rules
            .iter()
            .zip(&state.rules)
            .filter(|(r, _)| eligible(r))
            .map(|(r, rs)| Watched {
                name: r.name.clone(),
                record: rs.record,
                capacity: capacity(r),
                created: 0,
                sketched: 0,
                lent: None,
                draining_until: None,
                burst: Duration::from_nanos(r.burst_ns),
                calm_since: None,
                held_off_until: None,
                said_beyond: false,
            })
            .collect();
        let mut l = FloodLoop {
            rules,
            threshold: threshold(state.key_table_entries, state.source_cache_entries),
            last: None,
            flagged: true,
            said_pool_full: false,
        };
        l.clear(maps)?;
        Ok(l)
    }

    /// Every record's sketch taken back, and the flag cleared.
    pub fn clear(&mut self, maps: &mut Maps) -> Result<()> {
        let now = monotonic_ns();
        for record in 0..MAX_RULE_RECORDS as u32 {
            if maps.control.get(&record, 0).map(|c| c.sketch != 0).unwrap_or(false) {
                maps.update_control(record, now, |e| e.set_sketch(None))?;
            }
        }
        for w in &mut self.rules {
            w.lent = None;
            w.draining_until = None;
        }
        self.set_flag(maps, false)
    }

    fn set_flag(&mut self, maps: &mut Maps, on: bool) -> Result<()> {
        if self.flagged != on {
            let now = monotonic_ns();
            maps.update_control(GLOBAL_COUNTER_INDEX, now, |e| e.set_flood(on))?;
            self.flagged = on;
        }
        Ok(())
    }

    /// One read of the counters, and what follows from it.
    pub fn tick(&mut self, maps: &mut Maps, now: Instant) -> Result<()> {
        let dt = self.last.map(|t| now.saturating_duration_since(t).as_secs_f64());
        self.last = Some(now);
        for i in 0..self.rules.len() {
            let c = maps.counters(self.rules[i].record)?;
            let created = c.key_inserts + c.source_claims;
            let w = &mut self.rules[i];
            let (new_buckets, sketched) = (
                created.saturating_sub(w.created) as f64,
                c.sketched_pkts.saturating_sub(w.sketched) as f64,
            );
            w.created = created;
            w.sketched = c.sketched_pkts;
            let Some(dt) = dt.filter(|d| *d > 0.0) else { continue };
            let (new_rate, sketched_rate) = (new_buckets / dt, sketched / dt);
            match (w.lent, w.draining_until) {
                (None, _) => self.consider_lending(maps, i, new_rate, now)?,
                (Some(_), None) => {
                    self.consider_taking_back(maps, i, new_rate + sketched_rate, now)?
                }
                (Some(_), Some(_)) => self.drain(maps, i, new_rate, now)?,
            }
        }
        let any = self.rules.iter().any(|w| w.lent.is_some() && w.draining_until.is_none());
        self.set_flag(maps, any)
    }

    fn consider_lending(
        &mut self,
        maps: &mut Maps,
        i: usize,
        rate: f64,
        now: Instant,
    ) -> Result<()> {
        let threshold = self.threshold;
        let w = &mut self.rules[i];
        if rate < threshold || w.held_off_until.is_some_and(|t| now < t) {
            if rate < threshold {
                w.said_beyond = false;
            }
            return Ok(());
        }
        if rate > w.capacity {
            if !w.said_beyond {
                w.said_beyond = true;
                log::warning(format_args!(
                    "rule {}: {rate:.0} new keys/s, beyond the {:.0}/s a flood sketch holds with at most {:.0}% of new keys refused; its keys keep their buckets and the debt table",
                    w.name,
                    w.capacity,
                    FALSE_REFUSAL_TARGET * 100.0
                ));
            }
            return Ok(());
        }
        let taken: Vec<u32> = self.rules.iter().filter_map(|w| w.lent).collect();
        let Some(free) = (0..sketch::SKETCH_POOL).find(|s| !taken.contains(s)) else {
            if !self.said_pool_full {
                self.said_pool_full = true;
                log::warning(format_args!(
                    "rule {}: flooded ({rate:.0} new keys/s), but all {} flood sketches are lent; its keys keep their buckets",
                    self.rules[i].name,
                    sketch::SKETCH_POOL
                ));
            }
            return Ok(());
        };
        self.said_pool_full = false;
        // Zeroed before it is lent: TAT 0 is a full bucket, as a new key's.
        let zeros = vec![0u64; sketch::SKETCH_CELLS as usize];
        batch::set_range(&mut maps.sketches, free * sketch::SKETCH_CELLS, &zeros)
            .context("zeroing a flood sketch")?;
        let w = &mut self.rules[i];
        maps.update_control(w.record, monotonic_ns(), |e| e.set_sketch(Some(free)))?;
        w.lent = Some(free);
        w.calm_since = None;
        log::warning(format_args!(
            "rule {}: flooded ({rate:.0} new keys/s, threshold {threshold:.0}/s); its keys without a bucket are decided by flood sketch {free} (holds {:.0}/s)",
            w.name,
            w.capacity
        ));
        Ok(())
    }

    fn consider_taking_back(
        &mut self,
        maps: &mut Maps,
        i: usize,
        rate: f64,
        now: Instant,
    ) -> Result<()> {
        let threshold = self.threshold;
        let w = &mut self.rules[i];
        let why = if rate > 2.0 * w.capacity {
            w.held_off_until = Some(now + HOLD_OFF);
            Some(format!(
                "its flood grew to {rate:.0}/s, beyond the {:.0}/s the sketch holds",
                w.capacity
            ))
        } else if rate < threshold / 2.0 {
            let since = *w.calm_since.get_or_insert(now);
            (now.saturating_duration_since(since) >= CALM).then(|| {
                format!("under {:.0} new keys/s for {} s", threshold / 2.0, CALM.as_secs())
            })
        } else {
            w.calm_since = None;
            None
        };
        let Some(why) = why else { return Ok(()) };
        // It decides nothing from here, but new buckets start no earlier
        // than its estimate until every estimate is in the past: one burst.
        maps.update_control(w.record, monotonic_ns(), |e| e.drain_sketch())?;
        w.draining_until = Some(now + w.burst + PERIOD);
        w.calm_since = None;
        log::warning(format_args!(
            "rule {}: flood sketch {} taken back ({why}); freed in {:.1} s",
            w.name,
            w.lent.unwrap_or(0),
            (w.burst + PERIOD).as_secs_f64()
        ));
        Ok(())
    }

    /// A sketch being taken back: lent again as it is if the flood resumes
    /// (and the sketch still holds it), else freed once drained.
    fn drain(&mut self, maps: &mut Maps, i: usize, rate: f64, now: Instant) -> Result<()> {
        let threshold = self.threshold;
        let w = &mut self.rules[i];
        let resumed =
            rate >= threshold && rate <= w.capacity && w.held_off_until.is_none_or(|t| now >= t);
        if resumed {
            maps.update_control(w.record, monotonic_ns(), |e| e.set_sketch(w.lent))?;
            w.draining_until = None;
            log::warning(format_args!(
                "rule {}: flooded again ({rate:.0} new keys/s); flood sketch {} decides again",
                w.name,
                w.lent.unwrap_or(0)
            ));
        } else if w.draining_until.is_some_and(|t| now >= t) {
            maps.update_control(w.record, monotonic_ns(), |e| e.set_sketch(None))?;
            w.lent = None;
            w.draining_until = None;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_turns_the_smaller_table_over_in_a_minute() {
        assert_eq!(threshold(1 << 20, 65_536), 65_536.0 / 60.0);
    }
}
