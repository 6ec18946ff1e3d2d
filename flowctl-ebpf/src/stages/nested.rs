//! Stage 4 of a rule with nested limits (`[[rule.limit]]`, docs/design.md
//! "Nested limits"): its own token bucket and up to `MAX_NESTED_LIMITS`
//! more, each with its own key kind, rate and burst, all of which a packet
//! must pass. Limit 0 is the rule's own bucket (its config is the rule's),
//! limit i > 0 the config at `nested_limit_at(rule_at, i - 1)`, with its
//! own state id (`nested_state_id`). Every one of their buckets lives in
//! the shared key table, so the rule's own bucket is not in the source's
//! cache entry here; their debts live in the rule's region of the debt
//! table, each under its own key. A quota comes after the limits, looked
//! at and committed at once in a function of its own
//! (`flowctl_nested_quota`); a full window has the limits give back.
//!
//! They compose as the other stages do, in two passes
//! (`flowctl_nested_admit`): first each limit whose key has a bucket takes
//! its token from it, and a key without one is only judged (from its
//! remembered debt); then the missing buckets are created, charged. A
//! refusal in either pass gives back what was taken, so a refused packet
//! keeps nothing, and it creates no bucket: a flood spread over keys
//! that one limit refuses does not fill the key table with the others'
//! (save when a bucket appears or empties between the passes, another
//! CPU's packet racing this one: those created before it then stay, their
//! tokens given back).
//! One lookup per limit on the common path (the buckets exist). The
//! price: between a take and its give-back (the same program run) another
//! CPU may find that token gone, which only ever refuses, never admits.
//!
//! The stage runs beside the decision, called from the entry point with the
//! decision's packed result (`packed::NESTED`), as the global rules' stage
//! does: the decision's frame (320 bytes) with this stage's and the debt
//! table's functions on top would pass the 512 bytes 6.1 allows a call
//! chain (it rounds each frame up to 32 bytes). Each limit's first pass,
//! take and give-back is a global function, verified once: inline, the loops over
//! four limits multiplied the paths the verifier walks (666k instructions
//! on 6.18 when tried). Inlining the debt table's work into them instead
//! of calling its functions cost 6.1 73k instructions more.

use super::{
    bucket::{flowctl_recall_debt, initial_tat, refuse_key_at, unmarked},
    quota::{remember_window, window_of, Quota, QuotaCommit, QuotaStage},
};
use crate::{
    accounting::{counters, flowctl_account, insert_failed},
    decision::{outcome_code, packed, Outcome},
    maps::{packet, LimitScratch, FLOWCTL_KEYS, FLOWCTL_LIMIT_SCRATCH, FLOWCTL_RULES},
};
use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns};
use flowctl_common::{
    action, bucket_table, debt::QUOTA_DOMAIN, gcra, keys::bucket_key, nested_limit_at, reason,
    unit, RuleConfig, CAS_RETRIES, MAX_NESTED_LIMITS,
};

/// Limits a rule with nested limits has at most: its own and the nested.
const MAX_LIMITS: u32 = 1 + MAX_NESTED_LIMITS as u32;

/// Decides, counts (`flowctl_account`) and packs, as the decision would
/// have, the packet the decision packed with `packed::NESTED`: a rule with
/// nested limits, a warm-up ramp, or its own table (`isolated`).
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_nested_decide(v: u64) -> u64 {
    let (record, rule_at) = (packed::record(v), packed::rule_at(v));
    let now = unsafe { bpf_ktime_get_ns() };
    let (Some(rule), Some(meta)) = (FLOWCTL_RULES.get(rule_at), packet()) else {
        return xdp_action::XDP_PASS as u64;
    };
    // What the rule's unit counts: the stages before let only SYNs of a
    // `connections` rule through to here.
    let cost = if rule.unit == unit::BYTES { meta.len as u64 } else { 1 };
    let verdict = if rule.bucket_table == bucket_table::OWN {
        super::isolated::flowctl_own_admit(rule_at, record, cost, now)
    } else if rule.cold_factor != 0 {
        super::warm::flowctl_warm_admit(rule_at, record, cost, now)
    } else {
        flowctl_nested_admit(rule_at, record, cost, now)
    };
    let outcome = match verdict {
        0 => Outcome::Pass,
        _ if rule.action == action::DRY_RUN => Outcome::WouldDrop,
        r => Outcome::Drop(r as usize - 1),
    };
    let c = outcome_code(outcome);
    let tcp = if meta.proto == 6 { meta.tcp_flags as u32 } else { 0 };
    let act = flowctl_account(record, c, meta.len as u64, tcp, now);
    packed::pack(act, c, record, rule_at, v & packed::SAMPLE != 0) | (v & (3 << 61))
}

