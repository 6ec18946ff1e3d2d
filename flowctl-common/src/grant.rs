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

/// How often the kernel re-reads a key's grant from the map, at most.
pub const REFRESH_NS: u64 = 50_000_000;
/// How often one key is reported hot to the agent, at most.
pub const HOT_EVERY_NS: u64 = 100_000_000;
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
