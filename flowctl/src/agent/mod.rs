//! `flowctl attach`: the agent. Loads or adopts the pinned data plane, applies
//! the profile, then runs until SIGINT/SIGTERM: writes the heartbeat and serves
//! `apply` on a unix socket. On exit it detaches unless `--keep`.

pub mod bbr;
pub mod breakers;
pub mod heavy;
pub mod klimiter;
pub mod metrics;
pub mod occupancy;
pub mod socket;

use crate::{
    agent::{
        breakers::{BreakerAgent, CgroupPoint},
        socket::{Request, Response},
    },
    dataplane::{
        self,
        pins::{self, AttachId},
        state::AttachState,
        Maps, Mode,
    },
    profile,
};
use anyhow::{bail, Context, Result};
use flowctl_common::{map_names, AgentRecord, LAYOUT_VERSION, NO_CPU_SIGNAL};
use std::{path::PathBuf, time::Duration};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

pub struct AttachArgs {
    /// The interface for the profile's rules; `None`: breakers only.
    pub iface: Option<String>,
    /// Where the breakers' hooks attach (default: the cgroup v2 root, the
    /// whole host).
    pub cgroup: Option<PathBuf>,
    pub profile: PathBuf,
    pub mode: Mode,
    pub netns: Option<String>,
    pub keep: bool,
    pub replace: bool,
    /// Serve Prometheus metrics here.
    pub metrics: Option<std::net::SocketAddr>,
}

pub fn require_root() -> Result<()> {
    // Capabilities are checked by the kernel; this catches the common case
    // early with a clear fix.
    let mut caps = String::new();
    if let Ok(s) = std::fs::read_to_string("/proc/self/status") {
        caps = s.lines().find(|l| l.starts_with("CapEff:")).unwrap_or("").to_string();
    }
    let eff = u64::from_str_radix(caps.trim_start_matches("CapEff:").trim(), 16).unwrap_or(0);
    const CAP_NET_ADMIN: u64 = 1 << 12;
    const CAP_SYS_ADMIN: u64 = 1 << 21;
    const CAP_BPF: u64 = 1 << 39;
    if eff & CAP_NET_ADMIN == 0 || eff & (CAP_BPF | CAP_SYS_ADMIN) == 0 {
        bail!("flowctl needs root, or the capabilities CAP_BPF (or CAP_SYS_ADMIN) and CAP_NET_ADMIN: run it with sudo");
    }
    Ok(())
}

pub fn run(args: AttachArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // Signal handlers first: a SIGINT that arrives while the program loads is
    // held until the loop starts, and then detaches cleanly.
    let signals = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    match args.iface.clone() {
        Some(iface) => run_with(args, iface, &rt, signals),
        None => run_breakers(args, &rt, signals),
    }
}

type Signals = (tokio::signal::unix::Signal, tokio::signal::unix::Signal);

/// `flowctl attach --cgroup PATH --profile F`: breakers only, no interface.
fn run_breakers(args: AttachArgs, rt: &tokio::runtime::Runtime, signals: Signals) -> Result<()> {
    let set = profile::load(&args.profile)?;
    if !set.rules.is_empty() {
        bail!(
            "{}: the profile has {} [[rule]]s, which need an interface: `flowctl attach IFACE --profile {}` (add --cgroup PATH for where its breakers attach)",
            args.profile.display(),
            set.rules.len(),
            args.profile.display()
        );
    }
    if set.breakers.is_empty() {
        bail!("{}: the profile has no [[breaker]]", args.profile.display());
    }
    if args.netns.is_some() {
        bail!("--netns names the namespace of an interface; breakers attach to a cgroup and see connects from every namespace");
    }
    require_root()?;
    kernel_check(&set, &args.profile)?;
    let point = CgroupPoint::resolve(args.cgroup.as_deref())?;
    let mut breakers = BreakerAgent::start(point, &set, &args.profile)?;
    if let Some(addr) = args.metrics {
        metrics::spawn(addr, metrics::Scope { iface: None, cgroup_id: Some(breakers.point.id) })?;
    }
    eprintln!(
        "flowctl: {} breakers from {} attached to cgroup {}; Ctrl-C to detach",
        breakers.breakers(),
        args.profile.display(),
        breakers.point.path.display()
    );
    let local = tokio::task::LocalSet::new();
    let result = local.block_on(rt, serve_breakers(&mut breakers, signals));
    let path = breakers.point.path.clone();
    drop(breakers);
    eprintln!("flowctl: breakers detached from cgroup {}", path.display());
    result
}

