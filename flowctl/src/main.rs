use clap::{CommandFactory, Parser, Subcommand};
use flowctl::{agent, cli, dataplane::Mode, fleet::etcd};
use std::path::PathBuf;

/// Kernel-assisted rate limiting at the NIC (XDP).
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// How stderr is written: `text` lines, or `json`, one object per line
    /// for a log collector (the same events; status lines become events
    /// of target flowctl::status). FLOWCTL_LOG filters the log events.
    #[arg(long, global = true, value_enum, default_value_t, env = "FLOWCTL_LOG_FORMAT")]
    log_format: flowctl::system::log::LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Load, attach and run the agent until Ctrl-C.
    ///
    /// Example: sudo flowctl attach eth0 --profile rules.toml
    ///
    /// Circuit breakers only (no interface):
    /// sudo flowctl attach --cgroup /sys/fs/cgroup/app --profile breakers.toml
    ///
    /// The profile a fleet shares, from etcd (docs/fleet.md):
    /// sudo flowctl attach eth0 --profile etcd://10.0.0.5:2379/flowctl/web
    Attach {
        /// The interface the profile's rules apply to (none: breakers only).
        #[arg(required_unless_present = "cgroup")]
        iface: Option<String>,
        /// The cgroup v2 directory the profile's breakers attach to
        /// (absolute or relative to the cgroup v2 mount; default: its root,
        /// the whole host).
        #[arg(long, value_name = "PATH")]
        cgroup: Option<PathBuf>,
        /// A profile file, or etcd://HOST:PORT[,HOST:PORT...]/PREFIX.
        #[arg(long)]
        profile: PathBuf,
        #[arg(long, value_enum, default_value_t = Mode::Auto)]
        mode: Mode,
        /// Network namespace (from `ip netns add`) that holds the interface.
        #[arg(long)]
        netns: Option<String>,
        /// Leave the pinned data plane enforcing when the agent exits.
        #[arg(long)]
        keep: bool,
        /// Discard existing pins (and all bucket state) instead of adopting them.
        #[arg(long)]
        replace: bool,
        /// Run as one component of a libxdp dispatcher, beside xdp-filter and other programs
        /// libxdp loads, at this run priority (lower runs first; default 50, libxdp's; a
        /// packet flowctl passes goes on to the next component). docs/coexistence.md
        #[arg(long, value_name = "RUN_PRIO", num_args = 0..=1, default_missing_value = "50")]
        multiprog: Option<u32>,
        /// Serve Prometheus metrics at http://ADDR/metrics (default 127.0.0.1:9464), in the
        /// namespace this command runs in (also with --netns); OpenMetrics or the classic text
        /// format, as the scraper's Accept asks.
        #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = flowctl::agent::metrics::DEFAULT_ADDR)]
        metrics: Option<std::net::SocketAddr>,
        #[command(flatten)]
        etcd: EtcdArgs,
        /// With an etcd profile: the root of the last good copies on disk.
        #[arg(long, value_name = "DIR", default_value = etcd::disk::DEFAULT_ROOT)]
        etcd_cache: PathBuf,
        /// With an etcd profile: a watch with no event and no progress
        /// notification for this long is reconnected.
        #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
        etcd_watch_timeout: f64,
    },
    /// Validate a profile and write it to etcd for every agent of a prefix:
    /// one transaction writes it and bumps the generation; prints the
    /// generation and the revision.
    ///
    /// Example: flowctl publish etcd://10.0.0.5:2379/flowctl/web rules.toml
    Publish {
        /// etcd://HOST:PORT[,HOST:PORT...]/PREFIX
        url: String,
        /// The profile file (validated here first, as `flowctl check` does).
        profile: PathBuf,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
    /// Detach and remove all pins of an interface (idempotent).
    Detach {
        iface: String,
        #[arg(long)]
        netns: Option<String>,
    },
    /// Hot-reload a profile, all or nothing; unchanged rules keep their
    /// buckets and unchanged breakers their state.
    ///
    /// Example: sudo flowctl apply eth0 rules.toml
    ///
    /// Breakers-only agent: sudo flowctl apply --cgroup /sys/fs/cgroup/app breakers.toml
    Apply {
        /// IFACE PROFILE, or PROFILE with --cgroup.
        #[arg(num_args = 1..=2, value_names = ["IFACE", "PROFILE"], required = true)]
        args: Vec<String>,
        /// The cgroup of a breakers-only agent.
        #[arg(long, value_name = "PATH")]
        cgroup: Option<PathBuf>,
        #[arg(long)]
        netns: Option<String>,
    },
    /// Show attachments, agents, memory and per-rule counters.
    ///
    /// The rollout of an etcd profile: flowctl status --fleet etcd://10.0.0.5:2379/flowctl/web
    /// (exits 1 until every agent enforces the newest profile).
    Status {
        #[arg(long)]
        json: bool,
        /// Each agent of this etcd prefix: its applied generation and hash
        /// against the newest, and its error.
        #[arg(long, value_name = "URL")]
        fleet: Option<String>,
        /// Only the attachments in this network namespace (from `ip netns add`).
        #[arg(long, conflicts_with = "fleet")]
        netns: Option<String>,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
    /// Live per-rule rates of every attachment (read-only; keys: s sort, p pause, ? legend, q quit).
    ///
    /// Example: sudo flowctl top --once --json
    Top {
        /// Only this interface.
        iface: Option<String>,
        /// Only the attachments in this network namespace (from `ip netns
        /// add`); with IFACE, the interface there.
        #[arg(long)]
        netns: Option<String>,
        /// Refresh period in seconds.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Print one reading (two samples `interval` apart) and exit.
        #[arg(long)]
        once: bool,
        /// With --once: JSON (schema in docs/top.md).
        #[arg(long, requires = "once")]
        json: bool,
        /// The heaviest keys of this rule instead (sampled; see docs/top.md
        /// for the error bound).
        #[arg(long, value_name = "RULE")]
        keys: Option<String>,
        /// With --keys: how many keys.
        #[arg(long, default_value_t = 20, requires = "keys")]
        count: usize,
        /// With --once (text): fit the table to N columns (default: the
        /// terminal's width; every column when not writing to a terminal).
        #[arg(long, value_name = "N", requires = "once")]
        width: Option<usize>,
    },
    /// Run the KLimiter controller against a described plant on a virtual
    /// clock; writes timeseries.csv and chart.svg.
    ///
    /// Example: flowctl simulate examples/scenarios/article.toml --out /tmp/sim
    Simulate {
        scenario: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Validate a profile without touching the kernel (for CI pipelines),
    /// and say what it costs in kernel memory on this host.
    ///
    /// Example: flowctl check rules.toml --cpus 128
    Check {
        profile: PathBuf,
        /// Also the kernel memory on a host with this many CPUs (the
        /// per-CPU counters and statistics rings grow with them); exits 1
        /// when that is over the profile's memory_budget.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=8192))]
        cpus: Option<u64>,
    },
    /// What this kernel supports, and whether each program verifies here
    /// (loaded once in a private bpffs; nothing is attached or left behind).
    /// Exits 1 when a program the profile needs does not verify or a part
    /// of the profile cannot run.
    ///
    /// Example: sudo flowctl doctor --profile rules.toml
    Doctor {
        /// Also say, for each part of this profile, whether it can run here.
        #[arg(long)]
        profile: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Which rule, key and limit apply to a packet, from the kernel's tables.
    ///
    /// Example: flowctl explain eth0 tcp 192.0.2.7 443 --dst 198.51.100.1
    Explain {
        iface: String,
        proto: String,
        src: String,
        dport: Option<u16>,
        /// The packet's destination address: needed when a rule of the
        /// active profile matches on `dst`.
        #[arg(long)]
        dst: Option<String>,
        #[arg(long)]
        netns: Option<String>,
    },
    /// Block and allow lists ([[list]] in the profile, docs/lists.md).
    #[command(subcommand)]
    List(ListCmd),
    /// Manual pages and shell completions from these definitions (for
    /// packagers: cargo xtask package; docs/packaging.md).
    #[command(hide = true, subcommand)]
    Generate(Generate),
}

#[derive(Subcommand)]
enum ListCmd {
    /// Read a list again and apply it, atomically: a packet sees the old
    /// list or the new one. The rules keep their buckets.
    ///
    /// From the file the profile names: sudo flowctl list update eth0 blocklist
    ///
    /// From another file (in force until the next apply or restart, which
    /// read the profile's file): sudo flowctl list update eth0 blocklist /tmp/new.txt
    Update {
        /// The interface whose agent applies it.
        iface: String,
        /// The list's name in the profile (`[[list]] name = ...`).
        name: String,
        /// One address or prefix per line, # comments (default: the
        /// profile's `file` of the list).
        file: Option<PathBuf>,
        #[arg(long)]
        netns: Option<String>,
    },
}

#[derive(Subcommand)]
enum Generate {
    /// flowctl.1 and a flowctl-VERB.1 per verb, into DIR.
    Man { dir: PathBuf },
    /// The completion script of SHELL, into DIR.
    Completions { shell: clap_complete::Shell, dir: PathBuf },
}

/// How to reach etcd: user and password, TLS.
#[derive(clap::Args)]
struct EtcdArgs {
    /// etcd user: NAME (with --etcd-password-file) or NAME:PASSWORD.
    #[arg(long, value_name = "NAME[:PASSWORD]")]
    etcd_user: Option<String>,
    /// The password, on the file's first line (kept out of `ps`).
    #[arg(long, value_name = "FILE")]
    etcd_password_file: Option<PathBuf>,
    /// The CA of etcd's server certificates: connect over TLS.
    #[arg(long, value_name = "FILE")]
    etcd_ca: Option<PathBuf>,
    /// A client certificate (PEM) for mutual TLS, with --etcd-key.
    #[arg(long, value_name = "FILE")]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, value_name = "FILE")]
    etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    fn access(self) -> anyhow::Result<etcd::Access> {
        etcd::Access::from_args(
            self.etcd_user,
            self.etcd_password_file,
            self.etcd_ca,
            self.etcd_cert,
            self.etcd_key,
        )
    }
}

/// `attach --profile etcd://...`: the agent's etcd configuration.
fn etcd_config(
    profile: &std::path::Path,
    iface: Option<&str>,
    netns: Option<&str>,
    args: EtcdArgs,
    cache: &std::path::Path,
    watch_timeout: f64,
) -> anyhow::Result<Option<etcd::Config>> {
    let Some(url) = profile.to_str().filter(|p| etcd::is_etcd(p)) else {
        let a = &args;
        if a.etcd_user.is_some()
            || a.etcd_password_file.is_some()
            || a.etcd_ca.is_some()
            || a.etcd_cert.is_some()
            || a.etcd_key.is_some()
        {
            anyhow::bail!("the --etcd-* options are for a profile from etcd: --profile etcd://HOST:PORT/PREFIX");
        }
        return Ok(None);
    };
    let timing = etcd::watch::Timing {
        silence: std::time::Duration::from_secs_f64(watch_timeout.clamp(1.0, 3600.0)),
        ..Default::default()
    };
    let iface = iface.unwrap_or_default();
    Ok(Some(etcd::Config::new(url.parse()?, args.access()?, timing, cache, netns, iface)))
}

fn main() {
    let cli = Cli::parse();
    flowctl::system::log::init(cli.log_format);
    let r = match cli.cmd {
        Cmd::Attach { iface, cgroup, profile, mode, netns, keep, replace, multiprog, metrics, etcd, etcd_cache, etcd_watch_timeout } => {
            etcd_config(&profile, iface.as_deref(), netns.as_deref(), etcd, &etcd_cache, etcd_watch_timeout)
                .and_then(|etcd| agent::run(agent::AttachArgs { iface, cgroup, profile, mode, netns, keep, replace, multiprog, metrics, etcd }))
        }
        Cmd::Publish { url, profile, etcd } => etcd.access().and_then(|a| cli::publish::publish(&url, &profile, a)),
        Cmd::Detach { iface, netns } => cli::detach::detach(&iface, &netns),
        Cmd::Apply { args, cgroup, netns } => match (args.as_slice(), cgroup) {
            ([iface, profile], None) => cli::apply::apply(iface, std::path::Path::new(profile), &netns),
            ([profile], Some(cg)) => cli::apply::apply_cgroup(&cg, std::path::Path::new(profile)),
            (_, None) => Err(anyhow::anyhow!("give `flowctl apply IFACE PROFILE`, or `flowctl apply --cgroup PATH PROFILE` for a breakers-only agent")),
            (_, Some(_)) => Err(anyhow::anyhow!("with --cgroup, give only the profile (an agent with an interface takes `flowctl apply IFACE PROFILE` for both)")),
        },
        Cmd::Status { json, fleet: Some(url), etcd, .. } => match etcd.access().and_then(|a| cli::rollout::show(&url, a, json)) {
            Ok(true) => Ok(()),
            Ok(false) => std::process::exit(1),
            Err(e) => Err(e),
        },
        Cmd::Status { json, fleet: None, netns, .. } => cli::status::status(json, &netns),
        Cmd::Check { profile, cpus } => match cli::check::check(&profile, cpus) {
            Ok(true) => Ok(()),
            Ok(false) => std::process::exit(1),
            Err(e) => Err(e),
        },
        Cmd::Doctor { profile, json } => match cli::doctor::run(profile.as_deref(), json) {
            Ok(true) => Ok(()),
            Ok(false) => std::process::exit(1),
            Err(e) => Err(e),
        },
        Cmd::Simulate { scenario, out } => cli::simulate::command(&scenario, &out),
        Cmd::Top { iface, netns, interval, once, json, keys, count, width } => {
            let interval = std::time::Duration::from_secs_f64(interval.clamp(0.1, 3600.0));
            cli::Only::resolve(iface.as_deref(), &netns).and_then(|only| {
                if let Some(rule) = keys {
                    if once {
                        cli::top::keys::once(interval, &only, &rule, count, json)
                    } else {
                        cli::top::keys::run(interval, &only, &rule, count)
                    }
                } else if once {
                    cli::top::once(interval, &only, json, width)
                } else {
                    cli::top::run(interval, &only)
                }
            })
        }
        Cmd::Explain { iface, proto, src, dport, dst, netns } => {
            cli::explain::explain(&iface, &proto, &src, dport, dst.as_deref(), &netns)
        }
        Cmd::List(ListCmd::Update { iface, name, file, netns }) => cli::list::update(&iface, &name, file.as_deref(), &netns),
        Cmd::Generate(Generate::Man { dir }) => cli::generate::man(Cli::command(), &dir).map(|files| files.iter().for_each(|f| println!("{}", f.display()))),
        Cmd::Generate(Generate::Completions { shell, dir }) => cli::generate::completions(Cli::command(), shell, &dir).map(|f| println!("{}", f.display())),
    };
    if let Err(e) = r {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
        }
        flowctl::system::log::error(format!("{e:#}"));
        std::process::exit(2);
    }
}
