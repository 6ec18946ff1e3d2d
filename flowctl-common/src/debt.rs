//! Remembered debts of refused buckets (docs/design.md, "Where bucket state
//! lives"): when a bucket refuses a packet, its TAT is written here, so a
//! key whose bucket the LRU table evicts comes back still in debt instead
//! of with a fresh burst.
//!
//! Each rule record owns [`DEBT_SETS_PER_RULE`] sets of [`DEBT_WAYS`]
//! tagged ways (a set is two 64-byte lines). A key's set and tag come from
//! one seeded hash ([`locate`]): the seed is the load's random
//! `GlobalRecord::hash_seed`, so a sender cannot aim its keys at a victim's
//! set. A new bucket starts from the debt of the way whose tag is its own
//! ([`recall`]), never from another key's: the untagged slots this replaced
//! handed a brand-new source the debt of whichever flood source shared its
//! slot, which under a flood of many refused sources refused most new
//! sources' first packet.
//!
//! Error bounds, per rule record:
//! - A key that was never refused starts in debt only if another refused
//!   key of its rule has its 63-bit tag in the same set: at most
//!   `DEBT_WAYS * 2^-56` = 2^-53 per new bucket (the tag's bits beyond the
//!   set's).
//! - A debt is forgotten only to make room: [`remember`] replaces the way
//!   whose debt ends first (an ended debt first), and keeps nothing when all
//!   eight end later than the new one, so each set keeps its own eight debts
//!   that end last. Sets fill unevenly: with live debts spread uniformly
//!   over a region's 128 sets, about 0.2 of 300 are lost, 3.5 of 500, 40 of
//!   768 and 143 of 1024 (a model of the policy; four ways in 256 sets, the
//!   same memory, lose 2, 18, 81 and 200). A forgotten debt costs something only if
//!   its key's bucket is evicted as well and the key comes back before the
//!   debt ends: it then starts with a full bucket, one burst.
//! - Writers do not lock. Only a refusal writes a tag, so a key that was
//!   never refused never reads a debt. The writer clears a way's TAT before
//!   it changes the tag, and [`recall`] reads the tag, the TAT, then the tag
//!   again: on x86 (stores and loads in order) a reader sees either the old
//!   key's pair or no debt. Two CPUs replacing the same way at once can
//!   still leave one refused key with the other's TAT, and on weakly
//!   ordered CPUs the previous occupant may read the new TAT once: either
//!   way a key that was refused once gets at most one bucket depth of debt
//!   it does not owe.

use crate::{keys::key_hash, BucketKey, MAX_RULE_RECORDS};

/// Ways per set: eight 16-byte ways, two 64-byte cache lines. Eight
/// rather than four in the same memory: sets that fill unevenly overflow
/// (and forget debts) far less often.
pub const DEBT_WAYS: usize = 8;
/// Sets per rule record: 1024 ways, 16 KiB.
pub const DEBT_SETS_PER_RULE: usize = 128;
/// Entries of `FLOWCTL_DEBT` (one set each).
pub const DEBT_SETS: usize = MAX_RULE_RECORDS * DEBT_SETS_PER_RULE;

/// One remembered debt: a key's tag (0: empty) and its bucket's TAT when
/// it was refused.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DebtWay {
    pub tag: u64,
    pub tat: u64,
}

/// One set of `FLOWCTL_DEBT`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DebtSet {
    pub ways: [DebtWay; DEBT_WAYS],
}

/// XORed into a key's tag for the debt of its quota window rather than of
/// its bucket: both live in the key's set, and neither is read as the
/// other (a bucket starting from a window's end would be refused for a
/// burst's worth of time it does not owe, and the reverse).
pub const QUOTA_DOMAIN: u64 = 1 << 63;

/// The set (an index into `FLOWCTL_DEBT`, within the record's region) and
/// the tag of `key` under rule record `record`. The tag is never 0.
#[inline(always)]
pub fn locate(seed: u64, record: u32, key: &BucketKey) -> (u32, u64) {
    let h = key_hash(seed, key);
    let set = (h >> 56) as u32 % DEBT_SETS_PER_RULE as u32;
    (record * DEBT_SETS_PER_RULE as u32 + set, h | 1)
}

/// The debt remembered for `tag`, when it is still in the future; else 0
/// (a full bucket). The tag is read again after the TAT: a way being
/// handed to another key between the two reads is not this key's debt.
#[inline(always)]
pub fn recall(set: &DebtSet, tag: u64, now: u64) -> u64 {
    let mut i = 0;
    while i < DEBT_WAYS {
        let w = &set.ways[i];
        if unsafe { core::ptr::read_volatile(&w.tag) } == tag {
            let tat = unsafe { core::ptr::read_volatile(&w.tat) };
            if tat > now && unsafe { core::ptr::read_volatile(&w.tag) } == tag {
                return tat;
            }
        }
        i += 1;
    }
    0
}

