//! Token buckets as the Generic Cell Rate Algorithm (docs/algorithms.md section 1).
//!
//! A bucket of rate `r` and burst `b` is GCRA with emission interval `T = 1/r`:
//! one u64 per key, the theoretical arrival time (TAT, ns). A packet of cost `c`
//! is admitted when `max(TAT, now) + c*T - now <= b*T`, and then TAT moves to
//! `max(TAT, now) + c*T`. The kernel applies [`admit`] inside a bounded
//! compare-and-swap loop, so concurrent CPUs never both spend the same token.
//!
//! Rounding always favours the limit: the per-packet increment is rounded up and
//! the depth down, so admitted cost over any interval `t` is at most `b + r*t`.

/// Fractional bits of [`crate::RuleConfig::interval_fp`]. 8 bits keep byte
/// rates exact to 1/256 ns per byte (100 Gbit/s is 0.08 ns per byte).
pub const FRAC_BITS: u32 = 8;

/// Nanoseconds a packet of `cost` units moves the TAT: `ceil(cost * T)`.
#[inline(always)]
pub fn increment_ns(interval_fp: u64, cost: u64) -> u64 {
    // Saturating multiply from 32-bit halves: BPF has no 128-bit multiply and
    // LLVM turns the usual overflow checks into a call to one.
    let (c_hi, c_lo) = (cost >> 32, cost & 0xffff_ffff);
    let (t_hi, t_lo) = (interval_fp >> 32, interval_fp & 0xffff_ffff);
    if c_hi != 0 && t_hi != 0 {
        return u64::MAX >> FRAC_BITS;
    }
    let cross = c_hi * t_lo + c_lo * t_hi; // one of the two terms is 0
    if cross >> 32 != 0 {
        return u64::MAX >> FRAC_BITS;
    }
    let low = c_lo * t_lo;
    let Some(scaled) = low.checked_add(cross << 32) else {
        return u64::MAX >> FRAC_BITS;
    };
    let whole = scaled >> FRAC_BITS;
    if scaled & ((1 << FRAC_BITS) - 1) != 0 {
        whole.saturating_add(1)
    } else {
        whole
    }
}

/// The GCRA decision: `Some(new_tat)` to admit, `None` to refuse. Pure; the
/// caller commits `new_tat` with compare-and-swap.
#[inline(always)]
pub fn admit(tat: u64, now: u64, increment: u64, burst_ns: u64) -> Option<u64> {
    let start = if tat > now { tat } else { now };
    let new_tat = start.saturating_add(increment);
    if new_tat - now > burst_ns {
        None
    } else {
        Some(new_tat)
    }
}

/// Emission interval (fixed point) for `per_second` units per second, rounded
/// up so the enforced rate never exceeds the configured one. `per_second` is a
/// rational `num / den` so "60/min" is exact.
pub fn interval_fp(num: u64, den: u64) -> u64 {
    // T = den / num seconds = den * 1e9 / num ns.
    let scaled = (den as u128) * 1_000_000_000u128 * (1u128 << FRAC_BITS);
    let num = num.max(1) as u128;
    let t = scaled.div_ceil(num);
    if t > u64::MAX as u128 {
        u64::MAX
    } else {
        t as u64
    }
}

/// Bucket depth in ns for `burst` units, rounded down.
pub fn burst_ns(interval_fp: u64, burst: u64) -> u64 {
    let ns = ((interval_fp as u128) * (burst as u128)) >> FRAC_BITS;
    if ns > u64::MAX as u128 {
        u64::MAX
    } else {
        ns as u64
    }
}

