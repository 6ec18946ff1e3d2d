//! `flowctl attach`: the agent. Checks the profile against this host and
//! kernel (`preflight`), loads or adopts the pinned data plane, applies the
//! profile, then serves (`serve`) until SIGINT/SIGTERM: the heartbeat, the
//! control loops (CPU signal, BBR, KLimiter, breakers, occupancy, key
//! samples) and `apply` on a unix socket. On exit it detaches unless
//! `--keep` (`attachment`).

pub mod attachment;
pub mod bbr;
pub mod breakers;
pub mod cgroup;
pub mod exposition;
pub mod flood;
pub mod heavy;
pub mod interface;
pub mod klimiter;
pub mod leases;
pub mod metrics;
pub mod occupancy;
pub mod preflight;
pub mod serve;
pub mod socket;
pub mod syn_totals;

use crate::{
    agent::{
        attachment::Attachment,
        breakers::BreakerAgent,
        cgroup::CgroupAgent,
        interface::InterfaceAgent,
        serve::{serve, Signals},
    },
    dataplane::{
        self,
        pins::{self, AttachId},
        state::AttachState,
        Maps, Mode,
    },
};
use anyhow::{bail, Result};
use std::path::PathBuf;

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
    /// `--multiprog`: a libxdp dispatcher's component at this run priority.
    pub multiprog: Option<u32>,
    /// Serve Prometheus metrics here.
    pub metrics: Option<std::net::SocketAddr>,
    /// `--profile etcd://...`: the profile comes from etcd (`profile` is
    /// then set to the staged copy once read).
    pub etcd: Option<crate::fleet::etcd::Config>,
}

pub fn run(args: AttachArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut signals = rt.block_on(async { Signals::install() })?;
    let local = tokio::task::LocalSet::new();
    match args.iface.clone() {
        Some(iface) => run_interface(args, &iface, &rt, &local, &mut signals),
        None if args.etcd.is_some() => bail!("a profile from etcd needs an interface: `flowctl attach IFACE --profile etcd://...` (breakers-only agents take a file)"),
        None => run_cgroup(args, &rt, &local, &mut signals),
    }
}

/// `flowctl attach --cgroup PATH --profile F`: breakers only, no interface.
fn run_cgroup(
    args: AttachArgs,
    rt: &tokio::runtime::Runtime,
    local: &tokio::task::LocalSet,
    signals: &mut Signals,
) -> Result<()> {
    let (set, point) =
        preflight::cgroup(&args.profile, args.cgroup.as_deref(), args.netns.as_deref())?;
    let breakers = BreakerAgent::start(point, &set, &args.profile)?;
    if let Some(addr) = args.metrics {
        metrics::Endpoint::bind(addr)?
            .serve(metrics::Scope { iface: None, cgroup_id: Some(breakers.point.id) })?;
    }
    crate::system::log::status(format_args!(
        "{} breakers from {} attached to cgroup {}; Ctrl-C to detach",
        breakers.breakers(),
        args.profile.display(),
        breakers.point.path.display()
    ));
    let mut agent = CgroupAgent::new(breakers);
    let result = local.block_on(rt, serve(&mut agent, signals));
    let path = agent.breakers.point.path.clone();
    drop(agent);
    crate::system::log::status(format_args!("breakers detached from cgroup {}", path.display()));
    result
}

