//! The warm-up ramp of a rule's aggregate bucket (docs/algorithms.md
//! section 1.8), after Guava's `SmoothWarmingUp`: a bucket that has been
//! idle is *cold* and admits at `rate / cold_factor`; sustained traffic
//! warms it to the full rate in about `warm_up`; idleness cools it again.
//!
//! The bucket keeps two words: its TAT, as a plain bucket (`gcra`), and its
//! *stored time* `x`: stored permits measured in the stable-rate time they
//! stand for (permits x `I`, `I = 1/rate`). With `W = warm_up` and
//! `c = cold_factor`:
//!
//! - `x` grows while the bucket is idle (its TAT behind the clock) by
//!   `k = 1/2 + 2/(1+c)` ns per idle ns, up to `x_max = k W`, so an idle
//!   period of `W` takes a warm bucket to fully cold. (Guava's cool-down
//!   interval is `W / maxPermits`; in time units its ratio depends on `c`
//!   alone. `c = 3` gives `k = 1`.)
//! - A packet of stable-rate time `inc` (`gcra::increment_ns`) uses `inc`
//!   of `x` (down to 0) and moves the TAT by the integral of the emission
//!   interval over the stored time it used: `I` per unit below the
//!   threshold `x_thr = W/2`, and `I (1 + (c-1)(x - x_thr)/(x_max - x_thr))`
//!   above it, so `c I` at `x_max`. Units beyond the stored time cost `I`.
//! - It is admitted when the TAT before it is at most `burst - inc` ahead
//!   of the clock: the plain bucket's test (`gcra::admit`) on the
//!   stable-rate time, so a cold unit, which may cost more than a small
//!   burst, is still admitted by an idle bucket.
//!
//! So a cold bucket admits `rate/c` after a burst of about
//! `1 + (burst - 1)/c`, and under
//! demand above the rate it reaches the full rate once it has used the
//! stored time above the threshold, which takes
//! `(x_max - x_thr) (1 + c)/2 = W` (Guava's construction). Every unit costs
//! between `I` and `c I`, whatever the state: the admitted rate is never
//! above the rule's rate and never below `rate/c` under sustained demand.
//!
//! Units: all times in ns; fractions in 16-bit fixed point. `W` is at most
//! [`MAX_WARM_UP_NS`] so every product stays within 64 bits (BPF has no
//! 128-bit arithmetic).

/// The longest `warm_up`: one hour, 2^41.7 ns.
pub const MAX_WARM_UP_NS: u64 = 3_600_000_000_000;
/// `cold_factor`'s range: at 1 there is no ramp; above 10 a cold rule
/// admits under a tenth of its rate, which is a different limit.
pub const MIN_COLD_FACTOR: u8 = 2;
pub const MAX_COLD_FACTOR: u8 = 10;
/// `cold_factor` when a rule gives `warm_up` alone (Guava's and Sentinel's
/// default).
pub const DEFAULT_COLD_FACTOR: u8 = 3;

const FP: u32 = 16;

/// A warm-up rule's bucket, one per rule record (`FLOWCTL_WARM`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WarmBucket {
    /// The rule state this bucket belongs to (`RuleConfig::state_id`; 0:
    /// none). A record that another rule's state takes over starts cold.
    pub state_id: u32,
    pub _pad: u32,
    /// The bucket's TAT (`gcra`); 0 with `stored_ns` 0 is a cold bucket.
    pub tat: u64,
    /// Stored time `x`, ns.
    pub stored_ns: u64,
}

/// A rule's warm-up parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ramp {
    /// `W`, ns (at most [`MAX_WARM_UP_NS`]).
    pub warm_ns: u64,
    /// `c`, [`MIN_COLD_FACTOR`] to [`MAX_COLD_FACTOR`].
    pub cold_factor: u64,
}

/// What an admission changes: the new TAT, and the stored time the bucket
/// gained from its idle time and used for the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub tat: u64,
    pub gained_ns: u64,
    pub used_ns: u64,
}

