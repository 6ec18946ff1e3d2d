//! Stage 4: the key's token bucket (GCRA, algorithms.md section 1),
//! one TAT per key: in the source's cache entry for a source-keyed rule
//! that owns it, else in the shared key table (`FLOWCTL_KEYS`); an
//! isolated rule's, in its own table (`super::isolated`). A refused
//! key's debt is remembered in its own tagged way of `FLOWCTL_DEBT`
//! (`flowctl_common::debt`), so eviction never hands it a fresh burst and
//! no other key starts with it (docs/design.md, "Where bucket state lives").

use super::{
    quota::{window_full, window_slot, QuotaCommit, QuotaStage},
    sketch, verdict,
};
use crate::{
    accounting::{counters, insert_failed},
    decision::{Decision, Outcome},
    maps::{packet, FLOWCTL_DEBT, FLOWCTL_GLOBAL, FLOWCTL_KEYS, FLOWCTL_RULES},
};
use flowctl_common::{
    booking, bucket_table, debt, gcra, key_kind, keys::bucket_key, reason, PacketMeta, RuleConfig,
    SrcEntry, CAS_RETRIES,
};

/// Stage 4 (and the commit of stage 3): look at the bucket, commit the
/// quota, then create or swap the bucket.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn admit<Q: QuotaStage>(
    rule: &RuleConfig,
    meta: &PacketMeta,
    entry_ptr: *mut SrcEntry,
    record: u32,
    cost: u64,
    now: u64,
    quota: &mut Q,
) -> Decision {
    // Stage 4, look: the bucket's verdict on a read, before anything commits.
    let inc = gcra::increment_ns(rule.interval_fp, cost);
    let mut tat_ptr: *mut u64 = core::ptr::null_mut();
    let mut create: Option<u64> = None;
    if rule.bucket_table != bucket_table::NONE {
        match bucket_tat(rule, meta, entry_ptr, now) {
            BucketRef::Ptr(p) => {
                let old = unsafe { core::ptr::read_volatile(p) };
                if gcra::admit(old, now, inc, rule.burst_ns).is_none() {
                    return refuse_rate(rule, record, p, old, now);
                }
                tat_ptr = p;
            }
            BucketRef::Missing => {
                let start = sketch::flowctl_new_key(rule.at, record, now, inc, 1);
                if start == sketch::ADMITTED {
                    // A flooded rule's sketch admitted it (charged, and no
                    // bucket is made): the quota commits, and that is all.
                    // A path of its own to the end: joined to the bucket's
                    // below, it cost 6.1's verifier 232k instructions
                    // (466,256 against 234,342, 2026-12-07).
                    return match quota.commit(cost) {
                        QuotaCommit::Done => Decision::of(rule, Outcome::Pass),
                        QuotaCommit::Full => verdict(rule, reason::QUOTA),
                        QuotaCommit::Contended => verdict(rule, reason::CONTENDED),
                    };
                }
                // `REFUSED` (the sketch's) is `u64::MAX`, refused here too.
                let Some(first) = gcra::admit(start, now, inc, rule.burst_ns) else {
                    // Costlier than the whole bucket, or still in debt:
                    // refused without creating state.
                    return verdict(rule, reason::RATE);
                };
                create = Some(unmarked(first));
            }
        }
    }

    // Stage 3, commit: the quota (one compare-and-swap, exact).
    match quota.commit(cost) {
        QuotaCommit::Done => {}
        QuotaCommit::Full => return verdict(rule, reason::QUOTA),
        QuotaCommit::Contended => return verdict(rule, reason::CONTENDED),
    }

    // Stage 4, commit: create the bucket charged, or swap its TAT.
    if let Some(first) = create {
        let key = bucket_key(meta, rule);
        // BPF_NOEXIST: if another CPU created the key first, use its bucket.
        if FLOWCTL_KEYS.insert(&key, &first, 1 /* BPF_NOEXIST */).is_ok() {
            if let Some(c) = counters(record) {
                c.key_inserts += 1;
            }
            return Decision::of(rule, Outcome::Pass);
        }
        match FLOWCTL_KEYS.get_ptr_mut(&key) {
            Some(p) => tat_ptr = p,
            None => {
                // The table refused the insert: admit (the quota has counted
                // it) and say so.
                insert_failed(record);
            }
        }
    }
    if tat_ptr.is_null() {
        return Decision::of(rule, Outcome::Pass);
    }
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(tat_ptr) };
        let Some(new) = gcra::admit(old, now, inc, rule.burst_ns) else {
            // Another CPU took the last token between the look and the swap.
            quota.rollback(cost);
            return refuse_rate(rule, record, tat_ptr, old, now);
        };
        // Admitting moves the TAT: clear the mark by rounding up to even.
        let new = unmarked(new);
        let (_, ok) = unsafe { crate::atomic::cxchg(tat_ptr, old, new) };
        if ok {
            return Decision::of(rule, Outcome::Pass);
        }
        tries += 1;
    }
    quota.rollback(cost);
    verdict(rule, reason::CONTENDED)
}

