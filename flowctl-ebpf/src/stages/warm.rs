//! Stage 4 of a rule with a warm-up ramp (`warm_up`, docs/algorithms.md
//! 1.8): the rule's one aggregate bucket, in its record's entry of
//! `FLOWCTL_WARM` (TAT and stored time), ramping from `rate / cold_factor`
//! to the rate as `flowctl_common::warm` computes. It runs beside the
//! decision in the nested limits' branch (`packed::NESTED`), so the
//! decision's paths gain no branch, and in a global function the verifier
//! walks once.
//!
//! The TAT moves by compare-and-swap, exactly as a plain bucket's does, so
//! no two CPUs spend the same time; the stored time follows with a
//! compare-and-swap of its own. A CPU that judged a packet on a stored
//! time another CPU moved meanwhile charges it at a slightly different
//! point of the ramp, never below `I` or above `c I` per unit: the rate's
//! bounds hold whatever the interleaving.

use crate::maps::{FLOWCTL_RULES, FLOWCTL_WARM};
use flowctl_common::{gcra, reason, warm::Ramp, CAS_RETRIES};

/// The warm-up bucket's verdict on a packet of `cost` units of the rule at
/// `rule_at`: 0 admitted; else 1 + the reason, as `flowctl_nested_admit`.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_warm_admit(rule_at: u32, record: u32, cost: u64, now: u64) -> u32 {
    let Some(rule) = FLOWCTL_RULES.get(rule_at) else { return 0 };
    let Some(b) = FLOWCTL_WARM.get_ptr_mut(record) else { return 0 };
    let ramp = Ramp { warm_ns: rule.warm_up_ns, cold_factor: rule.cold_factor as u64 };
    if rule.cold_factor < 2 || ramp.warm_ns == 0 {
        return 0;
    }
    unsafe {
        if core::ptr::read_volatile(&(*b).state_id) != rule.state_id {
            // A record this rule's state has not used yet: a cold bucket
            // (TAT 0, so all of `W` idle). CPUs racing here store the same.
            core::ptr::write_volatile(&mut (*b).tat, 0);
            core::ptr::write_volatile(&mut (*b).stored_ns, 0);
            core::ptr::write_volatile(&mut (*b).state_id, rule.state_id);
        }
    }
    let inc = gcra::increment_ns(rule.interval_fp, cost);
    let tat_ptr = unsafe { &mut (*b).tat as *mut u64 };
    let stored_ptr = unsafe { &mut (*b).stored_ns as *mut u64 };
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(tat_ptr) };
        let stored = unsafe { core::ptr::read_volatile(stored_ptr) };
        let Some(step) = ramp.admit(old, stored, now, inc, rule.burst_ns) else {
            return 1 + reason::RATE as u32;
        };
        let (_, ok) = unsafe { crate::atomic::cxchg(tat_ptr, old, step.tat) };
        if ok {
            settle_stored(&ramp, stored_ptr, &step);
            return 0;
        }
        tries += 1;
    }
    1 + reason::CONTENDED as u32
}

/// The stored time after an admission: what the winner of the TAT's swap
/// gained from the idle time and used. Lost to contention, the update is
/// skipped: the bucket then stays as cold as it was, which only admits less.
#[inline(always)]
fn settle_stored(ramp: &Ramp, stored_ptr: *mut u64, step: &flowctl_common::warm::Step) {
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let cur = unsafe { core::ptr::read_volatile(stored_ptr) };
        let (_, ok) = unsafe { crate::atomic::cxchg(stored_ptr, cur, ramp.after(cur, step)) };
        if ok {
            return;
        }
        tries += 1;
    }
}