/// What look and take return: 0 to go on, else 1 + the drop reason.
#[inline(always)]
const fn refused(why: usize) -> u32 {
    1 + why as u32
}

/// What one limit's take decides.
mod take {
    /// It took its token.
    pub const DONE: u32 = 0;
    /// It had no token for the packet.
    pub const REFUSED: u32 = 1;
    /// Its compare-and-swap lost `CAS_RETRIES` times.
    pub const CONTENDED: u32 = 2;
    /// First pass only: no bucket yet, and one would admit; the second
    /// pass creates it.
    pub const MISSING: u32 = 3;
}

/// Limit `i` of the rule at `rule_at`, with the CPU's scratch entry, in
/// which its key for the packet in flight is built (not on the stack: this
/// frame is in the middle of the chain).
#[inline(always)]
fn limit_and_scratch(rule_at: u32, i: u32) -> Option<(&'static RuleConfig, *mut LimitScratch)> {
    let at = if i == 0 { rule_at } else { nested_limit_at(rule_at, i - 1) };
    let limit = FLOWCTL_RULES.get(at)?;
    let meta = packet()?;
    let scratch = FLOWCTL_LIMIT_SCRATCH.get_ptr_mut(0)?;
    unsafe { (*scratch).key = bucket_key(meta, limit) };
    Some((limit, scratch))
}

/// Remembers the TAT limit `i`'s take wrote, for its give-back.
#[inline(always)]
fn note_written(scratch: *mut LimitScratch, i: u32, tat: u64) {
    if let Some(w) = unsafe { (*scratch).written.get_mut(i as usize) } {
        *w = tat;
    }
}

/// Limit `i`'s first pass: a bucket that exists is charged by
/// compare-and-swap (`take::DONE`), or refuses (`REFUSED`, its debt
/// remembered) or loses the race `CAS_RETRIES` times (`CONTENDED`); a key
/// without a bucket starts from its remembered debt, and is refused or
/// left to the second pass to create (`MISSING`): a refusal never creates
/// a bucket.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_limit_try(rule_at: u32, i: u32, record: u32, cost: u64, now: u64) -> u32 {
    let Some((limit, scratch)) = limit_and_scratch(rule_at, i) else { return take::DONE };
    let inc = gcra::increment_ns(limit.interval_fp, cost);
    match FLOWCTL_KEYS.get_ptr_mut(unsafe { &(*scratch).key }) {
        Some(tat_ptr) => charge(limit, record, tat_ptr, inc, now, scratch, i),
        None => {
            let start = initial_tat(limit.at, record, now);
            match gcra::admit(start, now, inc, limit.burst_ns) {
                Some(_) => take::MISSING,
                None => take::REFUSED,
            }
        }
    }
}

/// The limits' verdict on the packet in flight under the rule at
/// `rule_at` (0: admitted; else `refused(why)`), in the two passes above.
/// A refusing nested limit is counted (`limit_refusals`); a refusing
/// bucket's debt is remembered.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_nested_admit(rule_at: u32, record: u32, cost: u64, now: u64) -> u32 {
    let Some(rule) = FLOWCTL_RULES.get(rule_at) else { return 0 };
    let quota = rule.quota_bucket_ns != 0;
    let n = 1 + rule.nested as u32;
    // Limit i took its token: bit i.
    let mut taken = 0u32;
    let mut i = 0;
    while i < MAX_LIMITS {
        if i >= n {
            break;
        }
        match flowctl_limit_try(rule_at, i, record, cost, now) {
            take::DONE => taken |= 1 << i,
            take::MISSING => {}
            r => return refuse(rule_at, record, i, r, taken, cost),
        }
        i += 1;
    }
    let mut i = 0;
    while i < MAX_LIMITS {
        if i >= n {
            break;
        }
        if taken & 1 << i == 0 {
            let r = flowctl_limit_take(rule_at, i, record, cost, now);
            if r != take::DONE {
                return refuse(rule_at, record, i, r, taken, cost);
            }
            taken |= 1 << i;
        }
        i += 1;
    }
    // The quota last, looking and committing at once: a full window has
    // every limit give back. (Looking first as well, as for a rule without
    // limits, cost 6.1 47k instructions more in all; 21k this way.)
    if quota {
        let r = nested_window(rule, record, cost, now);
        if r != 0 {
            give_back_all(rule_at, taken, cost);
            return r;
        }
    }
    0
}

