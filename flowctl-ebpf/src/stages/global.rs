//! Stages 3 and 4 of a global rule (docs/fleet.md, "Global limits"): the
//! key's quota window and token bucket at the quota, rate and burst this
//! host's lease grants it, or at the rule's default share while it has
//! none. The grant lives in `FLOWCTL_GRANTS`, written by the agent; the
//! bucket keeps a copy it re-reads at most every `grant::REFRESH_NS`, so a
//! hot key costs one map lookup per packet like a local rule's (and one
//! more for a quota, as a local rule's quota does). A new grant changes the
//! rate and depth, never the TAT: the bucket is not reset. Keys that are refused, or
//! that use more than half their default burst, are reported to the agent
//! (`FLOWCTL_HOT_KEYS`), at most every `grant::HOT_EVERY_NS` each, so it
//! asks for their leases; and every key counts what it offers, which the
//! agent reads as its demand.

use super::bucket::{initial_tat, refuse_key_at, unmarked, unmarked_down};
use super::quota::{NoQuota, Quota, QuotaCommit, QuotaStage};
use crate::{
    accounting::{counters, flowctl_account},
    decision::{outcome_code, packed, Outcome},
    maps::{
        packet, GlobalScratch, FLOWCTL_GLOBAL_KEYS, FLOWCTL_GLOBAL_SCRATCH, FLOWCTL_GRANTS,
        FLOWCTL_HOT_KEYS, FLOWCTL_RULES,
    },
};
use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns};
use core::intrinsics::{atomic_cxchg, atomic_xadd, AtomicOrdering};
use flowctl_common::{
    action, gcra, grant, keys::bucket_key, reason, unit, BucketKey, GlobalBucket, HotKey,
    PacketMeta, RuleConfig, CAS_RETRIES,
};

/// What [`admit`] decides.
mod code {
    pub const PASS: u32 = 0;
    pub const RATE: u32 = 1;
    pub const CONTENDED: u32 = 2;
    pub const QUOTA: u32 = 3;
}

/// Finishes the decision `flowctl_decide` left to a global rule's bucket
/// (`v`, packed with `packed::GLOBAL`): the bucket's verdict, counted
/// (`flowctl_account`), packed as the decision would have. A global
/// function called from the entry point, taking and returning one scalar,
/// so its frame is a sibling of the decision's, not stacked on it (6.1
/// counts the combined chain against 512 bytes).
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_global_decide(v: u64) -> u64 {
    let (record, rule_at) = (packed::record(v), packed::rule_at(v));
    let now = unsafe { bpf_ktime_get_ns() };
    let (Some(rule), Some(meta)) = (FLOWCTL_RULES.get(rule_at), packet()) else {
        return xdp_action::XDP_PASS as u64;
    };
    // What the rule's unit counts: the stages before let only SYNs of a
    // `connections` rule through to here.
    let cost = if rule.unit == unit::BYTES { meta.len as u64 } else { 1 };
    let outcome = match admit(rule, meta, record, cost, now) {
        code::PASS => Outcome::Pass,
        _ if rule.action == action::DRY_RUN => Outcome::WouldDrop,
        code::CONTENDED => Outcome::Drop(reason::CONTENDED),
        code::QUOTA => Outcome::Drop(reason::QUOTA),
        _ => Outcome::Drop(reason::RATE),
    };
    let c = outcome_code(outcome);
    let tcp = if meta.proto == 6 { meta.tcp_flags as u32 } else { 0 };
    let act = flowctl_account(record, c, meta.len as u64, tcp, now);
    packed::pack(act, c, record, rule_at, v & packed::SAMPLE != 0) | (v & (3 << 61))
}

/// The bucket decision for a global rule's packet of `cost` units.
#[inline(always)]
fn admit(rule: &RuleConfig, meta: &PacketMeta, record: u32, cost: u64, now: u64) -> u32 {
    let Some(scratch) = FLOWCTL_GLOBAL_SCRATCH.get_ptr_mut(0) else { return code::PASS };
    unsafe { (*scratch).key = bucket_key(meta, rule) };
    let key = unsafe { &(*scratch).key };
    let Some(b) = bucket(scratch, record, now) else {
        // The table refused the insert: admit, and say so (as local rules).
        if let Some(c) = counters(record) {
            c.insert_failures += 1;
        }
        return code::PASS;
    };
    let b = unsafe { &mut *b };
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&mut b.offered, cost) };
    let word = current_grant(b, key, (rule.interval_fp, rule.burst_ns), now);
    let (interval_fp, burst_ns, leased) = match grant::decode(word) {
        Some((interval, units)) => (interval, gcra::increment_ns(interval, units), true),
        None => (rule.interval_fp, rule.burst_ns, false),
    };
    if rule.quota_bucket_ns == 0 {
        return spend(b, record, key, cost, now, (interval_fp, burst_ns, leased), &mut NoQuota);
    }
    // Stage 3: the window at this host's quota share (the rule's default
    // share's without a lease), checked now, committed with the bucket's
    // swap as local rules' are.
    let limit = if leased {
        unsafe { core::ptr::read_volatile(&b.quota) }
    } else {
        rule.quota_limit as u64
    };
    let mut quota = Quota::of_key(rule, key, limit, record, now);
    if !quota.has_room(cost) {
        report_hot(b, record, key, grant::hot::REFUSED, now);
        return code::QUOTA;
    }
    spend(b, record, key, cost, now, (interval_fp, burst_ns, leased), &mut quota)
}

