//! The circuit breakers' agent side: attaches the `flowctl-breaker` object
//! to a cgroup v2 directory, reads the outcome counters the kernel keeps,
//! rolls them into each breaker's window, decides (SRE probability or the
//! closed / open / half-open machine) and tells the hooks; publishes what it
//! decided for `status`, `top` and the metrics.
//!
//! The hooks live exactly as long as this agent: their links are owned by
//! the process, so when it exits (even killed) the kernel detaches them and
//! connections flow unthrottled; a hung agent stops pushing the deadline
//! forward and the hooks fail open after the grace period. A breaker with no
//! one deciding would either keep refusing a healed dependency or never
//! refuse, so nothing is kept across agents.
//!
//! `apply` keeps a breaker's state (window, open / half-open, probability)
//! when its identity (name, target, cgroup, mode and window parameters) is
//! unchanged, and starts changed or new ones closed with an empty window.
//! Kratos rebuilds (resets) every breaker on reload; keeping them means a
//! reload during an outage does not send the full load at the failing
//! dependency again.

use crate::dataplane::pins::run_file;
use crate::profile::{
    breaker::{addr_words, Breaker, BreakerMode, TargetSpec},
    RuleSet,
};
use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, PerCpuArray},
    programs::{links::CgroupAttachMode, CgroupSockAddr, SockOps},
    Ebpf, EbpfLoader,
};
use flowctl_common::{
    breaker::{
        counter, probe_word, sre_drop_ppm, target_flags, Control, Machine, Outcomes, State, Target,
        Window, DEADLINE_INDEX, MAX_TARGETS,
    },
    RUN_ROOT,
};
use serde::{Deserialize, Serialize};
use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// The agent reads the counters this often (or each window bucket, when
/// shorter).
pub const TICK_NS: u64 = 100_000_000;
/// A half-open round whose admitted probes have not all reported after
/// this long reopens: their outcome was lost (an evicted socket mark).
const PROBE_LOST_NS: u64 = 10_000_000_000;

/// The cgroup v2 directory the hooks attach to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupPoint {
    /// The cgroup v2 mount (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified`
    /// on hybrid systems).
    pub mount: PathBuf,
    pub path: PathBuf,
    /// The directory's inode: the kernel's cgroup id.
    pub id: u64,
}

impl CgroupPoint {
    /// `path` (absolute, or relative to the cgroup v2 mount); `None`: the
    /// whole host (the mount's root).
    pub fn resolve(path: Option<&Path>) -> Result<Self> {
        let mount = crate::system::cgroup::cgroup2_mount()?;
        let path = match path {
            None => mount.clone(),
            Some(p) => resolve_under(&mount, p)?,
        };
        let id =
            std::fs::metadata(&path).with_context(|| format!("cgroup {}", path.display()))?.ino();
        Ok(Self { mount, path, id })
    }

    pub fn run_dir(&self) -> PathBuf {
        run_dir(self.id)
    }

    /// The control socket of the agent holding this cgroup's breakers.
    pub fn socket_path(&self) -> PathBuf {
        self.run_dir().join(run_file::SOCKET)
    }
}

pub fn run_dir(cgroup_id: u64) -> PathBuf {
    Path::new(RUN_ROOT).join(format!("cgroup-{cgroup_id}"))
}

fn resolve_under(mount: &Path, p: &Path) -> Result<PathBuf> {
    let full = if p.is_absolute() { p.to_path_buf() } else { mount.join(p) };
    let full = std::fs::canonicalize(&full).with_context(|| {
        format!(
            "no cgroup {} (create it with `mkdir {}`, under the cgroup v2 mount {})",
            full.display(),
            full.display(),
            mount.display()
        )
    })?;
    if !full.starts_with(mount) {
        bail!("{} is not in the cgroup v2 hierarchy at {}", full.display(), mount.display());
    }
    if !full.join("cgroup.procs").exists() {
        bail!("{} is not a cgroup directory (no cgroup.procs)", full.display());
    }
    Ok(full)
}

