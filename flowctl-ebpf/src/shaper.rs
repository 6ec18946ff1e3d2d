//! TC egress: the shaper of `[[shaper]]` tables (`flowctl_common::shaper`,
//! docs/algorithms.md section 7). A packet to a shaper's target gets its
//! earliest departure time in `skb->tstamp`, from a leaky bucket of the
//! shaper (or of its flow), and the `fq` qdisc the agent installs holds it
//! until then. The first shaper in profile order whose target matches
//! decides; a packet no shaper matches passes untouched.

use crate::{
    maps::{FLOWCTL_SHAPERS, FLOWCTL_SHAPER_COUNTS, FLOWCTL_SHAPER_FLOWS, FLOWCTL_SHAPER_NEXT},
    outbound::{self, Outbound},
};
use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::classifier, programs::TcContext};
use flowctl_common::{
    gcra,
    keys::in_prefix,
    shaper::{flags, schedule, ShaperConfig, ShaperCounters, MAX_SHAPERS},
    BucketKey, CAS_RETRIES,
};

/// TC_ACT_OK: the packet goes on; TC_ACT_SHOT: dropped.
const TC_ACT_OK: i32 = 0;
const TC_ACT_SHOT: i32 = 2;

#[classifier]
pub fn flowctl_shape(ctx: TcContext) -> i32 {
    shape(&ctx).unwrap_or(TC_ACT_OK)
}

#[inline(always)]
fn shape(ctx: &TcContext) -> Option<i32> {
    let p = outbound::parse(ctx)?;
    let mut i = 0u32;
    while i < MAX_SHAPERS as u32 {
        let c = FLOWCTL_SHAPERS.get(i)?;
        if c.family == 0 {
            return None; // the used slots come first
        }
        if matches(c, &p) {
            return Some(pace(ctx, i, c, &p));
        }
        i += 1;
    }
    None
}

#[inline(always)]
fn matches(c: &ShaperConfig, p: &Outbound) -> bool {
    if c.family != p.family || (c.proto != 0 && c.proto != p.proto) {
        return false;
    }
    // A shaper with ports takes only packets whose ports were read.
    let all_ports = c.port_lo == 0 && c.port_hi == u16::MAX;
    if !all_ports && !(p.has_ports && p.dport >= c.port_lo && p.dport <= c.port_hi) {
        return false;
    }
    in_prefix(&p.dst, &c.addr, c.prefix_len, p.family)
}

/// Stamps (or drops) a packet of shaper `i`, and counts it.
#[inline(always)]
fn pace(ctx: &TcContext, i: u32, c: &ShaperConfig, p: &Outbound) -> i32 {
    let len = ctx.len() as u64;
    let counts = FLOWCTL_SHAPER_COUNTS.get_ptr_mut(i);
    if let Some(n) = counts {
        unsafe {
            (*n).offered_pkts += 1;
            (*n).offered_bytes += len;
        }
    }
    let Some(next_ptr) = bucket(i, c, p, counts) else { return TC_ACT_OK };
    let cost = if c.flags & flags::BYTES != 0 { len } else { 1 };
    let delay = gcra::increment_ns(c.interval_fp, cost);
    let now = unsafe { bpf_ktime_get_ns() };
    let skb = ctx.skb.skb;
    let stamp = unsafe { (*skb).tstamp };
    let dry = c.flags & flags::DRY_RUN != 0;
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(next_ptr) };
        let Some((depart, next)) = schedule(old, now, stamp, delay, c.horizon_ns) else {
            if let Some(n) = counts {
                unsafe {
                    (*n).horizon_drops += 1;
                    (*n).horizon_drop_bytes += len;
                }
            }
            return if dry { TC_ACT_OK } else { TC_ACT_SHOT };
        };
        let (_, ok) = unsafe { crate::atomic::cxchg(next_ptr, old, next) };
        if ok {
            if depart > now {
                if let Some(n) = counts {
                    unsafe {
                        (*n).delayed_pkts += 1;
                        (*n).delay_ns += depart - now;
                    }
                }
                if !dry {
                    unsafe { (*skb).tstamp = depart };
                }
            }
            return TC_ACT_OK;
        }
        tries += 1;
    }
    // Lost every race: sent at its own time (the others moved the bucket).
    TC_ACT_OK
}

/// The bucket of shaper `i` for this packet: the shaper's own, or its
/// flow's in the flow table (created at 0, a bucket with nothing ahead).
#[inline(always)]
fn bucket(
    i: u32,
    c: &ShaperConfig,
    p: &Outbound,
    counts: Option<*mut ShaperCounters>,
) -> Option<*mut u64> {
    if c.flags & flags::PER_FLOW == 0 {
        return FLOWCTL_SHAPER_NEXT.get_ptr_mut(i);
    }
    let key = BucketKey {
        state_id: i + 1,
        family: p.family,
        proto: p.proto,
        sport: p.sport,
        dport: p.dport,
        src: p.src,
        dst: p.dst,
        ..Default::default()
    };
    if let Some(ptr) = FLOWCTL_SHAPER_FLOWS.get_ptr_mut(&key) {
        return Some(ptr);
    }
    let _ = FLOWCTL_SHAPER_FLOWS.insert(&key, &0, 1 /* BPF_NOEXIST */);
    let got = FLOWCTL_SHAPER_FLOWS.get_ptr_mut(&key);
    if got.is_none() {
        if let Some(n) = counts {
            unsafe { (*n).table_full += 1 };
        }
    }
    got
}
