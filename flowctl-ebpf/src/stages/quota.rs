//! Stage 3: the quota, a sliding window of `quota_buckets` buckets per key
//! (`FLOWCTL_QUOTAS`). Checked before the bucket looks ([`Quota::has_room`]),
//! committed once the bucket has admitted on a read ([`QuotaStage::commit`]),
//! rolled back if the bucket's own swap then refuses
//! ([`QuotaStage::rollback`]).

use crate::{
    accounting::insert_failed,
    maps::{FLOWCTL_QUOTAS, FLOWCTL_ZERO_RING},
};
use core::intrinsics::{atomic_cxchg, AtomicOrdering};
use flowctl_common::{
    keys::bucket_key,
    window::{self, Window},
    BucketKey, PacketMeta, QuotaRing, RuleConfig, CAS_RETRIES,
};

/// What the bucket stage needs of the quota stage: commit after the bucket's
/// look, roll back if the bucket's swap then refuses.
pub trait QuotaStage {
    fn commit(&mut self, cost: u64) -> QuotaCommit;
    fn rollback(&mut self, cost: u64);
}

pub enum QuotaCommit {
    Done,
    Full,
    Contended,
}

/// Rules without a quota.
pub struct NoQuota;

impl QuotaStage for NoQuota {
    #[inline(always)]
    fn commit(&mut self, _cost: u64) -> QuotaCommit {
        QuotaCommit::Done
    }
    #[inline(always)]
    fn rollback(&mut self, _cost: u64) {}
}

/// The quota stage of one packet: its key's window ring and epoch, and
/// whether this packet has committed to it yet (so retries of the bucket's
/// compare-and-swap never count it twice).
pub struct Quota {
    ring: *mut QuotaRing,
    window: Window,
    epoch: u64,
    limit: u64,
    /// The K full buckets' sum, from `has_room` (past buckets no longer change).
    past: u64,
    committed: bool,
}

impl Quota {
    /// The ring for this packet's key, created empty when missing. A table
    /// that refuses the insert leaves the quota unenforced for this packet
    /// (counted as an insert failure), like the key table.
    #[inline(always)]
    pub fn of(rule: &RuleConfig, meta: &PacketMeta, record: u32, now: u64) -> Self {
        Self::of_key(rule, &bucket_key(meta, rule), rule.quota_limit as u64, record, now)
    }

    /// The ring of `key` (already made from the packet) with `limit` units
    /// per window: a global rule's quota share.
    #[inline(always)]
    pub fn of_key(rule: &RuleConfig, key: &BucketKey, limit: u64, record: u32, now: u64) -> Self {
        let window = Window { bucket_ns: rule.quota_bucket_ns, buckets: rule.quota_buckets };
        let key = *key;
        let mut ring = FLOWCTL_QUOTAS.get_ptr_mut(&key).unwrap_or(core::ptr::null_mut());
        if ring.is_null() {
            if let Some(zero) = FLOWCTL_ZERO_RING.get(0) {
                let _ = FLOWCTL_QUOTAS.insert(&key, zero, 1 /* BPF_NOEXIST */);
            }
            ring = FLOWCTL_QUOTAS.get_ptr_mut(&key).unwrap_or(core::ptr::null_mut());
            if ring.is_null() {
                insert_failed(record);
            }
        }
        Self { ring, window, epoch: window.epoch(now), limit, past: 0, committed: false }
    }

    #[inline(always)]
    fn word(&self, i: u32) -> u64 {
        unsafe {
            match (*self.ring).words.get(i as usize) {
                Some(w) => core::ptr::read_volatile(w),
                None => 0,
            }
        }
    }

    #[inline(always)]
    fn current(&self) -> Option<*mut u64> {
        let i = window::slot(self.epoch, self.window.slots());
        unsafe { (*self.ring).words.get_mut(i as usize).map(|w| w as *mut u64) }
    }

    #[inline(always)]
    pub fn has_room(&mut self, cost: u64) -> bool {
        if self.ring.is_null() {
            return true;
        }
        let sum = window::ring_sum(|i| self.word(i as u32), self.epoch, self.window.buckets);
        let current = match self.current() {
            Some(p) => window::count_in(unsafe { core::ptr::read_volatile(p) }, self.epoch) as u64,
            None => 0,
        };
        self.past = sum.saturating_sub(current);
        window::quota_admits(sum, cost, self.limit)
    }
}

impl QuotaStage for Quota {
    /// Adds the packet to the current bucket if the window still has room:
    /// the check and the increment are one compare-and-swap on the current
    /// slot (past buckets no longer change).
    #[inline(always)]
    fn commit(&mut self, cost: u64) -> QuotaCommit {
        if self.ring.is_null() || self.committed {
            return QuotaCommit::Done;
        }
        let Some(cur) = self.current() else { return QuotaCommit::Done };
        let past = self.past;
        let mut tries = 0;
        while tries < CAS_RETRIES {
            let old = unsafe { core::ptr::read_volatile(cur) };
            let sum = past + window::count_in(old, self.epoch) as u64;
            if !window::quota_admits(sum, cost, self.limit) {
                return QuotaCommit::Full;
            }
            let new = window::bumped(old, self.epoch, cost as u32);
            let (_, ok) = unsafe {
                atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                    cur, old, new,
                )
            };
            if ok {
                self.committed = true;
                return QuotaCommit::Done;
            }
            tries += 1;
        }
        QuotaCommit::Contended
    }

    /// Takes this packet's count back out after a later stage refused it.
    /// One attempt: if another CPU changed the slot meanwhile, the count
    /// stays (the window under-admits by this packet until the bucket ages
    /// out; never over-admits).
    #[inline(always)]
    fn rollback(&mut self, cost: u64) {
        if !self.committed {
            return;
        }
        let Some(cur) = self.current() else { return };
        let old = unsafe { core::ptr::read_volatile(cur) };
        let (e, c) = window::unpack(old);
        if e == self.epoch as u32 && (c as u64) >= cost {
            unsafe {
                let _ = atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                    cur,
                    old,
                    window::pack(self.epoch, c - cost as u32),
                );
            }
        }
        self.committed = false;
    }
}