/// `flowctl attach IFACE --profile F`: the rules on the interface, and the
/// profile's breakers, if any, on a cgroup.
fn run_interface(
    mut args: AttachArgs,
    iface: &str,
    rt: &tokio::runtime::Runtime,
    local: &tokio::task::LocalSet,
    signals: &mut Signals,
) -> Result<()> {
    // The metrics are served where the agent was started, not in the
    // interface's namespace (`--netns`), where the host cannot scrape them.
    let origin = crate::system::netns::Origin::here()?;
    // etcd: the profile is read (or, without etcd, taken from the disk
    // copy) into a file the usual path reads, from the interface's
    // namespace, where the agent lives and keeps its watch.
    let etcd = match args.etcd.take() {
        Some(cfg) => {
            if let Some(ns) = &args.netns {
                crate::system::netns::enter_netns(ns)?;
            }
            let start = rt.block_on(crate::fleet::etcd::follower::bootstrap(&cfg))?;
            args.profile = start.path.clone();
            Some((cfg, start))
        }
        None => None,
    };
    let checked = preflight::interface(&args.profile, iface, args.cgroup.as_deref())?;
    let mut set = checked.set;
    set.settings.kernel_events = crate::system::log::kernel_events();
    if let Some(ns) = &args.netns {
        crate::system::netns::enter_netns(ns)?;
    }
    pins::ensure_bpffs()?;
    pins::ensure_layout()?;
    let id = AttachId::of(iface)?;
    let lock = take_lock(&id, iface, args.netns.as_deref())?;
    // A socket left by an agent that was killed: gone before anything else, so
    // `status` never mistakes it for this agent being ready.
    let _ = std::fs::remove_file(socket::socket_path(&id));
    // --replace keeps the XDP link (ours, or another version's) so the
    // interface is never without the old program or the new one; an older
    // flowctl's kept data plane (an upgrade) is taken over the same way,
    // since its state cannot be adopted and refusing would leave it
    // without an agent.
    let upgrade = !id.pin_dir().exists()
        && pins::other_layout_dirs(&id).iter().any(|(v, _)| *v < flowctl_common::LAYOUT_VERSION);
    // Whether this start runs as a libxdp dispatcher's component, decided
    // before --replace or a takeover removes anything: a kept link (this
    // layout's or another's) cannot become a component in place.
    let kept = id.pin_dir().join("link").exists()
        || dataplane::multiprog::is_component(&id)
        || pins::other_layout_dirs(&id).iter().any(|(_, d)| d.join("link").exists());
    let multiprog = dataplane::multiprog::choose(&id, iface, args.multiprog, kept)?;
    let taken_over = if args.replace || upgrade {
        dataplane::replace_keeping_link(&id)?
    } else {
        preflight::pins(&id, &set, iface)?;
        None
    };
    let adopting = id.pin_dir().join("link").exists() || dataplane::multiprog::is_component(&id);
    let mut held = Attachment::new(id, iface, lock, adopting);
    let takeover = taken_over.clone().map(|mode| Takeover { mode, netns: args.netns.clone() });
    let mode_used = match load_and_attach(&mut held, &set, args.mode, multiprog, takeover.as_ref())
    {
        Err(e) if e.is::<dataplane::SeveredLink>() => {
            // Pins of an interface that no longer exists (its namespace was
            // deleted and the inode and ifindex reused): nothing to adopt.
            crate::system::log::warning(format_args!(
                "removing stale pins at {} (their interface is gone)",
                id.pin_dir().display()
            ));
            dataplane::detach(&id)?;
            held.not_adopting();
            load_and_attach(&mut held, &set, args.mode, multiprog, None)?
        }
        other => other?,
    };
    // A link taken over keeps the mode it was attached in.
    let mode_used = match taken_over {
        Some(m) if mode_used == "adopted" => m,
        _ => mode_used,
    };
    let adopted = !held.owns_pins();
    if !adopted {
        // Totals of an earlier data plane would go on counting in this one.
        let _ = std::fs::remove_file(syn_totals::SynTotals::path(&id));
    }
    let mut state = match AttachState::load(&id)? {
        Some(s) if adopted => s,
        _ => {
            AttachState::fresh(id, iface, args.netns.clone(), mode_used, &set.settings, now_unix())
        }
    };
    let mut maps = Maps::open(&id)?;
    maps.agent_heartbeat = true;
    preflight::attachment(&state, &set)?;
    dataplane::apply(&mut maps, &mut state, &set)?;
    state.record_profile(&args.profile)?;
    dataplane::heartbeat(&mut maps)?;
    let (ebpf, egress) = held.parts();
    dataplane::set_egress(ebpf, &mut maps, &set, egress)?;
    dataplane::set_shapers(ebpf, &mut maps, &set, egress, &state.iface)?;
    let breakers =
        checked.breakers.map(|p| BreakerAgent::start(p, &set, &args.profile)).transpose()?;
    if let Some(addr) = args.metrics {
        origin.run(|| metrics::Endpoint::bind(addr))?.serve(metrics::Scope {
            iface: Some(id),
            cgroup_id: breakers.as_ref().map(|b| b.point.id),
        })?;
    }
    let verb = if adopted { "adopted the pinned data plane on" } else { "attached to" };
    let source = match &etcd {
        Some((_, start)) => format!("{} ({})", start.candidate.label, start.candidate.version),
        None => args.profile.display().to_string(),
    };
    crate::system::log::status(format_args!(
        "{verb} {} ({} mode), {} rules from {}; Ctrl-C to {}",
        iface,
        state.mode,
        set.rules.len(),
        source,
        if args.keep { "stop the agent (the data plane stays)" } else { "detach" }
    ));
    if let Some(b) = &breakers {
        crate::system::log::status(format_args!(
            "{} breakers attached to cgroup {}",
            b.breakers(),
            b.point.path.display()
        ));
    }
    // Global rules' leases: a profile whose store cannot be configured (an
    // unreadable password file, a bad CA) refuses the attach here; a store
    // that is down does not (its keys run at their default share).
    let leases = leases::LeaseLoop::start(&state, &set, rt.handle())?;
    held.serve(args.keep);
    let follower = etcd.map(|(cfg, start)| {
        let f = crate::fleet::etcd::Follower::start(cfg, start, id.run_dir(), rt.handle());
        interface::record_source(&mut state, &f);
        f
    });
    let (ebpf, egress) = held.parts();
    let mut agent = InterfaceAgent::new(
        maps,
        state,
        set,
        checked.cpu,
        ebpf,
        egress,
        breakers,
        args.cgroup.clone(),
    );
    agent.etcd = follower;
    agent.leases = leases;
    let result = local.block_on(rt, serve(&mut agent, signals));
    // The breakers go first, then the egress filters and the data plane.
    drop(agent);
    held.finish()?;
    result
}

