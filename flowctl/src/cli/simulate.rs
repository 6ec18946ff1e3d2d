//! `flowctl simulate SCENARIO --out DIR`: the real KLimiter controller (the
//! function the agent calls) on a virtual clock against a described plant:
//! entries with offered load over time, baselines whose level is a linear
//! combination of admitted loads plus noise (coefficients and thresholds may
//! change mid-run). Writes `timeseries.csv` and `chart.svg` into DIR.
//! Deterministic: the noise comes from the scenario's seed.

use crate::controllers::klimiter::{BaselineSpec, Config, Controller, EntrySpec, Period, StepView};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::{fmt::Write as _, path::Path};

/// A value over time: a constant, steps (`[[t_s, v], ...]`, each holding
/// from its time on) or a ramp (`{ ramp = [t0, v0, t1, v1] }`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Signal {
    Const(f64),
    Steps { steps: Vec<(f64, f64)> },
    Ramp { ramp: (f64, f64, f64, f64) },
}

impl Signal {
    pub fn at(&self, t: f64) -> f64 {
        match self {
            Signal::Const(v) => *v,
            Signal::Steps { steps } => {
                steps.iter().take_while(|(at, _)| *at <= t).last().map(|(_, v)| *v).unwrap_or(0.0)
            }
            Signal::Ramp { ramp: (t0, v0, t1, v1) } => {
                if t <= *t0 {
                    *v0
                } else if t >= *t1 {
                    *v1
                } else {
                    v0 + (v1 - v0) * (t - t0) / (t1 - t0)
                }
            }
        }
    }
}

/// Coefficients over time: constant, or steps of whole vectors.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Coefficients {
    Const(Vec<f64>),
    Steps { steps: Vec<(f64, Vec<f64>)> },
}