/// The rule's quota window (`quota::Quota`), for a rule that has one:
/// `cost` units counted into it if it has room, exactly, by
/// compare-and-swap (0; else `refused(QUOTA)` or `refused(CONTENDED)`). A
/// global function of its own: inline in `flowctl_nested_admit`, the
/// window's code made that frame 264 bytes, which with a limit's function
/// and the debt table's on top passed the 512 bytes of 6.1's call chain.
/// For the same reason it calls nothing itself (its own frame is 240
/// bytes): a ring it had to create comes back as `window::NEW` without a
/// decision (the caller recalls the key's debt, `flowctl_recall_debt`,
/// which fills the ring, and asks again with `window::AGAIN`), and a
/// refusal to remember carries `window::NOTE`.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_nested_quota(
    rule_at: u32,
    record: u32,
    cost: u64,
    now: u64,
    again: u32,
) -> u32 {
    let (Some(rule), Some(meta)) = (FLOWCTL_RULES.get(rule_at), packet()) else { return 0 };
    let (mut q, created) = Quota::of_nested(rule, meta, record, now);
    if created && again == 0 {
        return window::NEW;
    }
    if !q.has_room(cost) {
        let note = if q.first_refusal_in_bucket() { window::NOTE } else { 0 };
        return refused(reason::QUOTA) | note;
    }
    match q.commit(cost) {
        QuotaCommit::Done => 0,
        QuotaCommit::Full => refused(reason::QUOTA),
        QuotaCommit::Contended => refused(reason::CONTENDED),
    }
}

/// The quota window's answer to `flowctl_nested_admit`, beside
/// `refused(why)`.
mod window {
    /// The ring was just created: restore it, then ask again.
    pub const NEW: u32 = 1 << 30;
    /// A refusal the debt table does not hold yet (flag on the refusal).
    pub const NOTE: u32 = 1 << 31;
    /// `again` of the second call.
    pub const AGAIN: u32 = 1;
}

/// The quota stage of a rule with nested limits: `flowctl_nested_quota`'s
/// answer, with the window restored and the refusal remembered from here.
#[inline(always)]
fn nested_window(rule: &RuleConfig, record: u32, cost: u64, now: u64) -> u32 {
    let mut r = flowctl_nested_quota(rule.at, record, cost, now, 0);
    if r == window::NEW {
        // Fills the ring if the key's last refusal is remembered.
        flowctl_recall_debt(rule.at, record, now, QUOTA_DOMAIN);
        r = flowctl_nested_quota(rule.at, record, cost, now, window::AGAIN);
    }
    if r & window::NOTE != 0 {
        remember_window(rule.at, record, &window_of(rule), now);
    }
    r & !window::NOTE
}

/// Limit `i` could not take (`take::REFUSED` or `CONTENDED`): the limits
/// in `taken` give their tokens back, and the refusal is counted.
#[inline(always)]
fn refuse(rule_at: u32, record: u32, i: u32, r: u32, taken: u32, cost: u64) -> u32 {
    give_back_all(rule_at, taken, cost);
    if r == take::REFUSED {
        count_refusal(record, i);
        return refused(reason::RATE);
    }
    refused(reason::CONTENDED)
}

/// The limits in `taken` (bit i: limit i) give their tokens back.
#[inline(always)]
fn give_back_all(rule_at: u32, taken: u32, cost: u64) {
    let mut j = 0;
    while j < MAX_LIMITS {
        if taken & 1 << j != 0 {
            flowctl_limit_give_back(rule_at, j, cost);
        }
        j += 1;
    }
}

