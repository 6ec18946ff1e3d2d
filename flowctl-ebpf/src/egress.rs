//! TC egress: counts packets and new TCP connections this host sends to the
//! downstream endpoints of KLimiter's `egress` baselines (the level of a
//! protected database, say). Never changes a verdict: every packet passes.

use crate::maps::{FLOWCTL_EGRESS_COUNTS, FLOWCTL_EGRESS_TARGETS};
use aya_ebpf::{macros::classifier, programs::TcContext};
use flowctl_common::{tcp_flags, EGRESS_COUNTERS_PER_TARGET, MAX_EGRESS_TARGETS};

/// TC_ACT_OK: the packet goes on.
const TC_ACT_OK: i32 = 0;

#[classifier]
pub fn flowctl_egress(ctx: TcContext) -> i32 {
    let _ = count(&ctx);
    TC_ACT_OK
}

#[inline(always)]
fn bytes<const N: usize>(ctx: &TcContext, off: usize) -> Option<[u8; N]> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if off > 128 || start + off + N > end {
        return None;
    }
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const [u8; N]) })
}

#[inline(always)]
fn count(ctx: &TcContext) -> Option<()> {
    let eth = bytes::<14>(ctx, 0)?;
    let ether_type = u16::from_be_bytes([eth[12], eth[13]]);
    let mut dst = [0u32; 4];
    let (family, proto, l4) = match ether_type {
        0x0800 => {
            let h = bytes::<20>(ctx, 14)?;
            let ihl = ((h[0] & 0x0f) as usize) * 4;
            // Later fragments carry no ports: not counted.
            if u16::from_be_bytes([h[6], h[7]]) & 0x1fff != 0 || ihl < 20 {
                return None;
            }
            dst[0] = u32::from_be_bytes([h[16], h[17], h[18], h[19]]);
            (4u8, h[9], 14 + ihl)
        }
        0x86dd => {
            let h = bytes::<40>(ctx, 14)?;
            let mut i = 0;
            while i < 4 {
                dst[i] = u32::from_be_bytes([
                    h[24 + i * 4],
                    h[25 + i * 4],
                    h[26 + i * 4],
                    h[27 + i * 4],
                ]);
                i += 1;
            }
            // Extension headers are not walked: such packets are not counted.
            (6u8, h[6], 14 + 40)
        }
        _ => return None,
    };
    if proto != 6 && proto != 17 {
        return None;
    }
    let ports = bytes::<4>(ctx, l4)?;
    let dport = u16::from_be_bytes([ports[2], ports[3]]);
    // A UDP datagram may be shorter than a TCP header: read the flags only
    // for TCP.
    let syn = proto == 6
        && bytes::<14>(ctx, l4)
            .is_some_and(|t| t[13] & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN);
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
