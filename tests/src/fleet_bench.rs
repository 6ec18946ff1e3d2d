//! `cargo xtask bench fleet`, 8c: the real three-agent lab
//! (docs/benchmarks.md, section 8). A real Redis in its own namespace and
//! three labs with real `flowctl attach` agents (the release binary) sharing
//! one global per-source rule ([`crate::fleet_lab`]: L = 300/s, B = 30,
//! `default_share = "none"`, lease 2 s, refresh 500 ms). One source address
//! sends skewed UDP to the three hosts, heavy on host 1, then moves the
//! heavy traffic to host 3 mid-run. Measured, from the agents' kernel
//! counters (`flowctl status --json`, about every 100 ms):
//!
//! - accuracy: the worst window's admitted total (fleet-wide) over
//!   `L*t + B`, for any window and for about 1 s and 5 s ones; `t` is the
//!   shortest the time between the two counter reads can have been (the
//!   end of the first `status` to the start of the second), so the ratio
//!   errs high;
//! - utilisation: admitted / min(offered, L*t), after the store's first
//!   lease (a fresh store learns for one lease and grants nothing then);
//! - convergence after the shift: from host 3's first heavy packet to the
//!   start of the first 0.5 s window in which host 3 admits at least 90%
//!   of its fair share (water-filling of the offered rates), against
//!   `2 x refresh + RTT` (docs/fleet.md), RTT the agents' own measure;
//! - Redis operations per second per agent, from Redis itself (`INFO
//!   commandstats` before and after, through `redis-cli` in its namespace;
//!   the bench's own INFO calls left out), beside the script calls each
//!   agent counts, and beside envoyproxy/ratelimit's one round trip per
//!   decision (ops/s = packets/s).
//!
//! Everything the run makes goes when it ends or fails: agents (SIGINT,
//! then SIGKILL by PID), Redis by PID, the namespaces, the agents' run
//! directories; then it checks nothing of it is left.

use crate::{
    cli::attachment,
    etcd::wait_for,
    fleet_lab::{self, Fleet, BURST, DPORT, RATE, SRC},
    need::{Host, Need},
    traffic::blast_from,
};
use flowctl::fleet::global::allocator::fair_share;
use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, Instant},
};

/// The labs' subnets (10.201.S.0/24, and S on the Redis links): apart from
/// the e2e test's and the demo's.
const SUBNETS: [u8; 3] = [239, 240, 241];
/// Offered per host, packets per second, before and after the shift.
const BEFORE: [u64; 3] = [600, 200, 20];
const AFTER: [u64; 3] = [20, 200, 600];
/// The profile's lease and refresh (fleet_lab::profile).
const LEASE_S: f64 = 2.0;
const REFRESH_S: f64 = 0.5;
/// How often the counters are read, and the convergence window.
const SAMPLE: Duration = Duration::from_millis(100);
const CONVERGE_WINDOW_S: f64 = 0.5;

/// One read of every lab's counters: when `status` started and returned,
/// and (offered, passed) per lab.
struct Sample {
    start: Instant,
    end: Instant,
    counts: Vec<(u64, u64)>,
}

impl Sample {
    fn passed(&self) -> u64 {
        self.counts.iter().map(|c| c.1).sum()
    }
    fn offered(&self) -> u64 {
        self.counts.iter().map(|c| c.0).sum()
    }
    /// Seconds from `t0` to the middle of the read.
    fn at(&self, t0: Instant) -> f64 {
        let mid = self.start + (self.end - self.start) / 2;
        secs_between(t0, mid)
    }
}

/// `b - a` in seconds, negative when `b` is earlier.
fn secs_between(a: Instant, b: Instant) -> f64 {
    match b.checked_duration_since(a) {
        Some(d) => d.as_secs_f64(),
        None => -a.duration_since(b).as_secs_f64(),
    }
}

