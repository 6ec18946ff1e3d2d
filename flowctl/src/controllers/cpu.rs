//! The CPU signal (docs/algorithms.md section 3): a usage sample every 250 ms in
//! per-mille, smoothed by an EMA with decay 0.95.
//!
//! Sources, chosen per profile (`[settings] cpu = ...`):
//! - `host`: `/proc/stat` (read with the `procfs` crate), busy time over all
//!   time of every CPU; 1000 = every CPU busy.
//! - `cgroup:<path>`: the protected service's cgroup, not the agent's own. v2:
//!   `cpu.stat` `usage_usec` against `cpu.max`; v1: `cpuacct.usage` against
//!   `cpu.cfs_quota_us / cpu.cfs_period_us`; without a quota, against the
//!   CPUs the cgroup may use (its cpuset, else every online CPU). 1000 = the
//!   cgroup uses all it may.
//! - `file:<path>`: a number in per-mille read from a file, for tests and for
//!   signals computed elsewhere.
//!
//! Kratos starts its EMA at 0, so under full load it takes ~8 s to cross an
//! 800 threshold; flowctl seeds the EMA with the first sample instead.

use anyhow::{anyhow, bail, Context, Result};
use std::{
    path::{Path, PathBuf},
    time::Instant,
};

/// Kratos' decay.
pub const DECAY: f64 = 0.95;
/// How often the agent samples.
pub const SAMPLE_PERIOD: std::time::Duration = std::time::Duration::from_millis(250);

/// Which source a signal comes from, as the profile names it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CpuSource {
    Host,
    Cgroup(String),
    File(PathBuf),
}

impl CpuSource {
    /// `host`, `cgroup:/path` or `file:/path`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "host" {
            return Ok(Self::Host);
        }
        if let Some(p) = s.strip_prefix("cgroup:") {
            if p.is_empty() || !p.starts_with('/') {
                return Err(format!("`{s}`: the cgroup path starts with / and is relative to the cgroup mount, e.g. \"cgroup:/system.slice/nginx.service\""));
            }
            return Ok(Self::Cgroup(p.to_string()));
        }
        if let Some(p) = s.strip_prefix("file:") {
            if p.is_empty() {
                return Err(format!("`{s}`: name the file, e.g. \"file:/run/cpu\""));
            }
            return Ok(Self::File(PathBuf::from(p)));
        }
        Err(format!("unknown cpu source `{s}`: use \"host\", \"cgroup:/path\" or \"file:/path\""))
    }

    /// The code kept in the agent record (`flowctl_common::AgentRecord`).
    pub fn code(&self) -> u32 {
        match self {
            Self::Host => 1,
            Self::Cgroup(_) => 2,
            Self::File(_) => 3,
        }
    }

    pub fn name_of(code: u32) -> &'static str {
        match code {
            1 => "host",
            2 => "cgroup",
            3 => "file",
            _ => "none",
        }
    }
}

/// The smoothed signal, seeded with the first sample.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ema {
    value: Option<f64>,
}

impl Ema {
    /// Folds in one sample (per-mille) and returns the new value.
    pub fn update(&mut self, sample: f64) -> f64 {
        let v = match self.value {
            None => sample,
            Some(prev) => prev * DECAY + sample * (1.0 - DECAY),
        };
        self.value = Some(v);
        v
    }

    pub fn value(&self) -> Option<f64> {
        self.value
    }
}

/// Where cgroup files live: the mounts, so tests can point at fixtures.
#[derive(Clone, Debug)]
pub struct CgroupRoots {
    /// cgroup v2 mounts to try (the unified hierarchy, or its hybrid mount).
    pub v2: Vec<PathBuf>,
    /// cgroup v1 mounts of the cpuacct and cpu controllers.
    pub v1_cpuacct: Vec<PathBuf>,
    pub v1_cpu: Vec<PathBuf>,
    pub v1_cpuset: Vec<PathBuf>,
}

