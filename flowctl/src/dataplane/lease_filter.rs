//! The lease filter (`FLOWCTL_LEASE_FILTER`, docs/design.md, "A key
//! without a lease skips the re-read"): one bit per slot (`grant::filter_slot`) of
//! the keys that may hold a grant in `FLOWCTL_GRANTS`, so the kernel skips
//! the grants lookup of a key without a lease. The lease loop is its one
//! writer, through [`GlobalKeys`](super::GlobalKeys): a key's bit is set
//! before its grant is written and cleared, once no granted key shares it,
//! after the grant is removed. A clear bit then always means "no grant";
//! a set one costs the kernel a lookup, nothing else.

use anyhow::{Context, Result};
use aya::maps::{Array, MapData};
use flowctl_common::{grant, BucketKey};
use std::collections::{HashMap, HashSet};

/// Which slots the granted keys hold, and how many keys each: the part of
/// the filter that is pure bookkeeping.
#[derive(Default)]
pub struct SlotCounts {
    granted: HashSet<BucketKey>,
    holders: HashMap<(u32, u64), u32>,
}

impl SlotCounts {
    /// `key` is granted: the slot whose bit must be set first, if it was
    /// clear (`None`: already counted, or the slot already set).
    pub fn add(&mut self, key: &BucketKey) -> Option<(u32, u64)> {
        if !self.granted.insert(*key) {
            return None;
        }
        let slot = grant::filter_slot(key);
        let n = self.holders.entry(slot).or_default();
        *n += 1;
        (*n == 1).then_some(slot)
    }

    /// `key`'s grant is gone: the slot whose bit may now be cleared, if no
    /// other granted key holds it.
    pub fn remove(&mut self, key: &BucketKey) -> Option<(u32, u64)> {
        if !self.granted.remove(key) {
            return None;
        }
        let slot = grant::filter_slot(key);
        let n = self.holders.get_mut(&slot).expect("a granted key's slot is counted");
        *n -= 1;
        if *n > 0 {
            return None;
        }
        self.holders.remove(&slot);
        Some(slot)
    }
}

pub struct LeaseFilter {
    words: Array<MapData, u64>,
    counts: SlotCounts,
}

impl LeaseFilter {
    /// The filter over the pinned map, counting the grants already in
    /// `FLOWCTL_GRANTS` (an agent that restarted, or re-attached, finds its
    /// predecessor's) and setting their bits. Bits no grant holds stay as
    /// they are: a stale set bit only costs a lookup.
    pub fn open(
        words: Array<MapData, u64>,
        granted: impl Iterator<Item = BucketKey>,
    ) -> Result<Self> {
        let mut f = Self { words, counts: SlotCounts::default() };
        for key in granted {
            if let Some(slot) = f.counts.add(&key) {
                f.update(slot, true)?;
            }
        }
        Ok(f)
    }

    /// Call before writing `key`'s grant.
    pub fn granting(&mut self, key: &BucketKey) -> Result<()> {
        match self.counts.add(key) {
            Some(slot) => self.update(slot, true).inspect_err(|_| {
                // Not set: the grant is not written either; count it out.
                self.counts.remove(key);
            }),
            None => Ok(()),
        }
    }

    /// Call after removing `key`'s grant.
    pub fn removed(&mut self, key: &BucketKey) -> Result<()> {
        match self.counts.remove(key) {
            Some(slot) => self.update(slot, false),
            None => Ok(()),
        }
    }

    /// Sets or clears one bit: a read, then a write of its word (the lease
    /// loop is the only writer, so nothing comes between).
    fn update(&mut self, (word, bit): (u32, u64), set: bool) -> Result<()> {
        let old = self.words.get(&word, 0).context("reading FLOWCTL_LEASE_FILTER")?;
        let new = if set { old | bit } else { old & !bit };
        if new != old {
            self.words.set(word, new, 0).context("writing FLOWCTL_LEASE_FILTER")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> BucketKey {
        BucketKey { state_id: 5, family: 4, src: [i, 0, 0, 0], ..Default::default() }
    }

    /// Two keys that share a slot (found by search: 2^20 slots).
    fn sharing() -> (BucketKey, BucketKey) {
        let mut by_slot = HashMap::new();
        for i in 0.. {
            if let Some(j) = by_slot.insert(grant::filter_slot(&key(i)), i) {
                return (key(j), key(i));
            }
        }
        unreachable!()
    }

    #[test]
    fn a_slot_is_cleared_only_when_its_last_granted_key_goes() {
        let (a, b) = sharing();
        let slot = grant::filter_slot(&a);
        let mut c = SlotCounts::default();
        assert_eq!(c.add(&a), Some(slot), "the first key sets the bit");
        assert_eq!(c.add(&a), None, "a rewritten grant counts once");
        assert_eq!(c.add(&b), None, "the bit is already set");
        assert_eq!(c.remove(&a), None, "b still holds it");
        assert_eq!(c.remove(&a), None, "a removed twice counts once");
        assert_eq!(c.remove(&b), Some(slot), "the last one clears it");
        assert_eq!(c.remove(&key(u32::MAX)), None, "an ungranted key clears nothing");
    }
}
