//! The flood loop: lends the pool's flood sketches (`FLOWCTL_SKETCHES`) to
//! rules whose new keys would turn the tables over, and takes them back
//! when the flood ends (docs/design.md, "The flood sketch").
//!
//! Every period (`period_for`: 50 ms, longer when a read would copy more
//! than `READ_BUDGET` allows) it reads each eligible rule's buckets created
//! (`key_inserts + source_claims`) and packets its sketch decided
//! (`sketched_pkts`). A rule is **flooded** when it creates buckets faster
//! than the smaller of the key table and the source cache turns over in
//! `TURNOVER`. A flooded rule is lent a clean sketch when the sketch can
//! hold its flood within the false-refusal target
//! (`sketch::flood_capacity`, `FALSE_REFUSAL_TARGET`): beyond that a sketch
//! would refuse more new legitimate keys than the buckets and the debt
//! table do, so the rule keeps them, and the agent says so. While any rule
//! holds a sketch the global control record's `FLOOD` flag is set, so new
//! sources get no cache entry (`classify::flooded`).
//!
//! With `flood_watch` in the profile's settings, `watch` also reads the
//! rules without a sketch every `WATCH_PERIOD` (10 ms) and lends to one
//! whose new buckets since its last watch are a flood
//! (`WATCH_MIN_KEYS` of them, at the threshold's rate): a strong flood
//! then gets buckets for about 10 ms instead of up to a period. Off by
//! default for its cost: the wake-ups (docs/design.md, "Reaction time").
//!
//! A sketch is taken back when its rule's keys without a bucket come slower
//! than half the threshold for `CALM`, or when they come faster than twice
//! what the sketch holds for `GROWN_FOR` (then it is held off for
//! `HOLD_OFF`). Taken back,
//! it first drains for one burst (`SKETCH_DRAINING`): it decides nothing,
//! the flag is cleared, and new buckets start no earlier than its
//! estimate, so a key it refused does not come out with a full bucket; a
//! flood that resumes meanwhile gets it back as it is. This loop is the
//! only writer of the records' `sketch` fields, of their draining flag and
//! of the flood flag; it clears all of them when it starts (a previous
//! agent's) and when the agent stops, and the kernel ignores them once the
//! agent's heartbeat is older than the grace period.
//!
//! **Clean sketches.** A cell is a TAT, and a TAT in the past is a full
//! bucket, so a sketch is as good as zeroed once its rule's burst has
//! passed since it last decided: a drained sketch is clean when it is
//! freed. Zeroing one (`BPF_MAP_UPDATE_BATCH` of its 131,072 cells) took
//! 48 ms under a 100,000/s flood on this project's 2-CPU machine, half the
//! time a flood's sources got entries before the sketch was lent, so it is
//! done ahead: a sketch whose state is unknown (a previous agent's, or one
//! taken back without a drain) is zeroed by a read that lent none (one a
//! read), and only a sketch not yet clean is zeroed as it is lent.

use crate::{
    dataplane::{batch, state::AttachState, Maps},
    profile::{Rule, RuleSet},
    system::{clock::monotonic_ns, log},
};
use anyhow::{Context, Result};
use flowctl_common::{
    key_kind, sketch, unit, RuleCounters, GLOBAL_COUNTER_INDEX, MAX_RULE_RECORDS,
};
use std::time::{Duration, Instant};

