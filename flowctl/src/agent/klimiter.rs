//! KLimiter in the agent: every sample period it reads each entry's offered
//! and admitted rates from the kernel's statistics rings and each baseline's
//! level from its source; every control period it steps the controller
//! (`crate::controllers::klimiter`, the same code `flowctl simulate` runs) on the
//! period's means and writes the new ratios into the entries' control
//! records. What it decided, and why, is published in the run directory
//! (`klimiter.json`) for `top` and the metrics.
//!
//! Level sources other than the CPU run on their own threads, so a slow
//! command or endpoint never holds up the agent; a value older than two
//! sample periods counts as missing.

use crate::{
    controllers::klimiter::{BaselineSpec, Config, Controller, EntrySpec, Period, StepView},
    dataplane::{state::AttachState, Maps},
    profile::{klimiter::LevelSource, RuleSet},
    system::clock::monotonic_ns,
};
use anyhow::Result;
use flowctl_common::{unit, NO_CPU_SIGNAL};
use serde::{Deserialize, Serialize};
use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// The latest reading of a gauge: (value, when).
type Reading = Arc<Mutex<Option<(f64, Instant)>>>;

enum Level {
    Cpu,
    Gauge {
        reading: Reading,
        stop: Arc<std::sync::atomic::AtomicBool>,
    },
    /// The TC egress counter of target `slot`: the count and time of the
    /// last sample, for a rate.
    Egress {
        slot: u32,
        connections: bool,
        last: Option<(u64, Instant)>,
    },
}