async fn serve_breakers(breakers: &mut BreakerAgent, signals: Signals) -> Result<()> {
    let (mut int, mut term) = signals;
    let sock = breakers.point.run_dir().join("agent.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = tokio::net::UnixListener::bind(&sock)
        .with_context(|| format!("binding {}", sock.display()))?;
    let mut tick = ticker(breakers.tick_period());
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Pending>(8);
    loop {
        tokio::select! {
            _ = int.recv() => break,
            _ = term.recv() => break,
            _ = tick.tick() => {
                if let Err(e) = breakers.tick(crate::system::clock::monotonic_ns()) {
                    tracing::warn!("breakers: {e:#}");
                }
            }
            Some((line, reply)) = rx.recv() => {
                let resp = match serde_json::from_str::<Request>(&line) {
                    Ok(Request::Apply { profile }) => apply_breakers_only(breakers, &PathBuf::from(profile)),
                    Ok(_) => Response::err("this agent runs breakers only (no interface)"),
                    Err(e) => Response::err(format!("bad request: {e}")),
                };
                let _ = reply.send(resp);
                if tick.period() != breakers.tick_period() {
                    tick = ticker(breakers.tick_period());
                }
            }
            conn = listener.accept() => {
                if let Ok((stream, _)) = conn {
                    read_request(stream, tx.clone());
                }
            }
        }
    }
    let _ = std::fs::remove_file(&sock);
    Ok(())
}

/// Rejects a profile whose parts need a kernel feature this kernel lacks
/// (`kernel::features::REQUIREMENTS`), naming the feature and the release
/// that has it.
pub fn kernel_check(set: &profile::RuleSet, path: &std::path::Path) -> Result<()> {
    crate::kernel::features::check_profile(set)
        .map_err(|e| anyhow::anyhow!("{}: {e:#}", path.display()))
}

fn apply_breakers_only(breakers: &mut BreakerAgent, path: &std::path::Path) -> Response {
    let set = match profile::load(path) {
        Ok(s) => s,
        Err(e) => return Response::err(e.to_string()),
    };
    if let Err(e) = kernel_check(&set, path) {
        return Response::err(format!("{e:#}"));
    }
    if !set.rules.is_empty() {
        return Response::err(format!(
            "{}: the profile has [[rule]]s, but this agent has no interface (nothing was applied)",
            path.display()
        ));
    }
    if set.breakers.is_empty() {
        return Response::err(format!("{}: the profile has no [[breaker]]; stop the agent to detach the breakers (nothing was applied)", path.display()));
    }
    match breakers.apply(&set, path) {
        Ok(()) => Response::ok(format!("applied {} breakers", set.breakers.len())),
        Err(e) => Response::err(format!("{e:#} (nothing was applied)")),
    }
}

/// Reads one request line from a control-socket connection on its own task
/// (a client that says nothing cannot hold up the loops) and hands it to the
/// loop, which answers through the oneshot.
fn read_request(stream: tokio::net::UnixStream, tx: tokio::sync::mpsc::Sender<Pending>) {
    tokio::task::spawn_local(async move {
        let (r, mut w) = stream.into_split();
        let mut line = String::new();
        let mut reader = BufReader::new(r);
        let resp =
            match tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut line)).await {
                Ok(Ok(n)) if n > 0 => {
                    let (rtx, rrx) = tokio::sync::oneshot::channel();
                    if tx.send((line, rtx)).await.is_err() {
                        return;
                    }
                    rrx.await.unwrap_or_else(|_| Response::err("the agent is stopping"))
                }
                _ => Response::err("no request received"),
            };
        if let Ok(mut out) = serde_json::to_string(&resp) {
            out.push('\n');
            let _ = w.write_all(out.as_bytes()).await;
        }
    });
}