impl Ramp {
    /// `k`, the stored time gained per idle ns, fixed point.
    #[inline(always)]
    fn cool_fp(&self) -> u64 {
        // `c` is a u8 in the rule's config: the divisor is 1 to 256 and the
        // compiler can see it is never 0 (a division that could panic
        // leaves the BPF program ending in an unreachable instruction).
        (1 << FP) / 2 + (2 << FP) / (1 + (self.cold_factor & 0xff))
    }

    /// `x_max`: the stored time of a cold bucket.
    #[inline(always)]
    pub fn max_stored_ns(&self) -> u64 {
        (self.warm_ns * self.cool_fp()) >> FP
    }

    /// `x_thr`: below it every unit costs `I`.
    #[inline(always)]
    pub fn threshold_ns(&self) -> u64 {
        self.warm_ns / 2
    }

    /// Stored time gained by `idle` ns of idleness (not capped).
    #[inline(always)]
    fn gain(&self, idle: u64) -> u64 {
        let idle = if idle < self.warm_ns { idle } else { self.warm_ns };
        (idle * self.cool_fp()) >> FP
    }

    /// The bucket's stored time at `now`, before a packet: what it holds,
    /// plus what its idle time since the TAT adds, capped at `x_max`.
    #[inline(always)]
    pub fn stored_at(&self, tat: u64, stored: u64, now: u64) -> u64 {
        let gained = if tat < now { self.gain(now - tat) } else { 0 };
        let x = stored.saturating_add(gained);
        let max = self.max_stored_ns();
        if x < max {
            x
        } else {
            max
        }
    }

    /// TAT time for `inc` ns of stable-rate time taken from stored time
    /// `x`: the integral of the emission interval, relative to `I`, over
    /// `[x - inc, x]`.
    #[inline(always)]
    pub fn charge_ns(&self, x: u64, inc: u64) -> u64 {
        let thr = self.threshold_ns();
        let over = x.saturating_sub(thr);
        let above = if inc < over { inc } else { over };
        if above == 0 {
            return inc;
        }
        let span = self.max_stored_ns() - thr;
        if span == 0 {
            return inc;
        }
        // The interval is linear in x, so its integral over the stretch
        // above the threshold is the stretch times the interval at its
        // middle. `above <= span < 2^42`, so the shifts stay in 64 bits.
        let mid = x - above / 2 - thr;
        let mid = if mid < span { mid } else { span };
        let frac = (mid << FP) / span;
        let extra = ((above * frac) >> FP) * (self.cold_factor - 1);
        inc.saturating_add(extra)
    }

    /// The decision on a packet of stable-rate time `inc` at `now`:
    /// `Some(step)` to admit, `None` to refuse (nothing changes).
    #[inline(always)]
    pub fn admit(&self, tat: u64, stored: u64, now: u64, inc: u64, burst_ns: u64) -> Option<Step> {
        let start = if tat > now { tat } else { now };
        // The plain bucket's test, `start + inc - now <= burst`, on the
        // stable-rate time: a cold unit's cost (up to c I) may exceed a
        // small burst, and an idle bucket must still admit.
        if inc > burst_ns || start - now > burst_ns - inc {
            return None;
        }
        let x = self.stored_at(tat, stored, now);
        let new_tat = start.saturating_add(self.charge_ns(x, inc));
        let gained = x.saturating_sub(stored);
        Some(Step { tat: new_tat, gained_ns: gained, used_ns: if inc < x { inc } else { x } })
    }

    /// The stored time a bucket holds after `step`, from what it held
    /// (`stored`, perhaps moved by another CPU since `admit` read it).
    #[inline(always)]
    pub fn after(&self, stored: u64, step: &Step) -> u64 {
        let x = stored.saturating_add(step.gained_ns);
        let max = self.max_stored_ns();
        let x = if x < max { x } else { max };
        x.saturating_sub(step.used_ns)
    }

