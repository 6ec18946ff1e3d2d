//! Stage 4 of an isolated rule (`isolate = true`, `bucket_table::OWN`):
//! the key's token bucket as in [`super::bucket`], in the rule's own LRU
//! hash (`FLOWCTL_RULE_TABLES`, at the rule's counter record) rather than
//! the shared tables, so no other rule's keys can evict it and its keys
//! evict none of theirs (docs/design.md, "Where bucket state lives").
//!
//! It runs beside the decision, as nested limits do
//! (`flowctl_nested_decide`, `packed::NESTED`): the decision's frame with
//! this one and the sketch's on top would pass the 512 bytes of stack 6.1
//! allows a call chain. A global function, so the inner map's pointer (a
//! third kind of map value beside the source cache's and the key table's)
//! multiplies no path of the decision. Isolated rules have no quota, nested
//! limits, ramp, booking, lease or BBR (the profile refuses those), so the
//! whole stage fits in here.

use super::{
    bucket::{refuse_key_at, unmarked},
    sketch,
};
use crate::{
    accounting::{counters, insert_failed},
    maps::{packet, FLOWCTL_LIMIT_SCRATCH, FLOWCTL_RULES, FLOWCTL_RULE_TABLES},
};
use flowctl_common::{gcra, keys::bucket_key, reason, CAS_RETRIES};

/// The own-table bucket's verdict on a packet of `cost` units of the rule
/// at `rule_at`: 0 admitted; else 1 + the reason, as
/// `flowctl_nested_admit`.
///
/// A rule whose table is not there is a rule of the slot an apply has just
/// retired (its table is dropped after the flip, so only a packet already
/// past the slot's choice meets this; an apply whose table cannot be made
/// fails before its flip): admitted without a bucket and counted as a
/// failed insert, as when its table refuses one.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_own_admit(rule_at: u32, record: u32, cost: u64, now: u64) -> u32 {
    let (Some(rule), Some(meta), Some(table)) =
        (FLOWCTL_RULES.get(rule_at), packet(), FLOWCTL_RULE_TABLES.get(record))
    else {
        insert_failed(record);
        return 0;
    };
    // The key in the CPU's scratch entry, not on this frame: the entry
    // point's, this one and the debt's or sketch's must stay within 512
    // bytes (232 with the key here: 560 in all). An isolated rule has no
    // nested limits, the scratch's other user.
    let Some(scratch) = FLOWCTL_LIMIT_SCRATCH.get_ptr_mut(0) else {
        insert_failed(record);
        return 0;
    };
    unsafe { (*scratch).key = bucket_key(meta, rule) };
    let key = unsafe { &(*scratch).key };
    let inc = gcra::increment_ns(rule.interval_fp, cost);
    let tat_ptr = match table.get_ptr_mut(key) {
        Some(p) => p,
        None => {
            // A new key (or one back after its own table evicted it): the
            // flood sketch if the rule was lent one, else its remembered
            // debt, else a full bucket, as in the shared tables.
            let start = sketch::flowctl_new_key(rule_at, record, now, inc, 1);
            if start == sketch::ADMITTED {
                return 0;
            }
            let Some(first) = gcra::admit(start, now, inc, rule.burst_ns) else {
                return 1 + reason::RATE as u32;
            };
            // BPF_NOEXIST: if another CPU created the key first, use its bucket.
            if table.insert(key, &unmarked(first), 1).is_ok() {
                if let Some(c) = counters(record) {
                    c.key_inserts += 1;
                }
                return 0;
            }
            match table.get_ptr_mut(key) {
                Some(p) => p,
                None => {
                    // The table refused the insert: admit and say so.
                    insert_failed(record);
                    return 0;
                }
            }
        }
    };
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(tat_ptr) };
        let Some(new) = gcra::admit(old, now, inc, rule.burst_ns) else {
            refuse_key_at(rule_at, record, tat_ptr, old, now);
            return 1 + reason::RATE as u32;
        };
        let (_, ok) = unsafe { crate::atomic::cxchg(tat_ptr, old, unmarked(new)) };
        if ok {
            return 0;
        }
        tries += 1;
    }
    1 + reason::CONTENDED as u32
}
