//! The BBR adaptive limiter's decision (docs/algorithms.md section 4; Kratos and
//! its port aegis), pure: the agent evaluates it over the statistics rings
//! and writes the result into the rule's control record; host tests run the
//! golden vectors.
//!
//! Over a window of full buckets (the bucket being filled is skipped):
//! - `maxPass` = the most completions in one bucket (at least 1);
//! - `minRT` = ceil(min over buckets of the mean round trip in ms) (at least 1);
//! - `maxInFlight = maxPass * minRT * bucketsPerSecond / 1000`;
//! - a new arrival is refused when `cpu >= threshold` and
//!   `inFlight > 1 && inFlight > maxInFlight`; after an overload the in-flight
//!   test stays on for a cool-down (1 s) even when the CPU is below threshold.
//!
//! Four defects of the original are fixed by default, each behind a named
//! `Compat` switch that restores it:
//! - `floor_max_inflight`: aegis floors `maxInFlight`, so a capacity of 5.9
//!   admits 5. flowctl rounds up: never fewer than measured.
//! - `empty_window_zero`: with no completed buckets the estimate is 0, so under
//!   high CPU every second concurrent arrival is refused although nothing is
//!   known. flowctl does not limit until the window has data.
//! - `cooldown_from_first_drop`: Kratos anchors the cool-down at the first
//!   drop of an episode, so after a long overload it has already expired when
//!   the CPU falls. flowctl anchors it at the last overload: the last drop
//!   made while the CPU was over threshold. (Not at any last drop: drops in
//!   the cool-down would then extend it for as long as connections stay
//!   open, with the CPU long back to normal; the end-to-end test caught it.)
//! - `min_rt_from_window`: Kratos takes `minRT` from the window alone, so
//!   once the window holds only buckets measured under load, queueing raises
//!   `minRT`, `maxInFlight` with it, and the service's latency with that
//!   (BBR refreshes RTprop by probing unloaded; a limiter in front of a
//!   saturated service never is). flowctl holds its `minRT`: any window
//!   can lower it, only a window measured wholly unloaded can raise it
//!   (`filtered_min_rt_ms`).

/// One full bucket of the window: completions and round-trip totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BbrBucket {
    pub completed: u64,
    /// Round trips in the bucket, in microseconds (the kernel's resolution).
    pub rt_sum_us: u64,
    pub rt_count: u64,
    /// Measured while the limiter was engaged (CPU over the threshold or
    /// the test on): its round trips include queueing.
    pub loaded: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compat {
    pub floor_max_inflight: bool,
    pub empty_window_zero: bool,
    pub cooldown_from_first_drop: bool,
    pub min_rt_from_window: bool,
}

