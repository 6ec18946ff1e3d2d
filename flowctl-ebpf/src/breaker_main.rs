//! flowctl's circuit breakers in the kernel (issue 6, first part): cgroup
//! `connect4`/`connect6` hooks refuse new TCP connections to a watched
//! downstream with the share the agent sets (failing at once with its
//! errno, nothing sent), and a `sock_ops` program counts what happens to
//! the connections that do go out (attempts, successes, failures,
//! handshake timeouts). UDP `connect()` is never throttled: it has no
//! outcome to learn from.
#![no_std]
#![allow(internal_features)]
#![feature(core_intrinsics)]
#![no_main]

use aya_ebpf::{
    bindings::{
        bpf_sock_addr, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTO_CB,
        BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_SOCK_OPS_TCP_CONNECT_CB,
    },
    helpers::{
        bpf_get_prandom_u32, bpf_ktime_get_ns,
        generated::{bpf_get_current_ancestor_cgroup_id, bpf_get_socket_cookie, bpf_set_retval},
    },
    macros::{cgroup_sock_addr, map, sock_ops},
    maps::{Array, LruHashMap, PerCpuArray},
    programs::{SockAddrContext, SockOpsContext},
};
use core::intrinsics::{atomic_cxchg, AtomicOrdering};
use flowctl_common::breaker::{
    counter, probe_word, target_flags, Control, SockMark, Target, DEADLINE_INDEX, MAX_TARGETS,
    SOCK_MARKS,
};

#[map]
static FLOWCTL_BREAKER_TARGETS: Array<Target> = Array::with_max_entries(MAX_TARGETS as u32, 0);
#[map]
static FLOWCTL_BREAKER_CONTROL: Array<Control> = Array::with_max_entries(MAX_TARGETS as u32, 0);
#[map]
static FLOWCTL_BREAKER_COUNTS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(MAX_TARGETS as u32 * counter::COUNT, 0);
/// The agent's deadline (`DEADLINE_INDEX`).
#[map]
static FLOWCTL_BREAKER_DEADLINE: Array<u64> = Array::with_max_entries(1, 0);
/// Sockets let through, by cookie, until their handshake's outcome.
#[map]
static FLOWCTL_BREAKER_SOCKS: LruHashMap<u64, SockMark> =
    LruHashMap::with_max_entries(SOCK_MARKS, 0);

const SOCK_STREAM: u32 = 1;
/// TCP states (include/net/tcp_states.h).
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;

#[cgroup_sock_addr(connect4)]
pub fn flowctl_connect4(ctx: SockAddrContext) -> i32 {
    let sa = unsafe { &*ctx.sock_addr };
    let addr = [u32::from_be(sa.user_ip4), 0, 0, 0];
    decide(&ctx, sa, 4, &addr)
}

