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

/// How far a bucket's TAT may move back to return a token whose admission
/// wrote `written` (`admit`'s `new_tat`) with `increment`, at `now`: the
/// part of that token, `[written - increment, written]`, still ahead of the
/// clock. Once `written` has passed, the bucket may have filled up and
/// restarted from another admission's own now, and moving it back by the
/// whole increment would erase that admission's charge; never giving back
/// more than is still ahead keeps every admission charged.
#[inline(always)]
pub fn give_back(written: u64, now: u64, increment: u64) -> u64 {
    let ahead = written.saturating_sub(now);
    if ahead < increment {
        ahead
    } else {
        increment
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

/// Bucket depth in ns for a burst of `burst` packets of cost 1 (packets,
/// connections): `burst` times the rounded-up increment, so exactly
/// `burst` pass back to back and admitted units over any `t` stay within
/// `burst + t / increment <= burst + r*t`. The depth must not be rounded
/// on its own: `floor(burst * T)` is below `burst * ceil(T)` whenever the
/// interval has a fraction of a nanosecond, which refused every packet of
/// a burst of 1 (213/s, `T` = 4,694,835.68 ns: increment 4,694,836, depth
/// 4,694,835) and one packet of larger bursts.
pub fn burst_ns(interval_fp: u64, burst: u64) -> u64 {
    burst.saturating_mul(increment_ns(interval_fp, 1))
}

/// Bucket depth in ns for a burst of `bytes` (a `bytes` rule, whose
/// packets cost their length): `ceil(bytes * T)`, so a packet as long as
/// the burst can pass. Rounding up lets admitted bytes over `t` reach
/// `bytes + r*(t + 1 ns)`: one nanosecond of the rate (12.5 B at 100
/// Gbit/s) over the bound, the price of nanosecond TATs.
pub fn byte_burst_ns(interval_fp: u64, bytes: u64) -> u64 {
    increment_ns(interval_fp, bytes)
}

/// `ns` of `units` at `interval_fp`, rounded down: [`increment_ns`] less
/// the rounding up (the low 8 bits of the product are exact even when it
/// wraps).
#[inline(always)]
fn units_ns_floor(interval_fp: u64, units: u64) -> u64 {
    let up = increment_ns(interval_fp, units);
    if up != u64::MAX >> FRAC_BITS && units.wrapping_mul(interval_fp) & ((1 << FRAC_BITS) - 1) != 0
    {
        up - 1
    } else {
        up
    }
}

/// The TAT of a bucket re-rated at `now` from `old` to `new`, each
/// `(interval_fp, depth_ns)`: the credit it held, in whole units (rounded
/// down), is kept, capped at the new depth; it is never scaled with the
/// rate. Keeping the TAT's nanoseconds instead would turn a credit of `x`
/// ns into `x * new_rate` units, and keeping the debt would hand a full
/// bucket the whole of a deeper one: either way a rate or burst share moved
/// from an empty bucket on one host to a full one on another would admit
/// more than L*t + B fleet-wide (docs/design.md, C3). A bucket re-rated
/// from a share that refuses everything (`interval_fp = u64::MAX`, depth
/// 0) starts empty. No 128-bit arithmetic: the kernel runs it.
#[inline(always)]
pub fn retarget(tat: u64, now: u64, old: (u64, u64), new: (u64, u64)) -> u64 {
    let ((old_interval, old_depth), (new_interval, new_depth)) = (old, new);
    let debt = tat.saturating_sub(now);
    let debt = if debt < old_depth { debt } else { old_depth };
    let credit_ns = old_depth - debt;
    if old_interval == 0 || credit_ns == 0 {
        return now.saturating_add(new_depth);
    }
    // Whole units of credit: credit_ns * 256 / old_interval (saturating
    // for credits past 2^56 ns).
    let scaled = if credit_ns >> (64 - FRAC_BITS) != 0 { u64::MAX } else { credit_ns << FRAC_BITS };
    let credit = units_ns_floor(new_interval, scaled / old_interval);
    let credit = if credit < new_depth { credit } else { new_depth };
    now.saturating_add(new_depth - credit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    /// A give-back never returns more than is left ahead of the clock of
    /// the token it returns, and a taken-and-returned token leaves a bucket
    /// that admits nothing another admission has not been charged for:
    /// after A's take, B's admission and A's give-back, the TAT is at least
    /// where B's admission alone would have left it.
    #[test]
    fn give_back_keeps_other_admissions_charged() {
        let inc = 100;
        // A takes from a full bucket at 1000, B admits at 1150 (A's token
        // has expired, the bucket restarts from B's now), A gives back.
        let a = admit(0, 1000, inc, 500).unwrap();
        let b = admit(a, 1150, inc, 500).unwrap();
        assert_eq!(b, 1250, "B restarted from its own now");
        assert_eq!(give_back(a, 1160, inc), 0, "A's token has expired");
        // A give-back in time returns what is left ahead.
        assert_eq!(give_back(a, 1040, inc), 60);
        assert_eq!(give_back(5000, 1040, inc), inc, "a token deep in debt comes back whole");
    }

    proptest! {
        #[test]
        fn give_back_never_undoes_another_admission(
            tat in 0u64..10_000, t_a in 0u64..10_000, d_b in 0u64..1_000, d_g in 0u64..1_000,
            inc in 1u64..500, burst in 500u64..5_000,
        ) {
            let Some(after_a) = admit(tat, t_a, inc, burst) else { return Ok(()) };
            let t_b = t_a + d_b;
            let Some(after_b) = admit(after_a, t_b, inc, burst) else { return Ok(()) };
            let back = give_back(after_a, t_b + d_g, inc);
            // Where B alone (A never admitted) would have left the bucket.
            let b_alone = admit(tat, t_b, inc, burst).unwrap_or(after_b);
            prop_assert!(after_b - back >= b_alone.min(after_b));
            prop_assert!(back <= inc);
        }
    }

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
            gaps in proptest::collection::vec(0u64..20_000_000, 1..400),
        ) {
            // Packets of cost 1, the unit rules' case.
            let t = interval_fp(rate, 1);
            let depth = burst_ns(t, burst);
            let mut now = 5 * SEC;
            let mut tat = 0;
            let mut log: Vec<(u64, u64)> = Vec::new();
            for gap in gaps {
                now += gap;
                if let Some(n) = admit(tat, now, increment_ns(t, 1), depth) {
                    tat = n;
                    log.push((now, 1));
                }
            }
            prop_assert!(within(&log, burst, rate, 0));
        }

        /// Byte rules: packets cost their length; a packet as long as the
        /// burst passes a full bucket, and admitted bytes over any `t`
        /// stay within `b + r*(t + 1 ns)`.
        #[test]
        fn admitted_bytes_within_bound(
            rate in 1_000u64..20_000_000_000,
            burst in 1518u64..100_000,
            gaps in proptest::collection::vec((0u64..2_000_000, 64u64..1519), 1..400),
        ) {
            let t = interval_fp(rate, 1);
            let depth = byte_burst_ns(t, burst);
            prop_assert!(admit(0, SEC, increment_ns(t, burst), depth).is_some(), "a burst-long packet");
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
            prop_assert!(within(&log, burst, rate, 1));
        }

        /// A burst of `b` single units passes back to back from a full
        /// bucket, and no more.
        #[test]
        fn exactly_the_burst_passes_at_once(rate in 1u64..1_000_000, burst in 1u64..200) {
            let params = (interval_fp(rate, 1), burst_ns(interval_fp(rate, 1), burst));
            prop_assert_eq!(credit(0, 10 * SEC, params), burst);
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
                let r = admit(tat, now, step, depth);
                prop_assert!(r.is_some());
                tat = r.unwrap();
                now += step;
            }
        }
    }

    /// Whether the admissions in `log` ((time ns, cost)) stay within
    /// `burst + rate * (t + slack_ns)` over every span between two of them.
    fn within(log: &[(u64, u64)], burst: u64, rate: u64, slack_ns: u64) -> bool {
        for i in 0..log.len() {
            let mut sum = 0u128;
            for j in i..log.len() {
                sum += log[j].1 as u128;
                let dt = (log[j].0 - log[i].0 + slack_ns) as u128;
                // b + r*t, scaled by 1e9 to stay in integers.
                if sum * SEC as u128 > burst as u128 * SEC as u128 + rate as u128 * dt {
                    return false;
                }
            }
        }
        true
    }

    fn params(rate: u64, burst: u64) -> (u64, u64) {
        let i = interval_fp(rate, 1);
        (i, burst_ns(i, burst))
    }

    /// How many single units a bucket at `tat` admits at once at `now`.
    fn credit(tat: u64, now: u64, (interval, depth): (u64, u64)) -> u64 {
        let (mut t, mut n) = (tat, 0);
        while let Some(next) = admit(t, now, increment_ns(interval, 1), depth) {
            t = next;
            n += 1;
        }
        n
    }

    #[test]
    fn retargeting_keeps_the_credit_in_units() {
        let now = 50 * SEC;
        // Full at 10/s depth 10, re-rated to 100/s depth 100: still 10
        // units of credit, not 100.
        let to = params(100, 100);
        assert_eq!(credit(retarget(now - SEC, now, params(10, 10), to), now, to), 10);
        // Lowered: capped at the new depth.
        let to = params(10, 5);
        assert_eq!(credit(retarget(0, now, params(100, 100), to), now, to), 5);
        // Half spent (5 of 10 owed) and raised: 5 units left, the rest owed.
        let from = params(10, 10);
        let half = now + increment_ns(from.0, 5);
        let to = params(1000, 1000);
        assert_eq!(credit(retarget(half, now, from, to), now, to), 5);
        // An empty bucket stays empty; from refusing everything, empty.
        assert_eq!(retarget(now + from.1, now, from, to), now + to.1);
        assert_eq!(retarget(0, now, (u64::MAX, 0), to), now + to.1);
        // To refusing everything: nothing admitted.
        assert_eq!(credit(retarget(0, now, from, (u64::MAX, 0)), now, (u64::MAX, 0)), 0);
        // Unchanged parameters keep a whole-unit credit exactly.
        let tat = now + increment_ns(from.0, 3);
        assert_eq!(retarget(tat, now, from, from), tat);
    }

    #[test]
    fn floor_rounds_down_only_a_fraction() {
        let i = interval_fp(3, 1); // 333,333,333.33 ns
        assert_eq!(increment_ns(i, 1), 333_333_334);
        assert_eq!(units_ns_floor(i, 1), 333_333_333);
        assert_eq!(units_ns_floor(interval_fp(1, 1), 2), 2_000_000_000);
    }
}
