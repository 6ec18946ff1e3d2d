//! `cargo xtask bench overload`: the BBR overload experiment. A CPU-bound
//! TCP service runs in a namespace inside a cgroup v1 cpu cgroup with a fixed
//! quota (half a CPU, 10 ms periods so throttling pauses stay short); that
//! cgroup is also the agent's CPU source. A load generator in the client
//! namespace ramps offered connections to 3x the service's measured capacity
//! and holds there, once with the BBR rule off and once with it on. For the
//! hold phase it reports goodput (completed connections/s), completion time
//! of admitted connections (connect to response, p50/p99), the client's view
//! (refusals, connect timeouts), and the service's CPU.

use crate::lab::{sh, Lab};
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc, Mutex,
    },
    time::{Duration, Instant},
};

/// CPU time each request costs the service.
const WORK: Duration = Duration::from_millis(2);
/// The service's cgroup quota: `QUOTA_US` per `PERIOD_US`.
const PERIOD_US: u64 = 10_000;
const QUOTA_US: u64 = 5_000;
const PORT: u16 = 7600;
/// Where the service hands out its accept-to-close times.
const STATS_PORT: u16 = 7601;
/// A client gives up on a connect after this long (counted as a rejection).
const CONNECT_TIMEOUT: Duration = Duration::from_millis(200);
/// And on an admitted connection's response after this long.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(3);

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The service, run as `flowctl-bench serve-cpu NETNS ADDR CGROUP`: joins
/// the cgroup (before any thread exists, so all of them are in it), enters
/// the namespace, and answers each connection with one byte after `WORK` of
/// CPU time, on 64 threads. It keeps each connection's accept-to-close time;
/// a connection to `STATS_PORT` takes them (microseconds, one per line).
pub fn serve_cpu(netns: &str, addr: &str, cgroup: &str) -> ! {
    for ctl in ["cpu", "cpuacct"] {
        std::fs::write(format!("/sys/fs/cgroup/{ctl}/{cgroup}/cgroup.procs"), "0")
            .expect("join the service cgroup");
    }
    flowctl::system::netns::enter_netns(netns).expect("enter the service namespace");
    let listener = Arc::new(TcpListener::bind(addr).expect("bind"));
    let times = Arc::new(Mutex::new(Vec::<u32>::new()));
    let stats_addr: SocketAddr = addr
        .parse::<SocketAddr>()
        .map(|mut a| {
            a.set_port(STATS_PORT);
            a
        })
        .expect("service address");
    let stats = TcpListener::bind(stats_addr).expect("bind the stats port");
    let t = times.clone();
    std::thread::spawn(move || {
        for mut c in stats.incoming().flatten() {
            let taken = std::mem::take(&mut *t.lock().unwrap());
            let text: String = taken.iter().map(|v| format!("{v}\n")).collect();
            let _ = c.write_all(text.as_bytes());
        }
    });
    let mut threads = Vec::new();
    for _ in 0..64 {
        let (l, times) = (listener.clone(), times.clone());
        threads.push(std::thread::spawn(move || loop {
            let Ok((mut c, _)) = l.accept() else { continue };
            let accepted = Instant::now();
            let start = thread_cpu();
            let mut x = 0u64;
            while thread_cpu() - start < WORK {
                for _ in 0..1000 {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            }
            let _ = c.write_all(b"k");
            drop(c);
            times.lock().unwrap().push(accepted.elapsed().as_micros().min(u32::MAX as u128) as u32);
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    std::process::exit(0)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Outcome {
    Done(Duration),
    Refused,
    ConnectTimeout,
    ResponseTimeout,
    Other,
}

/// One phase's result (hold part only).
#[derive(Debug, Default)]
pub struct PhaseResult {
    pub offered_per_s: f64,
    pub goodput_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub refused: u64,
    pub connect_timeouts: u64,
    pub response_timeouts: u64,
    /// Tickets that waited over 100 ms for a free client thread (the
    /// generator itself fell behind).
    pub generator_late: u64,
    pub cpu_permille: f64,
    /// Server side: accept to close of the connections it served, ms.
    pub server_p50_ms: f64,
    pub server_p99_ms: f64,
    /// The share of the hold's quota periods in which the service was
    /// throttled (it used its 5 ms and waited for the next period).
    pub throttled_share: f64,
}

/// Takes the service's accept-to-close times collected since the last call.
fn server_times(lab: &Lab) -> Vec<f64> {
    let addr: SocketAddr = format!("{}:{STATS_PORT}", lab.ip_srv).parse().unwrap();
    Lab::in_ns(&lab.ns_cli, move || {
        let mut s = TcpStream::connect(addr).expect("the service's stats port");
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text.lines().filter_map(|l| l.parse::<f64>().ok()).map(|us| us / 1e3).collect()
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0.0)
}

/// Offers connections open-loop: `rate(t)` per second for `secs`, from a
/// pool of client threads in the client namespace; measures from
/// `hold_from` seconds on.
fn offer(
    lab: &Lab,
    cgroup: &str,
    rate: impl Fn(f64) -> f64,
    secs: f64,
    hold_from: f64,
) -> PhaseResult {
    let target: SocketAddr = format!("{}:{PORT}", lab.ip_srv).parse().unwrap();
    let (tx, rx) = mpsc::channel::<(Instant, bool)>();
    let rx = Arc::new(Mutex::new(rx));
    let results = Arc::new(Mutex::new(Vec::<(Outcome, bool, bool)>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..600 {
        let (rx, results, ns) = (rx.clone(), results.clone(), lab.ns_cli.clone());
        workers.push(
            std::thread::Builder::new()
                .stack_size(128 << 10)
                .spawn(move || {
                    flowctl::system::netns::enter_netns(&ns).unwrap();
                    loop {
                        let Ok((issued, measured)) = rx.lock().unwrap().recv() else { return };
                        let late = issued.elapsed() > Duration::from_millis(100);
                        let o = match TcpStream::connect_timeout(&target, CONNECT_TIMEOUT) {
                            Ok(mut s) => {
                                let t = Instant::now();
                                s.set_read_timeout(Some(RESPONSE_TIMEOUT)).unwrap();
                                let mut b = [0u8; 1];
                                match s.read(&mut b) {
                                    Ok(1) => Outcome::Done(t.elapsed()),
                                    Ok(_) => Outcome::Other,
                                    Err(e)
                                        if matches!(
                                            e.kind(),
                                            std::io::ErrorKind::WouldBlock
                                                | std::io::ErrorKind::TimedOut
                                        ) =>
                                    {
                                        Outcome::ResponseTimeout
                                    }
                                    Err(_) => Outcome::Other,
                                }
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                                Outcome::Refused
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                                Outcome::ConnectTimeout
                            }
                            Err(_) => Outcome::Other,
                        };
                        results.lock().unwrap().push((o, measured, late));
                    }
                })
                .unwrap(),
        );
    }
    let cpu0 = cgroup_usage(cgroup);
    let start = Instant::now();
    let mut hold_start: Option<(Instant, u64, (u64, u64))> = None;
    let mut offered = 0u64;
    let mut next = start;
    while start.elapsed().as_secs_f64() < secs {
        let t = start.elapsed().as_secs_f64();
        let measured = t >= hold_from;
        if measured && hold_start.is_none() {
            hold_start = Some((Instant::now(), cgroup_usage(cgroup), cpu_throttling(cgroup)));
            let _ = server_times(lab); // forget the ramp's
        }
        tx.send((Instant::now(), measured)).unwrap();
        offered += measured as u64;
        next += Duration::from_secs_f64(1.0 / rate(t).max(1.0));
        if let Some(d) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
    }
    let (hold_t0, hold_cpu0, throttle0) =
        hold_start.unwrap_or((start, cpu0, cpu_throttling(cgroup)));
    let hold_secs = hold_t0.elapsed().as_secs_f64();
    let throttle1 = cpu_throttling(cgroup);
    let cpu_permille = (cgroup_usage(cgroup) - hold_cpu0) as f64
        / 1e9
        / hold_secs
        / (QUOTA_US as f64 / PERIOD_US as f64)
        * 1000.0;
    let mut served = server_times(lab);
    served.sort_by(|a, b| a.total_cmp(b));
    drop(tx);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let results = results.lock().unwrap();
    let mut r = PhaseResult {
        offered_per_s: offered as f64 / hold_secs,
        cpu_permille,
        server_p50_ms: percentile(&served, 0.50),
        server_p99_ms: percentile(&served, 0.99),
        throttled_share: (throttle1.1 - throttle0.1) as f64
            / (throttle1.0 - throttle0.0).max(1) as f64,
        ..Default::default()
    };
    let mut times = Vec::new();
    for (o, measured, late) in results.iter() {
        if !measured {
            continue;
        }
        r.generator_late += *late as u64;
        match o {
            Outcome::Done(d) => times.push(d.as_secs_f64() * 1e3),
            Outcome::Refused => r.refused += 1,
            Outcome::ConnectTimeout => r.connect_timeouts += 1,
            Outcome::ResponseTimeout => r.response_timeouts += 1,
            Outcome::Other => {}
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    r.goodput_per_s = times.len() as f64 / hold_secs;
    r.p50_ms = percentile(&times, 0.50);
    r.p99_ms = percentile(&times, 0.99);
    r
}

fn cgroup_usage(cgroup: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/fs/cgroup/cpuacct/{cgroup}/cpuacct.usage"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// The cgroup's `(nr_periods, nr_throttled)` from cgroup v1 `cpu.stat`.
fn cpu_throttling(cgroup: &str) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/sys/fs/cgroup/cpu/{cgroup}/cpu.stat"))
        .unwrap_or_default();
    let field = |name: &str| {
        text.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok()).unwrap_or(0)
    };
    (field("nr_periods "), field("nr_throttled "))
}

fn print(label: &str, r: &PhaseResult) {
    println!(
        "  {label:<22} offered {:>4.0}/s goodput {:>4.0}/s | accept-to-close p50 {:>6.1} p99 {:>6.1} ms | client connect-to-response p50 {:>6.1} p99 {:>6.1} ms | refused {:>5} connect timeouts {:>5} response timeouts {:>4} | service CPU {:>4.0}‰, throttled in {:>3.0}% of periods{}",
        r.offered_per_s,
        r.goodput_per_s,
        r.server_p50_ms,
        r.server_p99_ms,
        r.p50_ms,
        r.p99_ms,
        r.refused,
        r.connect_timeouts,
        r.response_timeouts,
        r.cpu_permille,
        r.throttled_share * 100.0,
        if r.generator_late > 0 { format!("  (generator late {})", r.generator_late) } else { String::new() }
    );
}

/// The whole experiment (root; `bench_bin` is this benchmark's own binary,
/// `flowctl_bin` the agent).
pub fn run(bench_bin: &std::path::Path, flowctl_bin: &std::path::Path) {
    for l in sh(&["ip", "netns", "list"]).lines() {
        if let Some(name) = l.split_whitespace().next().filter(|n| n.starts_with("fovl")) {
            let _ = std::process::Command::new("ip").args(["netns", "del", name]).status();
        }
    }
    let lab = Lab::new("fovl", 232);
    let cgroup = crate::unique("flowctl-ovl-");
    for ctl in ["cpu", "cpuacct"] {
        std::fs::create_dir_all(format!("/sys/fs/cgroup/{ctl}/{cgroup}"))
            .expect("create the service cgroup (cgroup v1 cpu/cpuacct)");
    }
    std::fs::write(format!("/sys/fs/cgroup/cpu/{cgroup}/cpu.cfs_period_us"), PERIOD_US.to_string())
        .unwrap();
    std::fs::write(format!("/sys/fs/cgroup/cpu/{cgroup}/cpu.cfs_quota_us"), QUOTA_US.to_string())
        .unwrap();
    let mut service = std::process::Command::new(bench_bin)
        .args(["serve-cpu", &lab.ns_srv, &format!("{}:{PORT}", lab.ip_srv), &cgroup])
        .spawn()
        .expect("start the service");
    // RST replies (XDP_TX) on a veth reach the peer only when it runs NAPI:
    // a pass-through XDP program on the client side.
    let dev = lab.veth_cli.clone();
    let _peer = Lab::in_ns(&lab.ns_cli, move || crate::lab::attach_pass_xdp(&dev));
    let rule = format!("[[rule]]\nname = \"svc\"\nproto = \"tcp\"\ndport = {PORT}\nunit = \"connections\"\nrate = \"1000000/s\"\n");
    let settings = format!("[settings]\nkey_table_entries = 65536\nsource_cache_entries = 65536\ncpu = \"cgroup:/{cgroup}\"\n");
    // The profiles the phases apply, removed at the end.
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    let mut profile = |name: &str, rule: &str| {
        let path =
            std::env::temp_dir().join(format!("flowctl-ovl-{name}-{}.toml", std::process::id()));
        std::fs::write(&path, format!("{settings}{rule}")).unwrap();
        files.push(path.clone());
        path
    };
    // The rule with BBR, `extra` appended to its settings.
    let bbr = |extra: &str| {
        format!("{rule}bbr = {{ cpu_threshold = 800, window = \"10s\", buckets = 100, idle_timeout = \"10s\", reject = \"reset\"{extra} }}\n")
    };
    let off = profile("off", &rule);
    let on = profile("on", &bbr(""));
    let sticky = profile("sticky", &bbr(", release_below = 600"));
    let window_rt = profile("window", &bbr(", compat = [\"min_rt_from_window\"]"));
    let mut agent = std::process::Command::new(flowctl_bin)
        .args(["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile"])
        .arg(&off)
        .stdin(std::process::Stdio::null())
        .spawn()
        .expect("start the agent");
    std::thread::sleep(Duration::from_secs(2));
    let apply = |p: &std::path::Path| {
        let out = std::process::Command::new(flowctl_bin)
            .args(["apply", &lab.veth_srv, "--netns", &lab.ns_srv])
            .arg(p)
            .output()
            .unwrap();
        assert!(out.status.success(), "apply: {}", String::from_utf8_lossy(&out.stderr));
    };

    let nominal = (QUOTA_US as f64 / PERIOD_US as f64) / WORK.as_secs_f64();
    println!("  service: {:.0} ms of CPU per connection under a {}/{} us quota: nominal capacity {nominal:.0}/s", WORK.as_secs_f64() * 1e3, QUOTA_US, PERIOD_US);
    let unloaded = offer(&lab, &cgroup, |_| nominal * 0.2, 6.0, 1.0);
    print("unloaded (0.2x)", &unloaded);
    let cap = offer(&lab, &cgroup, |_| nominal * 1.5, 6.0, 2.0);
    print("saturated (1.5x)", &cap);
    let capacity = cap.goodput_per_s.max(1.0);
    println!("  measured capacity: {capacity:.0} completed connections/s");
    // The floor for the latency target: the service's own tail at the
    // goodput target (0.9x), with nothing refused.
    std::thread::sleep(Duration::from_secs(3));
    let near = offer(&lab, &cgroup, move |_| capacity * 0.9, 8.0, 2.0);
    print("0.9x, BBR off", &near);
    // Ramp from 0.2x to 3x over 10 s, then hold 3x for 10 s.
    let ramp = move |t: f64| capacity * if t < 10.0 { 0.2 + 2.8 * t / 10.0 } else { 3.0 };
    std::thread::sleep(Duration::from_secs(3));
    let without = offer(&lab, &cgroup, ramp, 20.0, 10.0);
    print("3x, BBR off", &without);
    // Each limited phase: back to no limit for 3 s (the service drains),
    // then the phase's profile and the ramp.
    let limited = |label: &str, p: &std::path::Path| {
        apply(&off);
        std::thread::sleep(Duration::from_secs(3));
        apply(p);
        let r = offer(&lab, &cgroup, ramp, 20.0, 10.0);
        print(label, &r);
        r
    };
    let with = limited("3x, BBR on", &on);
    let held = limited("3x, BBR, release 600", &sticky);
    let kratos_rt = limited("3x, BBR, minRT window", &window_rt);
    // The reference a concurrency limit is up against: a static rate at
    // 0.9x the measured capacity (the token bucket paces admissions).
    let paced_rule = rule
        .replace("rate = \"1000000/s\"", &format!("rate = \"{:.0}/s\"\nburst = 3", capacity * 0.9));
    assert_ne!(paced_rule, rule);
    let paced = profile("paced", &paced_rule);
    let static_rate = limited("3x, rate 0.9x, no BBR", &paced);
    let ratio = |r: &PhaseResult| {
        (
            r.goodput_per_s / capacity,
            r.server_p99_ms / unloaded.server_p99_ms.max(0.001),
            r.p99_ms / unloaded.p99_ms.max(0.001),
        )
    };
    for (label, r) in [
        ("BBR on at 3x", &with),
        ("BBR on, release 600 at 3x", &held),
        ("BBR on, compat min_rt_from_window at 3x", &kratos_rt),
        ("BBR off at 3x", &without),
        ("a static rate of 0.9x capacity at 3x (refusals: dropped SYNs)", &static_rate),
        ("BBR off at 0.9x (the floor: no overload)", &near),
    ] {
        let (g, s, c) = ratio(r);
        println!("  {label}: goodput {g:.2}x capacity (target >= 0.90); accept-to-close p99 {s:.1}x unloaded (target <= 3); client p99 {c:.1}x unloaded");
    }
    unsafe { libc::kill(agent.id() as i32, libc::SIGINT) };
    let _ = agent.wait();
    let _ = service.kill();
    let _ = service.wait();
    std::thread::sleep(Duration::from_millis(200));
    for ctl in ["cpu", "cpuacct"] {
        let _ = std::fs::remove_dir(format!("/sys/fs/cgroup/{ctl}/{cgroup}"));
    }
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
}