    /// How much of the full rate a bucket in this state admits now, in
    /// parts per million (`1e6 / c` cold, `1e6` warm): `I` over the
    /// emission interval at its stored time.
    pub fn rate_ppm(&self, tat: u64, stored: u64, now: u64) -> u64 {
        let x = self.stored_at(tat, stored, now);
        let thr = self.threshold_ns();
        if x <= thr {
            return 1_000_000;
        }
        let span = self.max_stored_ns() - thr;
        if span == 0 {
            return 1_000_000;
        }
        let frac = ((x - thr).min(span) << FP) / span;
        // I / (I (1 + (c-1) frac)), in ppm.
        (1_000_000u64 << FP) / ((1 << FP) + (self.cold_factor - 1) * frac)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    fn ramp(w: u64, c: u64) -> Ramp {
        Ramp { warm_ns: w, cold_factor: c }
    }

    /// A single-CPU host model of the kernel's bucket.
    struct Bucket {
        ramp: Ramp,
        inc: u64,
        burst_ns: u64,
        tat: u64,
        stored: u64,
    }

    impl Bucket {
        /// Cold, as the kernel claims a record's bucket.
        fn new(ramp: Ramp, interval: u64, burst: u64) -> Self {
            Self { ramp, inc: interval, burst_ns: burst * interval, tat: 0, stored: 0 }
        }
        fn offer(&mut self, now: u64) -> bool {
            match self.ramp.admit(self.tat, self.stored, now, self.inc, self.burst_ns) {
                Some(step) => {
                    self.tat = step.tat;
                    self.stored = self.ramp.after(self.stored, &step);
                    true
                }
                None => false,
            }
        }
        /// Admission times of a demand of one packet every `every` ns
        /// from `from` for `secs` seconds.
        fn run(&mut self, from: u64, every: u64, span: u64) -> Vec<u64> {
            (0..span / every).map(|i| from + i * every).filter(|&t| self.offer(t)).collect()
        }
    }

    fn admitted_in(times: &[u64], from: u64, to: u64) -> usize {
        times.iter().filter(|&&t| t >= from && t < to).count()
    }

    #[test]
    fn guava_s_shape_for_cold_factor_3() {
        let r = ramp(30 * S, 3);
        assert_eq!(r.max_stored_ns(), 30 * S, "k = 1 for c = 3");
        assert_eq!(r.threshold_ns(), 15 * S);
        let i = 10 * MS;
        let at_max = r.charge_ns(r.max_stored_ns(), i);
        assert!(at_max <= 3 * i && at_max > 3 * i - i / 1000, "about 3I at x_max: {at_max}");
        assert_eq!(r.charge_ns(r.threshold_ns(), i), i, "I at the threshold");
        assert_eq!(r.charge_ns(0, i), i, "I below it");
        // Halfway up the ramp: 2I.
        assert_eq!(r.charge_ns(22_500 * MS + i / 2, i), 2 * i);
        assert_eq!(r.rate_ppm(0, 0, 100 * S), 333_333);
        assert_eq!(r.rate_ppm(u64::MAX, 0, 0), 1_000_000);
    }

    /// 100/s, burst 10, warm_up 30 s, c = 3, demand 1000/s from cold: about
    /// 33/s in the first second (after a burst of about 3), the full rate
    /// after about 30 s, and exactly what a plain bucket admits after that.
    #[test]
    fn a_cold_rule_ramps_to_the_full_rate_in_about_warm_up() {
        let mut b = Bucket::new(ramp(30 * S, 3), 10 * MS, 10);
        let t0 = 1000 * S;
        let times = b.run(t0, MS, 40 * S);
        let first = admitted_in(&times, t0, t0 + S);
        assert!((33..=38).contains(&first), "first second: {first}");
        let per_s: Vec<usize> =
            (0..40).map(|k| admitted_in(&times, t0 + k * S, t0 + (k + 1) * S)).collect();
        let full = per_s.iter().position(|&n| n >= 100).expect("reaches the full rate");
        assert!((27..=31).contains(&full), "full rate from second {full}: {per_s:?}");
        assert!(per_s[full..].iter().all(|&n| n == 100), "{per_s:?}");
    }

    #[test]
    fn idleness_cools_a_warm_rule_back() {
        let r = ramp(10 * S, 4);
        let mut b = Bucket::new(r, 10 * MS, 10);
        let t0 = 1000 * S;
        b.run(t0, MS, 20 * S);
        assert_eq!(r.rate_ppm(b.tat, b.stored, t0 + 20 * S), 1_000_000, "warm");
        // 8 s idle: 7.2 s stored, above the 5 s threshold.
        let half = t0 + 20 * S + 8 * S;
        let ppm = r.rate_ppm(b.tat, b.stored, half);
        assert!(ppm < 1_000_000 && ppm > 250_000, "cooling: {ppm}");
        assert_eq!(r.rate_ppm(b.tat, b.stored, t0 + 31 * S), 250_000, "cold after W idle");
    }

    #[test]
    fn a_cost_beyond_the_stored_time_pays_i_per_unit() {
        let r = ramp(4 * S, 3);
        assert_eq!(r.charge_ns(0, 7 * S), 7 * S);
        // 1 s above the threshold at its mid-point 0.5 s of 2 s: 1 + 2*0.25.
        assert_eq!(r.charge_ns(3 * S, 3 * S), 3 * S + S / 2);
    }

    proptest! {
        /// Every unit costs between I and cI, so over any window of any
        /// demand a warm-up bucket admits no more than a plain bucket of
        /// the same rate and burst could (b + r t, rounded up once), and
        /// under demand that never lets it idle it admits at least
        /// (r/c) t after its burst.
        #[test]
        fn never_above_the_rate_never_below_rate_over_cold_factor(
            c in 2u64..=10,
            w_ms in 100u64..5_000,
            interval_us in 100u64..20_000,
            burst in 1u64..20,
            gaps in prop::collection::vec(1u64..40_000, 50..600),
        ) {
            let interval = interval_us * 1000;
            let mut b = Bucket::new(ramp(w_ms * MS, c), interval, burst);
            let mut now = 500 * S;
            let mut times = Vec::new();
            for g in gaps {
                now += g * 1000;
                if b.offer(now) {
                    times.push(now);
                }
            }
            for (i, &a) in times.iter().enumerate() {
                let n = times[i..].iter().take_while(|&&t| t <= a + 50 * interval).count() as u64;
                prop_assert!(n <= burst + 50 + 1, "{n} admitted in 50 intervals");
            }
            // Saturating demand from the last state: admissions at least
            // every c I once the burst is spent.
            let start = now + 1;
            let sat = b.run(start, interval / 10 + 1, 200 * interval);
            let later: Vec<u64> = sat.iter().copied().skip(burst as usize + 1).collect();
            for pair in later.windows(2) {
                prop_assert!(pair[1] - pair[0] <= c * interval + interval / 10 + 2, "gap {} > c I", pair[1] - pair[0]);
            }
        }

        /// Under sustained demand above the rate, the spacing of admissions
        /// only shrinks (the ramp is monotone) until it is I; then a
        /// silence of W returns the bucket to cold.
        #[test]
        fn monotone_under_sustained_load_and_cold_after_idle(
            c in 2u64..=10,
            w_ms in 200u64..3_000,
            interval_us in 500u64..10_000,
        ) {
            let interval = interval_us * 1000;
            let r = ramp(w_ms * MS, c);
            let mut b = Bucket::new(r, interval, 1);
            let t0 = 100 * S;
            let step = interval / 50 + 1;
            let span = w_ms * MS * 2;
            let times = b.run(t0, step, span);
            let gaps: Vec<u64> = times.windows(2).map(|p| p[1] - p[0]).collect();
            for p in gaps.windows(2) {
                prop_assert!(p[1] <= p[0] + 2 * step, "spacing grew from {} to {}", p[0], p[1]);
            }
            prop_assert!(*gaps.last().unwrap() <= interval + 2 * step, "warm at the end");
            let end = t0 + span;
            prop_assert!(r.rate_ppm(b.tat, b.stored, end) == 1_000_000);
            let cold = 1_000_000 / c;
            let ppm = r.rate_ppm(b.tat, b.stored, b.tat.max(end) + w_ms * MS);
            prop_assert!(ppm <= cold + 1, "after W idle: {ppm} ppm, cold is {cold}");
        }
    }
}