fn run_with(
    args: AttachArgs,
    iface: String,
    rt: &tokio::runtime::Runtime,
    signals: Signals,
) -> Result<()> {
    let set = profile::load(&args.profile)?;
    if set.rules.is_empty() {
        bail!(
            "{}: the profile has no [[rule]] for {iface}; for breakers only: `flowctl attach --cgroup PATH --profile {}` (no interface)",
            args.profile.display(),
            args.profile.display()
        );
    }
    require_root()?;
    // What the kernel lacks rejects the profile before anything is touched.
    kernel_check(&set, &args.profile)?;
    // The breakers' cgroups are checked before anything touches the kernel.
    let breaker_point = if !set.breakers.is_empty() {
        let point = CgroupPoint::resolve(args.cgroup.as_deref())?;
        breakers::check(&point, &set, &args.profile)?;
        Some(point)
    } else if args.cgroup.is_some() {
        bail!("{}: --cgroup given, but the profile has no [[breaker]]", args.profile.display());
    } else {
        None
    };

    // The CPU source is checked before anything touches the kernel.
    let cpu = crate::controllers::cpu::CpuSignal::new(set.settings.cpu_source.clone())
        .with_context(|| format!("{}: the cpu source", args.profile.display()))?;
    if let Some(ns) = &args.netns {
        crate::system::netns::enter_netns(ns)?;
    }
    pins::ensure_bpffs()?;
    pins::ensure_layout()?;
    let id = AttachId::of(&iface)?;
    let Some(lock) = pins::lock_attachment(&id)? else {
        bail!("another flowctl agent is already running for {} (lock {}); stop it first or use `flowctl apply` to change its profile", iface, id.run_dir().join("agent.lock").display());
    };
    // A socket left by an agent that was killed: gone before anything else, so
    // `status` never mistakes it for this agent being ready.
    let _ = std::fs::remove_file(socket::socket_path(&id));
    let link_pinned = id.pin_dir().join("link").exists();
    if link_pinned && args.replace {
        dataplane::detach(&id)?;
    } else if id.pin_dir().exists() {
        match dataplane::pinned_layout(&id) {
            Some(v) if v == LAYOUT_VERSION || v == 0 => {}
            other => bail!(
                "pins at {} have layout version {:?}, not {LAYOUT_VERSION}; refusing to adopt them. Re-run with --replace to start over (this resets all bucket state)",
                id.pin_dir().display(),
                other
            ),
        }
        for (name, want) in [
            (map_names::KEYS, set.settings.key_table_entries),
            (map_names::SRC_CACHE, set.settings.source_cache_entries),
            (map_names::QUOTAS, set.settings.quota_table_entries),
            (map_names::CONNS, set.settings.connection_table_entries),
        ] {
            if let Some(have) = dataplane::pinned_max_entries(&id, name) {
                if have != want {
                    bail!("the pinned {name} has {have} entries but the profile asks for {want}; table sizes can only change with --replace (which resets bucket state)");
                }
            }
        }
    }
    let mut adopting = id.pin_dir().join("link").exists();
    let (ebpf, mode_used) = match load_and_attach(&id, &set, &iface, args.mode, adopting) {
        Err(e) if e.is::<dataplane::SeveredLink>() => {
            // Pins of an interface that no longer exists (its namespace was
            // deleted and the inode and ifindex reused): nothing to adopt.
            eprintln!(
                "flowctl: warning: removing stale pins at {} (their interface is gone)",
                id.pin_dir().display()
            );
            dataplane::detach(&id)?;
            adopting = false;
            load_and_attach(&id, &set, &iface, args.mode, false)?
        }
        other => other?,
    };
    let mut state = match AttachState::load(&id)? {
        Some(s) if adopting => s,
        _ => AttachState {
            layout_version: LAYOUT_VERSION,
            iface: iface.clone(),
            netns: args.netns.clone(),
            id,
            mode: mode_used.clone(),
            profile_path: String::new(),
            rules: Vec::new(),
            next_state_id: 0,
            attached_at_unix: now_unix(),
            key_table_entries: set.settings.key_table_entries,
            source_cache_entries: set.settings.source_cache_entries,
            quota_table_entries: set.settings.quota_table_entries,
            stats: set.settings.stats,
            connection_table_entries: set.settings.connection_table_entries,
        },
    };
    let mut maps = Maps::open(&id)?;
    if let Err(e) = apply_and_record(&mut maps, &mut state, &set, &args.profile) {
        if !adopting {
            let _ = dataplane::detach(&id);
        }
        return Err(e);
    }
    dataplane::heartbeat(&mut maps)?;
    let mut ebpf = ebpf;
    let mut egress = dataplane::Egress::for_attachment(&id);
    if let Err(e) = dataplane::set_egress(&mut ebpf, &mut maps, &set, &mut egress) {
        if !adopting {
            let _ = dataplane::detach(&id);
        }
        return Err(e);
    }
    let mut breakers =
        match breaker_point.map(|p| BreakerAgent::start(p, &set, &args.profile)).transpose() {
            Ok(b) => b,
            Err(e) => {
                if !adopting {
                    let _ = dataplane::detach(&id);
                }
                return Err(e);
            }
        };
    if let Some(addr) = args.metrics {
        metrics::spawn(
            addr,
            metrics::Scope { iface: Some(id), cgroup_id: breakers.as_ref().map(|b| b.point.id) },
        )?;
    }
    let verb = if adopting { "adopted the pinned data plane on" } else { "attached to" };
    eprintln!(
        "flowctl: {verb} {} ({} mode), {} rules from {}; Ctrl-C to {}",
        iface,
        state.mode,
        set.rules.len(),
        args.profile.display(),
        if args.keep { "stop the agent (the data plane stays)" } else { "detach" }
    );
    let local = tokio::task::LocalSet::new();
    if let Some(b) = &breakers {
        eprintln!(
            "flowctl: {} breakers attached to cgroup {}",
            b.breakers(),
            b.point.path.display()
        );
    }
    let mut io = Io {
        ebpf: &mut ebpf,
        egress: &mut egress,
        breakers: &mut breakers,
        cgroup: args.cgroup.clone(),
    };
    let result = local.block_on(rt, serve(&id, &mut maps, &mut state, set, cpu, signals, &mut io));
    drop(breakers);
    // The egress filters (and a clsact qdisc flowctl added) go with the
    // agent, also under --keep: nothing reads their counts without it.
    egress.release();
    if args.keep {
        eprintln!("flowctl: agent stopped; the data plane on {iface} keeps enforcing (--keep)");
    } else {
        dataplane::detach(&id)?;
        eprintln!("flowctl: detached from {iface}");
    }
    drop(ebpf);
    drop(lock);
    result
}