impl Drop for Level {
    fn drop(&mut self) {
        if let Level::Gauge { stop, .. } = self {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// What `top` and the metrics read (`/run/flowctl/<id>/klimiter.json`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Published {
    /// CLOCK_MONOTONIC ns of the step.
    pub updated_ns: u64,
    pub step: PublishedStep,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PublishedStep {
    pub baselines: Vec<PublishedBaseline>,
    pub entries: Vec<PublishedEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PublishedBaseline {
    pub name: String,
    pub level: Option<f64>,
    pub threshold: f64,
    pub band: String,
    /// Per entry of the baseline: its estimated coefficient and share
    /// (null while the baseline's source fails).
    pub entries: Vec<PublishedShare>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PublishedShare {
    pub rule: String,
    pub coefficient: Option<f64>,
    pub share: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PublishedEntry {
    pub rule: String,
    pub ratio: f64,
    pub reason: String,
}

pub struct KlimiterLoop {
    ctl: Controller,
    /// Controller entry -> rule index in the set, and its name.
    rules: Vec<usize>,
    names: Vec<String>,
    levels: Vec<Level>,
    /// Sums since the last control step.
    offered: Vec<f64>,
    admitted: Vec<f64>,
    level_sum: Vec<f64>,
    level_n: Vec<u32>,
    samples: u32,
    per_control: u32,
    sample_period: Duration,
    /// Baselines whose source is failing now (warned once per episode).
    stale: Vec<bool>,
}

impl KlimiterLoop {
    /// `None` when the profile has no baselines.
    pub fn new(set: &RuleSet) -> Option<Self> {
        if set.baselines.is_empty() {
            return None;
        }
        let mut rules: Vec<usize> =
            set.baselines.iter().flat_map(|b| b.entries.iter().copied()).collect();
        rules.sort_unstable();
        rules.dedup();
        let entries = rules
            .iter()
            .map(|&i| EntrySpec { name: set.rules[i].name.clone(), floor: set.rules[i].priority })
            .collect();
        let baselines = set
            .baselines
            .iter()
            .map(|b| BaselineSpec {
                name: b.name.clone(),
                threshold: b.threshold,
                entries: b
                    .entries
                    .iter()
                    .map(|r| rules.iter().position(|x| x == r).expect("entry listed"))
                    .collect(),
            })
            .collect();
        let k = &set.klimiter;
        let per_control = (k.control_period_ns / k.sample_period_ns).max(1) as u32;
        let cfg = Config {
            dead_band: k.dead_band,
            release_after_periods: (k.stale_after_ns / k.control_period_ns).max(1) as u32,
            ..Config::default()
        };
        let sample_period = Duration::from_nanos(k.sample_period_ns);
        let mut slot = 0;
        let levels = set
            .baselines
            .iter()
            .map(|b| match &b.source {
                LevelSource::Egress { connections, .. } => {
                    slot += 1;
                    Level::Egress { slot: slot - 1, connections: *connections, last: None }
                }
                other => start_level(other, sample_period),
            })
            .collect();
        let (n, nb) = (rules.len(), set.baselines.len());
        let names = rules.iter().map(|&i| set.rules[i].name.clone()).collect();
        Some(Self {
            ctl: Controller::new(cfg, entries, baselines),
            rules,
            names,
            levels,
            offered: vec![0.0; n],
            admitted: vec![0.0; n],
            level_sum: vec![0.0; nb],
            level_n: vec![0; nb],
            samples: 0,
            per_control,
            sample_period,
            stale: vec![false; nb],
        })
    }

    /// Keeps the ratios of entries that `old` also had (after an apply).
    pub fn inherit(&mut self, old: &KlimiterLoop) {
        let mut r = self.ctl.ratios().to_vec();
        for (k, name) in self.names.iter().enumerate() {
            if let Some(v) = old.ctl.ratio_of(name) {
                r[k] = v;
            }
        }
        self.ctl.set_ratios(&r);
    }

    pub fn sample_period(&self) -> Duration {
        self.sample_period
    }

    /// One sample; every `per_control` samples, a control step that writes
    /// the ratios. `cpu` is the agent's CPU EMA (per mille).
    pub fn sample(
        &mut self,
        maps: &mut Maps,
        state: &AttachState,
        set: &RuleSet,
        cpu: u32,
    ) -> Result<()> {
        let now = monotonic_ns();
        let shape = state.stats;
        let span = ((self.sample_period.as_nanos() as u64) / shape.bucket_ns) as u32;
        for (k, &i) in self.rules.iter().enumerate() {
            let (s, secs) = maps.stats_rate_window(state.rules[i].record, &shape, now, span)?;
            let (o, a) = if set.rules[i].unit == unit::CONNECTIONS {
                (s.syn_offered, s.syn_passed)
            } else {
                (s.offered_pkts, s.passed_pkts)
            };
            self.offered[k] += o as f64 / secs;
            self.admitted[k] += a as f64 / secs;
        }
        let fresh = self.sample_period * 2;
        for (b, l) in self.levels.iter_mut().enumerate() {
            let v = match l {
                Level::Cpu => (cpu != NO_CPU_SIGNAL).then_some(cpu as f64),
                Level::Gauge { reading, .. } => {
                    reading.lock().unwrap().filter(|(_, at)| at.elapsed() <= fresh).map(|(v, _)| v)
                }
                Level::Egress { slot, connections, last } => {
                    let i = *slot * flowctl_common::EGRESS_COUNTERS_PER_TARGET as u32
                        + *connections as u32;
                    let count: u64 = maps.egress_counts.get(&i, 0)?.iter().sum();
                    let now = Instant::now();
                    let rate = last.and_then(|(c0, t0)| {
                        let dt = now.duration_since(t0).as_secs_f64();
                        (dt > 0.0).then(|| count.saturating_sub(c0) as f64 / dt)
                    });
                    *last = Some((count, now));
                    rate
                }
            };
            if let Some(v) = v {
                self.level_sum[b] += v;
                self.level_n[b] += 1;
            }
        }
        self.samples += 1;
        if self.samples < self.per_control {
            return Ok(());
        }
        // A baseline with no good reading in the period has no level; one
        // with some uses their mean.
        let n = self.samples as f64;
        let period = Period {
            offered: self.offered.iter().map(|v| v / n).collect(),
            admitted: self.admitted.iter().map(|v| v / n).collect(),
            levels: self
                .level_sum
                .iter()
                .zip(&self.level_n)
                .map(|(s, c)| (*c > 0).then(|| s / *c as f64))
                .collect(),
        };
        for b in 0..set.baselines.len() {
            self.ctl.set_threshold(b, set.baselines[b].threshold);
        }
        for (b, l) in period.levels.iter().enumerate() {
            let failing = l.is_none();
            if failing && !self.stale[b] {
                tracing::warn!(
                    "KLimiter: baseline {} has no level this period ({:?}); holding its entries, releasing them after {:?}",
                    set.baselines[b].name,
                    set.baselines[b].source,
                    Duration::from_nanos(set.klimiter.stale_after_ns)
                );
            } else if !failing && self.stale[b] {
                tracing::warn!("KLimiter: baseline {} has a level again", set.baselines[b].name);
            }
            self.stale[b] = failing;
        }
        let view = self.ctl.step(&period);
        self.offered.iter_mut().for_each(|v| *v = 0.0);
        self.admitted.iter_mut().for_each(|v| *v = 0.0);
        self.level_sum.iter_mut().for_each(|v| *v = 0.0);
        self.level_n.iter_mut().for_each(|v| *v = 0);
        self.samples = 0;
        for (k, &i) in self.rules.iter().enumerate() {
            let ppm = (self.ctl.ratios()[k] * 1e6).round() as u32;
            let per_flow = set.rules[i].admission_per_flow;
            maps.update_control(state.rules[i].record, now, |c| {
                c.set_admission(Some(ppm), per_flow)
            })?;
        }
        self.publish(state, set, &view, now)
    }

    fn publish(&self, state: &AttachState, set: &RuleSet, view: &StepView, now: u64) -> Result<()> {
        let step = PublishedStep {
            baselines: view
                .baselines
                .iter()
                .zip(&set.baselines)
                .map(|(v, b)| PublishedBaseline {
                    name: v.name.clone(),
                    level: v.level,
                    threshold: v.threshold,
                    band: v.band.clone(),
                    entries: b
                        .entries
                        .iter()
                        .enumerate()
                        .map(|(k, &r)| PublishedShare {
                            rule: set.rules[r].name.clone(),
                            coefficient: v.coefficients.get(k).copied().filter(|x| x.is_finite()),
                            share: v.shares.get(k).copied().filter(|x| x.is_finite()),
                        })
                        .collect(),
                })
                .collect(),
            entries: view
                .entries
                .iter()
                .map(|e| PublishedEntry {
                    rule: e.name.clone(),
                    ratio: e.ratio,
                    reason: e.reason.clone(),
                })
                .collect(),
        };
        let p = Published { updated_ns: now, step };
        let path = state.id.run_dir().join("klimiter.json");
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&p)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }
}

/// The published state, when the agent that wrote it is running now
/// (`agent_fresh`, from `occupancy::fresh_record`).
pub fn published(state: &AttachState, agent_fresh: bool) -> Option<PublishedStep> {
    if !agent_fresh {
        return None;
    }
    let text = std::fs::read(state.id.run_dir().join("klimiter.json")).ok()?;
    serde_json::from_slice::<Published>(&text).ok().map(|p| p.step)
}

fn start_level(src: &LevelSource, period: Duration) -> Level {
    let read: Box<dyn Fn() -> Option<f64> + Send> = match src.clone() {
        LevelSource::Cpu => return Level::Cpu,
        LevelSource::Egress { .. } => unreachable!("egress levels are read from the kernel"),
        LevelSource::File(f) => {
            Box::new(move || std::fs::read_to_string(&f).ok().and_then(|t| parse_level(&t)))
        }
        LevelSource::Command(c) => {
            Box::new(move || run_command(&c, period.max(Duration::from_secs(1))))
        }
        LevelSource::Http { url, metric } => {
            Box::new(move || http_metric(&url, &metric, Duration::from_secs(1)))
        }
    };
    let reading: Reading = Arc::new(Mutex::new(None));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (r, s) = (reading.clone(), stop.clone());
    std::thread::Builder::new()
        .name("flowctl-gauge".into())
        .spawn(move || {
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let started = Instant::now();
                if let Some(v) = read() {
                    *r.lock().unwrap() = Some((v, Instant::now()));
                }
                std::thread::sleep(period.saturating_sub(started.elapsed()));
            }
        })
        .expect("starting a gauge thread");
    Level::Gauge { reading, stop }
}

/// A level as text: one finite, non-negative number (garbage is no level).
pub fn parse_level(text: &str) -> Option<f64> {
    text.trim().parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
}

fn run_command(cmd: &str, timeout: Duration) -> Option<f64> {
    let mut child = std::process::Command::new("sh")
        .args(["-c", cmd])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => break,
            Ok(Some(_)) => return None,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take()?, &mut out).ok()?;
    parse_level(&out)
}

/// One sample of a Prometheus text exposition (the first series whose name
/// is `metric`, with or without labels).
pub fn prometheus_value(text: &str, metric: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let rest = l.strip_prefix(metric)?;
        let rest = if let Some(r) = rest.strip_prefix('{') { r.split_once('}')?.1 } else { rest };
        if !rest.starts_with(' ') {
            return None;
        }
        parse_level(rest.split_whitespace().next()?)
    })
}

fn http_metric(url: &str, metric: &str, timeout: Duration) -> Option<f64> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) =
        rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&host).ok()?.next()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let (head, body) = body.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.") || head.split_whitespace().nth(1).is_none_or(|c| c != "200") {
        return None;
    }
    prometheus_value(body, metric)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_strictly() {
        assert_eq!(parse_level(" 42.5\n"), Some(42.5));
        for bad in ["", "NaN", "-1", "inf", "12 apples", "banana"] {
            assert_eq!(parse_level(bad), None, "{bad}");
        }
    }

    #[test]
    fn prometheus_text_finds_the_metric() {
        let t = "# HELP pg_ops ops\n# TYPE pg_ops gauge\npg_ops_total 5\npg_ops{db=\"main\"} 123.5 1700000000\nother 1\n";
        assert_eq!(prometheus_value(t, "pg_ops"), Some(123.5));
        assert_eq!(prometheus_value(t, "other"), Some(1.0));
        assert_eq!(prometheus_value(t, "missing"), None);
        assert_eq!(prometheus_value("pg_ops garbage\n", "pg_ops"), None);
    }

    #[test]
    fn commands_time_out_and_garbage_is_no_level() {
        assert_eq!(run_command("echo 7", Duration::from_secs(2)), Some(7.0));
        assert_eq!(run_command("echo nope", Duration::from_secs(2)), None);
        assert_eq!(run_command("exit 3", Duration::from_secs(2)), None);
        let t = Instant::now();
        assert_eq!(run_command("sleep 5; echo 1", Duration::from_millis(200)), None);
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn http_gauge_reads_an_exposition() {
        let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
        let addr = server.server_addr().to_ip().unwrap();
        std::thread::spawn(move || {
            for req in server.incoming_requests().take(2) {
                let _ = req.respond(tiny_http::Response::from_string("db_load{x=\"1\"} 77\n"));
            }
        });
        assert_eq!(
            http_metric(&format!("http://{addr}/metrics"), "db_load", Duration::from_secs(1)),
            Some(77.0)
        );
        assert_eq!(
            http_metric(&format!("http://{addr}/metrics"), "nope", Duration::from_secs(1)),
            None
        );
        assert_eq!(
            http_metric("http://127.0.0.1:1/metrics", "x", Duration::from_millis(200)),
            None
        );
    }
}
