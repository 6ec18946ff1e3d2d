//! Per-rule statistics rings (docs/algorithms.md section 2): what the control
//! loops read at 100 ms resolution, and what `top` and the metrics show.
//!
//! Each rule record owns `buckets` consecutive entries of a per-CPU array.
//! A CPU writes only its own copy, so a bucket is reset and bumped with plain
//! stores: no compare-and-swap, no lost increments, no shared cache lines.
//! A bucket carries the epoch it counts (`now / bucket_ns + 1`, so 0 means
//! "never written"); a writer that finds an older epoch zeroes it first, and a
//! reader ignores any CPU's copy whose epoch is not the one it asks for, so a
//! CPU that saw no traffic for a while cannot contribute stale counts.

use crate::reason;

/// One bucket of one CPU's copy of a rule's ring. 112 bytes: with 100
/// buckets, 11.2 KB per rule record per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsBucket {
    /// `epoch_of(now)` of the interval counted here (0: never written).
    pub epoch: u64,
    pub offered_pkts: u32,
    /// Admitted (dry-run would-drops included: they pass).
    pub passed_pkts: u32,
    /// TCP SYN without ACK, offered to the rule.
    pub syn_offered: u32,
    /// Such SYNs that every stage admitted (BBR's arrivals).
    pub syn_passed: u32,
    /// TCP segments with FIN or RST (completions).
    pub fin_rst: u32,
    /// Connections of a BBR rule whose handshake completed (the client's
    /// ACK), and tracked connections that completed (FIN/RST), with their
    /// lifetimes as round trips.
    pub established: u32,
    pub completed: u32,
    /// First admitted SYNs of tracked connections (retransmissions once).
    pub arrivals: u32,
    pub rt_count: u32,
    pub rt_sum_us: u64,
    // Display-only from here on: pruned when statistics = "control".
    pub would_drop_pkts: u32,
    pub _pad: u32,
    pub offered_bytes: u64,
    pub passed_bytes: u64,
    pub dropped_pkts: [u32; reason::COUNT],
}

/// A CPU's current bucket: its epoch, ring slot and time span, so the
/// kernel divides once per bucket width, not per packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsClock {
    pub epoch: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub slot: u32,
    pub _pad: u32,
}

/// How much the kernel keeps in the rings, fixed at load.
pub mod level {
    /// Only what quotas, BBR and KLimiter read: packets offered and admitted,
    /// SYNs, completions, round trips.
    pub const CONTROL: u8 = 0;
    /// Also bytes, drops by reason and would-drops, for `top` and metrics.
    pub const FULL: u8 = 1;
    /// No rings at all. For `cargo xtask bench` only, to measure what the
    /// rings cost; profiles cannot select it (the control loops need them).
    pub const OFF: u8 = 2;
}

/// The bucket epoch of a monotonic time (never 0).
#[inline(always)]
pub fn epoch_of(now_ns: u64, bucket_ns: u64) -> u64 {
    // checked_div: a division the compiler cannot prove safe becomes a panic
    // path, which the verifier rejects.
    now_ns.checked_div(bucket_ns).unwrap_or(0) + 1
}

/// The ring a counter record writes, of the `records` rings the map holds
/// (`2 * max_rules + 1`, fixed at load): a rule's record (always below
/// `2 * max_rules`) its own, and the unmatched traffic's
/// (`GLOBAL_COUNTER_INDEX`, past every rule's) the last one. Kernel and
/// agent both index through this, so they agree whatever `max_rules` is.
#[inline(always)]
pub fn ring_record(record: u32, records: u32) -> u32 {
    let last = records.saturating_sub(1);
    if record < last {
        record
    } else {
        last
    }
}

/// Array index of `epoch`'s bucket in `record`'s ring.
#[inline(always)]
pub fn index(record: u32, epoch: u64, buckets: u32) -> u32 {
    let slot = epoch.checked_rem(buckets as u64).unwrap_or(0) as u32;
    record.wrapping_mul(buckets).wrapping_add(slot)
}

/// Sums of a span of buckets, over every CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSum {
    pub offered_pkts: u64,
    pub passed_pkts: u64,
    pub syn_offered: u64,
    pub syn_passed: u64,
    pub fin_rst: u64,
    pub established: u64,
    pub completed: u64,
    pub arrivals: u64,
    pub rt_count: u64,
    pub rt_sum_us: u64,
    pub would_drop_pkts: u64,
    pub offered_bytes: u64,
    pub passed_bytes: u64,
    pub dropped_pkts: [u64; reason::COUNT],
}

