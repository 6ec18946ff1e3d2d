//! What `top` remembers between reads, so the view can draw the last
//! minutes and not only the last instant: the state side of the split
//! (`view` and `detail` only draw it).
//!
//! Every series has one point per second. A rule's packet series come from
//! the kernel's statistics ring (docs/algorithms.md section 2), read in
//! whole slices of `ceil(1 s / bucket width)` buckets: the first read, when
//! `top` starts, folds in every complete slice the ring still holds (about
//! 10 s by default), so the history does not start empty, and each later
//! read folds in the slices completed since. What only the agent knows (the
//! admission ratio, BBR, KLimiter, the CPU signal, the breakers) has no
//! ring: it is recorded once per second of `top`'s own reads. A second
//! nobody read (`top` paused longer than the ring holds) is a gap (`None`),
//! never a made-up value.

use super::state::{Attachment, RuleRow, Top};
use crate::{
    agent::breakers::PublishedBreaker,
    dataplane::{pins::AttachId, Maps},
    system::clock::monotonic_ns,
};
use flowctl_common::{reason, stats};
use std::collections::{HashMap, VecDeque};

/// Points kept per series: three minutes, more than the widest view shows.
pub const POINTS: usize = 180;

/// The last [`POINTS`] values of one quantity, oldest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series(VecDeque<Option<f64>>);

impl Series {
    pub fn push(&mut self, v: Option<f64>) {
        if self.0.len() == POINTS {
            self.0.pop_front();
        }
        self.0.push_back(v);
    }

    /// `n` gaps (seconds nobody saw), at most a whole series of them.
    fn gap(&mut self, n: u64) {
        for _ in 0..n.min(POINTS as u64) {
            self.push(None);
        }
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The newest `n` points, oldest first.
    pub fn last(&self, n: usize) -> Vec<Option<f64>> {
        self.0.iter().skip(self.0.len().saturating_sub(n)).copied().collect()
    }

    /// The largest of the newest `n` points (0 when there is none).
    pub fn max_last(&self, n: usize) -> f64 {
        self.last(n).into_iter().flatten().fold(0.0, f64::max)
    }

    /// Whether any of the newest `n` points is above zero.
    pub fn any_last(&self, n: usize) -> bool {
        self.max_last(n) > 0.0
    }
}

/// One rule's history.
#[derive(Clone, Debug, Default)]
pub struct RuleHistory {
    /// The newest ring slice folded in (slice = epoch / buckets per slice).
    last_slice: Option<u64>,
    /// Seconds per ring point (1.0 unless the bucket width does not divide
    /// a second).
    pub slice_s: f64,
    /// Packets per second, from the ring.
    pub offered: Series,
    pub passed: Series,
    pub dropped: Series,
    pub would_drop: Series,
    /// Drops per second by reason (`reason::NAMES` order); all zero when the
    /// rings keep only what the control loops need (`statistics =
    /// "control"`), which `by_reason` says.
    pub reasons: [Series; reason::COUNT],
    pub by_reason: bool,
    /// Recorded per second of reads.
    pub ratio: Series,
    pub bbr_in_flight: Series,
    /// BBR's limit (`None`: no limit yet, or not an active BBR rule).
    pub bbr_limit: Series,
}

/// A KLimiter baseline's level against its threshold.
#[derive(Clone, Debug, Default)]
pub struct BaselineHistory {
    pub level: Series,
    pub threshold: Series,
}

/// A breaker's state, drop probability and outcomes per second.
#[derive(Clone, Debug, Default)]
pub struct BreakerHistory {
    /// One letter per second: c closed, t throttling, h half-open, o open.
    pub state: VecDeque<Option<char>>,
    pub drop_probability: Series,
    /// Per second, from the breaker's totals (`counter::NAMES`).
    pub attempts: Series,
    pub successes: Series,
    pub refused_by_peer: Series,
    pub timeouts: Series,
    /// Refused locally, or would be (dry-run).
    pub local: Series,
    last_totals: Option<(u64, std::collections::BTreeMap<String, u64>)>,
}

/// Identifies a rule across reads: its attachment and name.
pub type RuleKey = (AttachId, String);
/// Identifies a breaker: its cgroup's id and its name.
pub type BreakerKey = (u64, String);

#[derive(Debug, Default)]
pub struct History {
    pub rules: HashMap<RuleKey, RuleHistory>,
    /// The CPU signal in per-mille, per attachment.
    pub cpu: HashMap<AttachId, Series>,
    pub baselines: HashMap<(AttachId, String), BaselineHistory>,
    pub breakers: HashMap<BreakerKey, BreakerHistory>,
    /// The second (of the monotonic clock) the per-read series were last
    /// recorded for.
    last_second: Option<u64>,
}

impl History {
    pub fn rule(&self, id: AttachId, name: &str) -> Option<&RuleHistory> {
        self.rules.get(&(id, name.to_string()))
    }