impl Compat {
    /// Kratos' behaviour in every respect.
    pub const KRATOS: Self = Self {
        floor_max_inflight: true,
        empty_window_zero: true,
        cooldown_from_first_drop: true,
        min_rt_from_window: true,
    };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BbrConfig {
    /// CPU EMA in per-mille at or above which the limiter is active.
    pub cpu_threshold: u32,
    /// Buckets per second of the window (10 for 100 ms buckets).
    pub buckets_per_second: u64,
    pub cooldown_ns: u64,
    /// Hysteresis: once over `cpu_threshold`, the CPU counts as over until
    /// it falls below this (per mille; equal to the threshold: none, as in
    /// Kratos).
    pub release_below: u32,
    pub compat: Compat,
}

impl Default for BbrConfig {
    fn default() -> Self {
        Self {
            cpu_threshold: 800,
            buckets_per_second: 10,
            cooldown_ns: 1_000_000_000,
            release_below: 800,
            compat: Compat::default(),
        }
    }
}

/// `maxInFlight` from `maxPass` and `minRT` (ms); `None` means "no limit"
/// (an empty window, unless `empty_window_zero`).
pub fn in_flight_limit(pass: u64, min_rt_ms: Option<u64>, cfg: &BbrConfig) -> Option<u64> {
    let Some(rt) = min_rt_ms.filter(|_| pass > 0) else {
        return cfg.compat.empty_window_zero.then_some(0);
    };
    let product = pass as u128 * rt as u128 * cfg.buckets_per_second as u128;
    let v = if cfg.compat.floor_max_inflight { product / 1000 } else { product.div_ceil(1000) };
    Some(v.min(u64::MAX as u128) as u64)
}

/// `minRT`: ceil(min over buckets of the mean round trip, in ms), at least
/// 1; `None` without round trips.
pub fn min_rt_ms(window: &[BbrBucket]) -> Option<u64> {
    smallest_mean(window.iter().map(|b| (b.rt_sum_us, b.rt_count))).map(mean_ms)
}

/// `minRT` through the min-filter (unless `compat.min_rt_from_window`):
/// the smallest bucket mean `state` holds, lowered by every window, and
/// replaced (so it may rise) only by a window in which every bucket was
/// measured unloaded and some had round trips. A window that saw the
/// limiter engaged can lower `minRT` but never raise it: the queueing that
/// engagement brings (and the CPU signal's lag lets build up before it)
/// stays out of the estimate until the service has been seen unloaded for
/// a whole window.
pub fn filtered_min_rt_ms(
    window: &[BbrBucket],
    state: &mut BbrState,
    cfg: &BbrConfig,
) -> Option<u64> {
    if cfg.compat.min_rt_from_window {
        return min_rt_ms(window);
    }
    let window_min = smallest_mean(window.iter().map(|b| (b.rt_sum_us, b.rt_count)));
    let unloaded = window.iter().all(|b| !b.loaded);
    state.held_rt = match (unloaded && window_min.is_some(), state.held_rt) {
        (true, _) | (false, None) => window_min,
        (false, Some(held)) => smallest_mean([held].into_iter().chain(window_min)),
    };
    state.held_rt.map(mean_ms)
}

/// The smallest of `(sum, count)` means with `count > 0`, compared by
/// cross-multiplication (no division).
fn smallest_mean(means: impl Iterator<Item = (u64, u64)>) -> Option<(u64, u64)> {
    means
        .filter(|m| m.1 > 0)
        .min_by(|a, b| (a.0 as u128 * b.1 as u128).cmp(&(b.0 as u128 * a.1 as u128)))
}

/// A mean in µs as whole ms, rounded up, at least 1.
fn mean_ms((sum_us, count): (u64, u64)) -> u64 {
    (sum_us as u128).div_ceil(count as u128 * 1000).max(1) as u64
}

/// `maxPass`: the most completions in one full bucket (0 when empty).
pub fn max_pass(window: &[BbrBucket]) -> u64 {
    window.iter().map(|b| b.completed).max().unwrap_or(0)
}

/// The limiter's memory between decisions: when the cool-down started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BbrState {
    /// Time (ns) the cool-down counts from; 0: not cooling down.
    pub drop_anchor_ns: u64,
    /// Over the threshold and not yet below `release_below`.
    pub engaged: bool,
    /// The min-filter's memory: the `minRT` it holds, as the bucket's
    /// `(rt_sum_us, rt_count)`.
    pub held_rt: Option<(u64, u64)>,
}

/// Whether the CPU counts as over the threshold now (with hysteresis), and
/// remembers it.
pub fn cpu_over(state: &mut BbrState, cfg: &BbrConfig, cpu: u32) -> bool {
    if cpu >= cfg.cpu_threshold {
        state.engaged = true;
    } else if cpu < cfg.release_below.min(cfg.cpu_threshold) {
        state.engaged = false;
    }
    state.engaged
}