/// Remembers that the bucket of `tag` was refused with TAT `tat`: in its
/// own way (the later of the two debts), else in the way whose debt ends
/// first, if that ends before `tat`. The way's TAT is cleared before its
/// tag changes, so a reader between the stores sees no debt rather than
/// the previous key's.
#[inline(always)]
pub fn remember(set: &mut DebtSet, tag: u64, tat: u64, now: u64) {
    let mut victim = 0;
    let mut least = u64::MAX;
    let mut i = 0;
    while i < DEBT_WAYS {
        let w = &mut set.ways[i];
        if w.tag == tag {
            if tat > w.tat {
                unsafe { core::ptr::write_volatile(&mut w.tat, tat) };
            }
            return;
        }
        let left = if w.tat > now { w.tat } else { 0 };
        if left < least {
            least = left;
            victim = i;
        }
        i += 1;
    }
    if tat <= least || victim >= DEBT_WAYS {
        return;
    }
    let w = &mut set.ways[victim];
    unsafe {
        core::ptr::write_volatile(&mut w.tat, 0);
        core::ptr::write_volatile(&mut w.tag, tag);
        core::ptr::write_volatile(&mut w.tat, tat);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(i: u32) -> BucketKey {
        BucketKey { state_id: 7, family: 4, src: [0x0a00_0000 + i, 0, 0, 0], ..Default::default() }
    }

    /// A host model of one rule's region, as the kernel uses it.
    struct Region(Vec<DebtSet>);
    impl Region {
        fn new() -> Self {
            Self(vec![DebtSet::default(); DEBT_SETS_PER_RULE])
        }
        fn at(&mut self, k: &BucketKey) -> (&mut DebtSet, u64) {
            let (set, tag) = locate(0x5eed, 3, k);
            (&mut self.0[(set - 3 * DEBT_SETS_PER_RULE as u32) as usize], tag)
        }
        fn remember(&mut self, k: &BucketKey, tat: u64, now: u64) {
            let (s, tag) = self.at(k);
            remember(s, tag, tat, now);
        }
        fn recall(&mut self, k: &BucketKey, now: u64) -> u64 {
            let (s, tag) = self.at(k);
            recall(s, tag, now)
        }
    }

    #[test]
    fn sets_stay_in_the_record_s_region_and_tags_are_never_empty() {
        for i in 0..10_000 {
            let (set, tag) = locate(1, 9, &key(i));
            assert!((9 * 128..10 * 128).contains(&(set as usize)));
            assert_ne!(tag, 0);
        }
    }

    #[test]
    fn a_flood_of_refused_keys_gives_no_new_key_a_debt() {
        // The untagged slots this replaced: 2000 debtors over 1024 slots
        // put about 86% of new keys in debt.
        let mut r = Region::new();
        let now = 1_000_000;
        for i in 0..100_000 {
            r.remember(&key(i), now + 5_000_000 + i as u64, now);
        }
        let inherited = (1_000_000..1_010_000).filter(|&i| r.recall(&key(i), now) != 0).count();
        assert_eq!(inherited, 0);
    }

    #[test]
    fn a_debt_is_kept_until_it_ends_and_ended_ways_are_reused_first() {
        let mut r = Region::new();
        r.remember(&key(1), 500, 100);
        assert_eq!(r.recall(&key(1), 100), 500);
        assert_eq!(r.recall(&key(1), 500), 0, "ended");
        // A later refusal of the same key keeps the later debt.
        r.remember(&key(1), 400, 100);
        assert_eq!(r.recall(&key(1), 100), 500);
        r.remember(&key(1), 900, 100);
        assert_eq!(r.recall(&key(1), 100), 900);
        // Key 1 and seven more keys of its set fill it; at 950 key 1's
        // debt (900) has ended, so a ninth key takes its way rather than a
        // live one's, even with a debt that ends before theirs.
        let set_of = |k: u32| locate(0x5eed, 3, &key(k)).0;
        let same: Vec<u32> =
            (2..100_000).filter(|&k| set_of(k) == set_of(1)).take(DEBT_WAYS).collect();
        for &k in &same[..DEBT_WAYS - 1] {
            r.remember(&key(k), 5_000, 100);
        }
        r.remember(&key(same[DEBT_WAYS - 1]), 1_000, 950);
        assert_eq!(r.recall(&key(same[DEBT_WAYS - 1]), 950), 1_000);
        for &k in &same[..DEBT_WAYS - 1] {
            assert_eq!(r.recall(&key(k), 950), 5_000, "live debts kept");
        }
    }

    proptest! {
        /// A key recalls only a debt it was given (its own, the latest),
        /// and each set keeps exactly the debts of its keys that end last
        /// among those still live: all of them when `DEBT_WAYS` or fewer are.
        #[test]
        fn recalls_only_own_debts_and_keeps_each_set_s_latest(
            debts in proptest::collection::vec((0u32..5000, 1u64..1_000_000), 1..3000),
            now in 0u64..2_000_000,
        ) {
            // A key's TAT only grows, so each of its refusals is later.
            let mut r = Region::new();
            let mut own = std::collections::HashMap::new();
            for &(k, step) in &debts {
                let e = own.entry(k).or_insert(now);
                *e += step;
                r.remember(&key(k), *e, now);
            }
            let mut by_set: std::collections::HashMap<u32, Vec<u64>> = Default::default();
            for (&k, &d) in &own {
                by_set.entry(locate(0x5eed, 3, &key(k)).0).or_default().push(d);
            }
            for (&k, &d) in &own {
                let got = r.recall(&key(k), now);
                prop_assert!(got == 0 || got == d, "key {} recalled {} of its {}", k, got, d);
                let mut set = by_set[&locate(0x5eed, 3, &key(k)).0].clone();
                set.sort_unstable();
                let last_kept = set[set.len().saturating_sub(DEBT_WAYS)];
                if set.len() <= DEBT_WAYS || d > last_kept {
                    prop_assert_eq!(got, d, "one of its set's latest");
                }
                if d < last_kept {
                    prop_assert_eq!(got, 0, "beyond its set's latest");
                }
            }
            for k in 5000..5200 {
                prop_assert_eq!(r.recall(&key(k), now), 0);
            }
        }
    }
}
