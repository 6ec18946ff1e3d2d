//! The heaviest keys of a rule, from the kernel's packet samples
//! (`top --keys`): a Space-Saving sketch (Metwally, Agrawal, El Abbadi,
//! "Efficient Computation of Frequent and Top-k Elements in Data Streams",
//! ICDT 2005) per rule, with exponential decay so it shows traffic now.
//!
//! Error bound, as `top --keys` states it: with `k` counters over a (decayed)
//! sample total `M`, every reported count overestimates the key's true sample
//! count by at most its own `err`, and `err <= M / k`; any key with more than
//! `M / k` samples is in the sketch. Counts are scaled by the sampling rate
//! (one in `every`) to packets, which adds sampling noise of about
//! `every * sqrt(count)` packets on top.

use flowctl_common::{BucketKey, KeySample};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

#[derive(Clone, Copy, Debug, Default)]
struct Counter {
    count: f64,
    /// Overestimation bound: the count the key inherited when it took over
    /// the smallest counter.
    err: f64,
    dropped: f64,
    bytes: f64,
}

/// A Space-Saving sketch of `capacity` counters.
#[derive(Clone, Debug)]
pub struct SpaceSaving {
    capacity: usize,
    counters: HashMap<BucketKey, Counter>,
    /// Decayed total weight seen.
    total: f64,
}

impl SpaceSaving {
    pub fn new(capacity: usize) -> Self {
        Self { capacity: capacity.max(1), counters: HashMap::new(), total: 0.0 }
    }

    /// Adds one sample of weight `w`.
    pub fn add(&mut self, key: BucketKey, w: f64, dropped: bool, bytes: f64) {
        self.total += w;
        if let Some(c) = self.counters.get_mut(&key) {
            c.count += w;
            c.dropped += if dropped { w } else { 0.0 };
            c.bytes += bytes * w;
            return;
        }
        let mut new = Counter {
            count: w,
            err: 0.0,
            dropped: if dropped { w } else { 0.0 },
            bytes: bytes * w,
        };
        if self.counters.len() >= self.capacity {
            // Replace the smallest counter; the newcomer inherits its count as
            // possible overestimation. A linear scan: capacity is small (the
            // sketch is fed a few thousand samples a second at most).
            let (&victim, &min) = self
                .counters
                .iter()
                .min_by(|a, b| a.1.count.total_cmp(&b.1.count))
                .expect("capacity >= 1");
            self.counters.remove(&victim);
            new.count += min.count;
            new.err = min.count;
        }
        self.counters.insert(key, new);
    }

    /// Multiplies every weight by `f` (0 < f <= 1): older samples count less.
    /// Scaling all counters alike keeps the sketch's invariants.
    pub fn decay(&mut self, f: f64) {
        self.total *= f;
        for c in self.counters.values_mut() {
            c.count *= f;
            c.err *= f;
            c.dropped *= f;
            c.bytes *= f;
        }
        self.counters.retain(|_, c| c.count > 1e-3);
    }

    /// The largest bound on any count's overestimation: M / k.
    pub fn bound(&self) -> f64 {
        self.total / self.capacity as f64
    }

    pub fn total(&self) -> f64 {
        self.total
    }

    /// The `n` heaviest keys, heaviest first.
    pub fn top(&self, n: usize) -> Vec<(BucketKey, f64, f64, f64, f64)> {
        let mut v: Vec<_> =
            self.counters.iter().map(|(k, c)| (*k, c.count, c.err, c.dropped, c.bytes)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v.truncate(n);
        v
    }
}

/// One row of `top --keys`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HeavyKey {
    /// The key as the rule splits traffic (e.g. "10.0.0.1", "10.0.0.0/24",
    /// "10.0.0.1 -> :80").
    pub key: String,
    /// Estimated packets per second offered by this key.
    pub pps: f64,
    /// Estimated share of the rule's sampled packets, 0 to 100.
    pub share_pct: f64,
    /// Estimated dropped packets per second.
    pub dropped_pps: f64,
    /// Upper bound of the sketch's overestimation of `pps` for this key.
    pub error_pps: f64,
}

