//! Sliding-window counting for quotas (docs/algorithms.md section 2), pure.
//!
//! A quota "at most N per W" splits W into K buckets of length L = W/K and
//! keeps a ring of K + 1 slots. Each slot is one u64 packing the bucket's
//! epoch (`t / L`, low 32 bits) and its count (32 bits), so a shared slot is
//! reset and incremented by one compare-and-swap: a stale epoch is replaced by
//! (new epoch, cost), a current one incremented. ("CAS the start, then zero"
//! loses increments when two CPUs reach a stale bucket at once.)
//!
//! A packet is admitted when the current bucket plus the K full buckets
//! before it hold at most N - cost. Then no interval of length W ever holds
//! more than N admissions (every admission in such an interval falls in the
//! K + 1 epochs the last one summed), and the effective window is between W
//! and W + W/K: slight under-admission, never over. Summing only the buckets
//! that start within W of now, as Sentinel does, lets ~2N through in less than
//! W; the property tests below check the contract on arbitrary arrivals,
//! bursts at bucket boundaries included.
//!
//! Epochs are compared in 32 bits: a slot untouched for an exact multiple of
//! 2^32 bucket lengths (49.7 days at 1 ms buckets) would be misread as current.

/// Window geometry: `buckets` (K) buckets of `bucket_ns` (L) each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub bucket_ns: u64,
    pub buckets: u32,
}

impl Window {
    /// Ring slots: the current bucket plus K full ones.
    #[inline(always)]
    pub fn slots(&self) -> u32 {
        self.buckets.saturating_add(1)
    }

    /// `checked_div`: a division the compiler cannot prove safe becomes a
    /// panic path, which the verifier rejects.
    #[inline(always)]
    pub fn epoch(&self, now_ns: u64) -> u64 {
        now_ns.checked_div(self.bucket_ns).unwrap_or(0)
    }

    /// The nominal window W = K * L.
    pub fn window_ns(&self) -> u64 {
        self.bucket_ns.saturating_mul(self.buckets as u64)
    }
}

#[inline(always)]
pub fn pack(epoch: u64, count: u32) -> u64 {
    (epoch << 32) | count as u64
}

#[inline(always)]
pub fn unpack(word: u64) -> (u32, u32) {
    ((word >> 32) as u32, word as u32)
}

/// Ring slot of an epoch.
#[inline(always)]
pub fn slot(epoch: u64, slots: u32) -> u32 {
    epoch.checked_rem(slots as u64).unwrap_or(0) as u32
}

/// The count a slot holds for `epoch` (0 when the slot is stale).
#[inline(always)]
pub fn count_in(word: u64, epoch: u64) -> u32 {
    let (e, c) = unpack(word);
    if e == epoch as u32 {
        c
    } else {
        0
    }
}

/// The slot word after adding `cost` at `epoch`: the value to
/// compare-and-swap in.
#[inline(always)]
pub fn bumped(word: u64, epoch: u64, cost: u32) -> u64 {
    let (e, c) = unpack(word);
    if e == epoch as u32 {
        pack(epoch, c.saturating_add(cost))
    } else {
        pack(epoch, cost)
    }
}

/// Sum of the K full buckets before `epoch` (`back = 1..=K`), without the
/// current one. `word(i)` reads ring slot i. The loop bound is the constant
/// ring size, so the verifier sees a bounded loop.
#[inline(always)]
pub fn past_sum(w: &Window, epoch: u64, mut word: impl FnMut(u32) -> u64) -> u64 {
    let mut sum = 0u64;
    let slots = w.slots();
    let mut back = 1u32;
    while back < crate::QUOTA_RING_SLOTS as u32 {
        if back >= slots {
            break;
        }
        if let Some(e) = epoch.checked_sub(back as u64) {
            sum += count_in(word(slot(e, slots)), e) as u64;
        }
        back += 1;
    }
    sum
}

/// Sum of the current bucket and the K full buckets before it.
#[inline(always)]
pub fn window_sum(w: &Window, epoch: u64, mut word: impl FnMut(u32) -> u64) -> u64 {
    let current = count_in(word(slot(epoch, w.slots())), epoch) as u64;
    past_sum(w, epoch, word) + current
}

/// `window_sum` for the kernel: walks every ring slot (a constant 17) and
/// counts those whose epoch is 0..=K buckets old, without a branch (BPF has
/// no conditional set, and a branch per slot multiplies the verifier's
/// states). Equal to `window_sum` on rings written by `bumped` (property-tested).
#[inline(always)]
pub fn ring_sum(words: impl Fn(usize) -> u64, epoch: u64, buckets: u32) -> u64 {
    let now = epoch as u32;
    let mut sum = 0u64;
    let mut i = 0;
    while i < crate::QUOTA_RING_SLOTS {
        let (e, c) = unpack(words(i));
        let age = now.wrapping_sub(e) as u64;
        // 1 when age <= K: age - (K + 1) borrows into bit 63.
        let include = age.wrapping_sub(buckets as u64 + 1) >> 63;
        sum += c as u64 * include;
        i += 1;
    }
    sum
}

