//! Rare events for the agent's log, through aya-log (target
//! `flowctl::kernel`, level debug): a malformed or evasive frame with its
//! first bytes, and a table that refused new buckets of a rule. At most one
//! of each kind per CPU per second (`SAMPLE_NS`).
//!
//! Off unless the agent's log asks for them (`FLOWCTL_LOG` enabling
//! `flowctl::kernel=debug`): the agent then loads the object with aya-log's
//! `AYA_LOG_LEVEL` at debug; otherwise it is 0, a load-time constant, and
//! the verifier drops every branch guarded by [`on`] as dead code, so the
//! per-packet path pays nothing (docs/design.md, "Kernel events").
//!
//! All of it happens in [`flowctl_events`], a function the entry calls
//! last: the stages are untouched (a table's refusal is seen as growth of
//! the rule's per-CPU `insert_failures` counter since this CPU last looked,
//! `FLOWCTL_EVENT_SEEN`), and aya-log's frame never joins their deep call
//! chains.

use crate::{
    accounting::counters,
    parse::{bytes, class},
};
use aya_ebpf::{
    bindings::xdp_md, helpers::bpf_ktime_get_ns, macros::map, maps::PerCpuArray,
    programs::XdpContext,
};
use aya_log_ebpf::{
    debug,
    macro_support::{level_enabled, Level},
};
use flowctl_common::{COUNTER_RECORDS, KERNEL_EVENTS_TARGET};

/// Bytes of a malformed or evasive frame's start the event carries (in
/// 8-byte words).
const FRAME_BYTES: usize = 64;
/// One event of a kind per CPU per this many ns.
const SAMPLE_NS: u64 = 1_000_000_000;

/// When this CPU last logged each kind, and the frame it copies.
#[repr(C)]
pub struct EventSlot {
    insert_logged_ns: u64,
    malformed_logged_ns: u64,
    evasive_logged_ns: u64,
    frame: [u8; FRAME_BYTES],
}

#[map]
static FLOWCTL_EVENTS: PerCpuArray<EventSlot> = PerCpuArray::with_max_entries(1, 0);
/// Per rule record: its `insert_failures` on this CPU when last looked at.
#[map]
static FLOWCTL_EVENT_SEEN: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(COUNTER_RECORDS as u32, 0);

/// Whether kernel events were asked for at load (a constant there).
#[inline(always)]
pub fn on() -> bool {
    level_enabled(Level::Debug)
}

/// Logs what this packet has to show (`parsed`: its parse class; `len`:
/// its bytes on the wire; `record`: its rule's counter record). Called by
/// the entry only when [`on`]. A global function, verified once on its
/// own: as a static one it was walked once per state reaching the entry's
/// end (one per combination of the stages beside the decision), which took
/// 6.1 from 314k to 539k processed instructions with events on. Newer
/// verifiers skip a global function that no reachable code calls (global
/// subprograms are verified lazily since 2023's kernels: the selftest
/// `global_func_dead_code`), so with events off they walk none of it; 6.1
/// verifies it once either way.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_events(ctx: *mut xdp_md, parsed: u32, len: u64, record: u32) -> u32 {
    let Some(s) = FLOWCTL_EVENTS.get_ptr_mut(0) else { return 0 };
    let s = unsafe { &mut *s };
    let now = unsafe { bpf_ktime_get_ns() };
    if let (Some(c), Some(seen)) = (counters(record), FLOWCTL_EVENT_SEEN.get_ptr_mut(record)) {
        let (failures, seen) = (c.insert_failures, unsafe { &mut *seen });
        if failures > *seen && now.wrapping_sub(s.insert_logged_ns) >= SAMPLE_NS {
            s.insert_logged_ns = now;
            let new = failures - *seen;
            *seen = failures;
            debug!(
                &(),
                target: KERNEL_EVENTS_TARGET,
                "rule record {}: its table refused {} new buckets on this CPU (admitted, counted in insert_failures)",
                record,
                new
            );
        }
    }
    let (what, logged) = match parsed {
        class::MALFORMED => ("malformed", &mut s.malformed_logged_ns),
        class::EVASIVE => ("evasive", &mut s.evasive_logged_ns),
        _ => return 0,
    };
    if now.wrapping_sub(*logged) < SAMPLE_NS {
        return 0;
    }
    *logged = now;
    // Whole 8-byte words, each read through the parser's bounds-checked
    // `bytes` (the form of check the verifier follows on every kernel).
    let ctx = XdpContext::new(ctx);
    let mut n = 0usize;
    let mut word = 0usize;
    while word < FRAME_BYTES / 8 {
        let w = match bytes::<8>(&ctx, word * 8) {
            Ok(w) => {
                n = word * 8 + 8;
                w
            }
            Err(()) => [0; 8],
        };
        s.frame[word * 8..word * 8 + 8].copy_from_slice(&w);
        word += 1;
    }
    let frame: &[u8] = &s.frame[..];
    debug!(
        &(),
        target: KERNEL_EVENTS_TARGET,
        "{} frame of {} bytes; its first {} (whole words, zero-padded to 64): {:x}",
        what,
        len,
        n,
        frame
    );
    0
}
