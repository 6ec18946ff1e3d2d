//! KLimiter (docs/algorithms.md section 5): keeps each downstream resource (a
//! *baseline*, with a water level L and a threshold T) under its threshold
//! by lowering the admission ratios of the flowctl rules (*entries*) that
//! load it, low priority first. Pure and deterministic: the agent calls
//! [`Controller::step`] every control period with the period's means, and
//! `flowctl simulate` calls the same function against a modelled plant.
//!
//! One step, per baseline: fit the coefficients of L = sum a_i q_i over the
//! last max(2n, 10) periods (non-negative least squares; an ill-conditioned
//! history, e.g. entries cut in lockstep, keeps the previous fit); shares
//! s_i = a_i q_i / sum a_k q_k; then cut (L > T, aiming at T* = (1 - h/2) T,
//! round 1 within floors and the per-period cap with redistribution, round 2
//! below the floors when nobody has room left), raise (L < (1 - h) T:
//! slow start with headroom passed on from capped entries) or hold. An entry
//! takes the largest cut any of its baselines asks for, else holds if any is
//! in its dead band, else takes the smallest raise.

use nalgebra::DMatrix;
use serde::Serialize;
use std::collections::VecDeque;

/// Tuning, with the defaults of docs/algorithms.md section 5.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Dead band h: hold between (1 - h) T and T; cut towards (1 - h/2) T.
    pub dead_band: f64,
    /// Most ratio points an entry loses in one period.
    pub cap: f64,
    /// The lowest ratio anything is cut to.
    pub min_ratio: f64,
    /// Entries offered less than this (per second, before throttling) are
    /// never cut.
    pub eligible_qps: f64,
    /// Column-normalised condition number above which a fit is not trusted.
    pub max_condition: f64,
    /// New ratios are rounded down to this resolution.
    pub resolution: f64,
    /// A baseline whose level source fails holds its entries; after this
    /// many periods it releases them towards 1.0 at slow-start pace.
    pub release_after_periods: u32,
}

/// Ratios change only when the level is outside the threshold by more than
/// this fraction (docs/algorithms.md section 5); the profile's default too.
pub const DEFAULT_DEAD_BAND: f64 = 0.03;

