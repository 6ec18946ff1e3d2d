//! Stages 3 and 4 of a global rule (docs/fleet.md, "Global limits"): the
//! key's quota window and token bucket at the quota, rate and burst this
//! host's lease grants it, or at the rule's default share while it has
//! none. The grant lives in `FLOWCTL_GRANTS`, written by the agent; the
//! bucket keeps a copy it re-reads at most every `grant::REFRESH_NS`. A
//! source key's bucket lives in the source's cache entry, as a local
//! source-keyed rule's does, and its admissions are decided inline in the
//! decision ([`fast`]): one map lookup per packet like a local rule's (and
//! one more for a quota, as a local rule's quota does). Other key kinds'
//! buckets live in `FLOWCTL_GLOBAL_KEYS`. A new grant changes the rate and
//! depth, never the TAT: the bucket is not reset. Keys that are refused, or
//! that use more than half their default burst, are reported to the agent
//! (`FLOWCTL_HOT_KEYS`), at most every `grant::HOT_EVERY_NS` each, so it
//! asks for their leases; and every key counts what it offers, which the
//! agent reads as its demand.

use super::bucket::{debt_noted, initial_tat, refuse_key_at, unmarked, unmarked_down};
use super::quota::{NoQuota, Quota, QuotaCommit, QuotaStage};
use crate::{
    accounting::{counters, flowctl_account, insert_failed},
    decision::{outcome_code, packed, Decision, Outcome},
    maps::{
        packet, GlobalScratch, FLOWCTL_GLOBAL_KEYS, FLOWCTL_GLOBAL_SCRATCH, FLOWCTL_GRANTS,
        FLOWCTL_HOT_KEYS, FLOWCTL_LEASE_FILTER, FLOWCTL_REPORT_WINDOWS, FLOWCTL_RULES,
        FLOWCTL_SRC_CACHE,
    },
};
use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns};
use core::intrinsics::{atomic_xadd, AtomicOrdering};
use flowctl_common::{
    action, gcra, grant, key_kind, keys, keys::bucket_key, reason, unit, BucketKey, GlobalBucket,
    HotKey, PacketMeta, RuleConfig, SrcEntry, SrcKey, CAS_RETRIES,
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

/// A leased (or unleased) hot key's common case, inline in the decision
/// (`stages::enforce`), so it costs what a local source-keyed rule's packet
/// costs: one hash lookup (the source's cache entry, which holds the
/// bucket), no call, no key built. It decides only an admission that needs
/// nothing else: a source-keyed rule without a quota, whose bucket is in
/// the entry, with a copy of the grant still fresh, admitted by one
/// compare-and-swap and not due a hot-key report, or refused with its debt
/// already remembered and its report already made. Anything else (a first
/// refusal, a grant to re-read, a report, a lost swap) returns `None`
/// having changed nothing, and `flowctl_global_decide` decides it in full.
#[inline(always)]
pub fn fast(
    rule: &RuleConfig,
    meta: &PacketMeta,
    record: u32,
    entry: *mut SrcEntry,
    cost: u64,
    now: u64,
) -> Option<Decision> {
    if rule.key_kind != key_kind::SRC || rule.quota_bucket_ns != 0 || entry.is_null() {
        return None;
    }
    if unsafe { (*entry).owner_state } != rule.state_id {
        return None;
    }
    let b = unsafe { &mut (*entry).bucket };
    let word = match cached_grant(b, now) {
        Some(word) => word,
        // Due a re-read, but the key has no lease and the filter says none
        // was written since: a flood's keys and rarely seen ones stay here.
        None if no_lease_yet(b, &keys::source_key(meta, rule.state_id)) => grant::NO_LEASE,
        None => return None,
    };
    let (interval_fp, burst_ns, leased) = terms(rule, word);
    let tat_ptr = &mut b.tat as *mut u64;
    let old = unsafe { core::ptr::read_volatile(tat_ptr) };
    let Some(new) = gcra::admit(old, now, gcra::increment_ns(interval_fp, cost), burst_ns) else {
        // A refusal the full stage would only count: the debt is already
        // remembered and the key was reported hot within HOT_EVERY_NS.
        if !debt_noted(old) || (hot_due(b, now) && flowctl_take_report(record, now) != 0) {
            return None;
        }
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&mut b.offered, cost) };
        return Some(super::verdict(rule, reason::RATE));
    };
    let new = unmarked(new);
    if half_share_spent(leased, new, now, burst_ns) && hot_due(b, now) {
        return None;
    }
    let (_, ok) = unsafe { crate::atomic::cxchg(tat_ptr, old, new) };
    if !ok {
        return None;
    }
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&mut b.offered, cost) };
    Some(Decision::of(rule, Outcome::Pass))
}