impl Coefficients {
    fn at(&self, t: f64) -> &[f64] {
        match self {
            Coefficients::Const(v) => v,
            Coefficients::Steps { steps } => steps
                .iter()
                .take_while(|(at, _)| *at <= t)
                .last()
                .map(|(_, v)| v.as_slice())
                .unwrap_or(&[]),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioEntry {
    pub name: String,
    #[serde(default)]
    pub floor: f64,
    /// Offered load per second (before throttling).
    pub offered: Signal,
    /// Relative noise on the offered load (e.g. 0.05).
    #[serde(default)]
    pub noise: f64,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioBaseline {
    pub name: String,
    pub threshold: Signal,
    /// Entry names, or ["all"].
    pub entries: Vec<String>,
    /// The plant's true coefficients, one per listed entry.
    pub coefficients: Coefficients,
    /// Relative noise on the level (e.g. 0.02).
    #[serde(default)]
    pub noise: f64,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub duration_s: f64,
    #[serde(default = "one")]
    pub sample_period_s: f64,
    #[serde(default = "five")]
    pub control_period_s: f64,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "default_band")]
    pub dead_band: f64,
    #[serde(rename = "entry")]
    pub entries: Vec<ScenarioEntry>,
    #[serde(rename = "baseline")]
    pub baselines: Vec<ScenarioBaseline>,
}

fn one() -> f64 {
    1.0
}
fn five() -> f64 {
    5.0
}
fn default_band() -> f64 {
    crate::controllers::klimiter::DEFAULT_DEAD_BAND
}

/// One sampled instant.
#[derive(Clone, Debug, Default)]
pub struct Row {
    pub t: f64,
    pub offered: Vec<f64>,
    pub ratio: Vec<f64>,
    pub level: Vec<f64>,
    pub threshold: Vec<f64>,
    /// The controller's estimates and shares, from its last step.
    pub coefficients: Vec<Vec<f64>>,
    pub shares: Vec<Vec<f64>>,
}

/// A deterministic noise source (64-bit LCG, top 53 bits).
struct Noise(u64);

impl Noise {
    /// Uniform in [-1, 1].
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

impl Scenario {
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let s: Scenario = toml::from_str(&text).map_err(|e| {
            let (line, col) =
                e.span().map(|sp| crate::profile::line_col_of(&text, sp.start)).unwrap_or((0, 0));
            anyhow::anyhow!("{}:{line}:{col}: {}", path.display(), e.message())
        })?;
        s.validate().with_context(|| format!("{}", path.display()))?;
        Ok(s)
    }

    fn entry_indices(&self, b: &ScenarioBaseline) -> Result<Vec<usize>> {
        if b.entries.len() == 1 && b.entries[0] == "all" {
            return Ok((0..self.entries.len()).collect());
        }
        b.entries
            .iter()
            .map(|n| {
                self.entries
                    .iter()
                    .position(|e| &e.name == n)
                    .ok_or_else(|| anyhow::anyhow!("baseline {}: no entry named {n}", b.name))
            })
            .collect()
    }

    fn validate(&self) -> Result<()> {
        if !(self.duration_s > 0.0
            && self.sample_period_s > 0.0
            && self.control_period_s >= self.sample_period_s)
        {
            bail!("duration_s and sample_period_s must be positive and control_period_s at least sample_period_s");
        }
        if self.entries.is_empty() || self.baselines.is_empty() {
            bail!("a scenario needs at least one [[entry]] and one [[baseline]]");
        }
        for b in &self.baselines {
            let n = self.entry_indices(b)?.len();
            let lens: Vec<usize> = match &b.coefficients {
                Coefficients::Const(v) => vec![v.len()],
                Coefficients::Steps { steps } => steps.iter().map(|s| s.1.len()).collect(),
            };
            if lens.iter().any(|l| *l != n) {
                bail!("baseline {}: {n} entries but coefficients of length {lens:?}", b.name);
            }
        }
        Ok(())
    }

    /// Runs the scenario; one row per sample.
    pub fn run(&self) -> Result<Vec<Row>> {
        let entries: Vec<EntrySpec> = self
            .entries
            .iter()
            .map(|e| EntrySpec { name: e.name.clone(), floor: e.floor })
            .collect();
        let idx: Vec<Vec<usize>> =
            self.baselines.iter().map(|b| self.entry_indices(b)).collect::<Result<_>>()?;
        let baselines: Vec<BaselineSpec> = self
            .baselines
            .iter()
            .zip(&idx)
            .map(|(b, i)| BaselineSpec {
                name: b.name.clone(),
                threshold: b.threshold.at(0.0),
                entries: i.clone(),
            })
            .collect();
        let cfg = Config { dead_band: self.dead_band, ..Config::default() };
        let mut ctl = Controller::new(cfg, entries, baselines);
        let mut noise = Noise(self.seed ^ 0x9e37_79b9_7f4a_7c15);
        let samples = (self.duration_s / self.sample_period_s).round() as usize;
        let per_control = (self.control_period_s / self.sample_period_s).round().max(1.0) as usize;
        let (ne, nb) = (self.entries.len(), self.baselines.len());
        let mut acc = (vec![0.0; ne], vec![0.0; ne], vec![0.0; nb], 0usize);
        let mut last: Option<StepView> = None;
        let mut rows = Vec::with_capacity(samples);
        for k in 0..samples {
            let t = k as f64 * self.sample_period_s;
            let offered: Vec<f64> = self
                .entries
                .iter()
                .map(|e| (e.offered.at(t) * (1.0 + e.noise * noise.next())).max(0.0))
                .collect();
            let admitted: Vec<f64> = offered.iter().zip(ctl.ratios()).map(|(q, r)| q * r).collect();
            let mut levels = Vec::with_capacity(nb);
            for (b, i) in self.baselines.iter().zip(&idx) {
                let a = b.coefficients.at(t);
                let l: f64 = i.iter().zip(a).map(|(&e, a)| a * admitted[e]).sum();
                levels.push((l * (1.0 + b.noise * noise.next())).max(0.0));
            }
            for e in 0..ne {
                acc.0[e] += offered[e];
                acc.1[e] += admitted[e];
            }
            for (sum, level) in acc.2.iter_mut().zip(&levels) {
                *sum += level;
            }
            acc.3 += 1;
            rows.push(Row {
                t,
                offered: offered.clone(),
                ratio: ctl.ratios().to_vec(),
                level: levels.clone(),
                threshold: self.baselines.iter().map(|b| b.threshold.at(t)).collect(),
                coefficients: last
                    .as_ref()
                    .map(|v| v.baselines.iter().map(|b| b.coefficients.clone()).collect())
                    .unwrap_or_default(),
                shares: last
                    .as_ref()
                    .map(|v| v.baselines.iter().map(|b| b.shares.clone()).collect())
                    .unwrap_or_default(),
            });
            if acc.3 == per_control {
                let n = acc.3 as f64;
                for (b, spec) in self.baselines.iter().enumerate() {
                    ctl.set_threshold(b, spec.threshold.at(t));
                }
                let p = Period {
                    offered: acc.0.iter().map(|v| v / n).collect(),
                    admitted: acc.1.iter().map(|v| v / n).collect(),
                    levels: acc.2.iter().map(|v| Some(v / n)).collect(),
                };
                last = Some(ctl.step(&p));
                acc = (vec![0.0; ne], vec![0.0; ne], vec![0.0; nb], 0);
            }
        }
        Ok(rows)
    }

    /// The time series as CSV: t, then per entry offered/ratio, then per
    /// baseline level/threshold and the estimated coefficient and share of
    /// each of its entries.
    pub fn csv(&self, rows: &[Row]) -> Result<String> {
        let idx: Vec<Vec<usize>> =
            self.baselines.iter().map(|b| self.entry_indices(b)).collect::<Result<_>>()?;
        let mut out = String::from("t_s");
        for e in &self.entries {
            write!(out, ",{0}_offered,{0}_ratio", e.name)?;
        }
        for (b, i) in self.baselines.iter().zip(&idx) {
            write!(out, ",{0}_level,{0}_threshold", b.name)?;
            for &e in i {
                write!(out, ",{0}_coef_{1},{0}_share_{1}", b.name, self.entries[e].name)?;
            }
        }
        out.push('\n');
        for r in rows {
            write!(out, "{}", r.t)?;
            for e in 0..self.entries.len() {
                write!(out, ",{:.3},{:.4}", r.offered[e], r.ratio[e])?;
            }
            for (b, i) in idx.iter().enumerate() {
                write!(out, ",{:.3},{:.3}", r.level[b], r.threshold[b])?;
                for k in 0..i.len() {
                    let c =
                        r.coefficients.get(b).and_then(|v| v.get(k)).copied().unwrap_or(f64::NAN);
                    let s = r.shares.get(b).and_then(|v| v.get(k)).copied().unwrap_or(f64::NAN);
                    write!(out, ",{c:.4},{s:.4}")?;
                }
            }
            out.push('\n');
        }
        Ok(out)
    }

    /// Two panels: levels against thresholds, and admission ratios.
    pub fn svg(&self, rows: &[Row], path: &Path) -> Result<()> {
        use plotters::prelude::*;
        let root = SVGBackend::new(path, (1000, 700)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(350);
        let t_max = rows.last().map(|r| r.t).unwrap_or(1.0).max(1.0);
        let y_max = rows
            .iter()
            .flat_map(|r| r.level.iter().chain(&r.threshold))
            .fold(1.0f64, |a, b| a.max(*b))
            * 1.1;
        let palette = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
        let mut chart = ChartBuilder::on(&top)
            .caption("baseline levels (solid) and thresholds (dashed)", ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
        chart.configure_mesh().x_desc("seconds").draw()?;
        for (b, spec) in self.baselines.iter().enumerate() {
            let c = palette[b % palette.len()];
            chart
                .draw_series(LineSeries::new(
                    rows.iter().map(|r| (r.t, r.level[b])),
                    c.stroke_width(1),
                ))?
                .label(format!("{} level", spec.name))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c));
            chart.draw_series(DashedLineSeries::new(
                rows.iter().map(|r| (r.t, r.threshold[b])),
                6,
                4,
                c.stroke_width(2),
            ))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        let mut chart = ChartBuilder::on(&bottom)
            .caption("admission ratios", ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..t_max, 0.0..1.05)?;
        chart.configure_mesh().x_desc("seconds").draw()?;
        for (e, spec) in self.entries.iter().enumerate() {
            let c = palette[e % palette.len()];
            chart
                .draw_series(LineSeries::new(
                    rows.iter().map(|r| (r.t, r.ratio[e])),
                    c.stroke_width(2),
                ))?
                .label(format!("{} (floor {})", spec.name, spec.floor))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    }
}

/// The `simulate` command.
pub fn command(scenario: &Path, out: &Path) -> Result<()> {
    let s = Scenario::load(scenario)?;
    let started = std::time::Instant::now();
    let rows = s.run()?;
    let took = started.elapsed();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("timeseries.csv"), s.csv(&rows)?).context("writing timeseries.csv")?;
    s.svg(&rows, &out.join("chart.svg")).context("writing chart.svg")?;
    let last = rows.last().expect("at least one sample");
    out!(
        "simulated {:.0} s ({} samples) in {:.1} ms; final ratios {}; levels {}; wrote {}/timeseries.csv and chart.svg",
        s.duration_s,
        rows.len(),
        took.as_secs_f64() * 1e3,
        s.entries.iter().zip(&last.ratio).map(|(e, r)| format!("{}={r:.3}", e.name)).collect::<Vec<_>>().join(" "),
        s.baselines.iter().zip(&last.level).map(|(b, l)| format!("{}={l:.1}", b.name)).collect::<Vec<_>>().join(" "),
        out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(name: &str) -> Scenario {
        Scenario::load(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/scenarios").join(name),
        )
        .unwrap()
    }

    #[test]
    fn the_article_scenario_tells_the_article_story() {
        let s = example("article.toml");
        let started = std::time::Instant::now();
        let rows = s.run().unwrap();
        assert!(
            started.elapsed().as_secs_f64() < 1.0,
            "a 10-minute scenario in well under a second"
        );
        let before = &rows[295];
        assert!(
            (before.ratio[0] - 0.01).abs() < 1e-9 && (0.285..=0.296).contains(&before.ratio[1]),
            "{:?}",
            before.ratio
        );
        assert!(before.level[0] <= 60.0 && before.level[0] >= 58.0, "{}", before.level[0]);
        let end = rows.last().unwrap();
        assert!(
            (0.01..=0.02).contains(&end.ratio[0]) && (0.46..=0.51).contains(&end.ratio[1]),
            "{:?}",
            end.ratio
        );
        assert!((97.0..=100.0).contains(&end.level[0]));
        let csv = s.csv(&rows).unwrap();
        assert!(csv.starts_with("t_s,batch_offered,batch_ratio,checkout_offered,checkout_ratio,db_level,db_threshold,db_coef_batch,db_share_batch"));
        assert_eq!(csv.lines().count(), 601);
        let dir = std::env::temp_dir().join(format!("flowctl-sim-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        s.svg(&rows, &dir.join("chart.svg")).unwrap();
        let svg = std::fs::read_to_string(dir.join("chart.svg")).unwrap();
        assert!(
            svg.starts_with("<svg")
                && svg.contains("admission ratios")
                && svg.contains("checkout (floor 0.5)")
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn runs_are_deterministic_and_every_example_loads() {
        for name in ["article.toml", "noisy-shift.toml", "recovery.toml"] {
            let s = example(name);
            let (a, b) = (s.run().unwrap(), s.run().unwrap());
            assert_eq!(s.csv(&a).unwrap(), s.csv(&b).unwrap(), "{name}");
        }
        let r = example("recovery.toml").run().unwrap();
        assert_eq!(r.last().unwrap().ratio, vec![1.0, 1.0], "ratios climb back after the overload");
    }

    fn inline(text: &str) -> Scenario {
        let s: Scenario = toml::from_str(text).unwrap();
        s.validate().unwrap();
        s
    }

    #[test]
    fn a_mid_run_coefficient_change_is_re_identified() {
        // Loads that move independently (10% noise each, steps at different
        // times) identify the coefficients; at 300 s the second doubles.
        let s = inline(
            "duration_s = 600\nseed = 11\n\
             [[entry]]\nname = \"a\"\noffered = { steps = [[0, 40], [100, 60], [250, 45], [400, 70]] }\nnoise = 0.1\n\
             [[entry]]\nname = \"b\"\noffered = { steps = [[0, 30], [170, 50], [330, 35], [480, 55]] }\nnoise = 0.1\n\
             [[baseline]]\nname = \"db\"\nthreshold = 10000\nentries = [\"all\"]\ncoefficients = { steps = [[0, [1.0, 2.0]], [300, [1.0, 4.0]]] }\nnoise = 0.02\n",
        );
        let rows = s.run().unwrap();
        let before = &rows[295].coefficients[0];
        let after = &rows.last().unwrap().coefficients[0];
        assert!(
            (before[0] - 1.0).abs() < 0.15 && (before[1] - 2.0).abs() < 0.3,
            "before: {before:?}"
        );
        assert!((after[0] - 1.0).abs() < 0.2 && (after[1] - 4.0).abs() < 0.5, "after: {after:?}");
    }

    #[test]
    fn two_baselines_compose() {
        // "shared" loads both; each baseline has its own too. Both end at or
        // under their thresholds, and the shared entry follows the baseline
        // that asks the most of it.
        let s = inline(
            "duration_s = 600\nseed = 5\n\
             [[entry]]\nname = \"shared\"\noffered = 100\n\
             [[entry]]\nname = \"only_db\"\noffered = 100\nfloor = 0.6\n\
             [[entry]]\nname = \"only_cache\"\noffered = 100\nfloor = 0.6\n\
             [[baseline]]\nname = \"db\"\nthreshold = 150\nentries = [\"shared\", \"only_db\"]\ncoefficients = [1, 1]\n\
             [[baseline]]\nname = \"cache\"\nthreshold = 120\nentries = [\"shared\", \"only_cache\"]\ncoefficients = [1, 1]\n",
        );
        let rows = s.run().unwrap();
        let end = rows.last().unwrap();
        assert!(end.level[0] <= 150.0 + 1e-6 && end.level[1] <= 120.0 + 1e-6, "{:?}", end.level);
        assert!(end.level[1] >= 120.0 * 0.9, "not over-cut: {:?}", end.level);
        assert!(
            end.ratio[1] >= 0.6 - 1e-9 && end.ratio[2] >= 0.6 - 1e-9,
            "floors hold: {:?}",
            end.ratio
        );
        assert!(end.ratio[0] < end.ratio[1], "the shared entry took the cut: {:?}", end.ratio);
    }

    #[test]
    fn bad_scenarios_say_where() {
        let dir = std::env::temp_dir().join(format!("flowctl-sim-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.toml");
        std::fs::write(&p, "duration_s = 10\n[[entry]]\nname = \"a\"\noffered = 1\n[[baseline]]\nname = \"b\"\nthreshold = 1\nentries = [\"x\"]\ncoefficients = [1]\n").unwrap();
        assert!(Scenario::load(&p).unwrap_err().to_string().contains("bad.toml"));
        std::fs::write(&p, "duration_s = 10\ncolour = 1\n").unwrap();
        let e = Scenario::load(&p).unwrap_err().to_string();
        assert!(e.contains("bad.toml:2:1"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
