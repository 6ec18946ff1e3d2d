//! Stage 3: the quota, a sliding window of `quota_buckets` buckets per key
//! (`FLOWCTL_QUOTAS`). Checked before the bucket looks ([`Quota::has_room`]),
//! committed once the bucket has admitted on a read ([`QuotaStage::commit`]),
//! rolled back if the bucket's own swap then refuses
//! ([`QuotaStage::rollback`]). A local rule's refusal is remembered in the
//! debt table until everything its window counted has left it
//! (`window::refused_until`), and a ring created while that debt lasts
//! starts full: a key held at its quota gets no fresh window when the LRU
//! table evicts its ring (docs/design.md, "Where bucket state lives").

use super::bucket::{flowctl_recall_debt, flowctl_remember_debt};
use crate::{
    accounting::insert_failed,
    maps::{FLOWCTL_QUOTAS, FLOWCTL_ZERO_RING},
};
use core::intrinsics::{atomic_cxchg, AtomicOrdering};
use flowctl_common::{
    debt::QUOTA_DOMAIN,
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

/// Where a window's refusals go (docs/design.md, "Where bucket state
/// lives").
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Remember {
    /// A global rule's share: the fleet accounts for its window.
    Not,
    /// A local rule's window: restored and remembered from here.
    Here,
    /// A rule with nested limits: its caller (`flowctl_nested_admit`)
    /// restores and remembers, a call shallower, as the verifier's 512
    /// bytes of call-chain stack need ([`Quota::fresh`], [`Quota::note_due`]).
    Caller,
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
    remember: Remember,
    /// Where a refusal is remembered (`FLOWCTL_RULES` index and record).
    rule_at: u32,
    record: u32,
    now: u64,
    /// `Remember::Caller`: this packet created the ring (the caller
    /// restores it before deciding), and a refusal is for the caller to
    /// remember.
    pub fresh: bool,
    pub note_due: bool,
}

/// The window geometry of a rule's quota.
#[inline(always)]
pub fn window_of(rule: &RuleConfig) -> Window {
    Window { bucket_ns: rule.quota_bucket_ns, buckets: rule.quota_buckets }
}

impl Quota {
    /// The ring for this packet's key, created empty when missing. A table
    /// that refuses the insert leaves the quota unenforced for this packet
    /// (counted as an insert failure), like the key table.
    #[inline(always)]
    pub fn of(
        rule: &RuleConfig,
        meta: &PacketMeta,
        record: u32,
        now: u64,
        remember: Remember,
    ) -> Self {
        let limit = rule.quota_limit as u64;
        Self::of_key(rule, &bucket_key(meta, rule), limit, (remember, record), now)
    }

    /// The ring of `key` (already made from the packet) with `limit` units
    /// per window, for a global rule's quota share.
    #[inline(always)]
    pub fn of_share(rule: &RuleConfig, key: &BucketKey, limit: u64, record: u32, now: u64) -> Self {
        Self::of_key(rule, key, limit, (Remember::Not, record), now)
    }

    #[inline(always)]
    fn of_key(
        rule: &RuleConfig,
        key: &BucketKey,
        limit: u64,
        (remember, record): (Remember, u32),
        now: u64,
    ) -> Self {
        let window = window_of(rule);
        let epoch = window.epoch(now);
        let key = *key;
        let mut fresh = false;
        let mut ring = FLOWCTL_QUOTAS.get_ptr_mut(&key).unwrap_or(core::ptr::null_mut());
        if ring.is_null() {
            if let Some(zero) = FLOWCTL_ZERO_RING.get(0) {
                let _ = FLOWCTL_QUOTAS.insert(&key, zero, 1 /* BPF_NOEXIST */);
            }
            if remember == Remember::Here {
                flowctl_recall_debt(rule.at, record, now, QUOTA_DOMAIN);
            }
            fresh = true;
            ring = FLOWCTL_QUOTAS.get_ptr_mut(&key).unwrap_or(core::ptr::null_mut());
            if ring.is_null() {
                insert_failed(record);
            }
        }
        Self {
            ring,
            window,
            epoch,
            limit,
            past: 0,
            committed: false,
            remember,
            rule_at: rule.at,
            record,
            now,
            fresh,
            note_due: false,
        }
    }

    /// On a refusal by the window: remembered until everything counted up
    /// to now has left it, once per bucket (the ring's `noted` mark).
    #[inline(always)]
    fn note_refusal(&mut self) {
        if self.remember == Remember::Not || self.ring.is_null() {
            return;
        }
        let mark = self.epoch.wrapping_add(1);
        let noted = unsafe { &mut (*self.ring).noted as *mut u64 };
        if unsafe { core::ptr::read_volatile(noted) } == mark {
            return;
        }
        unsafe { core::ptr::write_volatile(noted, mark) };
        if self.remember == Remember::Caller {
            self.note_due = true;
            return;
        }
        let until = window::refused_until(&self.window, self.epoch);
        flowctl_remember_debt(self.rule_at, self.record, until, self.now, QUOTA_DOMAIN);
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
        let room = window::quota_admits(sum, cost, self.limit);
        if !room {
            self.note_refusal();
        }
        room
    }
}

/// Fills the ring just created for `key` (new, or back after the table
/// evicted it) while its key's last refusal by the window is remembered:
/// the rule's whole quota in the current bucket, so the key is refused
/// until that bucket has left the window. Every unit the old ring held was
/// counted by now, so this never admits more than it would have, and may
/// refuse up to a window longer (docs/algorithms.md 2.3). Called by
/// `flowctl_recall_debt` for `QUOTA_DOMAIN`, which has the key at hand
/// (a global function of its own would build and hash it once more, and
/// one more call deep did not fit the nested limits' call chain).
#[inline(always)]
pub fn fill_window(rule: &RuleConfig, key: &BucketKey, now: u64) {
    let window = window_of(rule);
    let epoch = window.epoch(now);
    let Some(ring) = FLOWCTL_QUOTAS.get_ptr_mut(key) else { return };
    let i = window::slot(epoch, window.slots());
    if let Some(w) = unsafe { (*ring).words.get_mut(i as usize) } {
        unsafe { core::ptr::write_volatile(w, window::pack(epoch, rule.quota_limit)) };
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
                self.note_refusal();
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