/// The rate (as `interval_fp`) and depth (ns) the bucket runs at under the
/// grant `word`, and whether that is a lease (else the rule's default
/// share).
#[inline(always)]
fn terms(rule: &RuleConfig, word: u64) -> (u64, u64, bool) {
    match grant::decode(word) {
        Some((interval, units)) => (interval, gcra::increment_ns(interval, units), true),
        None => (rule.interval_fp, rule.burst_ns, false),
    }
}

/// The bucket's copy of its grant, while it needs no re-read: read within
/// `grant::REFRESH_NS`, and its lease (if any) not ended. A lease that
/// ended is re-read at once (and found ended), so the key goes back to its
/// default share on time, debt carried over.
#[inline(always)]
fn cached_grant(b: &GlobalBucket, now: u64) -> Option<u64> {
    let read = unsafe { core::ptr::read_volatile(&b.grant_read_ns) };
    let cached = unsafe { core::ptr::read_volatile(&b.grant) };
    let ends = unsafe { core::ptr::read_volatile(&b.grant_expires_ns) };
    let live = cached == grant::NO_LEASE || now < ends;
    (read != 0 && now.saturating_sub(read) <= grant::REFRESH_NS && live).then_some(cached)
}

/// Whether a bucket whose copy of its grant is "no lease" may keep it
/// without a re-read: the key's bit in the lease filter is clear, so no
/// grant is in `FLOWCTL_GRANTS` for it (the agent sets the bit before it
/// writes a grant). A lease the bucket holds is always re-read: its end
/// or cut must take effect within `grant::REFRESH_NS`.
#[inline(always)]
fn no_lease_yet(b: &GlobalBucket, key: &BucketKey) -> bool {
    let cached = unsafe { core::ptr::read_volatile(&b.grant) };
    cached == grant::NO_LEASE && !may_hold_lease(key)
}

/// Whether `key`'s bit in the lease filter is set (or cannot be read).
#[inline(always)]
fn may_hold_lease(key: &BucketKey) -> bool {
    let (word, bit) = grant::filter_slot(key);
    match FLOWCTL_LEASE_FILTER.get(word) {
        Some(w) => (unsafe { core::ptr::read_volatile(w) } & bit) != 0,
        None => true,
    }
}

/// Whether an admission at the default share (no lease) left the bucket
/// more than half spent (TAT `new`): the key is hot, and is reported so the
/// agent asks for its lease.
#[inline(always)]
fn half_share_spent(leased: bool, new: u64, now: u64, burst_ns: u64) -> bool {
    !leased && new.saturating_sub(now) > burst_ns / 2
}

/// Whether a refused key due a report may go to the full stage to make
/// it: at most `grant::REFUSED_REPORTS_PER_WINDOW` per rule record per CPU
/// per `grant::HOT_EVERY_NS` (1: it may). Past that it is refused inline,
/// still due. A global function taking and returning scalars, verified
/// once on its own: inline in the decision, its branches multiplied 6.1's
/// walk of everything after it (588k instructions against 374k).
#[no_mangle]
#[inline(never)]
pub fn flowctl_take_report(record: u32, now: u64) -> u32 {
    let Some(w) = FLOWCTL_REPORT_WINDOWS.get_ptr_mut(record) else { return 1 };
    let w = unsafe { &mut *w };
    if now.saturating_sub(w.start_ns) >= grant::HOT_EVERY_NS {
        w.start_ns = now;
        w.used = 0;
    }
    if w.used >= grant::REFUSED_REPORTS_PER_WINDOW {
        return 0;
    }
    w.used += 1;
    1
}

