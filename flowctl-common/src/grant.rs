//! Global rules' per-key grants (docs/fleet.md, "Global limits"): what a
//! host's lease lets one key of a global rule admit here, packed in one
//! 8-byte word so the kernel reads and caches it with single loads and
//! stores and never sees half of an update.
//!
//! The agent writes a leased key's word into `FLOWCTL_GRANTS` (a hash map:
//! an update replaces the element whole). The kernel keeps a copy in the
//! key's bucket and re-reads the map at most every [`REFRESH_NS`], so a
//! grant takes effect within that time of being written: the agent waits
//! that long after writing a lower grant before it acknowledges it to the
//! store (only then may the store give the difference to other hosts).
//! Word 0 means "no lease": the key runs at the rule's default share.

use crate::BucketKey;

/// How often the kernel re-reads a key's grant from the map, at most.
pub const REFRESH_NS: u64 = 50_000_000;
/// How often one key is reported hot to the agent, at most.
pub const HOT_EVERY_NS: u64 = 100_000_000;
/// Refused keys one rule record may send to the full stage to be reported,
/// per CPU per [`HOT_EVERY_NS`] (the agent takes 4096 reports a tick): a
/// flood of refused sources is refused inline past that, its keys still
/// due a report, rather than each writing one into a ring the agent could
/// not drain anyway.
pub const REFUSED_REPORTS_PER_WINDOW: u64 = 1024;
/// The word of a key without a lease.
pub const NO_LEASE: u64 = 0;

/// Bits of the emission interval (fixed point, `gcra::FRAC_BITS`): up to
/// 2^48 / 256 ns, about 1,100 s per unit. A slower rate is stored as this
/// maximum (slower still: never more lenient).
const INTERVAL_BITS: u32 = 48;
pub const MAX_INTERVAL_FP: u64 = (1 << INTERVAL_BITS) - 1;
/// The burst, in units, as a 12-bit mantissa and a 4-bit exponent (units =
/// m << e), rounded down: at most 4095 << 15 units, within 1/4096 below
/// what was asked.
const MANTISSA_BITS: u32 = 12;
const EXPONENT_BITS: u32 = 4;
pub const MAX_BURST_UNITS: u64 = ((1 << MANTISSA_BITS) - 1) << ((1 << EXPONENT_BITS) - 1);

/// Words of the lease filter (`FLOWCTL_LEASE_FILTER`, one bit per slot):
/// 2^20 bits, 128 KiB, so with every grant held (`MAX_GRANTS`, 2^16) a key
/// without a lease finds its bit set in about 1 - e^(-1/16) = 6% of cases.
pub const LEASE_FILTER_WORDS: u32 = 1 << 14;
const LEASE_FILTER_BITS: u64 = LEASE_FILTER_WORDS as u64 * 64;
/// The filter's fixed seed: the agent and the kernel must agree on it, and
/// an attacker who aims keys at set bits only buys grants lookups.
const FILTER_SEED: u64 = 0x243f_6a88_85a3_08d3;

/// The lease filter's slot of `key`: its word and the bit in it. The agent
/// sets a key's bit before it writes the key's grant and clears it (when
/// no other granted key has the bit) after it removes the grant, so a
/// clear bit means the key holds no grant, and the kernel skips the
/// `FLOWCTL_GRANTS` lookup of a key without a lease (a flood's keys, or a
/// key visited less often than `REFRESH_NS`). A set bit only costs the
/// lookup. One `keys::key_hash`, the same in the kernel and the agent.
#[inline(always)]
pub fn filter_slot(key: &BucketKey) -> (u32, u64) {
    let h = crate::keys::key_hash(FILTER_SEED, key);
    let bit = h % LEASE_FILTER_BITS;
    ((bit / 64) as u32, 1 << (bit % 64))
}

/// Why a key is reported hot (`HotKey::why`).
pub mod hot {
    /// A packet of the key was refused.
    pub const REFUSED: u32 = 0;
    /// A key without a lease used more than half its default burst.
    pub const HALF_SHARE: u32 = 1;
}

/// The word for a grant of one unit per `interval_fp` (fixed-point ns) with
/// a burst of `burst_units`. Never [`NO_LEASE`]: a zero grant is the longest
/// interval with no burst, which refuses everything.
pub fn encode(interval_fp: u64, burst_units: u64) -> u64 {
    let interval = interval_fp.clamp(1, MAX_INTERVAL_FP);
    let units = burst_units.min(MAX_BURST_UNITS);
    let bits = u64::BITS - units.leading_zeros();
    let e = bits.saturating_sub(MANTISSA_BITS);
    let m = units >> e;
    (interval << (MANTISSA_BITS + EXPONENT_BITS)) | (m << EXPONENT_BITS) | e as u64
}

/// The emission interval (fixed point) and burst (units) of a word, `None`
/// for [`NO_LEASE`].
#[inline(always)]
pub fn decode(word: u64) -> Option<(u64, u64)> {
    if word == NO_LEASE {
        return None;
    }
    let interval = word >> (MANTISSA_BITS + EXPONENT_BITS);
    let m = (word >> EXPONENT_BITS) & ((1 << MANTISSA_BITS) - 1);
    let e = word & ((1 << EXPONENT_BITS) - 1);
    Some((interval, m << e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_slots_spread_and_stay_in_range() {
        // 4096 source keys of one rule over 2^20 bits: few share a bit
        // (expected about 8 pairs), and every slot is in the filter.
        let mut seen = std::collections::HashSet::new();
        for i in 0..4096u32 {
            let k = BucketKey {
                state_id: 7,
                family: 4,
                src: [0x0a00_0000 + i, 0, 0, 0],
                ..Default::default()
            };
            let (w, m) = filter_slot(&k);
            assert!(w < LEASE_FILTER_WORDS && m.count_ones() == 1);
            seen.insert((w, m));
        }
        assert!(seen.len() > 4096 - 40, "{} distinct slots", seen.len());
        // Every field counts.
        let k = BucketKey { state_id: 7, family: 4, src: [1, 0, 0, 0], ..Default::default() };
        for other in [
            BucketKey { state_id: 8, ..k },
            BucketKey { dport: 80, ..k },
            BucketKey { dst: [0, 0, 0, 1], ..k },
        ] {
            assert_ne!(filter_slot(&k), filter_slot(&other));
        }
    }

    #[test]
    fn words_round_trip_and_round_toward_the_limit() {
        for (interval, burst) in [(1u64, 0u64), (256, 1), (2_560_000, 50), (1 << 40, 4095)] {
            assert_eq!(decode(encode(interval, burst)), Some((interval, burst)));
        }
        // Bursts above 12 bits lose low bits, downward, by under 1/4096.
        for burst in [4096u64, 10_000, 1_000_003, 123_456_789] {
            let (_, b) = decode(encode(1000, burst)).unwrap();
            assert!(b <= burst && burst - b <= burst / 4096, "{burst} -> {b}");
        }
        assert_eq!(decode(encode(1000, u64::MAX)).unwrap().1, MAX_BURST_UNITS);
        // Too slow to store: the slowest that can be (stricter, not looser).
        assert_eq!(decode(encode(u64::MAX, 5)).unwrap().0, MAX_INTERVAL_FP);
        // A zero grant is a lease that admits nothing, not "no lease".
        let zero = encode(MAX_INTERVAL_FP, 0);
        assert_ne!(zero, NO_LEASE);
        assert_eq!(decode(zero), Some((MAX_INTERVAL_FP, 0)));
        assert_eq!(decode(NO_LEASE), None);
    }
}