/// A breaker's `cgroup`, checked against the attach point: its id and depth.
fn breaker_cgroup(point: &CgroupPoint, b: &Breaker, file: &Path) -> Result<(u64, u32)> {
    let Some(c) = &b.cgroup else { return Ok((0, 0)) };
    let path = resolve_under(&point.mount, Path::new(c)).map_err(|e| {
        anyhow::anyhow!("{}:{}: breaker `{}`: {e:#}", file.display(), b.line, b.name)
    })?;
    if !path.starts_with(&point.path) {
        bail!(
            "{}:{}: breaker `{}`: cgroup {} is outside the attach point {}: its processes would never reach the hooks (attach with --cgroup at a common ancestor)",
            file.display(),
            b.line,
            b.name,
            path.display(),
            point.path.display()
        );
    }
    let level = path.strip_prefix(&point.mount).expect("checked").components().count() as u32;
    Ok((std::fs::metadata(&path)?.ino(), level))
}

fn target_record(t: &TargetSpec, flags: u8, cgroup: (u64, u32)) -> Target {
    let (addr, family) = addr_words(&t.net.addr);
    Target {
        addr,
        prefix_len: t.net.len,
        family,
        flags,
        port_lo: t.ports.0,
        port_hi: t.ports.1,
        cgroup_id: cgroup.0,
        cgroup_level: cgroup.1,
        ..Default::default()
    }
}

/// The kernel's target table for a profile: every exempt target first (the
/// hooks take the first match), then the breakers; `slots[i]` is breaker
/// i's slot.
fn layout(
    point: &CgroupPoint,
    breakers: &[Breaker],
    file: &Path,
) -> Result<(Vec<Target>, Vec<u32>)> {
    let mut table = Vec::new();
    let mut cgroups = Vec::new();
    for b in breakers {
        let cg = breaker_cgroup(point, b, file)?;
        cgroups.push(cg);
        for e in &b.exempt {
            table.push(target_record(e, target_flags::EXEMPT, cg));
        }
    }
    let mut slots = Vec::new();
    for (b, cg) in breakers.iter().zip(cgroups) {
        slots.push(table.len() as u32);
        table.push(target_record(&b.target, if b.dry_run { target_flags::DRY_RUN } else { 0 }, cg));
    }
    if table.len() > MAX_TARGETS {
        bail!(
            "{}: {} target slots needed, the kernel has {MAX_TARGETS}",
            file.display(),
            table.len()
        );
    }
    Ok((table, slots))
}

/// Checks a profile's breakers against an attach point (cgroups exist and
/// are under it, slots suffice) without touching the kernel.
pub fn check(point: &CgroupPoint, set: &RuleSet, file: &Path) -> Result<()> {
    layout(point, &set.breakers, file).map(|_| ())
}

/// What a breaker last changed to, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub from: String,
    pub to: String,
    pub unix_ms: u64,
    pub reason: String,
}

/// One breaker's live state in the agent.
struct Live {
    def: Breaker,
    slot: u32,
    window: Window,
    machine: Option<Machine>,
    /// The counters at the last read (cumulative, summed over CPUs).
    seen: [u64; counter::COUNT as usize],
    /// Since this breaker was created (not reset by a keeping apply).
    totals: [u64; counter::COUNT as usize],
    drop_ppm: u32,
    state: &'static str,
    written: Option<Control>,
    round_started_ns: u64,
    probe: (u32, u32, u32),
    last_transition: Option<Transition>,
}

impl Live {
    fn new(def: Breaker, slot: u32) -> Self {
        let machine = match &def.mode {
            BreakerMode::State(cfg) => Some(Machine::new(*cfg)),
            BreakerMode::Sre { .. } => None,
        };
        Self {
            window: Window::new(def.window_ns, def.buckets),
            def,
            slot,
            machine,
            seen: [0; counter::COUNT as usize],
            totals: [0; counter::COUNT as usize],
            drop_ppm: 0,
            state: "closed",
            written: None,
            round_started_ns: 0,
            probe: (0, 0, 0),
            last_transition: None,
        }
    }

