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

/// The quota stage of one packet: its key's window ring and epoch, and
/// whether this packet has committed to it yet (so retries of the bucket's
/// compare-and-swap never count it twice). Where a refusal is remembered
/// is the callers' to say (`first_refusal_in_bucket`, `remember_window`):
/// as fields here they grew the decision's frame by 16 bytes, past the
/// call chain's margin (flowctl/tests/stack_depth.rs).
pub struct Quota {
    ring: *mut QuotaRing,
    window: Window,
    epoch: u64,
    limit: u64,
    /// The K full buckets' sum, from `has_room` (past buckets no longer change).
    past: u64,
    committed: bool,
}

/// The window geometry of a rule's quota.
#[inline(always)]
pub fn window_of(rule: &RuleConfig) -> Window {
    Window { bucket_ns: rule.quota_bucket_ns, buckets: rule.quota_buckets }
}

impl Quota {
    /// The ring for this packet's key under a local rule, created when
    /// missing and then filled while the key's last refusal by the window
    /// is remembered (`flowctl_recall_debt`). A table that refuses the insert
    /// leaves the quota unenforced for this packet (counted as an insert
    /// failure), like the key table.
    #[inline(always)]
    pub fn of(rule: &RuleConfig, meta: &PacketMeta, record: u32, now: u64) -> Self {
        let limit = rule.quota_limit as u64;
        Self::of_key(rule, &bucket_key(meta, rule), limit, (record, true), now).0
    }

    /// The same for a rule with nested limits, without the fill, and
    /// whether the ring was created: its caller (`flowctl_nested_admit`)
    /// recalls the debt, a call shallower, as the verifier's 512 bytes of
    /// call-chain stack need.
    #[inline(always)]
    pub fn of_nested(rule: &RuleConfig, meta: &PacketMeta, record: u32, now: u64) -> (Self, bool) {
        let limit = rule.quota_limit as u64;
        Self::of_key(rule, &bucket_key(meta, rule), limit, (record, false), now)
    }

    /// The ring of `key` (already made from the packet) with `limit` units
    /// per window, for a global rule's quota share: the fleet accounts for
    /// its window, so it is neither filled nor remembered.
    #[inline(always)]
    pub fn of_share(rule: &RuleConfig, key: &BucketKey, limit: u64, record: u32, now: u64) -> Self {
        Self::of_key(rule, key, limit, (record, false), now).0
    }

    #[inline(always)]
    fn of_key(
        rule: &RuleConfig,
        key: &BucketKey,
        limit: u64,
        (record, restore): (u32, bool),
        now: u64,
    ) -> (Self, bool) {
        let window = window_of(rule);
        let epoch = window.epoch(now);
        let key = *key;
        let mut created = false;
        let mut ring = FLOWCTL_QUOTAS.get_ptr_mut(&key).unwrap_or(core::ptr::null_mut());
        if ring.is_null() {
            if let Some(zero) = FLOWCTL_ZERO_RING.get(0) {
                let _ = FLOWCTL_QUOTAS.insert(&key, zero, 1 /* BPF_NOEXIST */);
            }
            created = true;
            if restore {
                // Fills the ring if the key's last refusal is remembered.
                flowctl_recall_debt(rule.at, record, now, QUOTA_DOMAIN);
            }
            ring = FLOWCTL_QUOTAS.get_ptr_mut(&key).unwrap_or(core::ptr::null_mut());
            if ring.is_null() {
                insert_failed(record);
            }
        }
        (Self { ring, window, epoch, limit, past: 0, committed: false }, created)
    }

    /// After `has_room` refused: marks the ring's `noted` word for this
    /// bucket, and says whether the refusal is the bucket's first, to be
    /// remembered (`remember_window`): once per key per bucket, not per
    /// packet.
    #[inline(always)]
    pub fn first_refusal_in_bucket(&self) -> bool {
        if self.ring.is_null() {
            return false;
        }
        let mark = self.epoch.wrapping_add(1);
        let noted = unsafe { &mut (*self.ring).noted as *mut u64 };
        if unsafe { core::ptr::read_volatile(noted) } == mark {
            return false;
        }
        unsafe { core::ptr::write_volatile(noted, mark) };
        true
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

/// Writes a window's refusal in the current bucket into the debt table,
/// lasting until the bucket has left the window (`window::refused_until`).
#[inline(always)]
pub fn remember_window(rule_at: u32, record: u32, window: &Window, now: u64) {
    let until = window::refused_until(window, window.epoch(now));
    flowctl_remember_debt(rule_at, record, until, now, QUOTA_DOMAIN);
}

/// For filling a ring just created (new, or back after the table evicted
/// it) whose key's last refusal by the window is still remembered: the
/// current bucket's slot (null: no ring), into which `flowctl_recall_debt`
/// writes `window_full` when it finds the debt, so the key is refused
/// until that bucket has left the window. Every unit the old ring held was
/// counted by now, so this never admits more than it would have, and may
/// refuse up to a window longer (docs/algorithms.md 2.3).
#[inline(always)]
pub fn window_slot(key: &BucketKey, rule: &RuleConfig, now: u64) -> *mut u64 {
    let Some(ring) = FLOWCTL_QUOTAS.get_ptr_mut(key) else { return core::ptr::null_mut() };
    let window = window_of(rule);
    let i = window::slot(window.epoch(now), window.slots());
    match unsafe { (*ring).words.get_mut(i as usize) } {
        Some(w) => w as *mut u64,
        None => core::ptr::null_mut(),
    }
}

/// The word of a slot that holds the rule's whole quota in the current
/// bucket.
#[inline(always)]
pub fn window_full(rule: &RuleConfig, now: u64) -> u64 {
    window::pack(window_of(rule).epoch(now), rule.quota_limit)
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
                // Filled by another CPU since `has_room`: not remembered
                // from here; the key's next packet is refused by
                // `has_room`, whose caller remembers it.
                return QuotaCommit::Full;
            }
            let new = window::bumped(old, self.epoch, cost as u32);
            let (_, ok) = unsafe { crate::atomic::cxchg(cur, old, new) };
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
                let _ = crate::atomic::cxchg(cur, old, window::pack(self.epoch, c - cost as u32));
            }
        }
        self.committed = false;
    }
}
