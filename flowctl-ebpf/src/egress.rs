//! TC egress: counts packets and new TCP connections this host sends to the
//! downstream endpoints of KLimiter's `egress` baselines (the level of a
//! protected database, say). Never changes a verdict: every packet passes.

use crate::maps::{FLOWCTL_EGRESS_COUNTS, FLOWCTL_EGRESS_TARGETS};
use aya_ebpf::{macros::classifier, programs::TcContext};
use flowctl_common::{EGRESS_COUNTERS_PER_TARGET, MAX_EGRESS_TARGETS};

/// TC_ACT_OK: the packet goes on.
const TC_ACT_OK: i32 = 0;

#[classifier]
pub fn flowctl_egress(ctx: TcContext) -> i32 {
    let _ = count(&ctx);
    TC_ACT_OK
}

#[inline(always)]
fn count(ctx: &TcContext) -> Option<()> {
    let p = crate::outbound::parse(ctx)?;
    // Later fragments and packets with IPv6 extension headers carry no
    // ports here: not counted.
    if !p.has_ports {
        return None;
    }
    let (family, proto, dport, dst, syn) = (p.family, p.proto, p.dport, p.dst, p.syn);
    let mut t = 0;
    while t < MAX_EGRESS_TARGETS as u32 {
        if let Some(target) = FLOWCTL_EGRESS_TARGETS.get(t) {
            if target.family == family
                && (target.proto == 0 || target.proto == proto)
                && dport >= target.port_lo
                && dport <= target.port_hi
                && flowctl_common::keys::in_prefix(&dst, &target.addr, target.prefix_len, family)
            {
                bump(t * EGRESS_COUNTERS_PER_TARGET as u32);
                if syn {
                    bump(t * EGRESS_COUNTERS_PER_TARGET as u32 + 1);
                }
            }
        }
        t += 1;
    }
    Some(())
}

#[inline(always)]
fn bump(i: u32) {
    if let Some(c) = FLOWCTL_EGRESS_COUNTS.get_ptr_mut(i) {
        unsafe { *c += 1 };
    }
}
