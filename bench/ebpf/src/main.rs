//! Reference programs for the benchmarks, measured beside flowctl in one run:
//!
//! - `bench_pass` / `bench_drop`: the XDP_PASS floor and XDP_DROP ceiling.
//! - `bench_bare`: the bare reference, one GCRA bucket per source IPv4 in an
//!   LRU hash and nothing else, with the same compare-and-swap update as
//!   flowctl (`flowctl_common::gcra`).
//! - `bench_bare_small`: the same with a 64k-entry table (section 1l).
//! - `bench_own_table`, `bench_cache_then_own_table`: per-rule key tables
//!   (an array of maps, one LRU hash per rule): what a rule whose keys no
//!   other rule's flood can evict would cost, without and with the source
//!   cache lookup that classification makes first (section 1n).
//! - `bench_spread`: rewrites the IPv4 source to walk N keys, then tail-calls
//!   the program under test, so BPF_PROG_TEST_RUN covers many keys.
//! - `bench_gen`: the live-frames generator: walks N sources and redirects
//!   each frame into a veth.
//! - `reject_me`: reads the packet without a bounds check, so the verifier
//!   refuses it (for the verifier-error test).
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

use aya_ebpf::{
    bindings::xdp_action,
    btf_maps::{ArrayOfMaps, LruHashMap as BtfLruHashMap},
    helpers::{bpf_ktime_get_ns, bpf_redirect},
    macros::{btf_map, map, xdp},
    maps::{Array, LruHashMap, PerCpuArray, ProgramArray},
    programs::XdpContext,
};
use core::intrinsics::{atomic_cxchg, AtomicOrdering};
use flowctl_common::gcra;

/// [0] = keys to walk, [1] = base IPv4 (host order), [2] = redirect ifindex.
#[map]
static BENCH_CONFIG: Array<u32> = Array::with_max_entries(4, 0);
/// [0] = interval_fp, [1] = burst_ns for the bare reference.
#[map]
static BENCH_LIMIT: Array<u64> = Array::with_max_entries(2, 0);
#[map]
static BENCH_SEQ: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);
#[map]
static BENCH_NEXT: ProgramArray = ProgramArray::with_max_entries(1, 0);
#[map]
static BENCH_BARE_KEYS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(1 << 20, 0);
#[map]
static BENCH_BARE_SMALL_KEYS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(1 << 16, 0);

/// Per-rule key tables: the benchmark fills slot 0 with an LRU hash of its
/// own size (the template's single entry is only the inner maps' shape:
/// a hash map's size may differ from it).
#[btf_map]
static BENCH_RULE_TABLES: ArrayOfMaps<BtfLruHashMap<[u32; 4], u64, 1>, 4> = ArrayOfMaps::new();
/// Stands in for flowctl's source cache (its key and value sizes). One
/// entry unless the benchmark sizes it (to 1M): the tests load this object
/// too, and should not preallocate 136 MiB for it.
#[map]
static BENCH_SOURCE_CACHE: LruHashMap<[u32; 4], [u64; 9]> = LruHashMap::with_max_entries(1, 0);

#[xdp]
pub fn bench_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// An extension (`freplace`) of `bench_pass`: the tests' probe of whether
/// this kernel loads extension programs, which libxdp's dispatcher and
/// `attach --multiprog` need (some kernels refuse them outright).
#[unsafe(no_mangle)]
#[unsafe(link_section = "freplace/bench_pass_ext")]
pub fn bench_pass_ext(_ctx: *mut aya_ebpf::bindings::xdp_md) -> u32 {
    xdp_action::XDP_PASS
}