impl Default for CgroupRoots {
    /// This host's mounts, from /proc/self/mounts ([`crate::system::cgroup`]): the
    /// cgroup2 mount (`/sys/fs/cgroup` on pure v2, `/sys/fs/cgroup/unified`
    /// on hybrid hosts) and the v1 hierarchies carrying cpuacct, cpu and
    /// cpuset (none on pure v2).
    fn default() -> Self {
        let m = crate::system::cgroup::mounts().unwrap_or_default();
        Self {
            v2: crate::system::cgroup::v2_of(&m).into_iter().collect(),
            v1_cpuacct: crate::system::cgroup::v1_of(&m, "cpuacct"),
            v1_cpu: crate::system::cgroup::v1_of(&m, "cpu"),
            v1_cpuset: crate::system::cgroup::v1_of(&m, "cpuset"),
        }
    }
}

/// A cgroup's CPU accounting files, resolved once.
#[derive(Clone, Debug, PartialEq)]
pub enum CgroupFiles {
    V1 { usage: PathBuf, quota: Option<PathBuf>, period: Option<PathBuf>, cpuset: Option<PathBuf> },
    V2 { stat: PathBuf, max: Option<PathBuf>, cpuset: Option<PathBuf> },
}

fn join(root: &Path, cg: &str) -> PathBuf {
    root.join(cg.trim_start_matches('/'))
}

impl CgroupFiles {
    /// Finds `cg`'s files: v2 when its directory has `cpu.stat` with
    /// `usage_usec` and a `cpu.max` (the cpu controller is enabled there), else
    /// v1 when the cpuacct hierarchy has it.
    pub fn resolve(roots: &CgroupRoots, cg: &str) -> Result<Self> {
        for r in &roots.v2 {
            let dir = join(r, cg);
            let stat = dir.join("cpu.stat");
            if dir.join("cpu.max").exists() && stat.exists() {
                let cpuset = Some(dir.join("cpuset.cpus.effective")).filter(|p| p.exists());
                return Ok(Self::V2 { stat, max: Some(dir.join("cpu.max")), cpuset });
            }
        }
        for r in &roots.v1_cpuacct {
            let usage = join(r, cg).join("cpuacct.usage");
            if usage.exists() {
                let cpu_dir = roots
                    .v1_cpu
                    .iter()
                    .map(|c| join(c, cg))
                    .find(|d| d.join("cpu.cfs_quota_us").exists());
                let cpuset = roots
                    .v1_cpuset
                    .iter()
                    .map(|c| join(c, cg).join("cpuset.effective_cpus"))
                    .find(|p| p.exists());
                return Ok(Self::V1 {
                    usage,
                    quota: cpu_dir.as_ref().map(|d| d.join("cpu.cfs_quota_us")),
                    period: cpu_dir.as_ref().map(|d| d.join("cpu.cfs_period_us")),
                    cpuset,
                });
            }
        }
        let list = |v: &[PathBuf]| match v {
            [] => "(none mounted)".to_string(),
            v => v.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        };
        bail!(
            "cgroup `{cg}` has no CPU accounting: looked for cpu.stat + cpu.max (v2) under {} and cpuacct.usage (v1) under {}; is the path relative to the cgroup mount and does the cgroup exist?",
            list(&roots.v2),
            list(&roots.v1_cpuacct)
        )
    }

