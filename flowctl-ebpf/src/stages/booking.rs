//! The bucket stage of a `connections` rule with `book_retransmits`
//! (docs/algorithms.md, 1.7): a SYN whose flow holds a due booking is
//! admitted on it, charged nothing more; any other SYN goes to the rule's
//! bucket as usual, and one the bucket refuses books the next token for
//! its retransmission (`flowctl_common::booking`) in `FLOWCTL_BOOKINGS`.
//! A global function beside the decision, like the global rules' stage,
//! so its map work is verified once and adds no path to the decision's.

use super::bucket;
use super::quota::NoQuota;
use crate::{
    accounting::{counters, flowctl_account},
    decision::{outcome_code, packed, Outcome},
    maps::{packet, FLOWCTL_BOOKINGS, FLOWCTL_RULES, FLOWCTL_SRC_CACHE},
};
use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns};
use flowctl_common::{
    booking::{self, Redeem},
    keys::flow_key,
    reason, PacketMeta, RuleConfig, SrcEntry, SrcKey,
};

/// Decides, counts and packs (as `flowctl_decide` would have) the SYN that
/// `flowctl_decide` left to this stage (`v`, packed with `packed::BOOK`).
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_book_decide(v: u64) -> u64 {
    let (record, rule_at) = (packed::record(v), packed::rule_at(v));
    let now = unsafe { bpf_ktime_get_ns() };
    let (Some(rule), Some(meta)) = (FLOWCTL_RULES.get(rule_at), packet()) else {
        return xdp_action::XDP_PASS as u64;
    };
    let c = outcome_code(decide(rule, meta, record, now));
    let act = flowctl_account(record, c, meta.len as u64, meta.tcp_flags as u32, now);
    packed::pack(act, c, record, rule_at, v & packed::SAMPLE != 0) | (v & (3 << 61))
}

#[inline(always)]
fn decide(rule: &RuleConfig, meta: &PacketMeta, record: u32, now: u64) -> Outcome {
    let flow = flow_key(meta, rule.state_id);
    if let Some(slot) = unsafe { FLOWCTL_BOOKINGS.get(&flow) } {
        match booking::redeem(*slot, now) {
            Redeem::Early => return Outcome::Drop(reason::RATE),
            // Only the CPU whose delete succeeds admits on the booking.
            Redeem::Due if FLOWCTL_BOOKINGS.remove(&flow).is_ok() => {
                if let Some(c) = counters(record) {
                    c.redeemed_syns += 1;
                }
                return Outcome::Pass;
            }
            Redeem::Due => return Outcome::Drop(reason::RATE),
            Redeem::Expired => {
                let _ = FLOWCTL_BOOKINGS.remove(&flow);
            }
        }
    }
    let entry: *mut SrcEntry = match FLOWCTL_SRC_CACHE.get_ptr_mut(&SrcKey::of(meta)) {
        Some(p) => p,
        None => core::ptr::null_mut(),
    };
    let d = bucket::admit(rule, meta, entry, record, 1, now, &mut NoQuota);
    match d.outcome {
        Outcome::Drop(why) if why == reason::RATE => {}
        other => return other,
    }
    // Refused by the rate: book the next token, charged now (before the
    // booking exists, so a booking never stands for an uncharged token).
    if let Some(slot) = bucket::book(rule, meta, entry, now) {
        if FLOWCTL_BOOKINGS.insert(&flow, &slot, 0).is_ok() {
            if let Some(c) = counters(record) {
                c.booked_syns += 1;
            }
        }
    }
    Outcome::Drop(reason::RATE)
}