/// What `top --keys` shows for one rule.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HeavyKeys {
    pub rule: String,
    /// The kernel samples one in this many of the rule's packets.
    pub sample_every: u32,
    /// Decayed samples behind the estimates.
    pub samples: f64,
    /// Any key above this rate is listed; no listed rate is over by more.
    pub bound_pps: f64,
    pub keys: Vec<HeavyKey>,
}

/// Sketches for every rule of an attachment, fed from the sampling ring.
pub struct Watch {
    capacity: usize,
    /// Per counter record.
    sketches: HashMap<u32, SpaceSaving>,
    /// Weights decay by this factor per second.
    decay_per_s: f64,
    /// Seconds since the watch started (the weights stand for less history
    /// at first).
    age_s: f64,
}

impl Watch {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, sketches: HashMap::new(), decay_per_s: 0.5, age_s: 0.0 }
    }

    /// Adds samples taken at one in `every`, spread over the last `dt_s`
    /// seconds (after `tick(dt_s)`): they count as taken mid-interval, so
    /// they are decayed by half the interval, as continuous decay would.
    pub fn feed(&mut self, samples: &[KeySample], every: u32, dt_s: f64) {
        let w = every as f64 * self.decay_per_s.powf(dt_s / 2.0);
        for s in samples {
            let cap = self.capacity;
            self.sketches.entry(s.record).or_insert_with(|| SpaceSaving::new(cap)).add(
                s.key,
                w,
                s.dropped != 0,
                s.len as f64,
            );
        }
    }

    /// Ages every sketch by `dt_s` seconds.
    pub fn tick(&mut self, dt_s: f64) {
        self.age_s += dt_s;
        let f = self.decay_per_s.powf(dt_s);
        for s in self.sketches.values_mut() {
            s.decay(f);
        }
    }

    /// The heaviest keys of the rule at `record`, rates in packets/s.
    pub fn report(&self, record: u32, rule: &str, kind: u8, every: u32, n: usize) -> HeavyKeys {
        // Weights are packets (samples x every). Decayed at d per second, a
        // steady rate r has summed to r (1 - d^T) / ln(1/d) after T seconds.
        let l = (1.0 / self.decay_per_s).ln();
        let seconds = ((1.0 - self.decay_per_s.powf(self.age_s)) / l).max(1e-3);
        let empty = SpaceSaving::new(self.capacity);
        let s = self.sketches.get(&record).unwrap_or(&empty);
        let keys = s
            .top(n)
            .into_iter()
            .map(|(k, count, err, dropped, _bytes)| HeavyKey {
                key: describe_key(&k, kind),
                pps: count / seconds,
                share_pct: if s.total() > 0.0 { 100.0 * count / s.total() } else { 0.0 },
                dropped_pps: dropped / seconds,
                error_pps: err / seconds,
            })
            .collect();
        HeavyKeys {
            rule: rule.to_string(),
            sample_every: every,
            samples: s.total() / every.max(1) as f64,
            bound_pps: s.bound() / seconds,
            keys,
        }
    }
}

/// A bucket key as the rule's key kind reads.
pub fn describe_key(k: &BucketKey, kind: u8) -> String {
    use flowctl_common::key_kind;
    let addr = |a: &[u32; 4]| -> String {
        if k.family == 4 {
            std::net::Ipv4Addr::from(a[0]).to_string()
        } else {
            let b: Vec<u8> = a.iter().flat_map(|w| w.to_be_bytes()).collect();
            let arr: [u8; 16] = b.try_into().unwrap_or([0; 16]);
            std::net::Ipv6Addr::from(arr).to_string()
        }
    };
    match kind {
        key_kind::RULE => "(whole rule)".into(),
        key_kind::SRC | key_kind::SRC_PREFIX => addr(&k.src),
        key_kind::DPORT => format!(":{}", k.dport),
        key_kind::SRC_DPORT => format!("{} -> :{}", addr(&k.src), k.dport),
        _ => format!("{}:{} -> {}:{} ({})", addr(&k.src), k.sport, addr(&k.dst), k.dport, k.proto),
    }
}