/// Limit `i`'s second pass (`take::*`): its bucket created charged; or, if
/// another CPU created it since the first pass, charged.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_limit_take(
    rule_at: u32,
    i: u32,
    record: u32,
    cost: u64,
    now: u64,
) -> u32 {
    let Some((limit, scratch)) = limit_and_scratch(rule_at, i) else { return take::DONE };
    let key = unsafe { &(*scratch).key };
    let inc = gcra::increment_ns(limit.interval_fp, cost);
    let tat_ptr = match FLOWCTL_KEYS.get_ptr_mut(key) {
        Some(p) => p,
        None => {
            let start = initial_tat(limit.at, record, now);
            let Some(first) = gcra::admit(start, now, inc, limit.burst_ns) else {
                return take::REFUSED;
            };
            // BPF_NOEXIST: if another CPU created the key first, charge its
            // bucket below.
            if FLOWCTL_KEYS.insert(key, &unmarked(first), 1).is_ok() {
                note_written(scratch, i, unmarked(first));
                if let Some(c) = counters(record) {
                    c.key_inserts += 1;
                }
                return take::DONE;
            }
            match FLOWCTL_KEYS.get_ptr_mut(key) {
                Some(p) => p,
                None => {
                    // The table refused the insert: admit, and say so (as
                    // a rule without nested limits does).
                    insert_failed(record);
                    return take::DONE;
                }
            }
        }
    };
    charge(limit, record, tat_ptr, inc, now, scratch, i)
}

/// Charges `inc` to limit `i`'s bucket at `tat_ptr` by compare-and-swap
/// (`take::*`), noting the TAT it wrote; a refusal remembers its debt.
#[inline(always)]
fn charge(
    limit: &RuleConfig,
    record: u32,
    tat_ptr: *mut u64,
    inc: u64,
    now: u64,
    scratch: *mut LimitScratch,
    i: u32,
) -> u32 {
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(tat_ptr) };
        let Some(new) = gcra::admit(old, now, inc, limit.burst_ns) else {
            refuse_key_at(limit.at, record, tat_ptr, old, now);
            return take::REFUSED;
        };
        let (_, ok) = unsafe { crate::atomic::cxchg(tat_ptr, old, unmarked(new)) };
        if ok {
            note_written(scratch, i, unmarked(new));
            return take::DONE;
        }
        tries += 1;
    }
    take::CONTENDED
}

/// Limit `i` gives back what is left of the token its take charged: the
/// part of [written - inc, written] still ahead of the clock, by
/// compare-and-swap. Not simply `inc`: if the bucket filled up again after
/// the take (its TAT passed, and another CPU's admission restarted it from
/// its own now), the token has already expired, and taking `inc` off would
/// erase that CPU's charge. Lost to contention, the token is lost, which
/// only ever admits less.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_limit_give_back(rule_at: u32, i: u32, cost: u64) -> u32 {
    let Some((limit, scratch)) = limit_and_scratch(rule_at, i) else { return 0 };
    let Some(&written) = (unsafe { (*scratch).written.get(i as usize) }) else { return 0 };
    let now = unsafe { bpf_ktime_get_ns() };
    let back = gcra::give_back(written, now, gcra::increment_ns(limit.interval_fp, cost));
    if back == 0 {
        return 0;
    }
    let Some(tat_ptr) = FLOWCTL_KEYS.get_ptr_mut(unsafe { &(*scratch).key }) else { return 0 };
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(tat_ptr) };
        let (_, ok) =
            unsafe { crate::atomic::cxchg(tat_ptr, old, unmarked(old.saturating_sub(back))) };
        if ok {
            break;
        }
        tries += 1;
    }
    0
}

/// One more refusal by limit `i`, counted when it is a nested one (the
/// rule's own are the `rate` drops less these). `get_mut`: an index the
/// compiler cannot bound would leave a panic call at the end of the
/// function, which the verifier rejects.
#[inline(always)]
fn count_refusal(record: u32, i: u32) {
    if i == 0 {
        return;
    }
    let slot = (i - 1) as usize;
    if let Some(n) = counters(record).and_then(|c| c.limit_refusals.get_mut(slot)) {
        *n += 1;
    }
}