/// Whether the key may be reported hot now (`grant::HOT_EVERY_NS` apart).
#[inline(always)]
fn hot_due(b: &GlobalBucket, now: u64) -> bool {
    let last = unsafe { core::ptr::read_volatile(&b.hot_ns) };
    last == 0 || now.saturating_sub(last) >= grant::HOT_EVERY_NS
}

/// The bucket decision for a global rule's packet of `cost` units.
#[inline(always)]
fn admit(rule: &RuleConfig, meta: &PacketMeta, record: u32, cost: u64, now: u64) -> u32 {
    let Some(scratch) = FLOWCTL_GLOBAL_SCRATCH.get_ptr_mut(0) else { return code::PASS };
    unsafe { (*scratch).key = bucket_key(meta, rule) };
    let key = unsafe { &(*scratch).key };
    // A source key without a quota: its bucket in the source's cache entry
    // when the rule owns it or can claim it. Only this branch's body is
    // walked a second time by the verifier for a pointer into the entry
    // (6.1 walked the whole stage twice when every bucket could be in
    // either map: 130k more instructions).
    if rule.key_kind == key_kind::SRC && rule.quota_bucket_ns == 0 {
        if let Some(b) = entry_bucket(rule, meta, record, key, now) {
            let b = unsafe { &mut *b };
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&mut b.offered, cost) };
            let terms = terms(rule, current_grant(b, key, (rule.interval_fp, rule.burst_ns), now));
            return spend(b, (record, rule.at), key, cost, now, terms, &mut NoQuota);
        }
    }
    let Some(b) = table_bucket(scratch, rule, record, now) else {
        // The table refused the insert: admit, and say so (as local rules).
        insert_failed(record);
        return code::PASS;
    };
    let b = unsafe { &mut *b };
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&mut b.offered, cost) };
    let word = current_grant(b, key, (rule.interval_fp, rule.burst_ns), now);
    let (interval_fp, burst_ns, leased) = terms(rule, word);
    if rule.quota_bucket_ns == 0 {
        return spend(
            b,
            (record, rule.at),
            key,
            cost,
            now,
            (interval_fp, burst_ns, leased),
            &mut NoQuota,
        );
    }
    // Stage 3: the window at this host's quota share (the rule's default
    // share's without a lease), checked now, committed with the bucket's
    // swap as local rules' are.
    let limit = if leased {
        unsafe { core::ptr::read_volatile(&b.quota) }
    } else {
        rule.quota_limit as u64
    };
    let mut quota = Quota::of_share(rule, key, limit, record, now);
    if !quota.has_room(cost) {
        report_hot(b, record, key, grant::hot::REFUSED, now);
        return code::QUOTA;
    }
    spend(b, (record, rule.at), key, cost, now, (interval_fp, burst_ns, leased), &mut quota)
}

/// Stage 4: the bucket's compare-and-swap at the grant's (or default
/// share's) rate and depth, with the quota's commit between the look and
/// the swap (rolled back if the swap loses).
#[inline(always)]
fn spend(
    b: &mut GlobalBucket,
    (record, rule_at): (u32, u32),
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
            refuse_key_at(rule_at, record, tat_ptr, old, now);
            return code::RATE;
        };
        match quota.commit(cost) {
            QuotaCommit::Done => {}
            QuotaCommit::Full => return code::QUOTA,
            QuotaCommit::Contended => return code::CONTENDED,
        }
        let new = unmarked(new);
        let (_, ok) = unsafe { crate::atomic::cxchg(tat_ptr, old, new) };
        if ok {
            if half_share_spent(leased, new, now, burst_ns) {
                report_hot(b, record, key, grant::hot::HALF_SHARE, now);
            }
            return code::PASS;
        }
        quota.rollback(cost);
        tries += 1;
    }
    code::CONTENDED
}