    fn transition(&mut self, to: &'static str, reason: String) {
        if to != self.state {
            tracing::info!("breaker {}: {} -> {to} ({reason})", self.def.name, self.state);
            self.last_transition = Some(Transition {
                from: self.state.into(),
                to: to.into(),
                unix_ms: unix_ms(),
                reason,
            });
            self.state = to;
        }
    }

    /// One step: the counters' deltas into the window, then the decision.
    /// Returns the control record the hooks should have.
    fn step(
        &mut self,
        counts: [u64; counter::COUNT as usize],
        kernel: Control,
        now: u64,
    ) -> Control {
        let mut d = [0u64; counter::COUNT as usize];
        for i in 0..d.len() {
            d[i] = counts[i].saturating_sub(self.seen[i]);
            self.totals[i] += d[i];
        }
        self.seen = counts;
        let c = |i: u32| d[i as usize];
        self.window.add(
            now,
            &Outcomes {
                requests: c(counter::ATTEMPTS),
                accepts: c(counter::SUCCESSES),
                refused_by_peer: c(counter::REFUSED_BY_PEER),
                timeouts: c(counter::TIMEOUTS),
                refused_locally: c(counter::REFUSED_LOCALLY),
                would_refuse: c(counter::WOULD_REFUSE),
            },
        );
        let w = self.window.sum(now);
        let errno = self.def.errno;
        match (&self.def.mode, self.machine.as_mut()) {
            (BreakerMode::Sre { k_milli, min_requests, max_drop_ppm }, _) => {
                self.drop_ppm =
                    sre_drop_ppm(w.requests, w.accepts, *k_milli, *min_requests, *max_drop_ppm);
                let to = if self.drop_ppm > 0 { "throttling" } else { "closed" };
                self.transition(
                    to,
                    format!("{} requests, {} accepts in the window", w.requests, w.accepts),
                );
                Control { drop_ppm: self.drop_ppm, errno, ..Default::default() }
            }
            (BreakerMode::State(_), Some(m)) => {
                let before = m.epoch;
                let mut why = String::new();
                m.tick(now);
                if m.epoch != before {
                    why = "sleep elapsed".into();
                }
                match m.state {
                    State::Closed => {
                        m.observe_window(w.requests, w.failures(), now);
                        if m.epoch != before {
                            why = format!(
                                "{} of {} requests failed in the window",
                                w.failures(),
                                w.requests
                            );
                        }
                    }
                    State::HalfOpen { .. }
                        if probe_word::epoch(kernel.probe_word) == m.epoch & 0xffff =>
                    {
                        let (admitted, ok, failed) = (
                            probe_word::admitted(kernel.probe_word),
                            probe_word::ok(kernel.probe_word),
                            probe_word::failed(kernel.probe_word),
                        );
                        self.probe = (admitted, ok, failed);
                        let epoch = m.epoch;
                        if failed > 0 {
                            m.outcome(epoch, true, false, now);
                            why = "a probe failed".into();
                        } else if admitted > ok
                            && now.saturating_sub(self.round_started_ns) > PROBE_LOST_NS
                        {
                            m.outcome(epoch, true, false, now);
                            why = "a probe's outcome was lost".into();
                        } else {
                            let State::HalfOpen { succeeded, .. } = m.state else { unreachable!() };
                            for _ in succeeded..ok {
                                m.outcome(epoch, true, true, now);
                            }
                            if m.state == State::Closed {
                                why = format!("{ok} probes succeeded");
                            }
                        }
                    }
                    _ => {}
                }
                let (to, control) = match m.state {
                    State::Closed => ("closed", Control { errno, ..Default::default() }),
                    State::Open { .. } => {
                        ("open", Control { drop_ppm: 1_000_000, errno, ..Default::default() })
                    }
                    State::HalfOpen { .. } => {
                        let probes = m.cfg.probes;
                        (
                            "half-open",
                            Control {
                                drop_ppm: 1_000_000,
                                errno,
                                probes,
                                probe_word: probe_word::pack(m.epoch, 0, 0, 0),
                                ..Default::default()
                            },
                        )
                    }
                };
                let changed = m.epoch != before;
                // Half-open: once the kernel holds this round's word it is
                // the truth until the round ends (rewriting it would re-admit
                // probes). A record without it (the round just began, or an
                // apply moved the breaker to a cleared slot) gets it now.
                let installed = kernel.probes == control.probes
                    && probe_word::epoch(kernel.probe_word)
                        == probe_word::epoch(control.probe_word);
                let new_round = to == "half-open" && (changed || !installed);
                if new_round {
                    m.restart_round();
                    self.round_started_ns = now;
                    self.probe = (0, 0, 0);
                }
                if changed {
                    if to == "closed" {
                        // Hystrix resets its counts on closing: the failures
                        // that opened it must not reopen it at once.
                        self.window.clear();
                    }
                    self.transition(to, why);
                }
                self.drop_ppm = control.drop_ppm;
                if to == "half-open" && !new_round {
                    kernel
                } else {
                    control
                }
            }
            (BreakerMode::State(_), None) => unreachable!("state breakers have a machine"),
        }
    }