/// How long a new agent waits for the lock's holder to let go when it is on
/// its way out (an agent stopping, a `detach`, an agent-less `apply`).
pub const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The attachment's lock for this agent: at once when free; when an agent,
/// a `detach` or an agent-less `apply` is finishing with it, after it lets
/// go (at most [`STOP_WAIT`]); else an error naming the agent that runs.
fn take_lock(
    id: &AttachId,
    iface: &str,
    netns: Option<&str>,
) -> Result<crate::system::lock::FileLock> {
    use crate::system::lock::phase;
    use std::time::{Duration, Instant};
    let start = Instant::now();
    let mut said = false;
    loop {
        if let Some(l) = pins::lock_attachment(id)? {
            if said {
                crate::system::log::status(format_args!("{iface} is free now"));
            }
            return Ok(l);
        }
        let waited = start.elapsed();
        let Some(h) = pins::lock_holder(id) else {
            // Let go between the two looks: try again, within bounds.
            if waited >= STOP_WAIT {
                bail!("the lock of {iface} ({}) stays taken", pins::lock_path(id).display());
            }
            continue;
        };
        if phase::is_transient(&h.phase) && waited < STOP_WAIT {
            if !said {
                crate::system::log::status(format_args!(
                    "waiting for the lock of {iface} ({h}) to be let go"
                ));
                said = true;
            }
        } else if phase::is_transient(&h.phase) {
            bail!(
                "the lock of {iface} ({h}) was not let go within {} s; is that process hung? (lock {})",
                STOP_WAIT.as_secs(),
                pins::lock_path(id).display()
            );
        } else if waited >= Duration::from_millis(500) {
            // Given a moment: a signal may be on its way to it.
            bail!(
                "another flowctl agent is already running for {iface} ({h}; lock {}); stop it first (`flowctl detach {iface}{ns}` stops it and detaches), or use `flowctl apply` to change its profile",
                pins::lock_path(id).display(),
                ns = netns.map(|n| format!(" --netns {n}")).unwrap_or_default(),
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Loads the object (or adopts the pins) and attaches it to the interface;
/// returns the mode used.
fn load_and_attach(
    held: &mut Attachment,
    set: &crate::profile::RuleSet,
    mode: Mode,
    multiprog: Option<u32>,
    takeover: Option<&Takeover>,
) -> Result<String> {
    let variant = match multiprog {
        Some(_) => dataplane::XdpVariant::Multiprog,
        None => dataplane::XdpVariant::for_kernel(),
    };
    let mut ebpf = dataplane::load_variant(&held.id, &set.settings, variant)?;
    if let Some(t) = takeover {
        // The link still runs the program being replaced: the new one goes
        // on it only with the profile in its maps, or packets would meet
        // empty tables (and pass) in between.
        let mut state = AttachState::fresh(
            held.id,
            &held.iface,
            t.netns.clone(),
            t.mode.clone(),
            &set.settings,
            now_unix(),
        );
        dataplane::apply(&mut Maps::open(&held.id)?, &mut state, set)?;
        state.save()?;
    }
    let mode = match multiprog {
        Some(prio) => dataplane::multiprog::join(&mut ebpf, &held.id, &held.iface, mode, prio)?,
        None => dataplane::attach(&mut ebpf, &held.id, &held.iface, mode)?,
    };
    held.loaded(ebpf, set.settings.kernel_events)?;
    Ok(mode)
}

/// `--replace` keeping an XDP link: the old program's mode, and where
/// the attachment lives, for the state written before the new program
/// takes the link.
struct Takeover {
    mode: String,
    netns: Option<String>,
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