fn load_and_attach(
    id: &AttachId,
    set: &profile::RuleSet,
    iface: &str,
    mode: Mode,
    adopting: bool,
) -> Result<(aya::Ebpf, String)> {
    let cleanup = |e: anyhow::Error| {
        if !adopting {
            let _ = dataplane::detach(id);
        }
        e
    };
    let mut ebpf = dataplane::load(id, &set.settings).map_err(cleanup)?;
    let mode = dataplane::attach(&mut ebpf, id, iface, mode).map_err(cleanup)?;
    Ok((ebpf, mode))
}

/// Applies `set` to an attachment and records it (state, active profile).
/// Both the agent and an agent-less `apply` come through here.
pub fn apply_and_record(
    maps: &mut Maps,
    state: &mut AttachState,
    set: &profile::RuleSet,
    path: &std::path::Path,
) -> Result<()> {
    let s = &set.settings;
    if (
        s.key_table_entries,
        s.source_cache_entries,
        s.quota_table_entries,
        s.connection_table_entries,
    ) != (
        state.key_table_entries,
        state.source_cache_entries,
        state.quota_table_entries,
        state.connection_table_entries,
    ) {
        bail!("table sizes differ from the attached data plane's; they can only change by re-attaching with --replace (nothing was applied)");
    }
    if s.stats != state.stats {
        bail!(
            "the statistics settings ({} level, {} x {} ms) differ from the attached data plane's ({} level, {} x {} ms); they are fixed when the program loads and change only by re-attaching with --replace (nothing was applied)",
            s.stats.level_name(), s.stats.buckets, s.stats.bucket_ns / 1_000_000,
            state.stats.level_name(), state.stats.buckets, state.stats.bucket_ns / 1_000_000
        );
    }
    dataplane::apply(maps, state, set)?;
    let abs = std::fs::canonicalize(path).unwrap_or(path.to_path_buf());
    state.profile_path = abs.display().to_string();
    std::fs::create_dir_all(state.id.run_dir())?;
    std::fs::copy(path, state.id.run_dir().join("profile.toml"))
        .context("saving the active profile")?;
    state.save()
}