/// The shortest period between two reads of the counters. A flood is seen
/// at the first read after it starts (a read's rate covers one period, and
/// a flood crosses the threshold within one at any rate worth a sketch), so
/// this is the time its sources get buckets and cache entries, evicting
/// others', before the sketch decides them: 250 ms at first, which let
/// 10,000-17,000 of a 95,000/s flood's sources in (e2e
/// `a_flooded_rule_is_lent_a_sketch_and_spares_other_keys`).
pub const MIN_PERIOD: Duration = Duration::from_millis(50);
/// The longest, for profiles whose reads would copy the most.
pub const MAX_PERIOD: Duration = Duration::from_millis(250);
/// Between two watches (`FloodLoop::watch`): the reads in between the
/// loop's that look only for a strong flood's start on rules without a
/// sketch, so one is lent within about this long rather than a period.
pub const WATCH_PERIOD: Duration = Duration::from_millis(10);
/// Buckets one watch must see created, besides the threshold's rate, to
/// lend: a handful of new keys in 10 ms is a rate over the threshold of
/// small tables (11 at 64k entries) without being a flood. Floods slower
/// than this many per watch (6,400/s) are left to the loop's period.
pub const WATCH_MIN_KEYS: u64 = 64;
/// What the loop may copy per second out of the per-CPU counters: a read
/// copies one `RuleCounters` per possible CPU per eligible rule (10 rules
/// on 128 CPUs: 369 kB, every 50 ms; 512 rules: 18.9 MB, every 250 ms,
/// over the budget, as before the period adapted).
pub const READ_BUDGET: f64 = 8e6;
/// A flood beyond twice what its sketch holds, for this long, takes the
/// sketch back: a 50 ms read alone would take it back on a spike.
pub const GROWN_FOR: Duration = Duration::from_millis(250);
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
    /// When the last watch (`FloodLoop::watch`) read the rule, and the
    /// buckets it counted; None while it holds a sketch (unwatched).
    watched: Option<(Instant, u64)>,
    lent: Option<u32>,
    /// Taken back, deciding nothing: freed at this time (`SKETCH_DRAINING`).
    draining_until: Option<Instant>,
    /// New buckets per second that make it flooded (`threshold_of`).
    threshold: f64,
    /// The rule's burst: how long after its last admission a cell can still
    /// hold a TAT in the future.
    burst: Duration,
    calm_since: Option<Instant>,
    /// Since when its flood has been beyond twice what the sketch holds.
    grown_since: Option<Instant>,
    held_off_until: Option<Instant>,
    /// Said once per episode that the flood is beyond a sketch.
    said_beyond: bool,
}