    fn published(&self, now: u64) -> PublishedBreaker {
        let w = self.window.sum(now);
        let t = |i: u32| self.totals[i as usize];
        PublishedBreaker {
            name: self.def.name.clone(),
            target: self.def.target.to_string(),
            cgroup: self.def.cgroup.clone(),
            mode: self.def.mode.name().into(),
            dry_run: self.def.dry_run,
            errno: crate::profile::breaker::errno_name(self.def.errno),
            state: self.state.into(),
            drop_probability: self.drop_ppm as f64 / 1e6,
            window: PublishedWindow { seconds: self.window.span_ns() as f64 / 1e9, outcomes: w },
            totals: counter::NAMES
                .iter()
                .enumerate()
                .map(|(i, n)| (n.to_string(), t(i as u32)))
                .collect(),
            probes: self
                .machine
                .as_ref()
                .filter(|m| matches!(m.state, State::HalfOpen { .. }))
                .map(|m| PublishedProbes {
                    allowed: m.cfg.probes,
                    admitted: self.probe.0,
                    succeeded: self.probe.1,
                    failed: self.probe.2,
                }),
            last_transition: self.last_transition.clone(),
        }
    }
}

/// What `status`, `top` and the metrics read
/// (`/run/flowctl/cgroup-<id>/breakers.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Published {
    pub cgroup: String,
    pub cgroup_id: u64,
    pub pid: u32,
    pub profile: String,
    /// Wall clock of the last write; readers treat it as stale after
    /// `STALE_MS` (the agent writes every 250 ms).
    pub updated_unix_ms: u64,
    pub breakers: Vec<PublishedBreaker>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PublishedBreaker {
    pub name: String,
    pub target: String,
    pub cgroup: Option<String>,
    pub mode: String,
    pub dry_run: bool,
    pub errno: String,
    /// sre: "closed" or "throttling"; state: "closed", "open", "half-open".
    pub state: String,
    pub drop_probability: f64,
    pub window: PublishedWindow,
    /// Counters since the breaker was created, by `counter::NAMES`.
    pub totals: std::collections::BTreeMap<String, u64>,
    pub probes: Option<PublishedProbes>,
    pub last_transition: Option<Transition>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PublishedWindow {
    pub seconds: f64,
    #[serde(flatten)]
    pub outcomes: Outcomes,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PublishedProbes {
    pub allowed: u32,
    pub admitted: u32,
    pub succeeded: u32,
    pub failed: u32,
}

/// Published state older than this is from an agent that is gone.
pub const STALE_MS: u64 = 3_000;

/// Every cgroup attachment's published breakers that are fresh.
pub fn published_all() -> Vec<Published> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(RUN_ROOT) else { return out };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(id) = name.strip_prefix("cgroup-").and_then(|i| i.parse::<u64>().ok()) else {
            continue;
        };
        let lock = run_dir(id).join(run_file::LOCK);
        if !crate::system::lock::lock_held(&lock) {
            continue;
        }
        let Ok(text) = std::fs::read(run_dir(id).join("breakers.json")) else { continue };
        if let Ok(p) = serde_json::from_slice::<Published>(&text) {
            if unix_ms().saturating_sub(p.updated_unix_ms) <= STALE_MS {
                out.push(p);
            }
        }
    }
    out.sort_by_key(|p| p.cgroup_id);
    out
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The breakers of one cgroup attachment: the loaded, attached object and
/// the breakers' state. Dropping it detaches the hooks.
pub struct BreakerAgent {
    pub point: CgroupPoint,
    ebpf: Ebpf,
    _lock: crate::system::lock::FileLock,
    /// After the lock (and its directory): the run root, if now empty.
    _prune: crate::dataplane::pins::PruneRootsOnDrop,
    live: Vec<Live>,
    profile: String,
    grace_ns: u64,
    last_publish_ns: u64,
}

impl BreakerAgent {
    /// Takes the cgroup's lock, loads and attaches, and sets the profile's
    /// breakers. Nothing stays attached on error.
    pub fn start(point: CgroupPoint, set: &RuleSet, profile: &Path) -> Result<Self> {
        // The cgroup checks first: a bad path is rejected before the kernel is touched.
        let (table, slots) = layout(&point, &set.breakers, profile)?;
        let dir = point.run_dir();
        let Some(lock) = crate::system::lock::FileLock::try_acquire(&dir.join(run_file::LOCK))?
        else {
            bail!(
                "another flowctl agent holds the breakers of cgroup {} (lock {}); stop it first or use `flowctl apply --cgroup {} PROFILE`",
                point.path.display(),
                dir.join(run_file::LOCK).display(),
                point.path.display()
            );
        };
        let ebpf = EbpfLoader::new()
            .load(crate::dataplane::object::breaker_object())
            .context("loading the breaker programs")?;
        let mut agent = Self {
            point,
            ebpf,
            _lock: lock,
            _prune: crate::dataplane::pins::PruneRootsOnDrop,
            live: Vec::new(),
            profile: String::new(),
            grace_ns: set.settings.grace_ns,
            last_publish_ns: 0,
        };
        agent.write_table(&table)?;
        agent.live =
            set.breakers.iter().zip(&slots).map(|(b, s)| Live::new(b.clone(), *s)).collect();
        agent.baseline_counts()?;
        agent.profile =
            std::fs::canonicalize(profile).unwrap_or(profile.into()).display().to_string();
        agent.tick(crate::system::clock::monotonic_ns())?;
        // A bpf_link attachment (what aya makes on this kernel) takes no
        // flags and always coexists with other programs on the cgroup, as
        // BPF_F_ALLOW_MULTI would (the kernel rejects flags on links).
        let cg = std::fs::File::open(&agent.point.path)
            .with_context(|| format!("opening {}", agent.point.path.display()))?;
        for name in ["flowctl_connect4", "flowctl_connect6"] {
            let p: &mut CgroupSockAddr =
                agent.ebpf.program_mut(name).context("program missing")?.try_into()?;
            p.load().with_context(|| format!("loading {name}"))?;
            p.attach(&cg, CgroupAttachMode::Single)
                .with_context(|| format!("attaching {name} to {}", agent.point.path.display()))?;
        }
        let p: &mut SockOps =
            agent.ebpf.program_mut("flowctl_sock_ops").context("program missing")?.try_into()?;
        p.load().context("loading flowctl_sock_ops")?;
        p.attach(&cg, CgroupAttachMode::Single).with_context(|| {
            format!("attaching flowctl_sock_ops to {}", agent.point.path.display())
        })?;
        std::fs::copy(profile, dir.join(run_file::PROFILE)).ok();
        Ok(agent)
    }

    pub fn breakers(&self) -> usize {
        self.live.len()
    }

    /// How often `tick` should run.
    pub fn tick_period(&self) -> std::time::Duration {
        let shortest = self.live.iter().map(|l| l.window.bucket_ns).min().unwrap_or(TICK_NS);
        std::time::Duration::from_nanos(shortest.min(TICK_NS))
    }

    /// A new profile: all checked before anything changes; kept breakers
    /// keep their state.
    pub fn apply(&mut self, set: &RuleSet, profile: &Path) -> Result<()> {
        let (table, slots) = layout(&self.point, &set.breakers, profile)?;
        let mut old: Vec<Live> = std::mem::take(&mut self.live);
        let mut next = Vec::new();
        // Slots whose control record belongs to no one now: unused ones, and
        // those a new or moved breaker takes over (they hold another
        // breaker's record, maybe a probe round with a matching epoch).
        let mut cleared: Vec<u32> =
            (0..MAX_TARGETS as u32).filter(|s| !slots.contains(s)).collect();
        for (b, slot) in set.breakers.iter().zip(&slots) {
            let mut l = match old.iter().position(|o| o.def.identity() == b.identity()) {
                Some(i) => {
                    let mut l = old.swap_remove(i);
                    l.def = b.clone();
                    if l.slot != *slot {
                        cleared.push(*slot);
                    }
                    l
                }
                None => {
                    cleared.push(*slot);
                    Live::new(b.clone(), *slot)
                }
            };
            l.slot = *slot;
            l.written = None;
            next.push(l);
        }
        self.live = next;
        self.write_table(&table)?;
        {
            let mut control: Array<_, Control> = Array::try_from(
                self.ebpf
                    .map_mut(flowctl_common::map_names::BREAKER_CONTROL)
                    .context("control map")?,
            )?;
            for s in cleared {
                control.set(s, Control::default(), 0)?;
            }
        }
        self.baseline_counts()?;
        self.grace_ns = set.settings.grace_ns;
        self.profile =
            std::fs::canonicalize(profile).unwrap_or(profile.into()).display().to_string();
        std::fs::copy(profile, self.point.run_dir().join(run_file::PROFILE)).ok();
        self.tick(crate::system::clock::monotonic_ns())
    }

    fn write_table(&mut self, table: &[Target]) -> Result<()> {
        let mut targets: Array<_, Target> = Array::try_from(
            self.ebpf.map_mut(flowctl_common::map_names::BREAKER_TARGETS).context("targets map")?,
        )?;
        for i in 0..MAX_TARGETS {
            targets.set(i as u32, table.get(i).copied().unwrap_or_default(), 0)?;
        }
        Ok(())
    }

    fn counts(&self, slot: u32) -> Result<[u64; counter::COUNT as usize]> {
        let m: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf.map(flowctl_common::map_names::BREAKER_COUNTS).context("counts map")?,
        )?;
        let mut out = [0u64; counter::COUNT as usize];
        for (i, o) in out.iter_mut().enumerate() {
            *o = m.get(&(slot * counter::COUNT + i as u32), 0)?.iter().sum();
        }
        Ok(out)
    }

    /// Counting starts from the counters' present values (slots move
    /// between profiles).
    fn baseline_counts(&mut self) -> Result<()> {
        for i in 0..self.live.len() {
            let c = self.counts(self.live[i].slot)?;
            self.live[i].seen = c;
        }
        Ok(())
    }

    /// Reads, decides, writes what changed, pushes the deadline forward and
    /// publishes (every 250 ms, and on every transition).
    pub fn tick(&mut self, now: u64) -> Result<()> {
        let mut transitioned = false;
        for i in 0..self.live.len() {
            let slot = self.live[i].slot;
            let counts = self.counts(slot)?;
            let kernel = {
                let control: Array<_, Control> = Array::try_from(
                    self.ebpf
                        .map(flowctl_common::map_names::BREAKER_CONTROL)
                        .context("control map")?,
                )?;
                control.get(&slot, 0)?
            };
            let before = self.live[i].last_transition.clone();
            let want = self.live[i].step(counts, kernel, now);
            transitioned |= self.live[i].last_transition != before;
            if self.live[i].written != Some(want) {
                let mut control: Array<_, Control> = Array::try_from(
                    self.ebpf
                        .map_mut(flowctl_common::map_names::BREAKER_CONTROL)
                        .context("control map")?,
                )?;
                control.set(slot, want, 0)?;
                self.live[i].written = Some(want);
            }
        }
        let mut deadline: Array<_, u64> = Array::try_from(
            self.ebpf
                .map_mut(flowctl_common::map_names::BREAKER_DEADLINE)
                .context("deadline map")?,
        )?;
        deadline.set(DEADLINE_INDEX, now + self.grace_ns, 0)?;
        if transitioned || now.saturating_sub(self.last_publish_ns) >= 250_000_000 {
            self.publish(now)?;
            self.last_publish_ns = now;
        }
        Ok(())
    }

    pub fn published(&self, now: u64) -> Published {
        Published {
            cgroup: self.point.path.display().to_string(),
            cgroup_id: self.point.id,
            pid: std::process::id(),
            profile: self.profile.clone(),
            updated_unix_ms: unix_ms(),
            breakers: self.live.iter().map(|l| l.published(now)).collect(),
        }
    }

    fn publish(&self, now: u64) -> Result<()> {
        let dir = self.point.run_dir();
        std::fs::create_dir_all(&dir)?;
        let tmp = dir.join("breakers.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&self.published(now))?)?;
        std::fs::rename(&tmp, dir.join("breakers.json"))?;
        Ok(())
    }
}

impl Drop for BreakerAgent {
    fn drop(&mut self) {
        // Readers stop showing it at once; the links go with the object.
        // With the profile's copy gone the directory is empty, and goes
        // with the lock.
        let _ = std::fs::remove_file(self.point.run_dir().join("breakers.json"));
        let _ = std::fs::remove_file(self.point.run_dir().join(run_file::PROFILE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::breaker::TargetSpec;
    use flowctl_common::breaker::StateConfig;

    const MS: u64 = 1_000_000;

    fn breaker(mode: BreakerMode) -> Breaker {
        Breaker {
            name: "db".into(),
            line: 1,
            target: TargetSpec {
                net: flowctl_common::tables::Cidr { addr: "10.0.0.1".parse().unwrap(), len: 32 },
                ports: (5432, 5432),
            },
            cgroup: None,
            mode,
            window_ns: 3_000 * MS,
            buckets: 10,
            errno: 111,
            dry_run: false,
            exempt: vec![],
        }
    }

    /// Cumulative kernel counters.
    fn counts(
        attempts: u64,
        successes: u64,
        refused: u64,
        timeouts: u64,
    ) -> [u64; counter::COUNT as usize] {
        let mut c = [0; counter::COUNT as usize];
        c[counter::ATTEMPTS as usize] = attempts;
        c[counter::SUCCESSES as usize] = successes;
        c[counter::REFUSED_BY_PEER as usize] = refused;
        c[counter::TIMEOUTS as usize] = timeouts;
        c
    }

    #[test]
    fn sre_follows_the_window_and_forgets_after_it() {
        let mut l = Live::new(
            breaker(BreakerMode::Sre { k_milli: 2000, min_requests: 100, max_drop_ppm: 900_000 }),
            0,
        );
        let c = l.step(counts(200, 20, 180, 0), Control::default(), 1_000 * MS);
        // (200 - 2 * 20) / 201
        assert_eq!((c.drop_ppm, l.state), (796_019, "throttling"));
        // Healed: nothing new fails, and the failures age out of the 3 s window.
        let c = l.step(counts(230, 50, 180, 0), Control::default(), 2_000 * MS);
        assert_eq!(c.drop_ppm, sre_drop_ppm(230, 50, 2000, 100, 900_000));
        let c = l.step(counts(240, 60, 180, 0), Control::default(), 4_500 * MS);
        assert_eq!((c.drop_ppm, l.state), (0, "closed"), "the window no longer holds the outage");
        assert_eq!(l.last_transition.as_ref().unwrap().to, "closed");
    }

    fn state_breaker() -> Live {
        Live::new(
            breaker(BreakerMode::State(StateConfig {
                failure_ppm: 500_000,
                min_requests: 20,
                sleep_ns: 1_000 * MS,
                probes: 2,
            })),
            3,
        )
    }

    #[test]
    fn state_opens_sleeps_and_hands_the_kernel_a_probe_round() {
        let mut l = state_breaker();
        let c = l.step(counts(30, 10, 20, 0), Control::default(), 100 * MS);
        assert_eq!((l.state, c.drop_ppm, c.probes), ("open", 1_000_000, 0));
        let c = l.step(counts(30, 10, 20, 0), c, 1_200 * MS);
        assert_eq!((l.state, c.probes), ("half-open", 2));
        let epoch = probe_word::epoch(c.probe_word);
        // While the round runs, the kernel's word is kept, not rewritten.
        let kernel = Control { probe_word: probe_word::pack(epoch, 1, 0, 0), ..c };
        assert_eq!(l.step(counts(31, 10, 20, 0), kernel, 1_300 * MS), kernel);
        // Two successes close it, and the window that opened it is cleared.
        let kernel = Control { probe_word: probe_word::pack(epoch, 2, 2, 0), ..c };
        let c = l.step(counts(32, 12, 20, 0), kernel, 1_400 * MS);
        assert_eq!((l.state, c.drop_ppm, c.probes), ("closed", 0, 0));
        assert_eq!(l.window.sum(1_400 * MS).requests, 0);
        assert_eq!(l.last_transition.as_ref().unwrap().reason, "2 probes succeeded");
    }

    #[test]
    fn a_failed_probe_reopens_and_a_stale_round_is_ignored() {
        let mut l = state_breaker();
        let c = l.step(counts(30, 0, 30, 0), Control::default(), 100 * MS);
        let c = l.step(counts(30, 0, 30, 0), c, 1_200 * MS);
        let epoch = probe_word::epoch(c.probe_word);
        // A word of another round (successes that began before): ignored.
        let stale = Control { probe_word: probe_word::pack(epoch.wrapping_sub(1), 2, 2, 0), ..c };
        l.step(counts(30, 0, 30, 0), stale, 1_300 * MS);
        assert_eq!(l.state, "half-open");
        let failed = Control { probe_word: probe_word::pack(epoch, 1, 0, 1), ..c };
        let c = l.step(counts(31, 0, 30, 1), failed, 1_400 * MS);
        assert_eq!((l.state, c.drop_ppm, c.probes), ("open", 1_000_000, 0));
        assert_eq!(l.last_transition.as_ref().unwrap().reason, "a probe failed");
    }

    #[test]
    fn a_cleared_record_gets_the_current_round_installed_again() {
        let mut l = state_breaker();
        let c = l.step(counts(30, 0, 30, 0), Control::default(), 100 * MS);
        let round = l.step(counts(30, 0, 30, 0), c, 1_200 * MS);
        assert_eq!(l.state, "half-open");
        // An apply moved the breaker: its new slot's record was cleared.
        let c = l.step(counts(30, 0, 30, 0), Control::default(), 1_300 * MS);
        assert_eq!(c, round, "the round is installed again, probes and all");
        assert_eq!((l.state, l.round_started_ns), ("half-open", 1_300 * MS));
        // And from then on the kernel's word is kept.
        let taken = Control {
            probe_word: probe_word::pack(probe_word::epoch(round.probe_word), 1, 0, 0),
            ..round
        };
        assert_eq!(l.step(counts(31, 0, 30, 0), taken, 1_400 * MS), taken);
    }

    #[test]
    fn a_probe_that_never_reports_reopens_after_the_limit() {
        let mut l = state_breaker();
        let c = l.step(counts(30, 0, 30, 0), Control::default(), 100 * MS);
        let c = l.step(counts(30, 0, 30, 0), c, 1_200 * MS);
        let lost =
            Control { probe_word: probe_word::pack(probe_word::epoch(c.probe_word), 1, 0, 0), ..c };
        l.step(counts(31, 0, 30, 0), lost, 5_000 * MS);
        assert_eq!(l.state, "half-open", "still waiting");
        l.step(counts(31, 0, 30, 0), lost, 1_200 * MS + PROBE_LOST_NS + 1);
        assert_eq!(l.state, "open");
    }
}