/// An interval for a control loop: a late tick is taken late, not in a
/// burst to catch up.
fn ticker(period: Duration) -> tokio::time::Interval {
    let mut t = tokio::time::interval(period);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A request read by a connection task, with the channel for its answer.
type Pending = (String, tokio::sync::oneshot::Sender<Response>);

#[allow(clippy::too_many_arguments)]
async fn serve(
    id: &AttachId,
    maps: &mut Maps,
    state: &mut AttachState,
    mut set: profile::RuleSet,
    mut cpu: crate::controllers::cpu::CpuSignal,
    signals: Signals,
    io: &mut Io<'_>,
) -> Result<()> {
    let (mut int, mut term) = signals;
    let sock = socket::socket_path(id);
    let _ = std::fs::remove_file(&sock);
    let listener = tokio::net::UnixListener::bind(&sock)
        .with_context(|| format!("binding {}", sock.display()))?;
    // `flowctl apply --cgroup` reaches this agent through its cgroup's socket.
    let mut breaker_listener = bind_breaker_socket(io.breakers.as_ref())?;
    let mut breaker_tick =
        ticker(io.breakers.as_ref().map(|b| b.tick_period()).unwrap_or(Duration::from_secs(1)));
    let mut beat = tokio::time::interval(Duration::from_millis(500));
    let mut keys_tick = tokio::time::interval(Duration::from_millis(250));
    let mut cpu_tick = tokio::time::interval(crate::controllers::cpu::SAMPLE_PERIOD);
    let mut cpu_failing = false;
    // The BBR loop runs once per statistics bucket.
    let mut bbr_tick = ticker(Duration::from_nanos(state.stats.bucket_ns));
    let mut bbr = bbr::BbrLoop::default();
    let mut klim = klimiter::KlimiterLoop::new(&set);
    let mut klim_tick =
        ticker(klim.as_ref().map(|k| k.sample_period()).unwrap_or(Duration::from_secs(1)));
    let mut next_walk = tokio::time::Instant::now();
    let mut published = AgentRecord { cpu_permille: NO_CPU_SIGNAL, ..Default::default() };
    let mut keys = match heavy::KeyWatcher::open(id) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!("top --keys unavailable: {e:#}");
            None
        }
    };
    // Connections are read on their own tasks, so a client that connects and
    // says nothing cannot hold up the heartbeat; requests are then handled
    // one at a time here, where the maps are.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Pending>(8);
    loop {
        tokio::select! {
            _ = int.recv() => break,
            _ = term.recv() => break,
            _ = beat.tick() => {
                if let Err(e) = dataplane::heartbeat(maps) {
                    tracing::warn!("heartbeat failed: {e:#}");
                }
                published.updated_ns = crate::system::clock::monotonic_ns();
                if let Err(e) = maps.set_agent_record(&published) {
                    tracing::warn!("publishing agent state failed: {e:#}");
                }
            }
            _ = tokio::time::sleep_until(next_walk) => {
                let started = std::time::Instant::now();
                if let Err(e) = occupancy::walk(id, maps, state, &mut published) {
                    tracing::warn!("counting the key tables failed: {e:#}");
                }
                next_walk = tokio::time::Instant::now() + occupancy::next_walk_after(started.elapsed());
            }
            _ = cpu_tick.tick() => {
                match cpu.tick() {
                    Ok(v) => {
                        cpu_failing = false;
                        published.cpu_permille = v.map(|v| v.round() as u32).unwrap_or(NO_CPU_SIGNAL);
                        published.cpu_source = cpu.source().code();
                    }
                    // Hold the last value; say so once per failure episode.
                    Err(e) if !cpu_failing => {
                        cpu_failing = true;
                        tracing::warn!("CPU signal: {e:#} (holding the last value)");
                    }
                    Err(_) => {}
                }
            }
            _ = bbr_tick.tick(), if set.rules.iter().any(|r| r.bbr.is_some()) => {
                if let Err(e) = bbr.tick(maps, state, &set, published.cpu_permille, crate::system::clock::monotonic_ns()) {
                    tracing::warn!("BBR loop: {e:#}");
                }
            }
            _ = klim_tick.tick(), if klim.is_some() => {
                if let Some(k) = klim.as_mut() {
                    if let Err(e) = k.sample(maps, state, &set, published.cpu_permille) {
                        tracing::warn!("KLimiter: {e:#}");
                    }
                }
            }
            _ = keys_tick.tick() => {
                if let Some(w) = keys.as_mut().filter(|w| w.active()) {
                    if let Err(e) = w.poll(maps) {
                        tracing::warn!("key sampling: {e:#}");
                    }
                }
            }
            _ = breaker_tick.tick(), if io.breakers.is_some() => {
                if let Some(b) = io.breakers.as_mut() {
                    if let Err(e) = b.tick(crate::system::clock::monotonic_ns()) {
                        tracing::warn!("breakers: {e:#}");
                    }
                }
            }
            Some((line, reply)) = rx.recv() => {
                let before = set.clone();
                let _ = reply.send(handle(maps, state, &mut set, keys.as_mut(), &mut cpu, io, &line));
                if io.breakers.as_ref().map(|b| b.point.id) != breaker_listener.as_ref().map(|(id, _, _)| *id) {
                    if let Some((_, _, p)) = &breaker_listener {
                        let _ = std::fs::remove_file(p);
                    }
                    breaker_listener = bind_breaker_socket(io.breakers.as_ref()).unwrap_or_else(|e| {
                        tracing::warn!("{e:#}");
                        None
                    });
                }
                if let Some(b) = io.breakers.as_ref().filter(|b| b.tick_period() != breaker_tick.period()) {
                    breaker_tick = ticker(b.tick_period());
                }
                if set != before {
                    // A new profile: its egress targets, and a new KLimiter
                    // keeping the ratios of entries it still has.
                    if let Err(e) = dataplane::set_egress(io.ebpf, maps, &set, io.egress) {
                        tracing::warn!("egress counters: {e:#}");
                    }
                    let mut next = klimiter::KlimiterLoop::new(&set);
                    if let (Some(n), Some(o)) = (next.as_mut(), klim.as_ref()) {
                        n.inherit(o);
                    }
                    if let Some(n) = &next {
                        klim_tick = ticker(n.sample_period());
                    }
                    klim = next;
                }
            }
            conn = listener.accept() => {
                if let Ok((stream, _)) = conn {
                    read_request(stream, tx.clone());
                }
            }
            conn = async { breaker_listener.as_ref().expect("guarded").1.accept().await }, if breaker_listener.is_some() => {
                if let Ok((stream, _)) = conn {
                    read_request(stream, tx.clone());
                }
            }
        }
    }
    if let Some((_, _, p)) = &breaker_listener {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(&sock);
    if let Some(w) = keys.as_mut() {
        let _ = w.stop(maps);
    }
    // Readers show "agent not running" at once, not after the grace period.
    let _ = maps.set_agent_record(&AgentRecord::default());
    Ok(())
}

