//! The flood sketch (docs/algorithms.md 1.9): a fixed amount of memory that
//! decides for keys the key table does not hold, so that a flood of more
//! distinct keys (spoofed sources) than the table holds is limited without
//! creating a bucket per key, which evicts live keys and hands every
//! evicted key a fresh burst.
//!
//! A rule's sketch is [`SKETCH_ROWS`] rows of `columns` GCRA TATs (a
//! count-min sketch whose counters are TATs). A key owns one cell per row
//! ([`cells`]); its TAT is estimated as the least of its cells
//! ([`estimate`]), decided by the GCRA of its rule ([`crate::gcra::admit`]),
//! and an admission raises each of its cells to the new TAT if it is below
//! it ([`raised`], the conservative update of Estan and Varghese, "New
//! Directions in Traffic Measurement and Accounting", SIGCOMM 2002).
//!
//! Bounds (proved in docs/algorithms.md 1.9, checked by the property tests
//! below):
//! - **Never more lenient than a bucket per key.** Every cell of a key is at
//!   least the TAT an exact bucket fed the same admissions would hold, so
//!   each key's admissions conform to its rule's GCRA: at most
//!   `burst + r*t` in any `t`. Collisions only ever refuse.
//! - **False refusals are bounded by the load.** A cell's debt is at most
//!   the backlog of a single-server queue fed by every admission that
//!   touched it. Under a flood whose keys hash uniformly (the hash is keyed
//!   by the load's random seed), with a per-cell offered load `rho` (unit
//!   packets per second into the sketch times the increment, divided by
//!   `columns`), a key's first packet is refused with probability at most
//!   `p_row^ROWS`, with `p_row = min(rho, exp(-theta * (burst - 1)))` and
//!   `theta` the positive root of `rho * (e^theta - 1) = theta`
//!   ([`false_refusal_bound`]; Kingman's exponential bound for the queue's
//!   waiting time, which Poisson arrivals see at a random instant).

use crate::{keys::key_hash, BucketKey};

/// Rows: independent chances for a key to find a cell no heavy key shares.
/// Each row divides the false-refusal probability by about `1 / p_row`.
pub const SKETCH_ROWS: usize = 4;

/// Columns per row of each sketch of the pool (`FLOWCTL_SKETCHES`). At
/// 2^15 a sketch is 1 MiB and keeps a new key's first-packet refusals
/// under 1% for a flood of up to about 120,000 new-key packets per second
/// against 5/s with a burst of 3 (10,000 against 1/s with a burst of 1) ([`flood_capacity`]; docs/algorithms.md
/// 1.9).
pub const SKETCH_COLUMNS: u32 = 1 << 15;
/// Sketches in the pool the agent lends to flooded rules: so many rules
/// can be flooded at once; a further one keeps its buckets (and its debt
/// table) and the agent says so.
pub const SKETCH_POOL: u32 = 4;
/// Cells of one sketch: `SKETCH_ROWS` rows of `SKETCH_COLUMNS`.
pub const SKETCH_CELLS: u32 = SKETCH_ROWS as u32 * SKETCH_COLUMNS;

/// The index in the pool's flat array of sketch `sketch`'s cell in `row`
/// at `column` (sketch < `SKETCH_POOL`, column < `SKETCH_COLUMNS`).
#[inline(always)]
pub fn cell_index(sketch: u32, row: u32, column: u32) -> u32 {
    sketch * SKETCH_CELLS + row * SKETCH_COLUMNS + column
}

/// XORed into the load's seed, so a key's sketch cells are independent of
/// its debt set (`debt::locate`), which hashes the same key.
const SKETCH_SALT: u64 = 0x5ce7_c4f1_0a7e_d5e1;