/// Books the next token of the rule's bucket for a SYN it just refused
/// (`flowctl_common::booking::book`): the TAT moves as for an admission at
/// the slot, by compare-and-swap, and the slot is returned for the flow's
/// booking. None: nothing booked (no bucket, past the horizon, contended).
#[inline(always)]
pub(super) fn book(
    rule: &RuleConfig,
    meta: &PacketMeta,
    entry: *mut SrcEntry,
    now: u64,
) -> Option<u64> {
    let BucketRef::Ptr(tat_ptr) = bucket_tat(rule, meta, entry, now) else { return None };
    let inc = gcra::increment_ns(rule.interval_fp, 1);
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(tat_ptr) };
        let (new, slot) = booking::book(old, now, inc, rule.burst_ns, booking::HORIZON_NS)?;
        let (_, ok) = unsafe { crate::atomic::cxchg(tat_ptr, old, unmarked(new)) };
        if ok {
            return Some(slot);
        }
        tries += 1;
    }
    None
}

/// Gives back the token a flow had booked when it got in without its
/// booking (a token was free when its retransmission came): one charge per
/// admission, as if the booking had been redeemed. The TAT moves back by
/// one unit, by compare-and-swap; lost to contention, the token is lost
/// (never more admitted).
#[inline(always)]
pub(super) fn refund(rule: &RuleConfig, meta: &PacketMeta, entry: *mut SrcEntry, now: u64) {
    let BucketRef::Ptr(tat_ptr) = bucket_tat(rule, meta, entry, now) else { return };
    let inc = gcra::increment_ns(rule.interval_fp, 1);
    let old = unsafe { core::ptr::read_volatile(tat_ptr) };
    unsafe {
        let _ = crate::atomic::cxchg(tat_ptr, old, unmarked(old.saturating_sub(inc)));
    }
}

/// A token-bucket refusal. Bit 0 of a TAT marks "debt already remembered": a
/// key that keeps being refused pays for the debt table once, not per
/// packet. The mark makes the TAT 1 ns later, never earlier.
#[inline(always)]
fn refuse_rate(rule: &RuleConfig, record: u32, tat_ptr: *mut u64, old: u64, now: u64) -> Decision {
    // `refuse_key_at`'s body, written out: calling it here (inline, the
    // same logic) cost 6.1's verifier 7,834 instructions more (2026-12-04).
    if !debt_noted(old) {
        note_debt(rule.at, record, tat_ptr, old, now);
    }
    verdict(rule, reason::RATE)
}

/// The same for the global stage's bucket of the rule at `rule_at`.
#[inline(always)]
pub(super) fn refuse_key_at(rule_at: u32, record: u32, tat_ptr: *mut u64, old: u64, now: u64) {
    if !debt_noted(old) {
        note_debt(rule_at, record, tat_ptr, old, now);
    }
}

/// On a bucket's first refusal of an episode: its debt into the debt
/// table, and the mark.
#[inline(always)]
fn note_debt(rule_at: u32, record: u32, tat_ptr: *mut u64, old: u64, now: u64) {
    flowctl_remember_debt(rule_at, record, old, now, 0);
    unsafe {
        let _ = crate::atomic::cxchg(tat_ptr, old, old | DEBT_MARK);
    }
}

/// Writes the debt `tat` of the packet in flight's bucket under the rule at
/// `rule_at` (`FLOWCTL_RULES`) into its set (`debt::remember`); `domain`
/// is 0 for the bucket's debt, `debt::QUOTA_DOMAIN` for its window's. Global
/// functions, this and `flowctl_recall_debt`, and they build the key and
/// hash it themselves from the packet and the rule: inline, the hash over
/// the key's 44 bytes (314k instructions) and the seed's lookup (277k) were
/// verified once per path of every stage that creates or refuses a bucket,
/// and took 6.1 from 375k to 851k. Racing CPUs may lose one of two debts;
/// see `debt`.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_remember_debt(
    rule_at: u32,
    record: u32,
    tat: u64,
    now: u64,
    domain: u64,
) -> u32 {
    if let Some((set, tag)) = debt_way(rule_at, record, domain) {
        if let Some(s) = FLOWCTL_DEBT.get_ptr_mut(set) {
            debt::remember(unsafe { &mut *s }, tag, tat, now);
        }
    }
    0
}