/// The TAT of a bucket whose emission interval changes from `old` to `new`
/// (fixed point) at `now`: the debt it carries (`tat - now`) is kept in
/// units, not in nanoseconds, so a key that spent half its burst still has
/// half of it at the new rate. Units round up (the key owes at least what it
/// owed); a bucket with no debt stays as it is.
#[inline(always)]
pub fn rescale(tat: u64, now: u64, old: u64, new: u64) -> u64 {
    if tat <= now || old == 0 {
        return tat;
    }
    let debt_ns = tat - now;
    // Units owed: debt / interval, the debt scaled to the interval's fixed
    // point, rounded up. The shift saturates rather than wrap for debts
    // past 2^56 ns (two years).
    let scaled = if debt_ns >> (64 - FRAC_BITS) != 0 { u64::MAX } else { debt_ns << FRAC_BITS };
    let units = scaled / old + (scaled % old != 0) as u64;
    now.saturating_add(increment_ns(new, units))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn burst_then_rate() {
        // 10/s, burst 5: five back to back, then one every 100 ms.
        let t = interval_fp(10, 1);
        let depth = burst_ns(t, 5);
        let inc = increment_ns(t, 1);
        let mut tat = 0;
        let now = 1_000 * SEC;
        let mut admitted = 0;
        for _ in 0..20 {
            if let Some(n) = admit(tat, now, inc, depth) {
                tat = n;
                admitted += 1;
            }
        }
        assert_eq!(admitted, 5);
        assert!(admit(tat, now + SEC / 10 - 1, inc, depth).is_none());
        assert!(admit(tat, now + SEC / 10, inc, depth).is_some());
    }

    #[test]
    fn exact_rationals() {
        assert_eq!(interval_fp(60, 60), SEC << FRAC_BITS); // 60/min = 1/s
        assert_eq!(interval_fp(1_250_000, 1), 800 << FRAC_BITS); // 10 Mbit/s in bytes
        assert_eq!(increment_ns(interval_fp(1_250_000, 1), 1500), 1_200_000);
    }

    #[test]
    fn overflow_edges_saturate() {
        assert_eq!(interval_fp(0, 1), (SEC as u128 * 256) as u64); // num clamped to 1
        assert_eq!(interval_fp(1, u64::MAX), u64::MAX);
        assert_eq!(increment_ns(u64::MAX, u64::MAX), u64::MAX >> FRAC_BITS);
        assert_eq!(burst_ns(u64::MAX, u64::MAX), u64::MAX);
        // A TAT at the end of time refuses instead of wrapping.
        assert!(admit(u64::MAX, 5, 1, 1000).is_none());
        assert!(admit(u64::MAX - 10, u64::MAX - 10, 5, 10).is_some());
        // A packet costlier than the whole bucket is never admitted.
        assert!(admit(0, SEC, 2000, 1000).is_none());
    }

    #[test]
    fn fractional_byte_intervals_round_up() {
        // 100 Gbit/s = 12.5e9 B/s = 0.08 ns/B -> 20.48 units of 1/256 ns, rounded up to 21.
        let t = interval_fp(12_500_000_000, 1);
        assert_eq!(t, 21);
        assert_eq!(increment_ns(t, 1), 1);
        assert_eq!(increment_ns(t, 1500), 124); // ceil(1500*21/256)
    }

    proptest! {
        /// The contract: over any interval of length t between two admissions,
        /// admitted cost <= b + r*t (cost in units, t in seconds).
        #[test]
        fn admitted_within_bound(
            rate in 1u64..100_000,
            burst in 1u64..1000,
            gaps in proptest::collection::vec((0u64..20_000_000, 1u64..4), 1..400),
        ) {
            let t = interval_fp(rate, 1);
            let depth = burst_ns(t, burst.max(3));
            let burst = burst.max(3);
            let mut now = 5 * SEC;
            let mut tat = 0;
            let mut log: Vec<(u64, u64)> = Vec::new();
            for (gap, cost) in gaps {
                now += gap;
                if let Some(n) = admit(tat, now, increment_ns(t, cost), depth) {
                    tat = n;
                    log.push((now, cost));
                }
            }
            for i in 0..log.len() {
                let mut sum = 0u128;
                for j in i..log.len() {
                    sum += log[j].1 as u128;
                    let dt = (log[j].0 - log[i].0) as u128;
                    // b + r*t, scaled by 1e9 to stay in integers.
                    let bound = burst as u128 * SEC as u128 + rate as u128 * dt;
                    prop_assert!(sum * SEC as u128 <= bound, "i={i} j={j} sum={sum}");
                }
            }
        }

        /// A steady sender at exactly the rate is never refused once its burst
        /// is spent.
        #[test]
        fn steady_rate_is_admitted(rate in 1u64..10_000, n in 1usize..200) {
            let t = interval_fp(rate, 1);
            let depth = burst_ns(t, 1);
            let step = increment_ns(t, 1);
            let mut tat = 0;
            let mut now = SEC;
            for _ in 0..n {
                let r = admit(tat, now, step, depth.max(step));
                prop_assert!(r.is_some());
                tat = r.unwrap();
                now += step;
            }
        }
    }

    #[test]
    fn rescaling_keeps_the_debt_in_units() {
        let (slow, fast) = (interval_fp(1, 60), interval_fp(1000, 1));
        let now = 1_000_000_000_000;
        // One unit owed at 1/min (60 s of debt) is one unit at 1000/s (1 ms).
        assert_eq!(rescale(now + 60_000_000_000, now, slow, fast), now + 1_000_000);
        // Half a unit rounds up to a whole one.
        assert_eq!(rescale(now + 30_000_000_000, now, slow, fast), now + 1_000_000);
        // No debt: unchanged, whatever the rates.
        assert_eq!(rescale(now - 5, now, slow, fast), now - 5);
        // And back: 3 units at 1000/s are 3 minutes at 1/min.
        assert_eq!(rescale(now + 3_000_000, now, fast, slow), now + 180_000_000_000);
        // Any debt under a refuse-everything share (u64::MAX) is at most a
        // unit, rounded up to one.
        assert_eq!(rescale(now + 10, now, u64::MAX, fast), now + 1_000_000);
    }
}