    /// Cumulative CPU time used, in nanoseconds.
    pub fn usage_ns(&self) -> Result<u64> {
        match self {
            Self::V1 { usage, .. } => read_u64(usage),
            Self::V2 { stat, .. } => {
                let text = std::fs::read_to_string(stat)
                    .with_context(|| format!("reading {}", stat.display()))?;
                let usec = text
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix("usage_usec ").and_then(|v| v.trim().parse::<u64>().ok())
                    })
                    .ok_or_else(|| anyhow!("{}: no usage_usec line", stat.display()))?;
                Ok(usec * 1000)
            }
        }
    }

    /// CPUs the cgroup may use: its quota, else its cpuset, else every
    /// online CPU.
    pub fn capacity_cpus(&self) -> Result<f64> {
        let quota = match self {
            Self::V1 { quota: Some(q), period: Some(p), .. } => {
                let q: i64 = read_text(q)?.trim().parse().context("cpu.cfs_quota_us")?;
                let p: i64 = read_text(p)?.trim().parse().context("cpu.cfs_period_us")?;
                (q > 0 && p > 0).then(|| q as f64 / p as f64)
            }
            Self::V2 { max: Some(m), .. } => {
                let t = read_text(m)?;
                let mut it = t.split_whitespace();
                match (it.next(), it.next()) {
                    (Some("max"), _) | (None, _) => None,
                    (Some(q), Some(p)) => {
                        let (q, p): (f64, f64) = (
                            q.parse().context("cpu.max quota")?,
                            p.parse().context("cpu.max period")?,
                        );
                        (q > 0.0 && p > 0.0).then_some(q / p)
                    }
                    (Some(_), None) => bail!("{}: expected \"QUOTA PERIOD\"", m.display()),
                }
            }
            _ => None,
        };
        if let Some(q) = quota {
            return Ok(q);
        }
        let cpuset = match self {
            Self::V1 { cpuset, .. } | Self::V2 { cpuset, .. } => cpuset.as_ref(),
        };
        if let Some(n) = cpuset.and_then(|p| read_text(p).ok()).and_then(|t| count_cpu_list(&t)) {
            return Ok(n as f64);
        }
        Ok(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64)
    }
}

/// CPUs in a list such as "0-3,8,10-11" (None when empty or unreadable).
pub fn count_cpu_list(s: &str) -> Option<usize> {
    let mut n = 0;
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                n += b.checked_sub(a)? + 1;
            }
            None => {
                part.trim().parse::<usize>().ok()?;
                n += 1;
            }
        }
    }
    (n > 0).then_some(n)
}

fn read_text(p: &Path) -> Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

fn read_u64(p: &Path) -> Result<u64> {
    read_text(p)?.trim().parse().with_context(|| format!("{}: not a number", p.display()))
}

/// One source's raw readings, turned into usage samples.
pub struct Sampler {
    source: CpuSource,
    cgroup: Option<CgroupFiles>,
    /// Host: (busy ticks, total ticks); cgroup: (usage ns, wall time).
    last_host: Option<(u64, u64)>,
    last_cgroup: Option<(u64, Instant)>,
}

impl Sampler {
    pub fn new(source: CpuSource) -> Result<Self> {
        Self::with_roots(source, &CgroupRoots::default())
    }

    pub fn with_roots(source: CpuSource, roots: &CgroupRoots) -> Result<Self> {
        let cgroup = match &source {
            CpuSource::Cgroup(cg) => Some(CgroupFiles::resolve(roots, cg)?),
            _ => None,
        };
        let mut s = Self { source, cgroup, last_host: None, last_cgroup: None };
        // The first reading of a cumulative counter gives no sample; take it
        // now so the first `sample()` (250 ms later) already has one.
        let _ = s.sample();
        Ok(s)
    }

    pub fn source(&self) -> &CpuSource {
        &self.source
    }