#[cgroup_sock_addr(connect6)]
pub fn flowctl_connect6(ctx: SockAddrContext) -> i32 {
    let sa = unsafe { &*ctx.sock_addr };
    let (family, addr) = v6_peer(sa.user_ip6);
    decide(&ctx, sa, family, &addr)
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
fn decide(ctx: &SockAddrContext, sa: &bpf_sock_addr, family: u8, addr: &[u32; 4]) -> i32 {
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
    let Some(c) = FLOWCTL_BREAKER_CONTROL.get_ptr_mut(t) else { return 1 };
    let c = unsafe { &mut *c };
    let mut mark = SockMark { slot: t, ..Default::default() };
    // Past the deadline the agent has stopped speaking: fail open.
    let deadline = FLOWCTL_BREAKER_DEADLINE.get(DEADLINE_INDEX).copied().unwrap_or(0);
    let enforcing = unsafe { bpf_ktime_get_ns() } < deadline;
    let mut refuse = false;
    if enforcing && c.probes != 0 {
        match take_probe(c) {
            Some(epoch) => {
                mark.probe = 1;
                mark.epoch = epoch;
                bump(t, counter::PROBES);
            }
            None => refuse = true,
        }
    } else if enforcing && c.drop_ppm != 0 {
        let r = unsafe { bpf_get_prandom_u32() } as u64;
        refuse = (r * 1_000_000) >> 32 < c.drop_ppm as u64;
    }
    if refuse {
        if target.flags & target_flags::DRY_RUN == 0 {
            bump(t, counter::REFUSED_LOCALLY);
            unsafe { bpf_set_retval(-(c.errno as i32)) };
            return 0;
        }
        bump(t, counter::WOULD_REFUSE);
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    let _ = FLOWCTL_BREAKER_SOCKS.insert(&cookie, &mark, 0);
    1
}

/// One of the half-open round's probes, if any is left: its epoch.
#[inline(always)]
fn take_probe(c: &mut Control) -> Option<u32> {
    let p = &mut c.probe_word as *mut u64;
    let mut tries = 0;
    while tries < 8 {
        let old = unsafe { core::ptr::read_volatile(p) };
        if probe_word::admitted(old) >= c.probes {
            return None;
        }
        let (_, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                p,
                old,
                old + probe_word::ADMITTED_ONE,
            )
        };
        if ok {
            return Some(probe_word::epoch(old));
        }
        tries += 1;
    }
    None
}

/// A probe's outcome, counted only in the round (epoch) it was admitted in:
/// a round the agent has since closed or reopened ignores it.
#[inline(always)]
fn probe_outcome(m: &SockMark, inc: u64) {
    if m.probe == 0 {
        return;
    }
    let Some(c) = FLOWCTL_BREAKER_CONTROL.get_ptr_mut(m.slot) else { return };
    let p = unsafe { &mut (*c).probe_word as *mut u64 };
    let mut tries = 0;
    while tries < 8 {
        let old = unsafe { core::ptr::read_volatile(p) };
        if probe_word::epoch(old) != m.epoch {
            return;
        }
        let (_, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                p,
                old,
                old + inc,
            )
        };
        if ok {
            return;
        }
        tries += 1;
    }
}

/// The first matching target (exempt ones are listed first by the agent).
#[inline(always)]
fn find(family: u8, addr: &[u32; 4], port: u16) -> Option<u32> {
    let mut t = 0;
    while t < MAX_TARGETS as u32 {
        if let Some(x) = FLOWCTL_BREAKER_TARGETS.get(t) {
            if x.family == family
                && port >= x.port_lo
                && port <= x.port_hi
                && flowctl_common::keys::in_prefix(addr, &x.addr, x.prefix_len, family)
                && (x.cgroup_id == 0
                    || unsafe { bpf_get_current_ancestor_cgroup_id(x.cgroup_level as i32) }
                        == x.cgroup_id)
            {
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

/// Outcomes of the connections the hooks let through (found by cookie;
/// other sockets cost one lookup on these four callbacks).
#[sock_ops]
pub fn flowctl_sock_ops(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if op != BPF_SOCK_OPS_TCP_CONNECT_CB
        && op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB
        && op != BPF_SOCK_OPS_STATE_CB
        && op != BPF_SOCK_OPS_RTO_CB
    {
        return 1;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops as *mut _) };
    let Some(m) = FLOWCTL_BREAKER_SOCKS.get_ptr_mut(&cookie) else { return 1 };
    let m = unsafe { &mut *m };
    match op {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            bump(m.slot, counter::ATTEMPTS);
            let _ =
                ctx.set_cb_flags((BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG) as i32);
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            if m.decided == 0 {
                bump(m.slot, counter::SUCCESSES);
                probe_outcome(m, probe_word::OK_ONE);
            }
            let _ = ctx.set_cb_flags(0);
            let _ = FLOWCTL_BREAKER_SOCKS.remove(&cookie);
        }
        BPF_SOCK_OPS_STATE_CB => {
            // args[0]: old state, args[1]: new state.
            if ctx.arg(1) == TCP_CLOSE {
                if ctx.arg(0) == TCP_SYN_SENT && m.decided == 0 {
                    bump(m.slot, counter::REFUSED_BY_PEER);
                    probe_outcome(m, probe_word::FAILED_ONE);
                }
                let _ = FLOWCTL_BREAKER_SOCKS.remove(&cookie);
            }
        }
        _ => {
            // RTO: the callback's arguments are retransmit counts and the
            // RTO; the handshake is the socket's state.
            if unsafe { (*ctx.ops).state } == TCP_SYN_SENT && m.decided == 0 {
                bump(m.slot, counter::TIMEOUTS);
                probe_outcome(m, probe_word::FAILED_ONE);
                m.decided = 1;
            }
        }
    }
    1
}

flowctl_common::bpf_object_boilerplate!();