impl StatsSum {
    pub fn add(&mut self, b: &StatsBucket) {
        self.offered_pkts += b.offered_pkts as u64;
        self.passed_pkts += b.passed_pkts as u64;
        self.syn_offered += b.syn_offered as u64;
        self.syn_passed += b.syn_passed as u64;
        self.fin_rst += b.fin_rst as u64;
        self.established += b.established as u64;
        self.completed += b.completed as u64;
        self.arrivals += b.arrivals as u64;
        self.rt_count += b.rt_count as u64;
        self.rt_sum_us += b.rt_sum_us;
        self.would_drop_pkts += b.would_drop_pkts as u64;
        self.offered_bytes += b.offered_bytes;
        self.passed_bytes += b.passed_bytes;
        for (s, d) in self.dropped_pkts.iter_mut().zip(b.dropped_pkts.iter()) {
            *s += *d as u64;
        }
    }

    pub fn dropped_total(&self) -> u64 {
        self.dropped_pkts.iter().sum()
    }
}

/// Sums `epochs` (each of them, over every CPU's copy whose epoch matches)
/// from one record's ring as read from the map: `cpus[c][slot]`.
pub fn sum_epochs<'a>(
    cpus: impl Iterator<Item = &'a [StatsBucket]>,
    epochs: core::ops::Range<u64>,
    buckets: u32,
) -> StatsSum {
    let mut sum = StatsSum::default();
    for ring in cpus {
        for e in epochs.clone() {
            let slot = index(0, e, buckets) as usize;
            if let Some(b) = ring.get(slot) {
                if b.epoch == e {
                    sum.add(b);
                }
            }
        }
    }
    sum
}

/// The complete buckets of the last `span` ones before `now`'s (the current,
/// still-filling bucket is left out), limited to what the ring still holds.
pub fn complete_span(
    now_ns: u64,
    bucket_ns: u64,
    buckets: u32,
    span: u32,
) -> core::ops::Range<u64> {
    let cur = epoch_of(now_ns, bucket_ns);
    let span = span.min(buckets.saturating_sub(1)) as u64;
    cur.saturating_sub(span).max(1)..cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_start_at_one_and_slots_wrap() {
        assert_eq!(epoch_of(0, 100), 1);
        assert_eq!(epoch_of(99, 100), 1);
        assert_eq!(epoch_of(100, 100), 2);
        assert_eq!(epoch_of(5, 0), 1, "a zero width is not a panic");
        assert_eq!(index(3, 250, 100), 350);
        assert_eq!(index(0, 100, 100), 0);
        assert_eq!(index(0, 7, 0), 0);
    }

    fn bucket(epoch: u64, offered: u32) -> StatsBucket {
        StatsBucket { epoch, offered_pkts: offered, ..Default::default() }
    }

    #[test]
    fn sums_only_matching_epochs_of_every_cpu() {
        let buckets = 4u32;
        // CPU 0 wrote epochs 5..=8; CPU 1 last wrote epoch 2 and 3 (stale).
        let mut cpu0 = vec![StatsBucket::default(); 4];
        for e in 5..=8u64 {
            cpu0[(e % 4) as usize] = bucket(e, e as u32);
        }
        let mut cpu1 = vec![StatsBucket::default(); 4];
        cpu1[2] = bucket(2, 100);
        cpu1[3] = bucket(7, 1000);
        let s = sum_epochs([&cpu0[..], &cpu1[..]].into_iter(), 6..9, buckets);
        assert_eq!(s.offered_pkts, 6 + 7 + 8 + 1000);
    }

    #[test]
    fn complete_span_leaves_out_the_current_bucket() {
        // now in epoch 11 (t = 1000..1099 with 100 ns buckets).
        assert_eq!(complete_span(1050, 100, 100, 10), 1..11);
        assert_eq!(complete_span(10_050, 100, 100, 10), 91..101);
        // Never more than the ring holds minus the bucket being written.
        assert_eq!(complete_span(100_000, 100, 10, 50), 992..1001);
    }
}