/// A source key's bucket in its source's cache entry, as a local
/// source-keyed rule's is: the entry's when the rule owns it, claimed when
/// no rule does; `None` when another rule owns it (or the source has no
/// entry), and the key's bucket is in the key table.
#[inline(always)]
fn entry_bucket(
    rule: &RuleConfig,
    meta: &PacketMeta,
    record: u32,
    key: &BucketKey,
    now: u64,
) -> Option<*mut GlobalBucket> {
    let e = FLOWCTL_SRC_CACHE.get_ptr_mut(&SrcKey::of(meta))?;
    let owner = unsafe { (*e).owner_state };
    if owner == rule.state_id {
        return Some(unsafe { &mut (*e).bucket });
    }
    if owner != 0 {
        return None;
    }
    // Claim it (racing CPUs store the same values).
    let b = unsafe { &mut (*e).bucket };
    start(b, rule, record, key, now);
    unsafe { (*e).owner_state = rule.state_id };
    if let Some(c) = counters(record) {
        c.key_inserts += 1;
    }
    Some(b)
}

/// The key's bucket in `FLOWCTL_GLOBAL_KEYS`, made (from its remembered
/// debt) if it has none, in the CPU's scratch entry, as the key is (see
/// `GlobalScratch`).
#[inline(always)]
fn table_bucket(
    scratch: *mut GlobalScratch,
    rule: &RuleConfig,
    record: u32,
    now: u64,
) -> Option<*mut GlobalBucket> {
    let key = unsafe { &(*scratch).key };
    if let Some(p) = FLOWCTL_GLOBAL_KEYS.get_ptr_mut(key) {
        return Some(p);
    }
    let fresh = unsafe { &mut (*scratch).fresh };
    start(fresh, rule, record, key, now);
    // BPF_NOEXIST: if another CPU made it first, use that one.
    if FLOWCTL_GLOBAL_KEYS.insert(key, fresh, 1).is_ok() {
        if let Some(c) = counters(record) {
            c.key_inserts += 1;
        }
    }
    FLOWCTL_GLOBAL_KEYS.get_ptr_mut(key)
}

/// A new bucket: its remembered debt, no lease read yet; empty if the key
/// holds a lease here. Only a key that was hot here gets a lease, so a
/// leased key without a bucket lost it to eviction (a flood of new sources
/// in the source cache, or of keys in the key table), and its credit with
/// it: starting full at the default share would carry that share's burst
/// into the lease at the next re-read, units the store never granted.
/// Field by field: a struct literal is zero-filled through memset.
#[inline(always)]
fn start(b: &mut GlobalBucket, rule: &RuleConfig, record: u32, key: &BucketKey, now: u64) {
    let debt = initial_tat(rule.at, record, now);
    let leased = may_hold_lease(key)
        && matches!(unsafe { FLOWCTL_GRANTS.get(key) }, Some(g) if now < g.expires_ns);
    // Empty at the share's depth (the bucket's terms until its first
    // re-read), so the re-read carries no credit into the lease.
    let empty = unmarked_down(now.saturating_add(rule.burst_ns));
    b.tat = if leased && debt < empty { empty } else { debt };
    b.grant = grant::NO_LEASE;
    b.grant_read_ns = 0;
    b.grant_expires_ns = 0;
    b.offered = 0;
    b.hot_ns = 0;
    b.quota = 0;
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
    if let Some(word) = cached_grant(b, now) {
        return word;
    }
    if no_lease_yet(b, key) {
        return grant::NO_LEASE;
    }
    let cached = unsafe { core::ptr::read_volatile(&b.grant) };
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
            let (_, ok) = unsafe { crate::atomic::cxchg(&mut b.tat, tat, moved) };
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
    if !hot_due(b, now) {
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