/// What the interface agent's loop owns besides the maps.
struct Io<'a> {
    ebpf: &'a mut aya::Ebpf,
    /// The TC egress counter's attachments (detached when the agent ends).
    egress: &'a mut dataplane::Egress,
    breakers: &'a mut Option<BreakerAgent>,
    /// `--cgroup`, for breakers a later profile adds.
    cgroup: Option<PathBuf>,
}

type BreakerListener = Option<(u64, tokio::net::UnixListener, PathBuf)>;

fn bind_breaker_socket(b: Option<&BreakerAgent>) -> Result<BreakerListener> {
    let Some(b) = b else { return Ok(None) };
    let p = b.point.run_dir().join("agent.sock");
    let _ = std::fs::remove_file(&p);
    let l =
        tokio::net::UnixListener::bind(&p).with_context(|| format!("binding {}", p.display()))?;
    Ok(Some((b.point.id, l, p)))
}

/// The breakers' part of an apply, checked before the rules are applied:
/// what to do once they are.
enum BreakerChange {
    None,
    Stop,
    Apply,
    Start(CgroupPoint),
}

fn plan_breakers(
    io: &Io<'_>,
    set: &profile::RuleSet,
    path: &std::path::Path,
) -> Result<BreakerChange> {
    Ok(match (io.breakers.as_ref(), set.breakers.is_empty()) {
        (None, true) => BreakerChange::None,
        (Some(_), true) => BreakerChange::Stop,
        (Some(b), false) => {
            breakers::check(&b.point, set, path)?;
            BreakerChange::Apply
        }
        (None, false) => {
            let point = CgroupPoint::resolve(io.cgroup.as_deref())?;
            breakers::check(&point, set, path)?;
            BreakerChange::Start(point)
        }
    })
}