/// When everything a key's ring counts up to the end of bucket `epoch` has
/// left the window: the end of bucket `epoch + K`. A key its quota refuses
/// in `epoch` has its debt remembered until then, so a ring the table
/// evicts meanwhile comes back full (docs/design.md, "Where bucket state
/// lives").
#[inline(always)]
pub fn refused_until(w: &Window, epoch: u64) -> u64 {
    // Wrapping: `epoch * L` is at most the clock and (K + 1) * L at most
    // twice the window, so only a window of over 290 years could wrap, and
    // a wrapped end only forgets the refusal. A checked product would need
    // `__multi3`, which BPF does not have.
    epoch.wrapping_add(w.buckets as u64 + 1).wrapping_mul(w.bucket_ns)
}

/// The quota decision: admit `cost` when the window holds at most
/// `limit - cost`.
#[inline(always)]
pub fn quota_admits(sum: u64, cost: u64, limit: u64) -> bool {
    sum.saturating_add(cost) <= limit
}

/// What a ring has spent, for a global quota's report to the store
/// (docs/fleet.md): the units the kernel counts now (`ring_sum`), and how
/// long until every one of them has left a window of W: each was spent
/// before the end of the newest bucket that holds any, and no later than
/// `now`, so all are out by `min(that end, now) + W`.
pub fn spent(words: &[u64], w: &Window, now_ns: u64) -> (u64, u64) {
    let epoch = w.epoch(now_ns);
    let used = ring_sum(|i| words.get(i).copied().unwrap_or(0), epoch, w.buckets);
    let newest = words
        .iter()
        .map(|&x| unpack(x))
        .filter(|&(_, c)| c > 0)
        .map(|(e, _)| (epoch as u32).wrapping_sub(e) as u64)
        .filter(|age| *age <= w.buckets as u64)
        .min();
    let clear_in = match (used, newest) {
        (0, _) | (_, None) => 0,
        (_, Some(age)) => {
            let end = (epoch - age.min(epoch) + 1).saturating_mul(w.bucket_ns);
            end.min(now_ns).saturating_add(w.window_ns()).saturating_sub(now_ns)
        }
    };
    (used, clear_in)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn spent_says_how_long_until_the_ring_clears() {
        let w = Window { bucket_ns: 1_000, buckets: 4 };
        let mut words = [0u64; crate::QUOTA_RING_SLOTS];
        // 3 units in bucket 10, 2 in bucket 12; now in bucket 12.
        words[slot(10, w.slots()) as usize] = pack(10, 3);
        words[slot(12, w.slots()) as usize] = pack(12, 2);
        // The newest units may have been spent up to now (12_500): they
        // leave a 4_000 ns window by 16_500.
        assert_eq!(spent(&words, &w, 12_500), (5, 4_000));
        // In bucket 14 nothing new: the newest units (bucket 12) were spent
        // before 13_000, so all are out by 17_000.
        assert_eq!(spent(&words, &w, 14_200), (5, 2_800));
        // Bucket 10 has aged past K; bucket 12's 2 remain.
        assert_eq!(spent(&words, &w, 15_100).0, 2);
        assert_eq!(spent(&[0; crate::QUOTA_RING_SLOTS], &w, 15_100), (0, 0));
    }

    /// A single-threaded model of the kernel ring.
    struct Ring {
        w: Window,
        words: Vec<u64>,
        limit: u64,
    }

    impl Ring {
        fn new(w: Window, limit: u64) -> Self {
            Self { words: vec![0; w.slots() as usize], w, limit }
        }

        fn offer(&mut self, now: u64, cost: u32) -> bool {
            let e = self.w.epoch(now);
            let sum = window_sum(&self.w, e, |i| self.words[i as usize]);
            // The kernel's branch-free sum agrees.
            let mut ring = [0u64; crate::QUOTA_RING_SLOTS];
            ring[..self.words.len()].copy_from_slice(&self.words);
            assert_eq!(ring_sum(|i| ring[i], e, self.w.buckets), sum);
            if !quota_admits(sum, cost as u64, self.limit) {
                return false;
            }
            let s = slot(e, self.w.slots()) as usize;
            self.words[s] = bumped(self.words[s], e, cost);
            true
        }
    }

    #[test]
    fn a_refusal_is_remembered_until_its_bucket_leaves_the_window() {
        // K = 4 buckets of 100: bucket 7 counts through bucket 11 (ages
        // 0..=K), so its units have all left at the end of bucket 11.
        let w = Window { bucket_ns: 100, buckets: 4 };
        assert_eq!(refused_until(&w, 7), 1_200);
        let mut ring = [0u64; crate::QUOTA_RING_SLOTS];
        ring[slot(7, w.slots()) as usize] = pack(7, 5);
        let sum_at = |t: u64| window_sum(&w, w.epoch(t), |i| ring[i as usize]);
        assert_eq!(sum_at(1_199), 5);
        assert_eq!(sum_at(1_200), 0);
    }

    #[test]
    fn past_and_window_sums() {
        let w = Window { bucket_ns: 10, buckets: 3 };
        let mut words = [0u64; 4];
        for (e, c) in [(5u64, 1u32), (6, 2), (7, 4), (8, 8)] {
            words[slot(e, 4) as usize] = pack(e, c);
        }
        assert_eq!(past_sum(&w, 8, |i| words[i as usize]), 7);
        assert_eq!(window_sum(&w, 8, |i| words[i as usize]), 15);
        // One epoch later the oldest bucket (5) is long gone and 8 is past.
        assert_eq!(window_sum(&w, 9, |i| words[i as usize]), 14);
    }

    #[test]
    fn packing_round_trips_and_resets_stale_slots() {
        let w = pack(7, 3);
        assert_eq!(unpack(w), (7, 3));
        assert_eq!(count_in(w, 7), 3);
        assert_eq!(count_in(w, 8), 0);
        assert_eq!(unpack(bumped(w, 7, 2)), (7, 5));
        assert_eq!(unpack(bumped(w, 9, 2)), (9, 2), "a stale epoch restarts the count");
        assert_eq!(unpack(bumped(pack(1, u32::MAX), 1, 5)), (1, u32::MAX), "counts saturate");
        // Epochs wrap in 32 bits without disturbing the count.
        assert_eq!(unpack(pack((1u64 << 32) + 5, 1)), (5, 1));
    }

    #[test]
    fn admits_exactly_n_then_again_after_the_window() {
        // 60 per minute, 6 buckets of 10 s.
        let w = Window { bucket_ns: 10_000_000_000, buckets: 6 };
        let mut r = Ring::new(w, 60);
        let t0 = 1_000 * w.bucket_ns + 3;
        assert_eq!((0..100).filter(|_| r.offer(t0, 1)).count(), 60);
        // Still refused one bucket before the window ends...
        assert!(!r.offer(t0 + w.window_ns() - w.bucket_ns, 1));
        // ...and admitted once the burst's bucket has left the K full ones.
        assert!(r.offer(t0 - 3 + w.window_ns() + w.bucket_ns, 1));
    }

    #[test]
    fn boundary_burst_cannot_double_the_quota() {
        // Sentinel's flaw: N at the end of a bucket, N more just after it
        // leaves a "within W of now" window. Here the second burst waits.
        let w = Window { bucket_ns: 1_000, buckets: 2 };
        let mut r = Ring::new(w, 10);
        let end_of_bucket = 10 * 1_000 + 999;
        assert_eq!((0..10).filter(|_| r.offer(end_of_bucket, 1)).count(), 10);
        let just_after_w = end_of_bucket + w.window_ns() - 998; // W later, next bucket start
        assert_eq!((0..10).filter(|_| r.offer(just_after_w, 1)).count(), 0);
        let after_w_plus_l = 10 * 1_000 + w.window_ns() + w.bucket_ns;
        assert_eq!((0..10).filter(|_| r.offer(after_w_plus_l, 1)).count(), 10);
    }

    proptest! {
        /// The contract: no interval of length W holds more than N admitted,
        /// for arbitrary arrivals (including many at bucket boundaries).
        #[test]
        fn never_more_than_n_in_any_window(
            buckets in 1u32..12,
            bucket_ns in 1u64..2_000,
            limit in 1u64..40,
            steps in proptest::collection::vec((0u64..3_000, 1u32..4, any::<bool>()), 1..300),
        ) {
            let w = Window { bucket_ns, buckets };
            let mut r = Ring::new(w, limit);
            let mut now = 1_000_000u64;
            let mut log: Vec<(u64, u64)> = Vec::new();
            for (gap, cost, snap) in steps {
                now += gap;
                // Half the arrivals land on the last or first ns of a bucket.
                let t = if snap { (now / bucket_ns) * bucket_ns + if gap % 2 == 0 { 0 } else { bucket_ns - 1 } } else { now };
                let t = t.max(log.last().map(|l| l.0).unwrap_or(0));
                if r.offer(t, cost) {
                    log.push((t, cost as u64));
                }
            }
            let wn = w.window_ns();
            for i in 0..log.len() {
                let sum: u64 = log[i..].iter().take_while(|(t, _)| *t < log[i].0 + wn).map(|(_, c)| c).sum();
                prop_assert!(sum <= limit, "{sum} > {limit} in [{}, +{wn})", log[i].0);
            }
        }

        /// Under-admission is bounded: a lone sender that waits W + L after
        /// its last admission is always admitted again.
        #[test]
        fn effective_window_at_most_w_plus_l(buckets in 1u32..12, bucket_ns in 1u64..5_000, start in 0u64..1_000_000) {
            let w = Window { bucket_ns, buckets };
            let mut r = Ring::new(w, 1);
            prop_assert!(r.offer(start, 1));
            prop_assert!(r.offer(start + w.window_ns() + bucket_ns, 1));
        }
    }
}
