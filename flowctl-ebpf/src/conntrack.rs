//! BBR rules' connection work after the decision (docs/design.md,
//! "BBR at L4"): tracking each TCP connection from its SYN to its FIN
//! or RST (arrivals, establishments, completions and their round trips, in
//! the statistics ring and the open-connection ring the agent sums), and
//! the RST reply to a SYN the BBR stage refused.

use crate::{
    accounting::current_stats,
    maps::{packet, FLOWCTL_CONNS, FLOWCTL_CONTROL, FLOWCTL_OPEN},
    parse,
};
use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::bpf_ktime_get_ns,
    programs::XdpContext,
};
use core::intrinsics::AtomicOrdering;
use flowctl_common::{
    conn_state, tcp_flags, window, BucketKey, ConnEntry, PacketMeta, CAS_RETRIES, OPEN_BUCKETS,
    OPEN_BUCKET_NS,
};

/// Connection work for a BBR rule's TCP packet: the RST reply to a refused
/// SYN (`reply`; returns the XDP action), else tracking. A global function
/// reading the headers from `FLOWCTL_PACKET` (see `flowctl_sample_key`).
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_connection(ctx: *mut xdp_md, record: u32, code: u32, reply: u32) -> u32 {
    connection::<true>(ctx, record, code, reply)
}

/// `flowctl_connection` for the dispatcher component (`flowctl_xdp_multiprog`):
/// the RST reply keeps the frame's length (no `bpf_xdp_adjust_tail`), since
/// the kernel refuses an extension that changes packet data in place of a
/// dispatcher slot that does not (Linux 6.13, backported to 6.12 and seen
/// on Debian's 6.12.118: "Extension program changes packet data, while
/// original does not"). The reply's IP length says where it ends; the
/// SYN's option bytes after it are padding every stack ignores.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_connection_in_place(
    ctx: *mut xdp_md,
    record: u32,
    code: u32,
    reply: u32,
) -> u32 {
    connection::<false>(ctx, record, code, reply)
}

#[inline(always)]
fn connection<const CUT: bool>(ctx: *mut xdp_md, record: u32, code: u32, reply: u32) -> u32 {
    let c = XdpContext::new(ctx);
    let Some(meta) = packet() else { return xdp_action::XDP_DROP };
    if meta.proto != 6 {
        return xdp_action::XDP_DROP;
    }
    if reply != 0 {
        return reset::<CUT>(&c, meta);
    }
    track(meta, record, code);
    xdp_action::XDP_PASS
}

/// Follows the TCP connections of BBR rules (algorithms.md section 4, at
/// L4): the first admitted SYN of a tuple is an arrival (retransmissions are
/// not), the client's handshake-completing ACK establishes (counted in the
/// open ring's current epoch and the statistics ring), FIN or RST completes
/// (taken off the epoch it was established in, counted with its lifetime as
/// the round trip).
#[inline(always)]
fn track(meta: &PacketMeta, record: u32, code: u32) {
    let now = unsafe { bpf_ktime_get_ns() };
    let key = conn_key(meta, record);
    let flags = meta.tcp_flags;
    let syn = flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN;
    let entry = FLOWCTL_CONNS.get_ptr_mut(&key);
    if syn {
        if code == 0 && entry.is_none() {
            let e = ConnEntry { syn_ns: now, open_epoch: 0, state: conn_state::SYN_SEEN };
            if FLOWCTL_CONNS.insert(&key, &e, 1 /* BPF_NOEXIST */).is_ok() {
                if let Some(b) = current_stats(record, now) {
                    b.arrivals += 1;
                }
            }
        }
        return;
    }
    let Some(e) = entry else { return };
    let e = unsafe { &mut *e };
    if flags & (tcp_flags::FIN | tcp_flags::RST) != 0 {
        // Out of flight: take it off the kernel's count since the agent's
        // last tick (the SYN, or the agent's sum, counted it).
        if let Some(ctl) = FLOWCTL_CONTROL.get_ptr_mut(record) {
            unsafe {
                core::intrinsics::atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(
                    &mut (*ctl).bbr_admitted,
                    u32::MAX,
                )
            };
        }
        if e.state == conn_state::ESTABLISHED {
            open_add(record, e.open_epoch as u64, false);
            if let Some(b) = current_stats(record, now) {
                b.completed += 1;
                b.rt_count += 1;
                b.rt_sum_us += now.saturating_sub(e.syn_ns) / 1000;
            }
        }
        let _ = FLOWCTL_CONNS.remove(&key);
        return;
    }
    if flags & tcp_flags::ACK != 0 && e.state == conn_state::SYN_SEEN {
        let epoch = now / OPEN_BUCKET_NS;
        e.state = conn_state::ESTABLISHED;
        e.open_epoch = epoch as u32;
        open_add(record, epoch, true);
        if let Some(b) = current_stats(record, now) {
            b.established += 1;
        }
    }
}

/// The connection key: the 5-tuple, kept apart per rule record.
#[inline(always)]
fn conn_key(m: &PacketMeta, record: u32) -> BucketKey {
    BucketKey {
        state_id: record,
        family: m.family,
        proto: m.proto,
        sport: m.sport,
        dport: m.dport,
        _pad: 0,
        src: m.src,
        dst: m.dst,
    }
}

/// Adds one establishment to (or takes one completion off) `epoch` of a
/// record's open ring. A completion whose epoch has left the ring (or was
/// overwritten) changes nothing: that connection no longer counts anyway.
#[inline(always)]
fn open_add(record: u32, epoch: u64, add: bool) {
    let idx =
        record.wrapping_mul(OPEN_BUCKETS as u32).wrapping_add((epoch % OPEN_BUCKETS as u64) as u32);
    let Some(p) = FLOWCTL_OPEN.get_ptr_mut(idx) else { return };
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(p) };
        let (e, c) = window::unpack(old);
        let new = if add {
            window::bumped(old, epoch, 1)
        } else if e == epoch as u32 {
            window::pack(epoch, c.wrapping_sub(1))
        } else {
            return;
        };
        let (_, ok) = unsafe { crate::atomic::cxchg(p, old, new) };
        if ok {
            return;
        }
        tries += 1;
    }
}

/// Turns a refused SYN into the RST|ACK a closed port would send, in place,
/// to go back out of the interface (XDP_TX). Anything it cannot answer
/// exactly (IP options, IPv6 extension headers) is dropped instead.
#[inline(always)]
fn reset<const CUT: bool>(c: &XdpContext, meta: &PacketMeta) -> u32 {
    if parse::rst_reply(c, meta).is_err() {
        return xdp_action::XDP_DROP;
    }
    // Cut the frame after the 20-byte TCP header (the SYN's options go).
    let want = meta.l4_off as i64 + 20;
    let have = (c.data_end() - c.data()) as i64;
    if CUT
        && have > want
        && unsafe { aya_ebpf::helpers::bpf_xdp_adjust_tail(c.ctx, (want - have) as i32) } != 0
    {
        return xdp_action::XDP_DROP;
    }
    xdp_action::XDP_TX
}