/// The agents' run directories (`/run/flowctl/INO-IFINDEX`): flowctl keeps
/// the lock file when it detaches; removed here once the agents are gone
/// (this drops after the fleet), if the lock is all that is left.
struct RunDirs(Vec<PathBuf>);

impl Drop for RunDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let only_lock = std::fs::read_dir(d).is_ok_and(|es| {
                es.flatten().all(|e| e.file_name() == flowctl::dataplane::pins::run_file::LOCK)
            });
            if only_lock {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
}

/// Runs 8c and prints it; `Err` when the lab could not be run through
/// (after cleaning up). Needs root (the bench checks), `redis-server`,
/// `redis-cli` and FLOWCTL_BIN; without them it says it skipped.
pub fn run(quick: bool) -> Result<(), String> {
    println!("\n8c. The real three-agent lab (three `flowctl attach` agents, one Redis, one global per-source rule)");
    let host = Host::probe();
    let needs = [Need::Root, Need::Command("redis-server"), Need::Command("redis-cli")];
    if let Some(why) = host.unmet_all(&needs) {
        println!("  skipped: {why}");
        return Ok(());
    }
    if std::env::var_os(crate::cli::BIN_ENV).is_none() {
        println!("  skipped: set FLOWCTL_BIN to a release flowctl (cargo xtask bench does)");
        return Ok(());
    }
    // The bench pins itself to CPU 0 for BPF_PROG_TEST_RUN; the agents,
    // Redis and the senders inherit this thread's affinity: all CPUs.
    unpin();
    let t = Instant::now();
    let out = std::panic::catch_unwind(|| measure(quick));
    let took = t.elapsed().as_secs_f64();
    match out {
        Ok(Ok(())) => {
            println!("  (8c took {took:.0} s, setup and cleanup included)");
            Ok(())
        }
        Ok(Err(e)) => Err(format!("8c: {e} (after {took:.0} s; cleaned up)")),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("8c failed: {msg} (after {took:.0} s; cleaned up)"))
        }
    }
}

fn unpin() {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in 0..libc::sysconf(libc::_SC_NPROCESSORS_ONLN) as usize {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

/// `INFO commandstats`: calls per command.
fn command_calls(info: &str) -> BTreeMap<String, u64> {
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_string(), calls.parse().ok()?))
        })
        .collect()
}

/// Lease script calls (batches) the agent on each lab has sent.
fn batches(fleet: &Fleet) -> Vec<u64> {
    fleet
        .labs
        .iter()
        .map(|l| attachment(&l.veth_srv).and_then(|a| a["leases"]["batches"].as_u64()).unwrap_or(0))
        .collect()
}