impl Default for Config {
    fn default() -> Self {
        Self {
            dead_band: DEFAULT_DEAD_BAND,
            cap: 0.05,
            min_ratio: 0.01,
            eligible_qps: 5.0,
            max_condition: 50.0,
            resolution: 1e-3,
            release_after_periods: 6,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct EntrySpec {
    pub name: String,
    /// The lowest ratio round 1 may cut it to (its priority).
    pub floor: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BaselineSpec {
    pub name: String,
    pub threshold: f64,
    /// Indices of the entries that load it.
    pub entries: Vec<usize>,
}

/// One control period's means.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Period {
    /// Per entry, offered (before any throttling) and admitted per second.
    pub offered: Vec<f64>,
    pub admitted: Vec<f64>,
    /// Per baseline, the level; `None` when its source failed this period.
    pub levels: Vec<Option<f64>>,
}

/// What one baseline did in a step, for `top`, metrics and `simulate`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BaselineView {
    pub name: String,
    pub level: Option<f64>,
    pub threshold: f64,
    /// "cut", "raise", "hold" (dead band), "stale" (source failing).
    pub band: String,
    pub coefficients: Vec<f64>,
    pub shares: Vec<f64>,
    /// Whether this step refitted the coefficients (false: kept).
    pub fitted: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EntryView {
    pub name: String,
    pub ratio: f64,
    /// Why the ratio last changed ("" until it does).
    pub reason: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepView {
    pub baselines: Vec<BaselineView>,
    pub entries: Vec<EntryView>,
}

struct BaselineState {
    /// (admitted q of its entries, level) per period, newest last.
    history: VecDeque<(Vec<f64>, f64)>,
    coefficients: Vec<f64>,
    failing_periods: u32,
}

/// What a baseline asks of one entry.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ask {
    Cut(f64),
    Hold,
    Raise(f64),
}

pub struct Controller {
    cfg: Config,
    entries: Vec<EntrySpec>,
    baselines: Vec<BaselineSpec>,
    state: Vec<BaselineState>,
    ratios: Vec<f64>,
    reasons: Vec<String>,
}

impl Controller {
    pub fn new(cfg: Config, entries: Vec<EntrySpec>, baselines: Vec<BaselineSpec>) -> Self {
        let state = baselines
            .iter()
            .map(|b| BaselineState {
                history: VecDeque::new(),
                coefficients: vec![1.0; b.entries.len()],
                failing_periods: 0,
            })
            .collect();
        let n = entries.len();
        Self {
            cfg,
            entries,
            baselines,
            state,
            ratios: vec![1.0; n],
            reasons: vec![String::new(); n],
        }
    }

    pub fn ratios(&self) -> &[f64] {
        &self.ratios
    }

    /// Changes a baseline's threshold (thresholds may move at run time).
    pub fn set_threshold(&mut self, baseline: usize, t: f64) {
        self.baselines[baseline].threshold = t;
    }

    /// The ratio of the entry named `name`.
    pub fn ratio_of(&self, name: &str) -> Option<f64> {
        self.entries.iter().position(|e| e.name == name).map(|i| self.ratios[i])
    }

    /// Starts from given ratios (for tests and a restarted agent).
    pub fn set_ratios(&mut self, r: &[f64]) {
        self.ratios.copy_from_slice(r);
    }

    fn floor(&self, i: usize) -> f64 {
        self.entries[i].floor.max(self.cfg.min_ratio)
    }

    /// One control period: returns what every baseline and entry did.
    pub fn step(&mut self, p: &Period) -> StepView {
        let mut asks: Vec<Vec<(Ask, String)>> = vec![Vec::new(); self.entries.len()];
        let mut views = Vec::new();
        for b in 0..self.baselines.len() {
            let spec = self.baselines[b].clone();
            let q: Vec<f64> =
                spec.entries.iter().map(|&i| p.admitted.get(i).copied().unwrap_or(0.0)).collect();
            let mut view = BaselineView {
                name: spec.name.clone(),
                threshold: spec.threshold,
                level: p.levels.get(b).copied().flatten(),
                ..Default::default()
            };
            let Some(level) = view.level.filter(|l| l.is_finite() && *l >= 0.0) else {
                // A failing source: hold, then release towards 1.0.
                let st = &mut self.state[b];
                st.failing_periods += 1;
                view.band = "stale".into();
                view.coefficients = st.coefficients.clone();
                let release = st.failing_periods > self.cfg.release_after_periods;
                for &i in &spec.entries {
                    let ask = if release {
                        Ask::Raise(slow_start_cap(self.ratios[i]))
                    } else {
                        Ask::Hold
                    };
                    asks[i].push((
                        ask,
                        format!(
                            "{}: level source failing, {}",
                            spec.name,
                            if release { "releasing" } else { "holding" }
                        ),
                    ));
                }
                views.push(view);
                continue;
            };
            self.state[b].failing_periods = 0;
            view.fitted = self.fit(b, &q, level);
            let a = self.state[b].coefficients.clone();
            let loads: Vec<f64> = a.iter().zip(&q).map(|(a, q)| a * q).collect();
            let total: f64 = loads.iter().sum();
            let shares: Vec<f64> = if total > 0.0 {
                loads.iter().map(|l| l / total).collect()
            } else {
                vec![1.0 / q.len().max(1) as f64; q.len()]
            };
            view.coefficients = a;
            view.shares = shares.clone();
            let t = spec.threshold;
            let h = self.cfg.dead_band;
            if level > t {
                view.band = "cut".into();
                for (k, cut) in self.cut(&spec, &shares, level, p) {
                    asks[spec.entries[k]].push((
                        Ask::Cut(cut),
                        format!("{}: level {level:.1} over threshold {t:.1}", spec.name),
                    ));
                }
            } else if level < (1.0 - h) * t {
                view.band = "raise".into();
                for (k, r) in self.raise(&spec, &shares, level).into_iter().enumerate() {
                    asks[spec.entries[k]].push((
                        Ask::Raise(r),
                        format!("{}: level {level:.1} under {:.1}", spec.name, (1.0 - h) * t),
                    ));
                }
            } else {
                view.band = "hold".into();
                for &i in &spec.entries {
                    asks[i].push((Ask::Hold, String::new()));
                }
            }
            views.push(view);
        }
        // Combine: the largest cut, else hold, else the smallest raise.
        for (i, a) in asks.iter().enumerate() {
            let cut = a
                .iter()
                .filter_map(|(x, why)| if let Ask::Cut(c) = x { Some((*c, why)) } else { None })
                .max_by(|x, y| x.0.total_cmp(&y.0));
            let old = self.ratios[i];
            let new = if let Some((c, why)) = cut {
                let r = round_down(
                    (old - c.min(self.cfg.cap)).max(self.cfg.min_ratio),
                    self.cfg.resolution,
                );
                if r < old {
                    self.reasons[i] = format!("cut {:.3} -> {r:.3}: {why}", old);
                }
                r
            } else if a.iter().any(|(x, _)| *x == Ask::Hold) || a.is_empty() {
                old
            } else {
                let (r, why) = a
                    .iter()
                    .filter_map(
                        |(x, why)| if let Ask::Raise(r) = x { Some((*r, why)) } else { None },
                    )
                    .min_by(|x, y| x.0.total_cmp(&y.0))
                    .expect("only raises left");
                let r = round_down(r.min(1.0), self.cfg.resolution).max(old);
                if r > old {
                    self.reasons[i] = format!("raise {:.3} -> {r:.3}: {why}", old);
                }
                r
            };
            self.ratios[i] = new;
        }
        StepView {
            baselines: views,
            entries: self
                .entries
                .iter()
                .enumerate()
                .map(|(i, e)| EntryView {
                    name: e.name.clone(),
                    ratio: self.ratios[i],
                    reason: self.reasons[i].clone(),
                })
                .collect(),
        }
    }

    /// Adds the period to the baseline's history and refits when the
    /// history identifies the coefficients. Returns whether it refitted.
    fn fit(&mut self, b: usize, q: &[f64], level: f64) -> bool {
        let n = q.len();
        let keep = (2 * n).max(10);
        let st = &mut self.state[b];
        st.history.push_back((q.to_vec(), level));
        while st.history.len() > keep {
            st.history.pop_front();
        }
        if n == 0 || st.history.len() < n {
            return false;
        }
        let rows = st.history.len();
        let a = DMatrix::from_fn(rows, n, |r, c| st.history[r].0[c]);
        if condition_number(&a) > self.cfg.max_condition {
            return false;
        }
        let am = ndarray::Array2::from_shape_fn((rows, n), |(r, c)| st.history[r].0[c]);
        let bv = ndarray::Array1::from_iter(st.history.iter().map(|h| h.1));
        let (x, _) = nnls::nnls(am.view(), bv.view());
        st.coefficients = x.to_vec();
        true
    }

    /// Round 1 and, if needed, round 2: ratio points to cut per entry of
    /// the baseline (by position in its entry list).
    fn cut(
        &self,
        spec: &BaselineSpec,
        shares: &[f64],
        level: f64,
        p: &Period,
    ) -> Vec<(usize, f64)> {
        let cfg = &self.cfg;
        let target = (1.0 - cfg.dead_band / 2.0) * spec.threshold;
        let d = (level - target) / level;
        let n = spec.entries.len();
        let r: Vec<f64> = spec.entries.iter().map(|&i| self.ratios[i]).collect();
        let eligible: Vec<bool> = spec
            .entries
            .iter()
            .map(|&i| p.offered.get(i).copied().unwrap_or(0.0) >= cfg.eligible_qps)
            .collect();
        let floors: Vec<f64> = spec.entries.iter().map(|&i| self.floor(i)).collect();
        let mut cut = vec![0.0; n];
        const EPS: f64 = 1e-9;
        // Room: what the entry may still lose this period, within its floor
        // (round 1) or the minimum ratio (round 2), and the cap.
        let room = |k: usize, cut: &[f64], floor: f64| -> f64 {
            if !eligible[k] {
                return 0.0;
            }
            (r[k] - cut[k] - floor).min(cfg.cap - cut[k]).max(0.0)
        };
        // Round 1: each entry's proportional cut, limited; the level it
        // could not shed is spread over those with room.
        let mut d_left = 0.0;
        for k in 0..n {
            if !eligible[k] || r[k] <= 0.0 {
                continue;
            }
            let want = d * r[k];
            let got = want.min(room(k, &cut, floors[k]));
            cut[k] = got;
            d_left += (want - got) / r[k] * shares[k];
        }
        let spread = |cut: &mut Vec<f64>,
                      mut d_left: f64,
                      floor_of: &dyn Fn(usize) -> f64,
                      allowed: &dyn Fn(usize) -> bool|
         -> f64 {
            for _ in 0..(4 * n + 4) {
                if d_left <= EPS {
                    break;
                }
                let with_room: Vec<usize> =
                    (0..n).filter(|&k| allowed(k) && room(k, cut, floor_of(k)) > EPS).collect();
                let s_r: f64 = with_room.iter().map(|&k| shares[k]).sum();
                if with_room.is_empty() || s_r <= EPS {
                    break;
                }
                let mut next = 0.0;
                for &k in &with_room {
                    let want = r[k] * d_left / s_r;
                    let got = want.min(room(k, cut, floor_of(k)));
                    cut[k] += got;
                    next += (want - got) / r[k] * shares[k];
                }
                d_left = next;
            }
            d_left
        };
        d_left = spread(&mut cut, d_left, &|k| floors[k], &|_| true);
        // Round 2, in the same period: nobody is above its floor any more,
        // so cut below the floors (to the minimum ratio), by shares.
        let nobody_above_floor =
            (0..n).filter(|&k| eligible[k]).all(|k| r[k] - cut[k] <= floors[k] + EPS);
        if d_left > EPS && nobody_above_floor {
            let min = cfg.min_ratio;
            spread(&mut cut, d_left, &|_| min, &|_| true);
        }
        (0..n).filter(|&k| cut[k] > 0.0).map(|k| (k, cut[k])).collect()
    }

    /// New ratios for the baseline's entries (by position) under headroom.
    fn raise(&self, spec: &BaselineSpec, shares: &[f64], level: f64) -> Vec<f64> {
        let target = (1.0 - self.cfg.dead_band / 2.0) * spec.threshold;
        let r: Vec<f64> = spec.entries.iter().map(|&i| self.ratios[i]).collect();
        let caps: Vec<f64> = r.iter().map(|&x| slow_start_cap(x)).collect();
        if level <= 0.0 {
            return caps;
        }
        let m = target / level;
        // f(mu) = sum s_i min(mu, c_i / r_i): non-decreasing in mu.
        let f = |mu: f64| -> f64 {
            shares.iter().zip(r.iter().zip(&caps)).map(|(s, (r, c))| s * (mu * r).min(*c) / r).sum()
        };
        let mu_max = r.iter().zip(&caps).map(|(r, c)| c / r).fold(1.0, f64::max);
        if f(mu_max) <= m {
            return caps;
        }
        let (mut lo, mut hi) = (1.0, mu_max);
        for _ in 0..100 {
            let mid = (lo + hi) / 2.0;
            if f(mid) < m {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        r.iter().zip(&caps).map(|(r, c)| (lo * r).min(*c)).collect()
    }
}

/// Slow start: at most double, with 0.01 of allowance for tiny ratios.
pub fn slow_start_cap(r: f64) -> f64 {
    (2.0 * r).max(r + 0.01).min(1.0)
}

fn round_down(x: f64, res: f64) -> f64 {
    ((x / res) + 1e-9).floor() * res
}

/// Condition number of the column-normalised matrix (singular values'
/// ratio); infinite when a column is all zero or the matrix is singular.
pub fn condition_number(a: &DMatrix<f64>) -> f64 {
    let mut m = a.clone();
    for mut c in m.column_iter_mut() {
        let norm = c.norm();
        if norm == 0.0 {
            return f64::INFINITY;
        }
        c /= norm;
    }
    let sv = m.singular_values();
    let (max, min) = sv.iter().fold((0.0f64, f64::INFINITY), |(mx, mn), &v| (mx.max(v), mn.min(v)));
    if min <= 0.0 {
        f64::INFINITY
    } else {
        max / min
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A noise-free linear plant: level = sum a_i * offered_i * r_i.
    struct Plant {
        offered: Vec<f64>,
        a: Vec<f64>,
    }

    impl Plant {
        fn period(&self, r: &[f64], noise: f64) -> Period {
            let admitted: Vec<f64> = self.offered.iter().zip(r).map(|(q, r)| q * r).collect();
            let level: f64 = admitted.iter().zip(&self.a).map(|(q, a)| q * a).sum();
            Period {
                offered: self.offered.clone(),
                admitted,
                levels: vec![Some(level * (1.0 + noise))],
            }
        }
        fn level(&self, r: &[f64]) -> f64 {
            self.offered.iter().zip(r).zip(&self.a).map(|((q, r), a)| q * r * a).sum()
        }
    }

    /// Entries (name, floor) under one baseline `b` over all of them.
    fn one_baseline(entries: &[(&str, f64)], threshold: f64) -> Controller {
        let specs =
            entries.iter().map(|&(name, floor)| EntrySpec { name: name.into(), floor }).collect();
        let baselines = vec![BaselineSpec {
            name: "b".into(),
            threshold,
            entries: (0..entries.len()).collect(),
        }];
        Controller::new(Config::default(), specs, baselines)
    }

    fn article() -> (Controller, Plant) {
        let entries = vec![
            EntrySpec { name: "e1".into(), floor: 0.0 },
            EntrySpec { name: "e2".into(), floor: 0.5 },
        ];
        let baselines =
            vec![BaselineSpec { name: "db".into(), threshold: 60.0, entries: vec![0, 1] }];
        (
            Controller::new(Config::default(), entries, baselines),
            Plant { offered: vec![100.0, 100.0], a: vec![1.0, 2.0] },
        )
    }

    #[test]
    fn article_experiment_floors_then_round_two_then_raise() {
        let (mut c, plant) = article();
        let mut e2_at_floor_while_e1_cut = false;
        let mut settled_at = None;
        for period in 1..=40 {
            c.step(&plant.period(c.ratios(), 0.0));
            let r = c.ratios().to_vec();
            if (r[1] - 0.5).abs() < 1e-9 && r[0] < 0.5 && r[0] > 0.01 {
                e2_at_floor_while_e1_cut = true;
            }
            let l = plant.level(&r);
            if settled_at.is_none() && (60.0 * 0.97..=60.0).contains(&l) {
                settled_at = Some(period);
            }
        }
        let r = c.ratios().to_vec();
        assert!(e2_at_floor_while_e1_cut, "entry 2 waits at its floor while entry 1 is cut");
        assert!((r[0] - 0.01).abs() < 1e-9, "entry 1 at 1%: {r:?}");
        assert!((0.285..=0.296).contains(&r[1]), "round 2 takes entry 2 to about 0.29: {r:?}");
        let l = plant.level(&r);
        assert!((58.2..=60.0).contains(&l), "level {l} within the band");
        let p = settled_at.unwrap();
        assert!((20..=28).contains(&p), "settled after {p} periods (about 24)");
        // The threshold rises to 100: entry 2 rises in one period.
        c.set_threshold(0, 100.0);
        c.step(&plant.period(c.ratios(), 0.0));
        let r1 = c.ratios().to_vec();
        assert!((0.46..=0.51).contains(&r1[1]), "entry 2 in one period: {r1:?}");
        assert!((0.01..=0.02).contains(&r1[0]), "entry 1 near its 1% floor: {r1:?}");
        for _ in 0..10 {
            c.step(&plant.period(c.ratios(), 0.0));
        }
        let l = plant.level(c.ratios());
        assert!((97.0..=100.0).contains(&l), "settles at about 100: {l} ({:?})", c.ratios());
    }

    /// Raises aim at T* = (1 - h/2) T, so "the threshold is at least the
    /// full-admission level" has to mean at least full / (1 - h/2) for the
    /// ratios to reach 1.0 (with T exactly 300 they settle at 0.985, in the
    /// dead band): 306 here.
    #[test]
    fn recovery_to_full_admission_within_seven_periods() {
        for start in [[0.01, 0.01], [0.01, 0.3], [0.5, 0.02], [0.9, 0.011]] {
            let (mut c, plant) = article();
            c.set_threshold(0, 306.0);
            c.set_ratios(&start);
            let mut n = 0;
            while c.ratios().iter().any(|r| *r < 1.0) {
                c.step(&plant.period(c.ratios(), 0.0));
                n += 1;
                assert!(n <= 7, "from {start:?}: {:?} after {n} periods", c.ratios());
            }
        }
    }

    #[test]
    fn a_cut_of_twenty_points_takes_four_periods() {
        let mut c = one_baseline(&[("e", 0.0)], 80.0 / 0.985);
        let plant = Plant { offered: vec![100.0], a: vec![1.0] };
        let mut n = 0;
        while c.ratios()[0] > 0.8 + 1e-9 {
            c.step(&plant.period(c.ratios(), 0.0));
            n += 1;
            assert!(n <= 4, "{:?}", c.ratios());
        }
        assert_eq!(n, 4);
    }

    #[test]
    fn noisy_level_rarely_over_and_never_far_over() {
        let (mut c, plant) = article();
        let mut seed = 12345u64;
        let mut noise = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * 0.02
        };
        let (mut over, mut settled_periods, mut worst) = (0, 0, 0.0f64);
        for period in 0..300 {
            c.step(&plant.period(c.ratios(), noise()));
            if period >= 40 {
                let l = plant.level(c.ratios());
                settled_periods += 1;
                over += (l > 60.0) as u32;
                worst = worst.max(l / 60.0);
            }
        }
        assert!(
            (over as f64) < 0.1 * settled_periods as f64,
            "over T in {over} of {settled_periods} periods"
        );
        assert!(worst <= 1.02, "worst {worst}");
    }

    #[test]
    fn cap_floor_and_minimum_hold() {
        let (mut c, plant) = article();
        let mut prev = c.ratios().to_vec();
        for _ in 0..60 {
            c.step(&plant.period(c.ratios(), 0.0));
            for (a, b) in prev.iter().zip(c.ratios()) {
                assert!(a - b <= 0.05 + 1e-9, "cap: {a} -> {b}");
                assert!(*b >= 0.01 - 1e-12, "1% floor");
            }
            prev = c.ratios().to_vec();
        }
    }

    #[test]
    fn dead_band_holds() {
        let (mut c, plant) = article();
        c.set_ratios(&[1.0, 0.1]); // level 100 + 20 = 120
        c.set_threshold(0, 121.0); // 120 is within (1 - 0.03) * 121 .. 121
        let v = c.step(&plant.period(c.ratios(), 0.0));
        assert_eq!(v.baselines[0].band, "hold");
        assert_eq!(c.ratios(), &[1.0, 0.1]);
    }

    #[test]
    fn eligibility_uses_offered_load() {
        // Entry 1 offers 4/s (never cut), entry 2 carries the cut alone.
        let mut c = one_baseline(&[("small", 0.0), ("big", 0.0)], 50.0);
        let plant = Plant { offered: vec![4.0, 100.0], a: vec![1.0, 1.0] };
        for _ in 0..5 {
            c.step(&plant.period(c.ratios(), 0.0));
        }
        assert_eq!(c.ratios()[0], 1.0, "under 5 offered/s: never cut");
        assert!(c.ratios()[1] < 1.0);
    }

    #[test]
    fn round_one_respects_floors_and_redistributes() {
        // Entry 1 sits near its floor: what it cannot shed goes to entry 2
        // in the same period (both within the cap).
        let mut c = one_baseline(&[("high", 0.9), ("low", 0.0)], 190.0);
        c.set_ratios(&[0.91, 1.0]);
        let plant = Plant { offered: vec![100.0, 100.0], a: vec![1.0, 1.0] };
        // Level 191 > 190: d is small; entry 1 can only lose 0.01.
        let v = c.step(&plant.period(c.ratios(), 0.0));
        assert_eq!(v.baselines[0].band, "cut");
        let r = c.ratios();
        assert!(r[0] >= 0.9 - 1e-9, "the floor holds in round 1: {r:?}");
        let level = plant.level(r);
        assert!(
            level <= 190.0 * (1.0 - 0.015) + 0.2,
            "the whole cut was made this period: {level}"
        );
    }

    #[test]
    fn raise_passes_headroom_from_capped_entries() {
        // Entry 1 is tiny and capped by slow start; its unused headroom goes
        // to entry 2, so the level rises to the target in one period.
        let (mut c, plant) = article();
        c.set_ratios(&[0.01, 0.25]); // level 1 + 50 = 51
        c.set_threshold(0, 80.0);
        c.step(&plant.period(c.ratios(), 0.0));
        let r = c.ratios().to_vec();
        assert!(r[0] <= 0.02 + 1e-9, "{r:?}");
        let l = plant.level(&r);
        assert!(l > 0.97 * 78.8 && l <= 78.9, "one step reaches the target: {l} {r:?}");
    }

    #[test]
    fn nnls_recovers_coefficients_under_noise() {
        let mut c = one_baseline(&[("a", 0.0), ("b", 0.0)], 1e9);
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut last = None;
        for _ in 0..12 {
            let q = [50.0 + 100.0 * rnd(), 50.0 + 100.0 * rnd()];
            let l = (1.5 * q[0] + 0.5 * q[1]) * (1.0 + 0.04 * (rnd() - 0.5));
            last = Some(c.step(&Period {
                offered: q.to_vec(),
                admitted: q.to_vec(),
                levels: vec![Some(l)],
            }));
        }
        let co = &last.unwrap().baselines[0].coefficients;
        assert!((co[0] - 1.5).abs() < 0.1 && (co[1] - 0.5).abs() < 0.1, "{co:?}");
    }

    #[test]
    fn lockstep_history_keeps_the_previous_estimate() {
        let mut c = one_baseline(&[("a", 0.0), ("b", 0.0)], 1e9);
        let mut v = None;
        for k in 0..12 {
            let q = 100.0 - k as f64 * 5.0; // both entries move together
            v = Some(c.step(&Period {
                offered: vec![q, q],
                admitted: vec![q, q],
                levels: vec![Some(3.0 * q)],
            }));
        }
        let b = &v.unwrap().baselines[0];
        assert!(!b.fitted);
        assert_eq!(b.coefficients, vec![1.0, 1.0], "the prior stays");
    }

    #[test]
    fn negative_truths_stay_non_negative() {
        let mut c = one_baseline(&[("a", 0.0), ("b", 0.0)], 1e9);
        let mut v = None;
        for k in 0..12 {
            let q = [100.0 + 10.0 * (k % 3) as f64, 50.0 + 20.0 * (k % 4) as f64];
            let l = (2.0 * q[0] - 0.5 * q[1]).max(0.0);
            v = Some(c.step(&Period {
                offered: q.to_vec(),
                admitted: q.to_vec(),
                levels: vec![Some(l)],
            }));
        }
        let co = &v.unwrap().baselines[0].coefficients;
        assert!(co.iter().all(|x| *x >= 0.0), "{co:?}");
    }

    #[test]
    fn a_failing_source_holds_then_releases() {
        let (mut c, plant) = article();
        c.set_ratios(&[0.2, 0.5]);
        for k in 1..=10 {
            let mut p = plant.period(c.ratios(), 0.0);
            p.levels = vec![None];
            let v = c.step(&p);
            assert_eq!(v.baselines[0].band, "stale");
            if k <= 6 {
                assert_eq!(c.ratios(), &[0.2, 0.5], "held");
            }
        }
        assert!(
            c.ratios()[0] > 0.2 && c.ratios()[1] > 0.5,
            "released at slow-start pace: {:?}",
            c.ratios()
        );
    }

    #[test]
    fn several_baselines_take_the_largest_cut() {
        let entries = vec![EntrySpec { name: "e".into(), floor: 0.0 }];
        let baselines = vec![
            BaselineSpec { name: "low".into(), threshold: 1000.0, entries: vec![0] },
            BaselineSpec { name: "high".into(), threshold: 50.0, entries: vec![0] },
        ];
        let mut c = Controller::new(Config::default(), entries, baselines);
        let p = Period {
            offered: vec![100.0],
            admitted: vec![100.0],
            levels: vec![Some(100.0), Some(100.0)],
        };
        c.step(&p);
        assert!(
            (c.ratios()[0] - 0.95).abs() < 1e-9,
            "the cut of the baseline over its threshold, capped: {:?}",
            c.ratios()
        );
    }
}