fn handle(
    maps: &mut Maps,
    state: &mut AttachState,
    active: &mut profile::RuleSet,
    keys: Option<&mut heavy::KeyWatcher>,
    cpu: &mut crate::controllers::cpu::CpuSignal,
    io: &mut Io<'_>,
    line: &str,
) -> Response {
    let req: Request = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return Response::err(format!("bad request: {e}")),
    };
    match req {
        Request::Apply { profile } => {
            let path = PathBuf::from(&profile);
            let set = match profile::load(&path) {
                Ok(s) => s,
                Err(e) => return Response::err(e.to_string()),
            };
            if let Err(e) = kernel_check(&set, &path) {
                return Response::err(format!("{e:#}"));
            }
            // A new CPU source must work before anything is applied.
            let new_cpu = if &set.settings.cpu_source != cpu.source() {
                match crate::controllers::cpu::CpuSignal::new(set.settings.cpu_source.clone()) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        return Response::err(format!(
                            "{}: the cpu source: {e:#} (nothing was applied)",
                            path.display()
                        ))
                    }
                }
            } else {
                None
            };
            if set.rules.is_empty() {
                return Response::err(format!(
                    "{}: the profile has no [[rule]] for this interface (nothing was applied)",
                    path.display()
                ));
            }
            let change = match plan_breakers(io, &set, &path) {
                Ok(c) => c,
                Err(e) => return Response::err(format!("{e:#} (nothing was applied)")),
            };
            let result = apply_and_record(maps, state, &set, &path).and_then(|()| match change {
                BreakerChange::None => Ok(()),
                BreakerChange::Stop => {
                    *io.breakers = None;
                    Ok(())
                }
                BreakerChange::Apply => io.breakers.as_mut().expect("planned").apply(&set, &path),
                BreakerChange::Start(point) => {
                    *io.breakers = Some(BreakerAgent::start(point, &set, &path)?);
                    Ok(())
                }
            });
            let n = set.rules.len();
            if result.is_ok() {
                *active = set;
            }
            match result {
                Ok(()) if new_cpu.is_some() => {
                    *cpu = new_cpu.expect("checked");
                    Response::ok(format!(
                        "applied {n} rules (generation {}); CPU signal now from {:?}",
                        maps.global().map(|g| g.generation).unwrap_or(0),
                        cpu.source()
                    ))
                }
                Ok(()) => Response::ok(format!(
                    "applied {n} rules (generation {})",
                    maps.global().map(|g| g.generation).unwrap_or(0)
                )),
                Err(e) => Response::err(format!("{e:#}")),
            }
        }
        Request::Keys { rule, top } => {
            let Some(w) = keys else {
                return Response::err("key sampling is unavailable in this agent (see its log)");
            };
            let report = w.ask(maps).and_then(|()| heavy::rule_report(w, maps, state, &rule, top));
            match report.and_then(|r| Ok(serde_json::to_value(r)?)) {
                Ok(v) => Response { ok: true, message: String::new(), data: Some(v) },
                Err(e) => Response::err(format!("{e:#}")),
            }
        }
    }
}