/// The column of `key` in each row of a sketch with `columns` columns per
/// row (a power of two). One keyed hash gives all rows (double hashing,
/// Kirsch and Mitzenmacher, "Less Hashing, Same Performance", ESA 2006):
/// row `i` takes `h1 + i * h2`, `h2` odd.
#[inline(always)]
pub fn cells(seed: u64, key: &BucketKey, columns: u32) -> [u32; SKETCH_ROWS] {
    let h = key_hash(seed ^ SKETCH_SALT, key);
    let (h1, h2) = (h as u32, (h >> 32) as u32 | 1);
    let mask = columns.wrapping_sub(1);
    let mut out = [0u32; SKETCH_ROWS];
    let mut i = 0;
    while i < SKETCH_ROWS {
        out[i] = h1.wrapping_add((i as u32).wrapping_mul(h2)) & mask;
        i += 1;
    }
    out
}

/// The key's TAT as the sketch knows it: the least of its cells. Never
/// below the TAT its own bucket would hold.
#[inline(always)]
pub fn estimate(cells: [u64; SKETCH_ROWS]) -> u64 {
    let mut m = cells[0];
    let mut i = 1;
    while i < SKETCH_ROWS {
        if cells[i] < m {
            m = cells[i];
        }
        i += 1;
    }
    m
}

/// A cell after an admission moved its key's TAT to `new`: raised to it,
/// never lowered (a cell shared with a key further in debt keeps that
/// debt).
#[inline(always)]
pub fn raised(cell: u64, new: u64) -> u64 {
    if cell > new {
        cell
    } else {
        new
    }
}

/// The bound on the probability that a key's first packet is refused by
/// collisions, for a rule whose sketch sees a per-cell offered load `rho`
/// (see the module's documentation) and whose burst is `burst` unit
/// packets: `min(rho, exp(-theta * (burst - 1)))^rows`. 1 when `rho >= 1`
/// (the cells are saturated: the flood alone exceeds what `columns` keys
/// at the rule's rate may send).
#[cfg(not(target_arch = "bpf"))]
pub fn false_refusal_bound(rho: f64, burst: u64, rows: usize) -> f64 {
    if rho >= 1.0 {
        return 1.0;
    }
    if rho <= 0.0 {
        return 0.0;
    }
    // rho * (e^t - 1) - t is negative on (0, theta) and positive beyond.
    let f = |t: f64| rho * t.exp_m1() - t;
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while f(hi) < 0.0 {
        lo = hi;
        hi *= 2.0;
    }
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if f(mid) < 0.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    // `lo` is at or below the root, so the bound errs on the safe side.
    let p_row = rho.min((-lo * burst.saturating_sub(1) as f64).exp());
    p_row.powi(rows as i32)
}

/// Columns per row that keep [`false_refusal_bound`] at or below `target`
/// for a flood of `flood_pps` unit packets per second against a rule whose
/// increment is `increment_ns` and burst `burst`: the least power of two.
/// None if no sketch of up to 2^24 columns does.
#[cfg(not(target_arch = "bpf"))]
pub fn columns_for(flood_pps: f64, increment_ns: u64, burst: u64, target: f64) -> Option<u32> {
    let work = flood_pps * increment_ns as f64 * 1e-9;
    (0..=24u32)
        .map(|b| 1u32 << b)
        .find(|&w| false_refusal_bound(work / w as f64, burst, SKETCH_ROWS) <= target)
}