/// Samples the kernel's ring into sketches while someone is asking: the
/// agent runs one (asked through the control socket), and `top --keys` runs
/// its own when no agent does. Sampling is on only while asked, at a rate
/// adapted so a few thousand samples a second come through whatever the
/// packet rate.
pub struct KeyWatcher {
    ring: crate::dataplane::KeySamples,
    watch: Watch,
    every: u32,
    last_asked: Option<std::time::Instant>,
    last_poll: std::time::Instant,
}

/// Samples per second the sampling rate is steered to.
const TARGET_SAMPLES_PER_S: f64 = 2000.0;
/// Sampling stops this long after the last question.
const IDLE_OFF: std::time::Duration = std::time::Duration::from_secs(10);
/// Samples drained per poll at most (the ring holds more; the rest wait).
const MAX_DRAIN: usize = 65536;
/// Counters per rule sketch.
pub const SKETCH_CAPACITY: usize = 256;

impl KeyWatcher {
    pub fn open(id: &crate::dataplane::pins::AttachId) -> anyhow::Result<Self> {
        Ok(Self {
            ring: crate::dataplane::KeySamples::open(id)?,
            watch: Watch::new(SKETCH_CAPACITY),
            every: 16,
            last_asked: None,
            last_poll: std::time::Instant::now(),
        })
    }

    pub fn active(&self) -> bool {
        self.last_asked.is_some()
    }

    /// Someone wants the heavy keys: start (or keep) sampling.
    pub fn ask(&mut self, maps: &mut crate::dataplane::Maps) -> anyhow::Result<()> {
        if self.last_asked.is_none() {
            maps.set_key_sampling(self.every)?;
            self.last_poll = std::time::Instant::now();
        }
        self.last_asked = Some(std::time::Instant::now());
        Ok(())
    }

    /// Drains the ring into the sketches, steers the rate, and stops
    /// sampling when nobody has asked for a while.
    pub fn poll(&mut self, maps: &mut crate::dataplane::Maps) -> anyhow::Result<()> {
        let Some(asked) = self.last_asked else { return Ok(()) };
        let now = std::time::Instant::now();
        let dt = now.duration_since(self.last_poll).as_secs_f64();
        self.last_poll = now;
        let samples = self.ring.drain(MAX_DRAIN);
        self.watch.tick(dt);
        self.watch.feed(&samples, self.every, dt);
        if asked.elapsed() > IDLE_OFF {
            self.stop(maps)?;
            return Ok(());
        }
        if dt > 0.05 {
            let rate = samples.len() as f64 / dt;
            let next = if rate > 2.0 * TARGET_SAMPLES_PER_S {
                self.every.saturating_mul(2)
            } else if rate < TARGET_SAMPLES_PER_S / 2.0 && self.every > 1 {
                self.every / 2
            } else {
                self.every
            };
            if next != self.every {
                self.every = next;
                maps.set_key_sampling(next)?;
            }
        }
        Ok(())
    }

    /// Stops sampling and forgets the sketches.
    pub fn stop(&mut self, maps: &mut crate::dataplane::Maps) -> anyhow::Result<()> {
        self.last_asked = None;
        self.watch = Watch::new(SKETCH_CAPACITY);
        let _ = self.ring.drain(MAX_DRAIN);
        maps.set_key_sampling(0)
    }

    pub fn report(&self, record: u32, rule: &str, kind: u8, n: usize) -> HeavyKeys {
        self.watch.report(record, rule, kind, self.every, n)
    }
}