    pub fn breaker(&self, cgroup_id: u64, name: &str) -> Option<&BreakerHistory> {
        self.breakers.get(&(cgroup_id, name.to_string()))
    }

    /// Folds in one read: the rings' new slices, and (once per second) what
    /// the agents publish.
    pub fn update(&mut self, top: &Top) {
        self.update_at(top, monotonic_ns(), |a| Maps::open(&a.id).ok())
    }

    fn update_at(&mut self, top: &Top, now_ns: u64, open: impl Fn(&Attachment) -> Option<Maps>) {
        for a in &top.attachments {
            if let Some(maps) = open(a) {
                for r in &a.rules {
                    let h = self.rules.entry((a.id, r.rule.clone())).or_default();
                    fold_ring(h, &a.stats, now_ns, |epochs| {
                        maps.stats_epochs(r.record, &a.stats, epochs).ok()
                    });
                }
            }
        }
        let second = now_ns / 1_000_000_000;
        let missed = match self.last_second {
            Some(s) if s == second => return,
            Some(s) => second - s - 1,
            None => 0,
        };
        self.last_second = Some(second);
        for a in &top.attachments {
            let cpu = self.cpu.entry(a.id).or_default();
            cpu.gap(missed);
            cpu.push(a.cpu_permille.map(f64::from));
            for r in &a.rules {
                record_rule(self.rules.entry((a.id, r.rule.clone())).or_default(), r, missed);
            }
            for b in a.klimiter.iter().flat_map(|k| &k.baselines) {
                let h = self.baselines.entry((a.id, b.name.clone())).or_default();
                h.level.gap(missed);
                h.threshold.gap(missed);
                h.level.push(b.level);
                h.threshold.push(Some(b.threshold));
            }
        }
        let now_ms = now_ns / 1_000_000;
        for c in &top.breakers {
            for b in &c.breakers {
                let h = self.breakers.entry((c.cgroup_id, b.name.clone())).or_default();
                record_breaker(h, b, missed, now_ms);
            }
        }
    }
}

/// Folds the ring's slices completed since the last read (all it still
/// holds, on the first) into `h`. `read` sums a range of bucket epochs
/// over every CPU (`None`: the ring cannot be read now).
fn fold_ring(
    h: &mut RuleHistory,
    shape: &crate::profile::StatsSettings,
    now_ns: u64,
    read: impl Fn(std::ops::Range<u64>) -> Option<stats::StatsSum>,
) {
    let bucket_ns = shape.bucket_ns.max(1);
    let per_slice = 1_000_000_000u64.div_ceil(bucket_ns).clamp(1, shape.buckets.max(2) as u64 - 1);
    h.slice_s = (per_slice * bucket_ns) as f64 / 1e9;
    h.by_reason = shape.level == stats::level::FULL;
    let cur = stats::epoch_of(now_ns, bucket_ns);
    // Complete: every bucket before the current (still filling) one.
    let Some(newest) = (cur / per_slice).checked_sub(1) else { return };
    // Still whole in the ring: the last `buckets - 1` complete buckets.
    let oldest_held = cur.saturating_sub(shape.buckets as u64 - 1).div_ceil(per_slice).max(1);
    let first = match h.last_slice {
        Some(last) if last >= newest => return,
        Some(last) => {
            let first = (last + 1).max(oldest_held);
            for series in all_ring_series(h) {
                series.gap(first - (last + 1));
            }
            first
        }
        None => oldest_held.max(newest.saturating_sub(POINTS as u64 - 1)),
    };
    for s in first..=newest {
        let sum = read(s * per_slice..(s + 1) * per_slice);
        let rate = |n: u64| sum.map(|_| n as f64 / h.slice_s);
        let sum_or = sum.unwrap_or_default();
        let (o, p, w) = (sum_or.offered_pkts, sum_or.passed_pkts, sum_or.would_drop_pkts);
        h.offered.push(rate(o));
        h.passed.push(rate(p));
        // Passed counts would-drops (they pass), so what did not pass was
        // dropped, whatever the rings keep of the reasons.
        h.dropped.push(rate(o.saturating_sub(p)));
        h.would_drop.push(rate(w));
        for (i, series) in h.reasons.iter_mut().enumerate() {
            series.push(rate(sum_or.dropped_pkts[i]));
        }
    }
    h.last_slice = Some(newest);
}

fn all_ring_series(h: &mut RuleHistory) -> impl Iterator<Item = &mut Series> {
    [&mut h.offered, &mut h.passed, &mut h.dropped, &mut h.would_drop]
        .into_iter()
        .chain(h.reasons.iter_mut())
}

fn record_rule(h: &mut RuleHistory, r: &RuleRow, missed: u64) {
    for s in [&mut h.ratio, &mut h.bbr_in_flight, &mut h.bbr_limit] {
        s.gap(missed);
    }
    h.ratio.push(Some(r.admission_ratio));
    h.bbr_in_flight.push(r.bbr.as_ref().map(|b| b.in_flight as f64));
    h.bbr_limit.push(r.bbr.as_ref().and_then(|b| b.max_in_flight).map(f64::from));
}

fn record_breaker(h: &mut BreakerHistory, b: &PublishedBreaker, missed: u64, now_ms: u64) {
    let letter = match b.state.as_str() {
        "closed" => 'c',
        "throttling" => 't',
        "half-open" => 'h',
        "open" => 'o',
        _ => '?',
    };
    for _ in 0..missed.min(POINTS as u64) {
        push_letter(&mut h.state, None);
    }
    push_letter(&mut h.state, Some(letter));
    let total = |t: &std::collections::BTreeMap<String, u64>, names: &[&str]| -> u64 {
        names.iter().map(|n| t.get(*n).copied().unwrap_or(0)).sum()
    };
    // Rates from the totals' change since the last record (none on the first).
    let per_s: Option<[f64; 5]> = h.last_totals.as_ref().and_then(|(at, before)| {
        let dt = now_ms.saturating_sub(*at) as f64 / 1e3;
        (dt > 0.0).then(|| {
            [
                &["attempts"][..],
                &["successes"],
                &["refused_by_peer"],
                &["timeouts"],
                &["refused_locally", "would_refuse"],
            ]
            .map(|names| total(&b.totals, names).saturating_sub(total(before, names)) as f64 / dt)
        })
    });
    h.drop_probability.gap(missed);
    h.drop_probability.push(Some(b.drop_probability));
    let outcomes =
        [&mut h.attempts, &mut h.successes, &mut h.refused_by_peer, &mut h.timeouts, &mut h.local];
    for (i, s) in outcomes.into_iter().enumerate() {
        s.gap(missed);
        s.push(per_s.map(|v| v[i]));
    }
    h.last_totals = Some((now_ms, b.totals.clone()));
}

fn push_letter(q: &mut VecDeque<Option<char>>, c: Option<char>) {
    if q.len() == POINTS {
        q.pop_front();
    }
    q.push_back(c);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::StatsSettings;

    fn shape() -> StatsSettings {
        StatsSettings {
            level: stats::level::FULL,
            bucket_ns: 100_000_000,
            buckets: 100,
            ..Default::default()
        }
    }

    /// A ring where each bucket epoch `e` held `e` offered packets, half
    /// of them passed.
    fn read(epochs: std::ops::Range<u64>) -> Option<stats::StatsSum> {
        let mut s = stats::StatsSum::default();
        for e in epochs {
            s.offered_pkts += e;
            s.passed_pkts += e / 2;
            s.dropped_pkts[reason::RATE] += e - e / 2;
        }
        Some(s)
    }

    #[test]
    fn the_first_read_seeds_what_the_ring_holds_and_later_reads_add_new_seconds() {
        let mut h = RuleHistory::default();
        // 100 s after boot: epoch 1001 is filling; the ring holds 902..=1000.
        fold_ring(&mut h, &shape(), 100_000_000_000, read);
        assert_eq!(h.slice_s, 1.0);
        // Whole seconds held: slices 91..=99 (epochs 910..=999).
        assert_eq!(h.offered.len(), 9);
        let last = h.offered.last(1)[0].unwrap();
        assert_eq!(last, (990..1000).sum::<u64>() as f64);
        assert_eq!(h.dropped.last(1)[0], h.reasons[reason::RATE].last(1)[0]);
        // The same second again adds nothing; 2.5 s later, two new seconds.
        fold_ring(&mut h, &shape(), 100_050_000_000, read);
        assert_eq!(h.offered.len(), 9);
        fold_ring(&mut h, &shape(), 102_500_000_000, read);
        assert_eq!(h.offered.len(), 11);
        assert_eq!(h.offered.last(1)[0].unwrap(), (1010..1020).sum::<u64>() as f64);
    }

    #[test]
    fn seconds_the_ring_no_longer_holds_are_gaps() {
        let mut h = RuleHistory::default();
        fold_ring(&mut h, &shape(), 100_000_000_000, read);
        // 30 s later: 20 s are gone from the ring, 9 are read back.
        fold_ring(&mut h, &shape(), 130_000_000_000, read);
        let pts = h.offered.last(POINTS);
        assert_eq!(pts.len(), 9 + 30);
        assert_eq!(pts.iter().filter(|p| p.is_none()).count(), 21);
        assert!(pts[pts.len() - 9..].iter().all(Option::is_some));
        // A ring that cannot be read is a gap too, not a zero.
        fold_ring(&mut h, &shape(), 131_000_000_000, |_| None);
        assert_eq!(h.offered.last(1), vec![None]);
    }

    #[test]
    fn series_keep_their_newest_points() {
        let mut s = Series::default();
        for i in 0..(POINTS + 5) {
            s.push(Some(i as f64));
        }
        assert_eq!(s.len(), POINTS);
        assert_eq!(s.last(2), vec![Some((POINTS + 3) as f64), Some((POINTS + 4) as f64)]);
        assert_eq!(s.max_last(3), (POINTS + 4) as f64);
    }
}
