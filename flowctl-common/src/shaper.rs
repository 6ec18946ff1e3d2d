//! The egress shaper (`[[shaper]]`, docs/algorithms.md section 7): a
//! leaky bucket per downstream target, or per flow to it, that paces what
//! this host sends instead of dropping it. The TC egress program stamps
//! each packet's earliest departure time (EDT, `skb->tstamp`) and the `fq`
//! qdisc holds it until then; TCP feels the held packets as backpressure
//! (TCP small queues), so the sending application blocks on its writes.
//!
//! One word of state per bucket: `next`, the earliest time the next packet
//! may leave. A packet of stable-rate time `delay` (`gcra::increment_ns`
//! of its cost) leaves at `depart = max(next, now, its own stamp)` and
//! moves `next` to `depart + delay`: a steady rate, no burst (the seeds'
//! blocking limiter). A packet whose `depart` is more than `horizon` ahead
//! is dropped (and counted) instead, and moves nothing: a sender faster
//! than the rate loses what the horizon cannot hold rather than queueing
//! without bound.

/// `[[shaper]]` tables a profile may have.
pub const MAX_SHAPERS: usize = 16;
/// Per-flow shapers' buckets (`FLOWCTL_SHAPER_FLOWS`, LRU), all shapers.
pub const SHAPER_FLOW_ENTRIES: u32 = 65_536;
/// Counters per shaper (`FLOWCTL_SHAPER_COUNTS`, per CPU).
pub const SHAPER_COUNTERS: usize = MAX_SHAPERS;

/// `ShaperConfig::flags`.
pub mod flags {
    /// One bucket per flow (5-tuple) to the target, not one for all.
    pub const PER_FLOW: u8 = 1;
    /// Measure only: nothing is stamped or dropped.
    pub const DRY_RUN: u8 = 2;
    /// The rate is in bytes (the packet's length), not packets.
    pub const BYTES: u8 = 4;
}

/// One shaper as the TC program reads it (`FLOWCTL_SHAPERS`, index =
/// profile order). `family` 0 marks an unused slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShaperConfig {
    /// Host-order address words of the target prefix (IPv4 in word 0).
    pub addr: [u32; 4],
    pub prefix_len: u8,
    /// 4 or 6; 0: an unused slot.
    pub family: u8,
    /// 6, 17, or 0 for any protocol.
    pub proto: u8,
    /// `flags::*`.
    pub flags: u8,
    pub port_lo: u16,
    pub port_hi: u16,
    /// Emission interval per unit (`gcra` fixed point).
    pub interval_fp: u64,
    /// The most a packet may be held, ns.
    pub horizon_ns: u64,
}

/// What one shaper counts, per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShaperCounters {
    pub offered_pkts: u64,
    pub offered_bytes: u64,
    /// Stamped to leave later than they came (or would have been).
    pub delayed_pkts: u64,
    /// Sum of the delays stamped (or that would have been), ns.
    pub delay_ns: u64,
    /// Dropped past the horizon (in dry-run: would have been).
    pub horizon_drops: u64,
    pub horizon_drop_bytes: u64,
    /// A per-flow shaper's bucket the flow table refused to hold: sent
    /// unshaped.
    pub table_full: u64,
    pub _reserved: u64,
}

/// The departure a packet gets: `Some((depart, next))`, or `None` past
/// the horizon (nothing moves).
#[inline(always)]
pub fn schedule(
    next: u64,
    now: u64,
    stamp: u64,
    delay: u64,
    horizon_ns: u64,
) -> Option<(u64, u64)> {
    let mut depart = if next > now { next } else { now };
    if stamp > depart {
        depart = stamp;
    }
    if depart - now > horizon_ns {
        return None;
    }
    Some((depart, depart.saturating_add(delay)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_steady_rate_without_burst_and_a_horizon() {
        // 1000/s: 1 ms apart, whenever they come.
        let (ms, h) = (1_000_000u64, 5_000_000u64);
        let mut next = 0;
        let mut departs = Vec::new();
        for i in 0..8 {
            match schedule(next, 100 * ms, 0, ms, h) {
                Some((d, n)) => {
                    departs.push(d - 100 * ms);
                    next = n;
                }
                None => assert!(i > 5, "dropped only past 5 ms"),
            }
        }
        assert_eq!(departs, [0, ms, 2 * ms, 3 * ms, 4 * ms, 5 * ms]);
        // Idle: the next leaves at once, no credit for the idle time.
        assert_eq!(schedule(next, 500 * ms, 0, ms, h), Some((500 * ms, 501 * ms)));
        // A later stamp of its own (TCP's pacing) is kept.
        assert_eq!(schedule(next, 500 * ms, 502 * ms, ms, h), Some((502 * ms, 503 * ms)));
    }

    proptest! {
        /// Whatever the arrivals, departures are at least `delay` apart,
        /// never before arrival, never more than the horizon after it.
        #[test]
        fn departures_keep_the_rate_and_the_horizon(
            gaps in prop::collection::vec(0u64..3_000, 1..400),
            delay in 1u64..2_000,
            horizon in 0u64..20_000,
        ) {
            let (mut now, mut next, mut last) = (1_000_000u64, 0u64, None::<u64>);
            for g in gaps {
                now += g;
                if let Some((d, n)) = schedule(next, now, 0, delay, horizon) {
                    prop_assert!(d >= now && d - now <= horizon);
                    if let Some(l) = last {
                        prop_assert!(d >= l + delay);
                    }
                    last = Some(d);
                    next = n;
                }
            }
        }
    }
}