/// Whether a new arrival is refused now, and the state after it.
pub fn should_drop(
    state: &mut BbrState,
    cfg: &BbrConfig,
    cpu: u32,
    in_flight: u64,
    max: Option<u64>,
    now_ns: u64,
) -> bool {
    let over = |max: Option<u64>| in_flight > 1 && max.is_some_and(|m| in_flight > m);
    if !cpu_over(state, cfg, cpu) {
        if state.drop_anchor_ns == 0 {
            return false;
        }
        if now_ns.saturating_sub(state.drop_anchor_ns) <= cfg.cooldown_ns {
            // Drops in the cool-down do not extend it.
            return over(max);
        }
        state.drop_anchor_ns = 0;
        return false;
    }
    let drop = over(max);
    if drop && (state.drop_anchor_ns == 0 || !cfg.compat.cooldown_from_first_drop) {
        state.drop_anchor_ns = now_ns;
    }
    drop
}

/// Whether the in-flight test is on at all now (CPU over threshold, or
/// cooling down): what the agent tells the kernel.
pub fn active(state: &BbrState, cfg: &BbrConfig, cpu: u32, now_ns: u64) -> bool {
    let over = cpu >= cfg.cpu_threshold
        || (state.engaged && cpu >= cfg.release_below.min(cfg.cpu_threshold));
    over || (state.drop_anchor_ns != 0
        && now_ns.saturating_sub(state.drop_anchor_ns) <= cfg.cooldown_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// `maxInFlight` over a window without the min-filter: the golden
    /// vectors' composition (the agent's filters `minRT` first).
    fn max_in_flight(window: &[BbrBucket], cfg: &BbrConfig) -> Option<u64> {
        in_flight_limit(max_pass(window), min_rt_ms(window), cfg)
    }

    /// aegis' fixture: a 1 s window of 10 buckets; bucket i completed
    /// `pass(i)` requests with RTs i*10+1 ..= i*10+10 ms. The last bucket is
    /// the one being filled and is skipped.
    fn aegis_window(pass: impl Fn(u64) -> u64) -> Vec<BbrBucket> {
        (0..9u64)
            .map(|i| BbrBucket {
                completed: pass(i),
                rt_sum_us: (i * 10 + 1..=i * 10 + 10).sum::<u64>() * 1000,
                rt_count: 10,
                loaded: false,
            })
            .collect()
    }

    #[test]
    fn golden_max_in_flight() {
        let cfg = BbrConfig::default();
        assert_eq!(max_in_flight(&aegis_window(|i| (i + 2) * 100), &cfg), Some(60));
        assert_eq!(max_in_flight(&aegis_window(|i| (i + 1) * 100), &cfg), Some(54));
        let kratos = BbrConfig { compat: Compat::KRATOS, ..cfg };
        assert_eq!(max_in_flight(&aegis_window(|i| (i + 2) * 100), &kratos), Some(60));
        assert_eq!(max_in_flight(&aegis_window(|i| (i + 1) * 100), &kratos), Some(54));
    }

    #[test]
    fn golden_drop_sequence_in_both_modes() {
        for compat in [Compat::default(), Compat::KRATOS] {
            let cfg = BbrConfig { compat, ..Default::default() };
            let max = max_in_flight(&aegis_window(|i| (i + 1) * 100), &cfg);
            assert_eq!(max, Some(54));
            let mut st = BbrState::default();
            let t0 = 100 * S;
            assert!(!should_drop(&mut st, &cfg, 800, 50, max, t0), "cpu 800, in flight 50: admit");
            assert!(should_drop(&mut st, &cfg, 800, 80, max, t0), "cpu 800, in flight 80: drop");
            assert!(
                should_drop(&mut st, &cfg, 700, 80, max, t0 + S / 2),
                "cpu 700 within 1 s of the drop: drop"
            );
            assert!(
                !should_drop(&mut st, &cfg, 700, 80, max, t0 + 2 * S + S / 2),
                "2 s later: admit"
            );
        }
    }

    #[test]
    fn rounding_up_by_default_floor_in_compat() {
        // maxPass 590, minRT 1 ms, 10 buckets/s: 5.9 in flight.
        let w = [BbrBucket { completed: 590, rt_sum_us: 1000, rt_count: 1, loaded: false }];
        assert_eq!(max_in_flight(&w, &BbrConfig::default()), Some(6));
        let floor = BbrConfig {
            compat: Compat { floor_max_inflight: true, ..Default::default() },
            ..Default::default()
        };
        assert_eq!(max_in_flight(&w, &floor), Some(5));
    }

    #[test]
    fn empty_window_does_not_limit_by_default() {
        let cfg = BbrConfig::default();
        assert_eq!(max_in_flight(&[], &cfg), None);
        assert_eq!(max_in_flight(&[BbrBucket::default(); 9], &cfg), None);
        let mut st = BbrState::default();
        assert!(!should_drop(&mut st, &cfg, 1000, 2, None, S), "nothing known: admit");
        let zero = BbrConfig {
            compat: Compat { empty_window_zero: true, ..Default::default() },
            ..Default::default()
        };
        let max = max_in_flight(&[], &zero);
        assert_eq!(max, Some(0));
        assert!(
            should_drop(&mut st, &zero, 1000, 2, max, S),
            "the defect: 2 in flight over a limit of 0"
        );
    }

    #[test]
    fn cooldown_counts_from_the_last_overload_by_default() {
        // Overloaded from t=0 to t=3 s, dropping throughout; the CPU falls at
        // 3.2 s; an arrival at 3.5 s with too many in flight.
        let max = Some(10);
        let run = |compat| {
            let cfg = BbrConfig { compat, ..Default::default() };
            let mut st = BbrState::default();
            for t in 0..=30u64 {
                assert!(should_drop(&mut st, &cfg, 900, 20, max, t * S / 10));
            }
            should_drop(&mut st, &cfg, 500, 20, max, 3 * S + S / 2)
        };
        assert!(run(Compat::default()), "0.5 s after the last overload: still cooling down");
        assert!(
            !run(Compat { cooldown_from_first_drop: true, ..Default::default() }),
            "Kratos: 3.5 s after the first drop, expired"
        );
    }

    #[test]
    fn drops_in_the_cooldown_do_not_extend_it() {
        let cfg = BbrConfig::default();
        let mut st = BbrState::default();
        assert!(should_drop(&mut st, &cfg, 900, 20, Some(10), S));
        // CPU low from here on; connections stay open, arrivals keep coming.
        for t in 1..=9u64 {
            assert!(should_drop(&mut st, &cfg, 100, 20, Some(10), S + t * S / 10), "cooling down");
        }
        assert!(
            !should_drop(&mut st, &cfg, 100, 20, Some(10), S + S + S / 10),
            "1 s after the overload: open"
        );
        assert!(!active(&st, &cfg, 100, 3 * S));
    }

    #[test]
    fn hysteresis_holds_the_test_on_until_the_cpu_falls_below_the_release() {
        let cfg = BbrConfig { release_below: 650, ..Default::default() };
        let mut st = BbrState::default();
        assert!(should_drop(&mut st, &cfg, 850, 20, Some(10), S));
        assert!(
            should_drop(&mut st, &cfg, 700, 20, Some(10), 5 * S),
            "700 is still over with a release at 650"
        );
        assert!(!should_drop(&mut st, &cfg, 600, 20, Some(10), 9 * S), "released");
        assert!(
            !should_drop(&mut st, &cfg, 700, 20, Some(10), 10 * S),
            "700 does not engage it again"
        );
    }

    #[test]
    fn one_in_flight_is_never_refused() {
        let cfg = BbrConfig::default();
        let mut st = BbrState::default();
        assert!(!should_drop(&mut st, &cfg, 1000, 1, Some(0), S));
    }

    #[test]
    fn activity_follows_cpu_and_cooldown() {
        let cfg = BbrConfig::default();
        let mut st = BbrState::default();
        assert!(!active(&st, &cfg, 700, S));
        assert!(active(&st, &cfg, 800, S));
        should_drop(&mut st, &cfg, 900, 100, Some(10), S);
        assert!(active(&st, &cfg, 100, S + S / 2));
        assert!(!active(&st, &cfg, 100, 3 * S));
    }

    fn bucket(rt_ms: u64, loaded: bool) -> BbrBucket {
        BbrBucket { completed: 10, rt_sum_us: rt_ms * 1000 * 4, rt_count: 4, loaded }
    }

    #[test]
    fn a_loaded_window_lowers_min_rt_but_cannot_raise_it() {
        let cfg = BbrConfig::default();
        let mut st = BbrState::default();
        // The ramp: unloaded at 2-3 ms, then queueing builds up at 9-12 ms
        // before the CPU signal engages the limiter (still unloaded).
        let ramp = [bucket(2, false), bucket(3, false), bucket(9, false), bucket(12, false)];
        assert_eq!(filtered_min_rt_ms(&ramp, &mut st, &cfg), Some(2));
        // Engaged: the unloaded buckets leave the window. Kratos' estimate
        // rises to 9; the filter holds 2.
        let engaged = [bucket(9, false), bucket(12, false), bucket(10, true)];
        assert_eq!(min_rt_ms(&engaged), Some(9));
        assert_eq!(filtered_min_rt_ms(&engaged, &mut st, &cfg), Some(2), "held");
        let loaded = [bucket(10, true), bucket(12, true)];
        assert_eq!(filtered_min_rt_ms(&loaded, &mut st, &cfg), Some(2), "held");
        // A loaded bucket faster than what is held lowers it.
        let fast = [bucket(1, true), bucket(12, true)];
        assert_eq!(filtered_min_rt_ms(&fast, &mut st, &cfg), Some(1));
        assert_eq!(filtered_min_rt_ms(&loaded, &mut st, &cfg), Some(1));
        // Nothing held yet: the window's own minimum.
        let mut fresh = BbrState::default();
        assert_eq!(filtered_min_rt_ms(&loaded, &mut fresh, &cfg), Some(10));
        assert_eq!(filtered_min_rt_ms(&[], &mut BbrState::default(), &cfg), None);
    }

    #[test]
    fn only_a_wholly_unloaded_window_raises_the_held_min_rt() {
        // The service became slower for good (5 ms). Once the limiter has
        // stayed off for a whole window, minRT follows it.
        let cfg = BbrConfig::default();
        let mut st = BbrState::default();
        assert_eq!(filtered_min_rt_ms(&[bucket(2, false)], &mut st, &cfg), Some(2));
        let partly = [bucket(9, true), bucket(5, false), bucket(6, false)];
        assert_eq!(filtered_min_rt_ms(&partly, &mut st, &cfg), Some(2));
        let idle = [BbrBucket::default(), BbrBucket::default()];
        assert_eq!(filtered_min_rt_ms(&idle, &mut st, &cfg), Some(2), "no round trips: kept");
        let unloaded = [bucket(5, false), bucket(6, false)];
        assert_eq!(filtered_min_rt_ms(&unloaded, &mut st, &cfg), Some(5));
        assert_eq!(filtered_min_rt_ms(&[bucket(9, true)], &mut st, &cfg), Some(5));
    }

    #[test]
    fn compat_takes_min_rt_from_the_window_alone() {
        let cfg = BbrConfig {
            compat: Compat { min_rt_from_window: true, ..Default::default() },
            ..Default::default()
        };
        let mut st = BbrState::default();
        assert_eq!(filtered_min_rt_ms(&[bucket(2, false)], &mut st, &cfg), Some(2));
        assert_eq!(filtered_min_rt_ms(&[bucket(9, true)], &mut st, &cfg), Some(9));
        assert_eq!(st.held_rt, None);
        let limit = in_flight_limit(50, Some(9), &cfg);
        assert_eq!(limit, Some(5), "50 a bucket x 9 ms x 10 buckets/s = 4.5, rounded up");
    }
}