pub struct FloodLoop {
    rules: Vec<Watched>,
    /// Between two reads (`period_for`).
    period: Duration,
    /// Between two watches: `WATCH_PERIOD`, or None when the watches'
    /// reads would copy more than `READ_BUDGET` allows.
    watch_period: Option<Duration>,
    last: Option<Instant>,
    /// From when each sketch of the pool holds no TAT in the future (None:
    /// unknown, zeroed before it is lent).
    clean_from: [Option<Instant>; sketch::SKETCH_POOL as usize],
    flagged: bool,
    said_pool_full: bool,
    said_zero_failed: bool,
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

/// The rule's own: an isolated rule (`isolate`) turns over its own table,
/// and no other.
pub fn threshold_of(rule: &Rule, key_table_entries: u32, source_cache_entries: u32) -> f64 {
    match rule.own_table {
        Some(entries) => threshold(entries, entries),
        None => threshold(key_table_entries, source_cache_entries),
    }
}

/// The loop's period for `rules` eligible rules on `cpus` possible CPUs:
/// as short as `MIN_PERIOD` while a read copies no more than `READ_BUDGET`
/// allows, never longer than `MAX_PERIOD`.
pub fn period_for(rules: usize, cpus: usize) -> Duration {
    if rules == 0 {
        return MAX_PERIOD; // nothing to read
    }
    let secs = read_bytes(rules, cpus) / READ_BUDGET;
    Duration::from_secs_f64(secs.clamp(MIN_PERIOD.as_secs_f64(), MAX_PERIOD.as_secs_f64()))
}

/// `WATCH_PERIOD` when watching `rules` eligible rules on `cpus` possible
/// CPUs copies no more than `READ_BUDGET` allows (a watch copies what a
/// read does), else None: the loop's reads alone.
pub fn watch_period_for(rules: usize, cpus: usize) -> Option<Duration> {
    let per_s = read_bytes(rules, cpus) / WATCH_PERIOD.as_secs_f64();
    (rules > 0 && per_s <= READ_BUDGET).then_some(WATCH_PERIOD)
}

/// What one read copies out of the per-CPU counters: a `RuleCounters` per
/// possible CPU per eligible rule.
fn read_bytes(rules: usize, cpus: usize) -> f64 {
    rules as f64 * cpus as f64 * size_of::<RuleCounters>() as f64
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
                threshold: threshold_of(r, state.key_table_entries, state.source_cache_entries),
                created: 0,
                sketched: 0,
                watched: None,
                lent: None,
                draining_until: None,
                burst: Duration::from_nanos(r.burst_ns),
                calm_since: None,
                grown_since: None,
                held_off_until: None,
                said_beyond: false,
            })
            .collect::<Vec<_>>();
        // Unknown, the count of possible CPUs is taken as the kernel's
        // largest configurable (NR_CPUS up to 8192): the longest period.
        let cpus = aya::util::nr_cpus().unwrap_or(8192);
        let watch_period = watch_period_for(rules.len(), cpus).filter(|_| set.settings.flood_watch);
        let mut l = FloodLoop {
            period: period_for(rules.len(), cpus),
            watch_period,
            rules,
            last: None,
            clean_from: [None; sketch::SKETCH_POOL as usize],
            flagged: true,
            said_pool_full: false,
            said_zero_failed: false,
        };
        l.clear(maps)?;
        Ok(l)
    }

    /// The loop for a new profile: this one's sketches taken back (of
    /// unknown state, zeroed ahead; freed drained sketches stay clean),
    /// the new rules watched.
    pub fn restart(mut self, maps: &mut Maps, state: &AttachState, set: &RuleSet) -> Result<Self> {
        self.clear(maps)?;
        let mut next = Self::start(maps, state, set)?;
        next.clean_from = self.clean_from;
        Ok(next)
    }

    /// How often `tick` wants to be called.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// How often `watch` wants to be called (None: not at all).
    pub fn watch_period(&self) -> Option<Duration> {
        self.watch_period
    }

    /// A read between the loop's (every `WATCH_PERIOD`) of the rules
    /// without a sketch only: one that created at least `WATCH_MIN_KEYS`
    /// buckets since the last watch, at the threshold's rate or faster, is
    /// considered for a sketch at once, as `tick` would at its next read.
    /// A strong flood's sources then get buckets and cache entries for
    /// about 10 ms instead of up to a period (50 ms).
    pub fn watch(&mut self, maps: &mut Maps, now: Instant) -> Result<()> {
        let lent_before = self.rules.iter().filter(|w| w.lent.is_some()).count();
        for i in 0..self.rules.len() {
            if self.rules[i].lent.is_some() {
                self.rules[i].watched = None;
                continue;
            }
            let c = maps.counters(self.rules[i].record)?;
            let created = c.key_inserts + c.source_claims;
            let w = &mut self.rules[i];
            let Some((at, before)) = w.watched.replace((now, created)) else { continue };
            let (new, dt) = (created.saturating_sub(before), now.saturating_duration_since(at));
            let rate = new as f64 / dt.as_secs_f64().max(1e-6);
            if new >= WATCH_MIN_KEYS && rate >= w.threshold {
                self.consider_lending(maps, i, rate, now)?;
            }
        }
        if self.rules.iter().filter(|w| w.lent.is_some()).count() > lent_before {
            self.set_flag(maps, true)?;
        }
        Ok(())
    }

    /// Every record's sketch taken back, and the flag cleared.
    pub fn clear(&mut self, maps: &mut Maps) -> Result<()> {
        let now = monotonic_ns();
        for record in 0..MAX_RULE_RECORDS as u32 {
            let lent = maps.control.get(&record, 0).map(|c| c.sketch).unwrap_or(0);
            if lent != 0 {
                maps.update_control(record, now, |e| e.set_sketch(None))?;
                // Taken back without a drain, its cells may be in the
                // future: zeroed before it is lent again.
                if let Some(c) = self.clean_from.get_mut(lent as usize - 1) {
                    *c = None;
                }
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
        let lent_before = self.rules.iter().filter(|w| w.lent.is_some()).count();
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
        self.set_flag(maps, any)?;
        // A read that lent a sketch may have zeroed one already.
        if self.rules.iter().filter(|w| w.lent.is_some()).count() <= lent_before {
            self.zero_one_unknown(maps, now);
        }
        Ok(())
    }

    /// Zeroes one free sketch whose state is unknown, if there is one.
    fn zero_one_unknown(&mut self, maps: &mut Maps, now: Instant) {
        if self.rules.is_empty() {
            return; // nothing to lend them to
        }
        let taken: Vec<u32> = self.rules.iter().filter_map(|w| w.lent).collect();
        if let Some(s) = (0..sketch::SKETCH_POOL)
            .find(|s| !taken.contains(s) && self.clean_from[*s as usize].is_none())
        {
            if self.zeroed(maps, s) {
                self.clean_from[s as usize] = Some(now);
            }
        }
    }

    /// Sketch `s` zeroed; a failure is said once until one succeeds.
    fn zeroed(&mut self, maps: &mut Maps, s: u32) -> bool {
        match zero(maps, s) {
            Ok(()) => {
                self.said_zero_failed = false;
                true
            }
            Err(e) => {
                if !self.said_zero_failed {
                    self.said_zero_failed = true;
                    log::warning(format_args!(
                        "{e:#}: flood sketch {s} is not lent until it can be zeroed"
                    ));
                }
                false
            }
        }
    }

    fn consider_lending(
        &mut self,
        maps: &mut Maps,
        i: usize,
        rate: f64,
        now: Instant,
    ) -> Result<()> {
        let w = &mut self.rules[i];
        let threshold = w.threshold;
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
        let is_clean = |s: u32| self.clean_from[s as usize].is_some_and(|t| t <= now);
        let free = (0..sketch::SKETCH_POOL).filter(|s| !taken.contains(s));
        let Some(free) = free.clone().find(|s| is_clean(*s)).or_else(|| free.clone().next()) else {
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
        if !is_clean(free) && !self.zeroed(maps, free) {
            return Ok(());
        }
        self.clean_from[free as usize] = None;
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
        let period = self.period;
        let w = &mut self.rules[i];
        let threshold = w.threshold;
        if rate <= 2.0 * w.capacity {
            w.grown_since = None;
        } else {
            w.calm_since = None;
        }
        let why = if rate > 2.0 * w.capacity {
            // The first read beyond covers one period already.
            let since = *w.grown_since.get_or_insert(now);
            (now.saturating_duration_since(since) + period >= GROWN_FOR).then(|| {
                w.held_off_until = Some(now + HOLD_OFF);
                format!(
                    "its flood grew to {rate:.0}/s, beyond the {:.0}/s the sketch holds",
                    w.capacity
                )
            })
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
        // It decided until this write landed, which may be well after the
        // read's `now` (the agent's other loops ran first); the period is
        // the margin for packets already in flight.
        let taken_at = now.max(Instant::now());
        w.draining_until = Some(taken_at + w.burst + period);
        w.calm_since = None;
        w.grown_since = None;
        log::warning(format_args!(
            "rule {}: flood sketch {} taken back ({why}); freed in {:.1} s",
            w.name,
            w.lent.unwrap_or(0),
            (w.burst + period).as_secs_f64()
        ));
        Ok(())
    }

    /// A sketch being taken back: lent again as it is if the flood resumes
    /// (and the sketch still holds it), else freed once drained.
    fn drain(&mut self, maps: &mut Maps, i: usize, rate: f64, now: Instant) -> Result<()> {
        let w = &mut self.rules[i];
        let threshold = w.threshold;
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
            // Drained for its burst: every cell is in the past.
            if let Some(s) = w.lent {
                self.clean_from[s as usize] = Some(now);
            }
            w.lent = None;
            w.draining_until = None;
        }
        Ok(())
    }
}

/// Sketch `s` of the pool zeroed: TAT 0 is a full bucket, as a new key's.
fn zero(maps: &mut Maps, s: u32) -> Result<()> {
    let zeros = vec![0u64; sketch::SKETCH_CELLS as usize];
    batch::set_range(&mut maps.sketches, s * sketch::SKETCH_CELLS, &zeros)
        .context("zeroing a flood sketch")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_period_is_short_unless_a_read_copies_more_than_the_budget() {
        let bytes = size_of::<RuleCounters>();
        assert_eq!(period_for(0, 128), MAX_PERIOD, "nothing to read");
        assert_eq!(period_for(10, 128), MIN_PERIOD, "369 kB a read");
        // At the budget, exactly: 100 ms.
        let rules = (READ_BUDGET / 10.0) as usize / (bytes * 64);
        let p = period_for(rules, 64);
        assert!(p > MIN_PERIOD && p <= Duration::from_millis(100), "{p:?}");
        assert_eq!(period_for(512, 128), MAX_PERIOD);
        assert_eq!(period_for(1, 8192), MAX_PERIOD, "CPUs unknown: 2.4 MB a read");
        assert_eq!(period_for(usize::MAX, usize::MAX), MAX_PERIOD, "no overflow");
    }

    #[test]
    fn watches_run_only_within_the_read_budget() {
        assert_eq!(watch_period_for(0, 2), None, "nothing to watch");
        assert_eq!(watch_period_for(2, 2), Some(WATCH_PERIOD), "1.2 kB a watch");
        // 288 B x 128 CPUs x 2 rules every 10 ms: 7.4 MB/s; 3 rules: 11 MB/s.
        assert_eq!(watch_period_for(2, 128), Some(WATCH_PERIOD));
        assert_eq!(watch_period_for(3, 128), None);
        assert_eq!(watch_period_for(usize::MAX, usize::MAX), None, "no overflow");
    }

    #[test]
    fn the_threshold_turns_the_smaller_table_over_in_a_minute() {
        assert_eq!(threshold(1 << 20, 65_536), 65_536.0 / 60.0);
    }
}
