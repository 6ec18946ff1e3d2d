//! The end of a SYN's decision under a `connections` rule with
//! `book_retransmits` (docs/algorithms.md, 1.7), after its bucket judged it
//! in the decision: a SYN the bucket refused is admitted on its flow's due
//! booking, or else books the next token for its retransmission; a SYN the
//! bucket admitted while its flow held a booking gives the booked token
//! back. Either way every admission is charged once. A global function
//! beside the decision, like the global rules' stage, so its map work is
//! verified once and adds no path to the decision's.

use super::bucket;
use crate::{
    accounting::{counters, flowctl_account},
    decision::{outcome_code, packed, Outcome},
    maps::{packet, FLOWCTL_BOOKINGS, FLOWCTL_RULES, FLOWCTL_SRC_CACHE},
};
use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns};
use flowctl_common::{
    action,
    booking::{self, Redeem},
    keys::flow_key,
    reason, PacketMeta, RuleConfig, SrcEntry, SrcKey,
};

/// Finishes, counts and packs (as `flowctl_decide` would have) the SYN
/// whose bucket verdict `flowctl_decide` packed with `packed::BOOK`.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_book_decide(v: u64) -> u64 {
    let (record, rule_at) = (packed::record(v), packed::rule_at(v));
    let now = unsafe { bpf_ktime_get_ns() };
    let (Some(rule), Some(meta)) = (FLOWCTL_RULES.get(rule_at), packet()) else {
        return xdp_action::XDP_PASS as u64;
    };
    let judged = packed::outcome(packed::code(v));
    let c = outcome_code(finish(rule, meta, record, judged, now));
    let act = flowctl_account(record, c, meta.len as u64, meta.tcp_flags as u32, now);
    packed::pack(act, c, record, rule_at, v & packed::SAMPLE != 0) | (v & (3 << 61))
}

#[inline(always)]
fn finish(rule: &RuleConfig, meta: &PacketMeta, record: u32, judged: Outcome, now: u64) -> Outcome {
    let refused = match judged {
        Outcome::Pass => false,
        Outcome::Drop(why) if why == reason::RATE => true,
        // Contended, or dry-run (nothing is booked in dry-run).
        other => return other,
    };
    if rule.action == action::DRY_RUN {
        return judged;
    }
    let flow = flow_key(meta, rule.state_id);
    let slot = unsafe { FLOWCTL_BOOKINGS.get(&flow) }.copied();
    let entry: *mut SrcEntry = match FLOWCTL_SRC_CACHE.get_ptr_mut(&SrcKey::of(meta)) {
        Some(p) => p,
        None => core::ptr::null_mut(),
    };
    let Some(slot) = slot else {
        if refused {
            book(rule, meta, entry, record, &flow, now);
        }
        return judged;
    };
    // Only the CPU whose delete succeeds uses (or gives back) the booking.
    match (refused, booking::redeem(slot, now)) {
        (false, _) => {
            if FLOWCTL_BOOKINGS.remove(&flow).is_ok() {
                bucket::refund(rule, meta, entry, now);
            }
            Outcome::Pass
        }
        (true, Redeem::Early) => judged,
        (true, Redeem::Due) => {
            if FLOWCTL_BOOKINGS.remove(&flow).is_err() {
                return judged;
            }
            if let Some(c) = counters(record) {
                c.redeemed_syns += 1;
            }
            Outcome::Pass
        }
        (true, Redeem::Expired) => {
            let _ = FLOWCTL_BOOKINGS.remove(&flow);
            book(rule, meta, entry, record, &flow, now);
            judged
        }
    }
}

/// Books the next token for the refused SYN's retransmission: charged
/// first (`bucket::book`), so a booking never stands for a token that was
/// not charged.
#[inline(always)]
fn book(
    rule: &RuleConfig,
    meta: &PacketMeta,
    entry: *mut SrcEntry,
    record: u32,
    flow: &flowctl_common::BucketKey,
    now: u64,
) {
    if let Some(slot) = bucket::book(rule, meta, entry, now) {
        if FLOWCTL_BOOKINGS.insert(flow, &slot, 0).is_ok() {
            if let Some(c) = counters(record) {
                c.booked_syns += 1;
            }
        }
    }
}