/// The debt remembered for the packet in flight's bucket (or, with
/// `debt::QUOTA_DOMAIN`, its window) under the rule at `rule_at`, when it
/// is still in the future; else 0 (`debt::recall`). A window's debt also
/// fills the key's ring, just created (`quota::window_slot`): the slot is
/// found before the debt's lookup, and the key lives
/// only until it is hashed, so this frame stays within the call chain's
/// margin (flowctl/tests/stack_depth.rs).
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_recall_debt(rule_at: u32, record: u32, now: u64, domain: u64) -> u64 {
    let (Some(global), Some(rule), Some(meta)) =
        (FLOWCTL_GLOBAL.get(0), FLOWCTL_RULES.get(rule_at), packet())
    else {
        return 0;
    };
    let (slot, full, set, tag) = {
        let key = bucket_key(meta, rule);
        let slot = if domain == debt::QUOTA_DOMAIN {
            window_slot(&key, rule, now)
        } else {
            core::ptr::null_mut()
        };
        let (set, tag) = debt::locate(global.hash_seed, record, &key);
        (slot, window_full(rule, now), set, tag ^ domain)
    };
    let debt = match FLOWCTL_DEBT.get(set) {
        Some(s) => debt::recall(s, tag, now),
        None => 0,
    };
    if debt != 0 && !slot.is_null() {
        unsafe { core::ptr::write_volatile(slot, full) };
    }
    debt
}

/// The debt table's set and tag of the packet in flight's key under the
/// rule at `rule_at`, keyed by the load's random `hash_seed`, in `domain`.
#[inline(always)]
fn debt_way(rule_at: u32, record: u32, domain: u64) -> Option<(u32, u64)> {
    let global = FLOWCTL_GLOBAL.get(0)?;
    let rule = FLOWCTL_RULES.get(rule_at)?;
    let meta = packet()?;
    let (set, tag) = debt::locate(global.hash_seed, record, &bucket_key(meta, rule));
    Some((set, tag ^ domain))
}

enum BucketRef {
    Ptr(*mut u64),
    /// No bucket yet for this key: the caller creates it, charged. (The key
    /// is rebuilt there: moving it through the enum makes LLVM call memcpy.)
    Missing,
}

/// Where the rule's bucket for this packet lives. A source-keyed rule keeps its
/// bucket in the source's cache entry when it owns it (one map touch per
/// packet); every other bucket lives in the shared key table.
#[inline(always)]
fn bucket_tat(rule: &RuleConfig, meta: &PacketMeta, entry: *mut SrcEntry, now: u64) -> BucketRef {
    if rule.key_kind == key_kind::SRC && !entry.is_null() {
        let owner = unsafe { (*entry).owner_state };
        if owner == rule.state_id {
            return BucketRef::Ptr(unsafe { &mut (*entry).bucket.tat as *mut u64 });
        }
        if owner == 0 {
            // Claim the entry, starting from the key's remembered debt (a full
            // bucket when there is none). Two CPUs may race here; both store
            // the same values.
            let start = sketch::flowctl_new_key(rule.at, rule.record, now, 0, 0);
            unsafe {
                (*entry).bucket.tat = start;
                (*entry).owner_state = rule.state_id;
            }
            if let Some(c) = counters(rule.record) {
                c.source_claims += 1;
            }
            return BucketRef::Ptr(unsafe { &mut (*entry).bucket.tat as *mut u64 });
        }
    }
    let key = bucket_key(meta, rule);
    match FLOWCTL_KEYS.get_ptr_mut(&key) {
        Some(p) => BucketRef::Ptr(p),
        None => BucketRef::Missing,
    }
}

/// Bit 0 of a stored TAT: this bucket's current debt is in `FLOWCTL_DEBT`.
const DEBT_MARK: u64 = 1;

/// Whether a refused bucket's debt is already remembered (its mark is set).
#[inline(always)]
pub(super) fn debt_noted(tat: u64) -> bool {
    tat & DEBT_MARK != 0
}

/// A TAT with the debt mark clear, rounded up (later, so never more lenient).
#[inline(always)]
pub(super) fn unmarked(tat: u64) -> u64 {
    tat.saturating_add(1) & !DEBT_MARK
}

/// A re-rated TAT (`gcra::retarget`) with the debt mark clear, rounded
/// down: the 1 ns it gives is less than the fraction of a unit the re-rating
/// already rounded away, so no whole unit is ever added; rounding up would
/// take a whole unit from a bucket whose credit is exactly whole.
#[inline(always)]
pub(super) fn unmarked_down(tat: u64) -> u64 {
    tat & !DEBT_MARK
}

/// Where a bucket of the rule at `rule_at` starts, for the packet in flight:
/// the debt remembered for its key when that is still in the future, else
/// 0 (a full bucket).
#[inline(always)]
pub(super) fn initial_tat(rule_at: u32, record: u32, now: u64) -> u64 {
    flowctl_recall_debt(rule_at, record, now, 0)
}