    /// Usage since the previous call, per-mille (0 to 1000); `None` on the
    /// first reading of a cumulative counter.
    pub fn sample(&mut self) -> Result<Option<f64>> {
        match &self.source {
            CpuSource::Host => {
                use procfs::CurrentSI;
                let t = procfs::KernelStats::current().context("reading /proc/stat")?.total;
                let idle = t.idle + t.iowait.unwrap_or(0);
                let total = t.user
                    + t.nice
                    + t.system
                    + idle
                    + t.irq.unwrap_or(0)
                    + t.softirq.unwrap_or(0)
                    + t.steal.unwrap_or(0);
                let busy = total - idle;
                let prev = self.last_host.replace((busy, total));
                Ok(prev.and_then(|(b0, t0)| host_permille(b0, t0, busy, total)))
            }
            CpuSource::Cgroup(_) => {
                let files = self.cgroup.as_ref().expect("resolved in new");
                let usage = files.usage_ns()?;
                let now = Instant::now();
                let prev = self.last_cgroup.replace((usage, now));
                let Some((u0, t0)) = prev else { return Ok(None) };
                let wall = now.duration_since(t0).as_nanos() as f64;
                let cap = files.capacity_cpus()?;
                if wall <= 0.0 || cap <= 0.0 {
                    return Ok(None);
                }
                Ok(Some(
                    (usage.saturating_sub(u0) as f64 / (wall * cap) * 1000.0).clamp(0.0, 1000.0),
                ))
            }
            CpuSource::File(p) => {
                let v: f64 = read_text(p)?
                    .trim()
                    .parse()
                    .with_context(|| format!("{}: not a number", p.display()))?;
                if !(0.0..=1000.0).contains(&v) {
                    bail!("{}: {v} is not a per-mille value (0 to 1000)", p.display());
                }
                Ok(Some(v))
            }
        }
    }
}

/// A source and its smoothed signal: what the agent ticks every
/// `SAMPLE_PERIOD`.
pub struct CpuSignal {
    sampler: Sampler,
    ema: Ema,
}

impl CpuSignal {
    pub fn new(source: CpuSource) -> Result<Self> {
        Ok(Self { sampler: Sampler::new(source)?, ema: Ema::default() })
    }

    pub fn source(&self) -> &CpuSource {
        self.sampler.source()
    }

    /// Takes a sample and folds it in; the EMA in per-mille (None until the
    /// first sample). A failed read leaves the EMA as it was.
    pub fn tick(&mut self) -> Result<Option<f64>> {
        if let Some(v) = self.sampler.sample()? {
            self.ema.update(v);
        }
        Ok(self.ema.value())
    }

    pub fn value(&self) -> Option<f64> {
        self.ema.value()
    }
}