fn measure(quick: bool) -> Result<(), String> {
    let (secs_a, secs_b): (u64, u64) = if quick { (8, 6) } else { (14, 12) };
    let (l, b) = (RATE as f64, BURST as f64);
    let mut dirs = RunDirs(Vec::new());
    let t_setup = Instant::now();
    let mut fleet = Fleet::start("fbr", "fbl", SUBNETS);
    let redis_pid = fleet.redis.server.pid();
    let mut pins = Vec::new();
    for lab in &fleet.labs {
        let a = attachment(&lab.veth_srv).ok_or("an agent's attachment is not in status")?;
        let name = format!("{}-{}", a["netns_inode"], a["ifindex"]);
        dirs.0.push(PathBuf::from(flowctl_common::RUN_ROOT).join(&name));
        pins.push(PathBuf::from(crate::cli::pin_dir(&a)));
    }
    let names: Vec<String> = fleet
        .labs
        .iter()
        .flat_map(|l| [l.ns_srv.clone(), l.ns_cli.clone()])
        .chain([fleet.redis.net.ns.0.clone()])
        .collect();
    wait_for("every agent sees Redis and 3 hosts", Duration::from_secs(20), || {
        fleet.labs.iter().all(fleet_lab::store_sees_fleet)
    });
    let rtt_ms = fleet
        .labs
        .iter()
        .filter_map(|lab| attachment(&lab.veth_srv)?["leases"]["store"]["rtt_ms"].as_f64())
        .fold(0.0, f64::max);
    println!(
        "  redis {} (pid {redis_pid}) in {}; agents on {} ({:.1} s to set up); L = {RATE}/s, B = {BURST}, lease {LEASE_S} s, refresh {REFRESH_S} s, store RTT {rtt_ms:.2} ms (the agents' slowest)",
        redis_version(&fleet),
        fleet.redis.net.ns.0,
        fleet.labs.iter().map(|l| l.veth_srv.as_str()).collect::<Vec<_>>().join(", "),
        t_setup.elapsed().as_secs_f64(),
    );
    println!(
        "  {SRC} sends UDP to port {DPORT} at {} pps for {secs_a} s, then {} pps for {secs_b} s (hosts 1, 2, 3): the heavy traffic moves from host 1 to host 3",
        BEFORE.map(|p| p.to_string()).join(", "),
        AFTER.map(|p| p.to_string()).join(", "),
    );

    let info_before = fleet.redis.cli(&["INFO", "commandstats"]);
    let batches_before = batches(&fleet);
    let t_info_before = Instant::now();
    let labs = &fleet.labs;
    // The senders, each bounded in packets and seconds; the counters read
    // every SAMPLE meanwhile (bounded too: the senders' time and 10 s).
    let (sent, samples) = std::thread::scope(|s| -> Result<_, String> {
        let senders: Vec<_> = labs
            .iter()
            .enumerate()
            .map(|(i, lab)| {
                s.spawn(move || {
                    let a =
                        blast_from(lab, SRC, DPORT, BEFORE[i], secs_a as f64, BEFORE[i] * secs_a);
                    let b = blast_from(lab, SRC, DPORT, AFTER[i], secs_b as f64, AFTER[i] * secs_b);
                    (a, b)
                })
            })
            .collect();
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(secs_a + secs_b + 10);
        let mut samples = Vec::new();
        let mut k = 0u32;
        while !senders.iter().all(|h| h.is_finished()) && Instant::now() < deadline {
            let start = Instant::now();
            let counts = fleet_lab::counters(labs)?;
            samples.push(Sample { start, end: Instant::now(), counts });
            k += 1;
            let next = (t0 + SAMPLE * k).max(Instant::now() + Duration::from_millis(10));
            std::thread::sleep(next - Instant::now());
        }
        let sent: Vec<_> = senders
            .into_iter()
            .map(|h| h.join().map_err(|_| "a sender panicked"))
            .collect::<Result<_, _>>()?;
        Ok((sent, samples))
    })?;
    // The last packets may still be on their way to the counters.
    std::thread::sleep(Duration::from_millis(200));
    let mut samples = samples;
    let start = Instant::now();
    let counts = fleet_lab::counters(labs)?;
    samples.push(Sample { start, end: Instant::now(), counts });
    let info_after = fleet.redis.cli(&["INFO", "commandstats"]);
    let redis_span = t_info_before.elapsed().as_secs_f64();
    let batches_after = batches(&fleet);
    if samples.len() < 10 {
        return Err(format!("only {} counter reads", samples.len()));
    }

    // When traffic started, the shift (host 3's first heavy packet), the end.
    let t0 = sent.iter().map(|(a, _)| a.1).min().unwrap();
    let shift = sent[2].1 .1;
    let shift_skew_ms = secs_between(shift, sent[0].1 .1).abs() * 1e3;
    let end = sent.iter().map(|(_, b)| b.2).max().unwrap();
    let span = secs_between(t0, end);
    let shift_at = secs_between(t0, shift);
    let reads: Vec<f64> =
        samples.windows(2).map(|w| secs_between(w[0].start, w[1].start)).collect();
    let read_ms = samples.iter().map(|s| secs_between(s.start, s.end)).sum::<f64>()
        / samples.len() as f64
        * 1e3;

    // Each host's admitted and offered rate per second of the run.
    println!(
        "\n  {:>5}  {:>16} {:>16} {:>16}  {:>7}",
        "t", "host 1 (offered)", "host 2 (offered)", "host 3 (offered)", "fleet"
    );
    let mut prev = &samples[0];
    let mut next_t = 1.0;
    for s in &samples[1..] {
        let (at, from) = (s.at(t0), prev.at(t0));
        if at < next_t || at <= from {
            continue;
        }
        let dt = at - from;
        let cell = |i: usize| {
            let p = (s.counts[i].1 - prev.counts[i].1) as f64 / dt;
            let o = (s.counts[i].0 - prev.counts[i].0) as f64 / dt;
            format!("{p:>5.0}/s ({o:>4.0}/s)")
        };
        let fleet_rate = (s.passed() - prev.passed()) as f64 / dt;
        let note = if from < shift_at && shift_at <= at {
            "  <- the heavy traffic moves to host 3"
        } else {
            ""
        };
        println!("  {at:>4.1}s  {} {} {}  {fleet_rate:>5.0}/s{note}", cell(0), cell(1), cell(2));
        prev = s;
        while next_t <= at {
            next_t += 1.0;
        }
    }

    // Accuracy: every pair of reads.
    let mut worst = (0.0f64, 0.0f64, 0u64);
    let worst_len = |target: f64| {
        let mut w = (0.0f64, 0.0f64, 0u64);
        for (i, si) in samples.iter().enumerate() {
            let Some(sj) = samples[i + 1..].iter().find(|sj| sj.at(t0) - si.at(t0) >= target)
            else {
                break;
            };
            let t = secs_between(si.end, sj.start);
            let a = sj.passed() - si.passed();
            let r = a as f64 / (l * t + b);
            if r > w.0 {
                w = (r, t, a);
            }
        }
        w
    };
    let (w1, w5) = (worst_len(0.95), worst_len(4.95));
    for (i, si) in samples.iter().enumerate() {
        for sj in &samples[i + 1..] {
            let t = secs_between(si.end, sj.start);
            if t <= 0.0 {
                continue;
            }
            let a = sj.passed() - si.passed();
            let r = a as f64 / (l * t + b);
            if r > worst.0 {
                worst = (r, t, a);
            }
        }
    }
    let (fst, lst) = (&samples[0], samples.last().unwrap());
    let whole_t = secs_between(fst.end, lst.start);
    let whole_a = lst.passed() - fst.passed();

    // Utilisation after the first lease (and one refresh for the grants).
    let util = |from: f64, to: f64| -> Option<(f64, f64)> {
        let i = samples.iter().position(|s| s.at(t0) >= from)?;
        let j = samples.iter().rposition(|s| s.at(t0) <= to)?;
        (j > i).then(|| {
            let (si, sj) = (&samples[i], &samples[j]);
            let t = sj.at(t0) - si.at(t0);
            let a = (sj.passed() - si.passed()) as f64;
            let o = (sj.offered() - si.offered()) as f64;
            (a / o.min(l * t), a / t)
        })
    };
    // Each host's admitted rate over a stretch, against its fair share.
    let per_host = |from: f64, to: f64, offered: &[u64; 3]| -> String {
        let i = samples.iter().position(|s| s.at(t0) >= from);
        let j = samples.iter().rposition(|s| s.at(t0) <= to);
        let (Some(i), Some(j)) = (i, j) else { return "?".to_string() };
        if j <= i {
            return "?".to_string();
        }
        let (si, sj) = (&samples[i], &samples[j]);
        let t = sj.at(t0) - si.at(t0);
        (0..3)
            .map(|h| {
                let r = (sj.counts[h].1 - si.counts[h].1) as f64 / t;
                let f = fair_share(RATE, offered, offered[h]) as f64;
                format!("host {} {r:.0}/s of {f:.0}/s ({:.2})", h + 1, r / f)
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let steady = LEASE_S + REFRESH_S;
    let fmt_util =
        |u: Option<(f64, f64)>| u.map_or("?".to_string(), |(u, r)| format!("{u:.3} ({r:.0}/s)"));

    // Convergence: host 3, the first 0.5 s window at 90% of its fair share.
    let fair = fair_share(RATE, &AFTER, AFTER[2]) as f64;
    let mut converge = None;
    for (k, sk) in samples.iter().enumerate() {
        if sk.at(t0) < shift_at {
            continue;
        }
        let Some(sj) =
            samples[k + 1..].iter().find(|sj| sj.at(t0) - sk.at(t0) >= CONVERGE_WINDOW_S)
        else {
            break;
        };
        let rate = (sj.counts[2].1 - sk.counts[2].1) as f64 / (sj.at(t0) - sk.at(t0));
        if rate >= 0.9 * fair {
            converge = Some(sk.at(t0) - shift_at);
            break;
        }
    }
    let bound_s = 2.0 * REFRESH_S + rtt_ms / 1e3;

    // Redis: commands the agents made between the two INFOs.
    let (cb, ca) = (command_calls(&info_before), command_calls(&info_after));
    let mut per_cmd: Vec<(String, u64)> = ca
        .iter()
        .filter(|(n, _)| !matches!(n.as_str(), "info" | "command" | "command|docs"))
        .map(|(n, c)| (n.clone(), c - cb.get(n).copied().unwrap_or(0)))
        .filter(|(_, d)| *d > 0)
        .collect();
    per_cmd.sort_by_key(|c| std::cmp::Reverse(c.1));
    let ops: u64 = per_cmd.iter().map(|c| c.1).sum();
    // What the agents send themselves (each a round trip): the two
    // scripts' EVALSHA, SCRIPT LOAD after a NOSCRIPT, a connection's
    // handshake; every other command runs inside the scripts.
    let top_level = |n: &str| {
        n.starts_with("eval")
            || n.starts_with("script")
            || n.starts_with("client")
            || matches!(n, "ping" | "auth" | "hello" | "select")
    };
    let requests: u64 = per_cmd.iter().filter(|(n, _)| top_level(n)).map(|c| c.1).sum();
    let agents = fleet.labs.len() as f64;
    let ops_agent = ops as f64 / agents / redis_span;
    let requests_agent = requests as f64 / agents / redis_span;
    let script_calls: Vec<f64> = batches_after
        .iter()
        .zip(&batches_before)
        .map(|(a, b)| (a - b) as f64 / redis_span)
        .collect();
    let offered_pkts: Vec<u64> = (0..3).map(|i| lst.counts[i].0 - fst.counts[i].0).collect();
    let pps_agent = offered_pkts.iter().sum::<u64>() as f64 / agents / span;

    println!(
        "\n  {:.1} s of traffic ({} packets sent: {}); counters read every {:.0} ms on average ({:.0} ms per read); the senders switched {shift_skew_ms:.0} ms apart",
        span,
        sent.iter().map(|(a, b)| a.0 + b.0).sum::<u64>(),
        sent.iter().map(|(a, b)| (a.0 + b.0).to_string()).collect::<Vec<_>>().join(" + "),
        reads.iter().sum::<f64>() / reads.len() as f64 * 1e3,
        read_ms,
    );
    println!(
        "  accuracy, the fleet's admitted total against L*t + B (t the shortest the time between the two reads can have been):"
    );
    println!(
        "    worst window: {:.3} ({} in {:.2} s, bound {:.0}); about 1 s: {:.3} ({} in {:.2} s); about 5 s: {:.3} ({} in {:.2} s); the whole run: {:.3} ({} in {:.1} s)",
        worst.0, worst.2, worst.1, l * worst.1 + b,
        w1.0, w1.2, w1.1,
        w5.0, w5.2, w5.1,
        whole_a as f64 / (l * whole_t + b), whole_a, whole_t,
    );
    println!(
        "  utilisation, admitted / min(offered, L*t), after the first lease ({steady} s: a fresh store learns, then a refresh): {} overall; {} before the shift, {} after it (the move included)",
        fmt_util(util(steady, span)),
        fmt_util(util(steady, shift_at)),
        fmt_util(util(shift_at, span)),
    );
    match converge {
        Some(c) => println!(
            "  convergence after the shift: host 3 at >= 90% of its fair share ({fair:.0}/s of {}/s offered) {c:.2} s after its first heavy packet; bound 2 x refresh + RTT = {bound_s:.2} s ({:.2}x; reads every ~{:.0} ms)",
            AFTER[2],
            c / bound_s,
            SAMPLE.as_secs_f64() * 1e3,
        ),
        None => println!(
            "  convergence after the shift: host 3 never reached 90% of its fair share ({fair:.0}/s) in the {secs_b} s after it (bound {bound_s:.2} s)"
        ),
    }
    println!(
        "  each host against its fair share (water-filling of the offered rates): before the shift {}; after it (from 1.5 s on) {}",
        per_host(steady, shift_at, &BEFORE),
        per_host(shift_at + 1.5, span, &AFTER),
    );
    println!(
        "  Redis, from INFO commandstats over {redis_span:.1} s (3 agents): {requests_agent:.2} requests/s per agent (round trips: EVALSHA of the lease and heartbeat scripts, SCRIPT LOAD), {ops_agent:.2} commands/s per agent counting those the scripts run ({}); lease batches each agent counted: {} per second",
        per_cmd.iter().map(|(n, c)| format!("{n} {:.2}", *c as f64 / agents / redis_span)).collect::<Vec<_>>().join(", "),
        script_calls.iter().map(|c| format!("{c:.2}")).collect::<Vec<_>>().join(", "),
    );
    println!(
        "  against the peers (docs/fleet.md): envoyproxy/ratelimit makes one Redis round trip per decision, so requests/s = packets/s: {pps_agent:.0}/s per agent on this traffic ({} on host 1 before the shift), {:.0}x flowctl's {requests_agent:.2} ({:.0}x its {ops_agent:.2} commands/s); its fixed windows admit up to 2L in a window straddling a boundary (A/bound up to {:.2} here), flowctl's worst window {:.3}",
        BEFORE[0],
        pps_agent / requests_agent.max(1e-9),
        pps_agent / ops_agent.max(1e-9),
        2.0 * l / (l + b),
        worst.0,
    );

    // Clean up, and check nothing is left.
    fleet.stop_agents();
    drop(fleet);
    let run_dirs = dirs.0.clone();
    drop(dirs);
    let netns = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let mut left: Vec<String> = names
        .iter()
        .filter(|n| netns.split_whitespace().any(|w| w == n.as_str()))
        .map(|n| format!("namespace {n}"))
        .collect();
    left.extend(
        pins.iter().chain(&run_dirs).filter(|p| p.exists()).map(|p| p.display().to_string()),
    );
    if unsafe { libc::kill(redis_pid as i32, 0) } == 0 {
        left.push(format!("redis pid {redis_pid}"));
    }
    if left.is_empty() {
        println!("  cleaned up: agents stopped (detached), redis killed by PID, {} namespaces removed, no pins or run directories left", names.len());
        Ok(())
    } else {
        Err(format!("left behind: {}", left.join(", ")))
    }
}

/// The server's version, from `INFO server`.
fn redis_version(fleet: &Fleet) -> String {
    let info = fleet.redis.cli(&["INFO", "server"]);
    info.lines()
        .find_map(|l| l.trim().strip_prefix("redis_version:"))
        .map_or("?".to_string(), |v| v.to_string())
}