/// The largest flood, in unit packets per second from keys without a
/// bucket, that a sketch of `columns` columns meets with at most `target`
/// of new keys' first packets refused, for a rule of increment
/// `increment_ns` and burst `burst` (the inverse of [`columns_for`], to
/// within 1%). 0 when even a trickle would miss the target.
#[cfg(not(target_arch = "bpf"))]
pub fn flood_capacity(columns: u32, increment_ns: u64, burst: u64, target: f64) -> f64 {
    if increment_ns == 0 {
        return f64::INFINITY;
    }
    // rho = pps * increment / columns; the bound grows with rho.
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if false_refusal_bound(mid, burst, SKETCH_ROWS) <= target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo * columns as f64 / (increment_ns as f64 * 1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gcra;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// The host model of one rule's sketch: what the kernel's stage does
    /// per packet, on a vector.
    struct Sketch {
        seed: u64,
        columns: u32,
        rows: Vec<u64>,
    }

    impl Sketch {
        fn new(seed: u64, columns: u32) -> Self {
            Sketch { seed, columns, rows: vec![0; SKETCH_ROWS * columns as usize] }
        }

        fn slots(&self, key: &BucketKey) -> [usize; SKETCH_ROWS] {
            let c = cells(self.seed, key, self.columns);
            core::array::from_fn(|i| i * self.columns as usize + c[i] as usize)
        }

        fn estimate(&self, key: &BucketKey) -> u64 {
            estimate(self.slots(key).map(|s| self.rows[s]))
        }

        /// The decision for one packet: admitted or not, and the cells raised.
        fn offer(&mut self, key: &BucketKey, now: u64, increment: u64, burst_ns: u64) -> bool {
            match gcra::admit(self.estimate(key), now, increment, burst_ns) {
                Some(new) => {
                    for s in self.slots(key) {
                        self.rows[s] = raised(self.rows[s], new);
                    }
                    true
                }
                None => false,
            }
        }
    }

    fn key(n: u32) -> BucketKey {
        BucketKey { state_id: 7, family: 4, proto: 17, src: [n, 0, 0, 0], ..Default::default() }
    }

    /// A small deterministic generator for the load simulations (xorshift64*).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        /// Exponential with mean `mean` (Poisson arrivals).
        fn exp(&mut self, mean: f64) -> f64 {
            let u = ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            -mean * u.ln()
        }
    }

    proptest! {
        /// Collisions never admit: with few columns (so keys share cells),
        /// every packet the sketch admits is one an exact bucket of its key,
        /// fed only the sketch's admissions, admits too, and every cell of a
        /// key stays at or above that bucket's TAT.
        #[test]
        fn never_more_lenient_than_a_bucket_per_key(
            seed in any::<u64>(),
            columns in prop::sample::select(vec![1u32, 2, 8, 64]),
            increment in 1u64..1_000,
            burst in 1u64..5,
            packets in prop::collection::vec((0u32..40, 0u64..400, 1u64..4), 1..400),
        ) {
            let mut sketch = Sketch::new(seed, columns);
            let mut exact: HashMap<u32, u64> = HashMap::new();
            let burst_ns = gcra::burst_ns(increment << gcra::FRAC_BITS, burst);
            let mut now = 1_000_000u64;
            for (k, dt, cost) in packets {
                now += dt;
                let inc = increment * cost;
                if sketch.offer(&key(k), now, inc, burst_ns) {
                    let tat = exact.entry(k).or_insert(0);
                    let new = gcra::admit(*tat, now, inc, burst_ns);
                    prop_assert!(new.is_some(), "key {k} admitted beyond its own bucket at {now}");
                    *tat = new.unwrap();
                }
                for (&k, &tat) in &exact {
                    prop_assert!(sketch.estimate(&key(k)) >= tat);
                }
            }
        }

        /// A key that shares no cell with another decides exactly as its
        /// own bucket: with one key, the sketch is a bucket.
        #[test]
        fn a_key_alone_is_decided_as_by_its_bucket(
            seed in any::<u64>(),
            increment in 1u64..1_000,
            burst in 1u64..5,
            packets in prop::collection::vec((0u64..2_000, 1u64..4), 1..200),
        ) {
            let mut sketch = Sketch::new(seed, 16);
            let burst_ns = gcra::burst_ns(increment << gcra::FRAC_BITS, burst);
            let (mut tat, mut now) = (0u64, 1_000_000u64);
            for (dt, cost) in packets {
                now += dt;
                let exact = gcra::admit(tat, now, increment * cost, burst_ns);
                prop_assert_eq!(sketch.offer(&key(1), now, increment * cost, burst_ns), exact.is_some());
                if let Some(t) = exact {
                    tat = t;
                }
            }
        }

        /// Rows are spread: a key's cells are in range and, for more than
        /// one column, not all in one column.
        #[test]
        fn cells_are_in_range(seed in any::<u64>(), n in any::<u32>(), log2 in 0u32..20) {
            let c = cells(seed, &key(n), 1 << log2);
            prop_assert!(c.iter().all(|&x| x < 1 << log2));
            // h2 is odd, so rows differ by a non-zero step modulo w >= 2.
            prop_assert!(log2 == 0 || c.iter().any(|&x| x != c[0]));
        }
    }

    /// Under a flood of distinct keys arriving as a Poisson process, new
    /// keys' first packets are refused no more often than the bound, and
    /// far less often in practice. Each flood packet is a new key (a
    /// spoofed source), the harshest case for a bucket per key.
    #[test]
    fn a_flood_refuses_new_keys_within_the_bound() {
        let increment = 200_000_000u64; // 5/s
        let columns = 1024u32;
        for (rho, burst) in [(0.3, 3u64), (0.5, 3), (0.8, 3), (0.5, 1), (0.5, 5)] {
            let burst_ns = gcra::burst_ns(increment << gcra::FRAC_BITS, burst);
            let mut sketch = Sketch::new(0x1234_5678, columns);
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (rho * 1000.0) as u64 ^ burst);
            // Flood packets per ns so that rho = rate * increment / columns.
            let mean_gap = increment as f64 / (rho * columns as f64);
            let (mut now, mut next_key) = (1_000_000_000f64, 0u32);
            let warm = 20_000u32;
            let (mut probes, mut refused) = (0u32, 0u32);
            for i in 0..200_000u32 {
                now += rng.exp(mean_gap);
                let admitted = sketch.offer(&key(next_key), now as u64, increment, burst_ns);
                next_key += 1;
                if i >= warm {
                    probes += 1;
                    refused += u32::from(!admitted);
                }
            }
            let measured = refused as f64 / probes as f64;
            let bound = false_refusal_bound(rho, burst, SKETCH_ROWS);
            // Three standard errors of the measured share on top of the bound.
            let slack = 3.0 * (bound.max(1.0 / probes as f64) / probes as f64).sqrt();
            assert!(
                measured <= bound + slack,
                "rho {rho}, burst {burst}: {refused} of {probes} refused ({measured:.2e}) above the bound {bound:.2e}"
            );
        }
    }

    #[test]
    fn the_bound_and_the_sizing_agree() {
        // M/D/1 at rho 0.5: theta solves 0.5 (e^t - 1) = t, about 1.2564.
        let b = false_refusal_bound(0.5, 3, 1);
        assert!((b - (-2.0 * 1.2564f64).exp()).abs() < 1e-3, "{b}");
        assert_eq!(false_refusal_bound(0.5, 1, 2), 0.25, "burst 1: the busy share per row");
        assert_eq!(false_refusal_bound(1.0, 3, 4), 1.0);
        // A 50,000/s flood against 5/s per source with a burst of 3: the
        // columns for at most 1% of new sources refused.
        let w = columns_for(50_000.0, 200_000_000, 3, 0.01).unwrap();
        assert!(false_refusal_bound(10_000.0 / w as f64, 3, SKETCH_ROWS) <= 0.01);
        assert!(false_refusal_bound(10_000.0 / (w / 2) as f64, 3, SKETCH_ROWS) > 0.01);
    }

    #[test]
    fn flood_capacity_inverts_the_sizing() {
        // The pool's sketches against 5/s, burst 3: the flood they hold at 1%.
        let pps = flood_capacity(SKETCH_COLUMNS, 200_000_000, 3, 0.01);
        assert!(pps > 50_000.0, "{pps}");
        assert!(columns_for(pps * 0.99, 200_000_000, 3, 0.01).unwrap() <= SKETCH_COLUMNS);
        assert!(columns_for(pps * 1.02, 200_000_000, 3, 0.01).unwrap() > SKETCH_COLUMNS);
        // A limit of one a minute meets even a trickle with saturated cells.
        assert!(flood_capacity(SKETCH_COLUMNS, 60_000_000_000, 1, 0.01) < 1_000.0);
        assert_eq!(cell_index(1, 2, 3), SKETCH_CELLS + 2 * SKETCH_COLUMNS + 3);
    }
}