/// Stage 4: the bucket's compare-and-swap at the grant's (or default
/// share's) rate and depth, with the quota's commit between the look and
/// the swap (rolled back if the swap loses).
#[inline(always)]
fn spend(
    b: &mut GlobalBucket,
    record: u32,
    key: &BucketKey,
    cost: u64,
    now: u64,
    (interval_fp, burst_ns, leased): (u64, u64, bool),
    quota: &mut impl QuotaStage,
) -> u32 {
    let inc = gcra::increment_ns(interval_fp, cost);
    let tat_ptr = &mut b.tat as *mut u64;
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(tat_ptr) };
        let Some(new) = gcra::admit(old, now, inc, burst_ns) else {
            report_hot(b, record, key, grant::hot::REFUSED, now);
            refuse_key_at(record, key, tat_ptr, old);
            return code::RATE;
        };
        match quota.commit(cost) {
            QuotaCommit::Done => {}
            QuotaCommit::Full => return code::QUOTA,
            QuotaCommit::Contended => return code::CONTENDED,
        }
        let new = unmarked(new);
        let (_, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                tat_ptr, old, new,
            )
        };
        if ok {
            if !leased && new.saturating_sub(now) > burst_ns / 2 {
                report_hot(b, record, key, grant::hot::HALF_SHARE, now);
            }
            return code::PASS;
        }
        quota.rollback(cost);
        tries += 1;
    }
    code::CONTENDED
}

/// The key's bucket, made (from its remembered debt) if it has none, in
/// the CPU's scratch entry, as the key is (see `GlobalScratch`).
#[inline(always)]
fn bucket(scratch: *mut GlobalScratch, record: u32, now: u64) -> Option<*mut GlobalBucket> {
    let key = unsafe { &(*scratch).key };
    if let Some(p) = FLOWCTL_GLOBAL_KEYS.get_ptr_mut(key) {
        return Some(p);
    }
    // Field by field: a struct literal is zero-filled through memset.
    let fresh = unsafe { &mut (*scratch).fresh };
    fresh.tat = initial_tat(record, key, now);
    fresh.grant = grant::NO_LEASE;
    fresh.grant_read_ns = 0;
    fresh.offered = 0;
    fresh.hot_ns = 0;
    fresh.quota = 0;
    fresh.grant_expires_ns = 0;
    // BPF_NOEXIST: if another CPU made it first, use that one.
    if FLOWCTL_GLOBAL_KEYS.insert(key, fresh, 1).is_ok() {
        if let Some(c) = counters(record) {
            c.key_inserts += 1;
        }
    }
    FLOWCTL_GLOBAL_KEYS.get_ptr_mut(key)
}

/// The key's grant word: the bucket's copy, re-read from the map when it is
/// older than `grant::REFRESH_NS` (with the quota share and the lease's end
/// beside it), or at once when the cached lease has ended. Racing CPUs
/// store the same word or a newer one, each a single 8-byte store. When the
/// word changed, the bucket's credit is carried over in whole units, capped
/// at the new depth (`gcra::retarget`, docs/design.md C3), so a new lease
/// never mints a burst: a key's first lease starts from what its default
/// share had left (nothing with `default_share = "none"`).
#[inline(always)]
fn current_grant(b: &mut GlobalBucket, key: &BucketKey, share: (u64, u64), now: u64) -> u64 {
    let read = unsafe { core::ptr::read_volatile(&b.grant_read_ns) };
    let cached = unsafe { core::ptr::read_volatile(&b.grant) };
    let ends = unsafe { core::ptr::read_volatile(&b.grant_expires_ns) };
    // A lease that ended is re-read at once (and found ended), so the key
    // goes back to its default share on time, debt carried over.
    let live = cached == grant::NO_LEASE || now < ends;
    if read != 0 && now.saturating_sub(read) <= grant::REFRESH_NS && live {
        return cached;
    }
    let (word, quota, expires) = match unsafe { FLOWCTL_GRANTS.get(key) } {
        Some(g) if now < g.expires_ns => (g.word, g.quota, g.expires_ns),
        _ => (grant::NO_LEASE, 0, 0),
    };
    if word != cached {
        let params =
            |w: u64| grant::decode(w).map_or(share, |(i, units)| (i, gcra::increment_ns(i, units)));
        let (from, to) = (params(cached), params(word));
        // One compare-and-swap, no loop (a loop multiplied the re-rating's
        // branches by its tries on 6.1's verifier): a TAT another CPU moved
        // meanwhile leaves the old word in place, and the next packet
        // re-rates from where it moved to.
        let tat = unsafe { core::ptr::read_volatile(&b.tat) };
        let moved = unmarked_down(gcra::retarget(tat, now, from, to));
        if moved != tat {
            let (_, ok) = unsafe {
                atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                    &mut b.tat, tat, moved,
                )
            };
            if !ok {
                return cached;
            }
        }
    }
    unsafe {
        core::ptr::write_volatile(&mut b.quota, quota);
        core::ptr::write_volatile(&mut b.grant_expires_ns, expires);
        core::ptr::write_volatile(&mut b.grant, word);
        core::ptr::write_volatile(&mut b.grant_read_ns, now);
    }
    word
}

/// Tells the agent about a hot key, at most every `grant::HOT_EVERY_NS`
/// per key (a full ring drops the report; the next one comes later).
#[inline(always)]
fn report_hot(b: &mut GlobalBucket, record: u32, key: &BucketKey, why: u32, now: u64) {
    let last = unsafe { core::ptr::read_volatile(&b.hot_ns) };
    if last != 0 && now.saturating_sub(last) < grant::HOT_EVERY_NS {
        return;
    }
    unsafe { core::ptr::write_volatile(&mut b.hot_ns, now) };
    if let Some(mut entry) = FLOWCTL_HOT_KEYS.reserve::<HotKey>(0) {
        let h = entry.as_mut_ptr();
        unsafe {
            (*h).record = record;
            (*h).why = why;
            (*h).key = *key;
        }
        entry.submit(0);
    }
}