/// The heaviest keys of the rule named `rule` of an attachment, from `w`.
pub fn rule_report(
    w: &KeyWatcher,
    maps: &crate::dataplane::Maps,
    state: &crate::dataplane::state::AttachState,
    rule: &str,
    n: usize,
) -> anyhow::Result<HeavyKeys> {
    let Some(i) = state.rules.iter().position(|r| r.name == rule) else {
        let names: Vec<&str> = state.rules.iter().map(|r| r.name.as_str()).collect();
        anyhow::bail!("no rule `{rule}` on {}; its rules are: {}", state.iface, names.join(", "));
    };
    let record = state.rules[i].record;
    let cfg = maps.active_rule(i)?;
    anyhow::ensure!(cfg.record == record, "the active rule table changed under us; ask again");
    Ok(w.report(record, rule, cfg.key_kind, n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(i: u32) -> BucketKey {
        BucketKey { family: 4, src: [i, 0, 0, 0], ..Default::default() }
    }

    #[test]
    fn heavy_hitters_win_and_counts_stay_within_the_bound() {
        let mut s = SpaceSaving::new(8);
        // Key 1: 50%, key 2: 25%, then 200 distinct one-off keys.
        for i in 0..400u32 {
            s.add(key(1), 1.0, false, 0.0);
            if i % 2 == 0 {
                s.add(key(2), 1.0, false, 0.0);
            }
            s.add(key(1000 + i % 200), 1.0, false, 0.0);
        }
        let top = s.top(2);
        assert_eq!(top[0].0, key(1));
        assert_eq!(top[1].0, key(2));
        let bound = s.bound();
        assert!(top[0].1 - 400.0 <= bound && top[0].1 >= 400.0);
        assert!(top[1].1 - 200.0 <= bound && top[1].1 >= 200.0);
    }

    proptest! {
        /// Space-Saving's guarantee on arbitrary streams: every tracked
        /// count is in [true, true + err], err <= M/k, and every key with
        /// more than M/k occurrences is tracked.
        #[test]
        fn space_saving_guarantee(stream in proptest::collection::vec(0u32..40, 1..600), k in 1usize..12) {
            let mut s = SpaceSaving::new(k);
            let mut truth: HashMap<u32, f64> = HashMap::new();
            for &x in &stream {
                s.add(key(x), 1.0, false, 0.0);
                *truth.entry(x).or_default() += 1.0;
            }
            let bound = s.bound();
            let tracked = s.top(usize::MAX);
            for (kk, count, err, _, _) in &tracked {
                let t = truth[&kk.src[0]];
                prop_assert!(*count >= t - 1e-9 && *count - t <= err + 1e-9);
                prop_assert!(*err <= bound + 1e-9);
            }
            for (x, t) in truth {
                if t > bound {
                    prop_assert!(tracked.iter().any(|e| e.0.src[0] == x), "key {x} with {t} > {bound} missing");
                }
            }
        }
    }

    #[test]
    fn decay_scales_everything_alike() {
        let mut s = SpaceSaving::new(2);
        for _ in 0..10 {
            s.add(key(1), 1.0, true, 100.0);
        }
        s.decay(0.5);
        let t = s.top(1);
        assert_eq!((t[0].1, t[0].3), (5.0, 5.0));
        assert_eq!(s.total(), 5.0);
    }

    #[test]
    fn keys_read_as_their_kind() {
        use flowctl_common::key_kind;
        let k =
            BucketKey { family: 4, src: [0x0a00_0001, 0, 0, 0], dport: 80, ..Default::default() };
        assert_eq!(describe_key(&k, key_kind::SRC), "10.0.0.1");
        assert_eq!(describe_key(&k, key_kind::SRC_DPORT), "10.0.0.1 -> :80");
        assert_eq!(describe_key(&k, key_kind::DPORT), ":80");
    }
}
