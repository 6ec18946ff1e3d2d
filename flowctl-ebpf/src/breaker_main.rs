//! flowctl's circuit breakers in the kernel (issue 6, first part): cgroup
//! `connect4`/`connect6` hooks refuse new TCP connections to a watched
//! downstream with the share the agent sets (failing at once with its
//! errno, nothing sent), and a `sock_ops` program counts what happens to
//! the connections that do go out (attempts, successes, failures,
//! handshake timeouts). UDP `connect()` is never throttled: it has no
//! outcome to learn from.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{bpf_sock_addr, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB},
    helpers::{bpf_get_prandom_u32, generated::bpf_set_retval},
    macros::{cgroup_sock_addr, map, sock_ops},
    maps::{Array, PerCpuArray},
    programs::{SockAddrContext, SockOpsContext},
};
use flowctl_common::breaker::{counter, target_flags, Control, Target, MAX_TARGETS};

#[map]
static FLOWCTL_BREAKER_TARGETS: Array<Target> = Array::with_max_entries(MAX_TARGETS as u32, 0);
#[map]
static FLOWCTL_BREAKER_CONTROL: Array<Control> = Array::with_max_entries(MAX_TARGETS as u32, 0);
#[map]
static FLOWCTL_BREAKER_COUNTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_TARGETS as u32 * counter::COUNT, 0);

const SOCK_STREAM: u32 = 1;
/// TCP states (include/net/tcp_states.h).
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;

#[cgroup_sock_addr(connect4)]
pub fn flowctl_connect4(ctx: SockAddrContext) -> i32 {
    let sa = unsafe { &*ctx.sock_addr };
    let addr = [u32::from_be(sa.user_ip4), 0, 0, 0];
    decide(sa, 4, &addr)
}

#[cgroup_sock_addr(connect6)]
pub fn flowctl_connect6(ctx: SockAddrContext) -> i32 {
    let sa = unsafe { &*ctx.sock_addr };
    let (family, addr) = v6_peer(sa.user_ip6);
    decide(sa, family, &addr)
}

/// A network-order IPv6 address as (family, host-order words): an
/// IPv4-mapped one (::ffff:a.b.c.d) goes to an IPv4 host and matches IPv4
/// targets.
#[inline(always)]
fn v6_peer(be: [u32; 4]) -> (u8, [u32; 4]) {
    let w = [u32::from_be(be[0]), u32::from_be(be[1]), u32::from_be(be[2]), u32::from_be(be[3])];
    if w[0] == 0 && w[1] == 0 && w[2] == 0xffff {
        (4, [w[3], 0, 0, 0])
    } else {
        (6, w)
    }
}

/// 1: let connect() go on; 0 with a return value set: it fails at once.
#[inline(always)]
fn decide(sa: &bpf_sock_addr, family: u8, addr: &[u32; 4]) -> i32 {
    if sa.type_ != SOCK_STREAM {
        return 1;
    }
    let port = u16::from_be(sa.user_port as u16);
    let Some(t) = find(family, addr, port) else { return 1 };
    bump(t, counter::CALLS);
    let Some(target) = FLOWCTL_BREAKER_TARGETS.get(t) else { return 1 };
    if target.flags & target_flags::EXEMPT != 0 {
        return 1;
    }
    let Some(c) = FLOWCTL_BREAKER_CONTROL.get(t) else { return 1 };
    if c.drop_ppm == 0 {
        return 1;
    }
    let r = unsafe { bpf_get_prandom_u32() } as u64;
    if (r * 1_000_000) >> 32 >= c.drop_ppm as u64 {
        return 1;
    }
    if target.flags & target_flags::DRY_RUN != 0 {
        bump(t, counter::WOULD_REFUSE);
        return 1;
    }
    bump(t, counter::REFUSED_LOCALLY);
    unsafe { bpf_set_retval(-(c.errno as i32)) };
    0
}

/// The first matching target (exempt ones are listed first by the agent).
#[inline(always)]
fn find(family: u8, addr: &[u32; 4], port: u16) -> Option<u32> {
    let mut t = 0;
    while t < MAX_TARGETS as u32 {
        if let Some(x) = FLOWCTL_BREAKER_TARGETS.get(t) {
            if x.family == family && port >= x.port_lo && port <= x.port_hi && flowctl_common::keys::in_prefix(addr, &x.addr, x.prefix_len, family) {
                return Some(t);
            }
        }
        t += 1;
    }
    None
}


#[inline(always)]
fn bump(t: u32, which: u32) {
    if let Some(c) = FLOWCTL_BREAKER_COUNTS.get_ptr_mut(t * counter::COUNT + which) {
        unsafe { *c += 1 };
    }
}

/// Outcomes of the connections that went out.
#[sock_ops]
pub fn flowctl_sock_ops(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    let (family, addr) = if ctx.family() == 2 {
        (4u8, [u32::from_be(ctx.remote_ip4()), 0, 0, 0])
    } else {
        v6_peer(ctx.remote_ip6())
    };
    // bpf_sock_ops.remote_port carries the network-order port in its upper
    // 16 bits (the context rewrite shifts it; local_port is host order).
    let port = u16::from_be((ctx.remote_port() >> 16) as u16);
    let Some(t) = find(family, &addr, port) else { return 1 };
    match op {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            bump(t, counter::ATTEMPTS);
            let _ = ctx.set_cb_flags((BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG) as i32);
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => bump(t, counter::SUCCESSES),
        BPF_SOCK_OPS_STATE_CB => {
            // args[0]: old state, args[1]: new state.
            if ctx.arg(0) == TCP_SYN_SENT && ctx.arg(1) == TCP_CLOSE {
                bump(t, counter::FAILURES);
            }
        }
        BPF_SOCK_OPS_RTO_CB => {
            // The callback's arguments are retransmit counts and the RTO;
            // the handshake is the socket's state.
            if unsafe { (*ctx.ops).state } == TCP_SYN_SENT {
                bump(t, counter::TIMEOUTS);
            }
        }
        _ => {}
    }
    1
}

flowctl_common::bpf_object_boilerplate!();
