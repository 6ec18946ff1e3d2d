//! Counting: every offered packet against its counter record (the running
//! totals per rule and per drop reason in `FLOWCTL_COUNTERS`) and the
//! current bucket of the record's statistics ring (`FLOWCTL_STATS`; see
//! docs/design.md, "Statistics rings").

use crate::maps::{
    FLOWCTL_COUNTERS, FLOWCTL_STATS, FLOWCTL_STATS_BUCKETS, FLOWCTL_STATS_BUCKET_NS,
    FLOWCTL_STATS_CLOCK, FLOWCTL_STATS_LEVEL, FLOWCTL_STATS_RECORDS,
};
use aya_ebpf::bindings::xdp_action;
use flowctl_common::{stats, tcp_flags, RuleCounters, StatsBucket};

/// This CPU's running totals of a counter record (a rule's, or
/// `GLOBAL_COUNTER_INDEX`).
#[inline(always)]
pub fn counters(record: u32) -> Option<&'static mut RuleCounters> {
    FLOWCTL_COUNTERS.get_ptr_mut(record).map(|p| unsafe { &mut *p })
}

/// Counts one offered packet of `len` bytes against its record (the running
/// totals and the current bucket of its statistics ring) and returns the
/// XDP action. A real BPF-to-BPF call taking only scalars, with nothing of
/// the caller live after it: the verifier walks it once per distinct
/// outcome instead of once per path through the stages.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_account(record: u32, code: u32, len: u64, tcp: u32, now: u64) -> u32 {
    let dropped = code >= 2;
    let why = code.wrapping_sub(2) as usize;
    if let Some(c) = counters(record) {
        c.offered_pkts += 1;
        c.offered_bytes += len;
        if dropped {
            if let (Some(p), Some(b)) = (c.dropped_pkts.get_mut(why), c.dropped_bytes.get_mut(why))
            {
                *p += 1;
                *b += len;
            }
        } else {
            c.passed_pkts += 1;
            c.passed_bytes += len;
            if code == 1 {
                c.would_drop_pkts += 1;
                c.would_drop_bytes += len;
            }
        }
    }
    let action = if dropped { xdp_action::XDP_DROP } else { xdp_action::XDP_PASS };
    let level = FLOWCTL_STATS_LEVEL.load();
    if level == stats::level::OFF {
        return action;
    }
    let full = level == stats::level::FULL;
    // Per-CPU: only this CPU writes its copy, so plain stores are exact.
    // (Two 64-bit divisions per packet cost more than the rest of the ring
    // update: `current_stats` divides once per bucket and keeps the answer.)
    if let Some(b) = current_stats(record, now) {
        b.offered_pkts += 1;
        if !dropped {
            b.passed_pkts += 1;
        }
        if tcp as u8 & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN {
            b.syn_offered += 1;
            if !dropped {
                b.syn_passed += 1;
            }
        }
        if tcp as u8 & (tcp_flags::FIN | tcp_flags::RST) != 0 {
            b.fin_rst += 1;
        }
        if full {
            b.offered_bytes += len;
            if dropped {
                if let Some(p) = b.dropped_pkts.get_mut(why) {
                    *p += 1;
                }
            } else {
                b.passed_bytes += len;
                if code == 1 {
                    b.would_drop_pkts += 1;
                }
            }
        }
    }
    action
}

/// A table refused a new bucket (or quota window) of the rule at counter
/// `record`, whose packet is admitted: counted in `insert_failures` (which
/// the kernel events watch, `events::flowctl_events`).
#[inline(always)]
pub fn insert_failed(record: u32) {
    if let Some(c) = counters(record) {
        c.insert_failures += 1;
    }
}

/// This CPU's current bucket of a record's statistics ring, reset when
/// stale (also what `conntrack` counts arrivals, establishments and
/// completions in).
#[inline(always)]
pub fn current_stats(record: u32, now: u64) -> Option<&'static mut StatsBucket> {
    let clock = unsafe { &mut *FLOWCTL_STATS_CLOCK.get_ptr_mut(0)? };
    if now >= clock.end_ns || now < clock.start_ns {
        let width = FLOWCTL_STATS_BUCKET_NS.load();
        let epoch = stats::epoch_of(now, width);
        clock.epoch = epoch;
        clock.slot = stats::index(0, epoch, FLOWCTL_STATS_BUCKETS.load());
        clock.start_ns = (epoch - 1).wrapping_mul(width);
        clock.end_ns = clock.start_ns.wrapping_add(width);
    }
    let ring = stats::ring_record(record, FLOWCTL_STATS_RECORDS.load());
    let index = ring.wrapping_mul(FLOWCTL_STATS_BUCKETS.load()).wrapping_add(clock.slot);
    let b = unsafe { &mut *FLOWCTL_STATS.get_ptr_mut(index)? };
    if b.epoch != clock.epoch {
        reset_bucket(b, clock.epoch, FLOWCTL_STATS_LEVEL.load() == stats::level::FULL);
    }
    Some(b)
}

/// Zeroes a stale bucket field by field (a struct-wide zero fill becomes a
/// memset call the verifier cannot load); display-only fields only when kept.
#[inline(always)]
fn reset_bucket(b: &mut StatsBucket, epoch: u64, full: bool) {
    b.epoch = epoch;
    b.offered_pkts = 0;
    b.passed_pkts = 0;
    b.syn_offered = 0;
    b.syn_passed = 0;
    b.fin_rst = 0;
    b.established = 0;
    b.completed = 0;
    b.arrivals = 0;
    b.rt_count = 0;
    b.rt_sum_us = 0;
    if full {
        b.would_drop_pkts = 0;
        b.offered_bytes = 0;
        b.passed_bytes = 0;
        let mut i = 0;
        while i < b.dropped_pkts.len() {
            b.dropped_pkts[i] = 0;
            i += 1;
        }
    }
}