/// Busy share between two `/proc/stat` readings, per-mille.
pub fn host_permille(busy0: u64, total0: u64, busy1: u64, total1: u64) -> Option<f64> {
    let dt = total1.checked_sub(total0)?;
    if dt == 0 {
        return None;
    }
    Some((busy1.saturating_sub(busy0) as f64 / dt as f64 * 1000.0).clamp(0.0, 1000.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ema_is_seeded_with_the_first_sample() {
        let mut e = Ema::default();
        assert_eq!(e.update(900.0), 900.0, "no blind spot: full load reads as full load at once");
        let v = e.update(100.0);
        assert!((v - (900.0 * 0.95 + 100.0 * 0.05)).abs() < 1e-9);
        // Converges to a constant input.
        for _ in 0..500 {
            e.update(300.0);
        }
        assert!((e.value().unwrap() - 300.0).abs() < 1e-6);
    }

    #[test]
    fn kratos_start_from_zero_would_take_seconds() {
        // Documenting the defect the seeding fixes: from 0 under full load,
        // the EMA needs ceil(ln(0.2)/ln(0.95)) = 32 samples (8 s at 250 ms)
        // to reach 800.
        let mut v = 0.0;
        let mut n = 0;
        while v < 800.0 {
            v = v * DECAY + 1000.0 * (1.0 - DECAY);
            n += 1;
        }
        assert_eq!(n, 32);
    }

    #[test]
    fn sources_parse_with_clear_errors() {
        assert_eq!(CpuSource::parse("host"), Ok(CpuSource::Host));
        assert_eq!(CpuSource::parse("cgroup:/a/b"), Ok(CpuSource::Cgroup("/a/b".into())));
        assert_eq!(CpuSource::parse("file:/run/x"), Ok(CpuSource::File("/run/x".into())));
        assert!(CpuSource::parse("cgroup:a").unwrap_err().contains("starts with /"));
        assert!(CpuSource::parse("proc").unwrap_err().contains("unknown cpu source"));
    }

    #[test]
    fn host_share_from_two_readings() {
        assert_eq!(host_permille(100, 1000, 600, 2000), Some(500.0));
        assert_eq!(host_permille(100, 1000, 100, 1000), None);
        assert_eq!(host_permille(100, 1000, 50, 900), None, "a counter going back gives no sample");
    }

    #[test]
    fn host_source_reads_proc_stat() {
        let mut s = Sampler::new(CpuSource::Host).unwrap();
        // Keep one CPU busy for a moment so the busy share cannot be zero.
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(120) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let v = s.sample().unwrap().expect("a second reading gives a sample");
        assert!(v > 0.0 && v <= 1000.0, "{v}");
    }

    #[test]
    fn cpu_lists_count() {
        assert_eq!(count_cpu_list("0-3,8,10-11\n"), Some(7));
        assert_eq!(count_cpu_list("1"), Some(1));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
    }

    /// A cgroup v2 fixture: a directory with cpu.stat and cpu.max.
    fn v2_fixture(max: &str) -> (PathBuf, CgroupRoots) {
        let root = std::env::temp_dir().join(format!(
            "flowctl-cg2-{}-{}",
            std::process::id(),
            max.replace(' ', "_")
        ));
        let dir = root.join("svc");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("cpu.stat"),
            "usage_usec 1000000\nuser_usec 600000\nsystem_usec 400000\n",
        )
        .unwrap();
        std::fs::write(dir.join("cpu.max"), max).unwrap();
        std::fs::write(dir.join("cpuset.cpus.effective"), "0-3\n").unwrap();
        let roots = CgroupRoots {
            v2: vec![root.clone()],
            v1_cpuacct: vec![],
            v1_cpu: vec![],
            v1_cpuset: vec![],
        };
        (root, roots)
    }

    #[test]
    fn cgroup_v2_usage_against_cpu_max() {
        let (root, roots) = v2_fixture("50000 100000\n");
        let files = CgroupFiles::resolve(&roots, "/svc").unwrap();
        assert!(matches!(files, CgroupFiles::V2 { .. }));
        assert_eq!(files.usage_ns().unwrap(), 1_000_000_000);
        assert_eq!(files.capacity_cpus().unwrap(), 0.5);
        // Half a CPU of quota, used at 0.25 CPU over 200 ms -> 500 per-mille.
        let mut s = Sampler::with_roots(CpuSource::Cgroup("/svc".into()), &roots).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        std::fs::write(root.join("svc/cpu.stat"), "usage_usec 1050000\n").unwrap();
        let v = s.sample().unwrap().unwrap();
        assert!((v - 500.0).abs() < 60.0, "{v}");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn cgroup_v2_without_quota_uses_its_cpuset() {
        let (root, roots) = v2_fixture("max 100000\n");
        let files = CgroupFiles::resolve(&roots, "/svc").unwrap();
        assert_eq!(files.capacity_cpus().unwrap(), 4.0);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn missing_cgroup_says_where_it_looked() {
        let roots = CgroupRoots {
            v2: vec!["/nonexistent-v2".into()],
            v1_cpuacct: vec!["/nonexistent-v1".into()],
            v1_cpu: vec![],
            v1_cpuset: vec![],
        };
        let e = CgroupFiles::resolve(&roots, "/svc").unwrap_err().to_string();
        assert!(e.contains("/nonexistent-v2") && e.contains("/nonexistent-v1"), "{e}");
    }

    #[test]
    fn file_source_rejects_garbage() {
        let p = std::env::temp_dir().join(format!("flowctl-cpu-file-{}", std::process::id()));
        std::fs::write(&p, "750\n").unwrap();
        let mut s = Sampler::new(CpuSource::File(p.clone())).unwrap();
        assert_eq!(s.sample().unwrap(), Some(750.0));
        std::fs::write(&p, "banana").unwrap();
        assert!(s.sample().is_err());
        std::fs::write(&p, "5000").unwrap();
        assert!(s.sample().unwrap_err().to_string().contains("per-mille"));
        std::fs::remove_file(p).unwrap();
    }
}