#[xdp]
pub fn bench_drop(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

/// Offset of the IPv4 source address in an untagged Ethernet frame.
const SRC_OFF: usize = 14 + 12;

#[inline(always)]
fn next_src() -> u32 {
    let n = BENCH_CONFIG.get(0).copied().unwrap_or(1).max(1);
    let base = BENCH_CONFIG.get(1).copied().unwrap_or(0x0a00_0000);
    let Some(seq) = BENCH_SEQ.get_ptr_mut(0) else { return base };
    unsafe {
        *seq = (*seq + 1) % n;
        base.wrapping_add(*seq)
    }
}

#[inline(always)]
fn rewrite_src(ctx: &XdpContext, src: u32) -> bool {
    let p = ctx.data() + SRC_OFF;
    if p + 4 > ctx.data_end() {
        return false;
    }
    unsafe { core::ptr::write_unaligned(p as *mut [u8; 4], src.to_be_bytes()) };
    true
}

#[xdp]
pub fn bench_spread(ctx: XdpContext) -> u32 {
    if !rewrite_src(&ctx, next_src()) {
        return xdp_action::XDP_ABORTED;
    }
    unsafe {
        let _ = BENCH_NEXT.tail_call(&ctx, 0);
    }
    xdp_action::XDP_ABORTED
}

#[xdp]
pub fn bench_gen(ctx: XdpContext) -> u32 {
    if !rewrite_src(&ctx, next_src()) {
        return xdp_action::XDP_ABORTED;
    }
    let ifindex = BENCH_CONFIG.get(2).copied().unwrap_or(0);
    unsafe { bpf_redirect(ifindex, 0) as u32 }
}

#[xdp]
pub fn bench_bare(ctx: XdpContext) -> u32 {
    bare(&ctx, &BENCH_BARE_KEYS)
}

/// The bare reference with a table of 64k entries instead of 1M: what the
/// size of an LRU hash (its bucket array and element area, 4 KiB pages)
/// costs a lookup at the same number of live keys.
#[xdp]
pub fn bench_bare_small(ctx: XdpContext) -> u32 {
    bare(&ctx, &BENCH_BARE_SMALL_KEYS)
}

#[xdp]
pub fn bench_own_table(ctx: XdpContext) -> u32 {
    own_table(&ctx, false)
}

#[xdp]
pub fn bench_cache_then_own_table(ctx: XdpContext) -> u32 {
    own_table(&ctx, true)
}

/// The bare reference's bucket in rule 0's own table, keyed as flowctl
/// keys a source (16 bytes), after the source cache's lookup when `cached`
/// (a miss inserts there, as classification does).
#[inline(always)]
fn own_table(ctx: &XdpContext, cached: bool) -> u32 {
    let Some(src) = frame_source(ctx) else { return xdp_action::XDP_PASS };
    let key = [0, 0, 0xffff_u32.to_be(), src];
    if cached && BENCH_SOURCE_CACHE.get_ptr(&key).is_none() {
        let _ = BENCH_SOURCE_CACHE.insert(&key, &[0; 9], 0);
    }
    let Some(table) = BENCH_RULE_TABLES.get(0) else {
        return xdp_action::XDP_PASS;
    };
    let Some((interval, burst)) = limit() else { return xdp_action::XDP_PASS };
    let now = unsafe { bpf_ktime_get_ns() };
    let inc = gcra::increment_ns(interval, 1);
    let Some(tat) = table.get_ptr_mut(&key) else {
        let _ = table.insert(&key, &(now + inc), 1);
        return xdp_action::XDP_PASS;
    };
    swap_tat(tat, now, inc, burst)
}

/// The frame's IPv4 source address (None: the frame is too short).
#[inline(always)]
fn frame_source(ctx: &XdpContext) -> Option<u32> {
    let p = ctx.data() + SRC_OFF;
    if p + 4 > ctx.data_end() {
        return None;
    }
    Some(u32::from_be_bytes(unsafe { *(p as *const [u8; 4]) }))
}

/// The reference bucket's emission interval and depth (`BENCH_LIMIT`).
#[inline(always)]
fn limit() -> Option<(u64, u64)> {
    Some((*BENCH_LIMIT.get(0)?, *BENCH_LIMIT.get(1)?))
}

/// The bucket's compare-and-swap, as flowctl's.
#[inline(always)]
fn swap_tat(tat: *mut u64, now: u64, inc: u64, burst: u64) -> u32 {
    let mut tries = 0;
    while tries < 4 {
        let old = unsafe { core::ptr::read_volatile(tat) };
        let Some(new) = gcra::admit(old, now, inc, burst) else {
            return xdp_action::XDP_DROP;
        };
        let (_, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                tat, old, new,
            )
        };
        if ok {
            return xdp_action::XDP_PASS;
        }
        tries += 1;
    }
    xdp_action::XDP_DROP
}

#[inline(always)]
fn bare(ctx: &XdpContext, keys: &LruHashMap<u32, u64>) -> u32 {
    let Some(src) = frame_source(ctx) else { return xdp_action::XDP_PASS };
    let Some((interval, burst)) = limit() else { return xdp_action::XDP_PASS };
    let now = unsafe { bpf_ktime_get_ns() };
    let inc = gcra::increment_ns(interval, 1);
    let Some(tat) = keys.get_ptr_mut(&src) else {
        let first = now + inc;
        let _ = keys.insert(&src, &first, 1);
        return xdp_action::XDP_PASS;
    };
    swap_tat(tat, now, inc, burst)
}

#[xdp]
pub fn reject_me(ctx: XdpContext) -> u32 {
    // Deliberately unchecked: the verifier must refuse this program.
    let p = ctx.data() as *const u8;
    unsafe { core::ptr::read_volatile(p.add(64)) as u32 }
}

flowctl_common::bpf_object_boilerplate!();
