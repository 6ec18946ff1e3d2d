//! The real `flowctl` binary on veth pairs in network namespaces, with real
//! UDP traffic. Bounds come from timestamps the harness records, never from
//! exact counts or sleeps. Root only; serial.

use flowctl_tests::cli::{attachment, bin, flowctl, rule};
use flowctl_tests::lab::Lab;
use serde_json::Value;
use std::{
    io::Write,
    net::UdpSocket,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

fn profile_file(text: &str) -> tempfile_lite::File {
    tempfile_lite::File::new(text)
}

/// In a VM of the kernel matrix (`cargo xtask test`): QEMU without KVM is
/// 10-50x slower, so deadlines and timing bounds are relaxed there, never
/// the correctness checks.
fn in_vm() -> bool {
    std::env::var_os("FLOWCTL_TEST_VM").is_some()
}

/// A tiny temp-file helper (removes the file on drop).
mod tempfile_lite {
    pub struct File(pub std::path::PathBuf);
    impl File {
        pub fn new(text: &str) -> Self {
            let p = std::env::temp_dir()
                .join(format!("{}.toml", flowctl_tests::unique("flowctl-profile-")));
            std::fs::write(&p, text).unwrap();
            Self(p)
        }
        pub fn path(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }
    impl Drop for File {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

struct Agent(Child);

impl Agent {
    fn start(lab: &Lab, profile: &str, extra: &[&str]) -> Self {
        let mut args = vec!["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", profile];
        args.extend_from_slice(extra);
        Self::spawn_until(&args, || {
            attachment(&lab.veth_srv).is_some_and(|v| v["agent_ready"] == true)
        })
    }

    /// Runs `flowctl ARGS` and waits (at most 15 s) until `ready`.
    fn spawn_until(args: &[&str], ready: impl Fn() -> bool) -> Self {
        let child = Command::new(bin()).args(args).stdin(Stdio::null()).spawn().unwrap();
        let a = Agent(child);
        let deadline = Instant::now() + Duration::from_secs(if in_vm() { 180 } else { 15 });
        while Instant::now() < deadline {
            if ready() {
                return a;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("agent {args:?} did not come up");
    }

    fn stop(mut self) {
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let st = self.0.wait().unwrap();
        assert!(st.success(), "agent exit: {st}");
    }

    fn kill9(mut self) {
        unsafe { libc::kill(self.0.id() as i32, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

impl Drop for Agent {
    /// On a failed test: SIGINT (the agent detaches), then SIGKILL after 3 s.
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Sends UDP from the client namespace's address at about `pps` for `secs`
/// (at most `max` packets); returns (sent, first send, last send).
fn blast(lab: &Lab, dport: u16, pps: u64, secs: f64, max: u64) -> (u64, Instant, Instant) {
    blast_from(lab, &lab.ip_cli, dport, pps, secs, max)
}

/// `blast` from `src`, any address of the client namespace.
fn blast_from(
    lab: &Lab,
    src: &str,
    dport: u16,
    pps: u64,
    secs: f64,
    max: u64,
) -> (u64, Instant, Instant) {
    let (src, dst) = (src.to_string(), format!("{}:{dport}", lab.ip_srv));
    Lab::in_ns(&lab.ns_cli, move || {
        let s = UdpSocket::bind(format!("{src}:0")).unwrap();
        let gap = Duration::from_secs_f64(1.0 / pps as f64);
        let first = Instant::now();
        let mut last = first;
        let mut n = 0;
        while n < max && first.elapsed().as_secs_f64() < secs {
            let _ = s.send_to(b"flowctl-e2e", &dst);
            last = Instant::now();
            n += 1;
            let next = first + gap * n as u32;
            if let Some(d) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
        }
        (n, first, last)
    })
}

const UDP_RULE: &str = "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n\
[[rule]]\nname = \"udp\"\nproto = \"udp\"\ndport = 7000\nrate = \"100/s\"\nburst = 20\nkey = \"src\"\n";

fn udp_limit_holds_within_bounds_then_detaches() {
    let lab = Lab::new("fe2e", 211);
    let prof = profile_file(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let (sent, first, last) = blast(&lab, 7000, 1000, 2.0, 5000);
    let t = last.duration_since(first).as_secs_f64();
    let r = rule(&lab.veth_srv, "udp");
    let admitted = r["passed_pkts"].as_u64().unwrap();
    let (b, rate) = (20.0, 100.0);
    let upper = b + rate * t + 1.0;
    let lower = 0.9 * (sent as f64).min(b + rate * t);
    println!("sent {sent} over {t:.3}s: admitted {admitted}, bounds [{lower:.0}, {upper:.0}]");
    assert_eq!(r["offered_pkts"].as_u64().unwrap(), sent);
    assert!(
        (admitted as f64) <= upper && (admitted as f64) >= lower,
        "admitted {admitted} outside [{lower}, {upper}]"
    );
    assert_eq!(r["dropped_by_reason"]["rate"].as_u64().unwrap(), sent - admitted);

    // explain agrees with the profile, from the kernel's tables.
    let out =
        flowctl(&["explain", &lab.veth_srv, "udp", &lab.ip_cli, "7000", "--netns", &lab.ns_srv]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("rule   udp") && text.contains("key    src"), "{text}");
    let out =
        flowctl(&["explain", &lab.veth_srv, "udp", &lab.ip_cli, "7001", "--netns", &lab.ns_srv]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("no rule matches"));

    agent.stop();
    assert!(attachment(&lab.veth_srv).is_none(), "SIGINT detaches");
    let out = flowctl(&["detach", &lab.veth_srv, "--netns", &lab.ns_srv]);
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("nothing attached"),
        "detach is idempotent"
    );
}

fn map_ids(iface: &str) -> Vec<u32> {
    let a = attachment(iface).unwrap();
    let dir = format!(
        "{}/v{}/ifaces/{}-{}",
        flowctl_common::PIN_ROOT,
        flowctl_common::LAYOUT_VERSION,
        a["netns_inode"],
        a["ifindex"]
    );
    flowctl_common::map_names::ALL
        .iter()
        .map(|n| aya::maps::MapData::from_pin(format!("{dir}/{n}")).unwrap().info().unwrap().id())
        .collect()
}

fn keep_survives_sigkill_and_restart_adopts_state() {
    let lab = Lab::new("fkeep", 212);
    // One token an hour: the test can take minutes under TCG (two agent
    // starts, each verifying the program), and must never see a refill.
    let prof = profile_file("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"slow\"\nproto = \"udp\"\nrate = \"1/h\"\nburst = 3\nkey = \"src\"\n");
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let ids = map_ids(&lab.veth_srv);
    let (sent, _, _) = blast(&lab, 7100, 200, 0.5, 20);
    let r = rule(&lab.veth_srv, "slow");
    assert_eq!(r["passed_pkts"].as_u64().unwrap(), 3, "burst of 3 then refused (sent {sent})");
    agent.kill9();
    // The kept data plane enforces alone.
    blast(&lab, 7100, 100, 0.2, 5);
    let r = rule(&lab.veth_srv, "slow");
    assert_eq!(r["passed_pkts"].as_u64().unwrap(), 3);
    let a = attachment(&lab.veth_srv).unwrap();
    assert_eq!(a["agent_running"], false);
    // Agent-less apply works on the kept data plane.
    let out = flowctl(&["apply", &lab.veth_srv, prof.path(), "--netns", &lab.ns_srv]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Restart: adopts pins, the drained key is still refused, maps unchanged.
    let agent = Agent::start(&lab, prof.path(), &[]);
    assert_eq!(map_ids(&lab.veth_srv), ids, "map ids unchanged across restart");
    blast(&lab, 7100, 100, 0.2, 5);
    let r = rule(&lab.veth_srv, "slow");
    assert_eq!(
        r["passed_pkts"].as_u64().unwrap(),
        3,
        "drained key still refused after re-adoption"
    );
    agent.stop();
}

fn apply_through_the_agent_is_all_or_nothing() {
    let lab = Lab::new("fapply", 213);
    let prof = profile_file(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let gen0 = attachment(&lab.veth_srv).unwrap()["generation"].as_u64().unwrap();
    // A client that connects to the control socket and says nothing must not
    // hold up the agent (heartbeat, other requests).
    let a = attachment(&lab.veth_srv).unwrap();
    let silent = std::os::unix::net::UnixStream::connect(format!(
        "/run/flowctl/{}-{}/agent.sock",
        a["netns_inode"], a["ifindex"]
    ))
    .unwrap();
    let bad = profile_file("[[rule]]\nname = \"x\"\nrate = \"0/s\"\n");
    let out = flowctl(&["apply", &lab.veth_srv, bad.path(), "--netns", &lab.ns_srv]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:3:", bad.path())) && err.contains("greater than zero"),
        "{err}"
    );
    assert_eq!(
        attachment(&lab.veth_srv).unwrap()["generation"].as_u64().unwrap(),
        gen0,
        "nothing applied"
    );
    let good = profile_file(&format!(
        "{UDP_RULE}[[rule]]\nname = \"icmp\"\nproto = \"icmp\"\nrate = \"10/s\"\n"
    ));
    let t = Instant::now();
    let out = flowctl(&["apply", &lab.veth_srv, good.path(), "--netns", &lab.ns_srv]);
    assert!(t.elapsed() < Duration::from_secs(3), "apply waited on the silent client");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(attachment(&lab.veth_srv).unwrap()["generation"].as_u64().unwrap(), gen0 + 1);
    assert_eq!(attachment(&lab.veth_srv).unwrap()["rules"].as_array().unwrap().len(), 2);
    drop(silent);
    agent.stop();
}

fn error_paths_say_how_to_fix() {
    let lab = Lab::new("ferr", 214);
    let prof = profile_file(UDP_RULE);
    // Missing interface.
    let out = flowctl(&["attach", "nosuchdev0", "--netns", &lab.ns_srv, "--profile", prof.path()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no interface named `nosuchdev0`"));
    // Missing capabilities: drop them all with setpriv.
    let out = Command::new("setpriv")
        .args(["--inh-caps=-all", "--bounding-set=-all", "--"])
        .arg(bin())
        .args(["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs root"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A bad profile is rejected with file and line before anything happens.
    let bad = profile_file("[[rule]]\nname = \"x\"\nsrc = \"10.0.0.1/8\"\nrate = \"1/s\"\n");
    let out = flowctl(&["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", bad.path()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("{}:3:", bad.path())));
    assert!(attachment(&lab.veth_srv).is_none());
    // `check` for CI pipelines.
    let out = flowctl(&["check", prof.path()]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("kernel memory"));
    // Native XDP is refused on a fresh namespace's lo: auto falls back loudly.
    let child = Command::new(bin())
        .args(["attach", "lo", "--netns", &lab.ns_srv, "--profile", prof.path()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while attachment("lo").is_none_or(|a| a["agent_ready"] != true) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(attachment("lo").expect("attached to lo")["mode"], "generic");
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("generic (skb) mode"));
    let _ = std::io::stdout().flush();
}

/// New TCP connections: a `connections` rule admits at most b + r*t SYNs;
/// refused SYNs are dropped, so those connects time out at the client.
fn tcp_connection_rate_within_bounds() {
    let lab = Lab::new("ftcp", 215);
    let prof = profile_file("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"conns\"\nproto = \"tcp\"\ndport = 7200\nunit = \"connections\"\nrate = \"20/s\"\nburst = 5\nkey = \"src\"\n");
    let server = TcpServer::start(&lab, 7200);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let (ok, attempts, t) = connect_many(&lab, 7200, 400, Duration::from_secs(2));
    let r = rule(&lab.veth_srv, "conns");
    let admitted = r["passed_pkts"].as_u64().unwrap();
    let syn_drops = r["dropped_by_reason"]["rate"].as_u64().unwrap_or(0);
    let upper = 5.0 + 20.0 * t + 1.0;
    println!("{attempts} connects, {ok} established over {t:.2}s; rule passed {admitted} packets, dropped {syn_drops} SYNs; bound {upper:.1}");
    assert!((ok as f64) <= upper, "{ok} connections > {upper}");
    assert!(ok as f64 >= 0.9 * (5.0 + 20.0 * t).min(attempts as f64) - 1.0, "too few: {ok}");
    assert_eq!(syn_drops, attempts - ok, "every refused connect lost exactly its SYN");
    assert_eq!(server.stop(), ok);
    agent.stop();
}

/// A real TCP server in the protected namespace, counting accepted
/// connections until stopped (or dropped). It closes what it accepts at
/// once, or keeps it open while `hold` is on.
struct TcpServer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hold: std::sync::Arc<std::sync::atomic::AtomicBool>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TcpServer {
    fn start(lab: &Lab, port: u16) -> Self {
        let addr = format!("{}:{port}", lab.ip_srv);
        let listener = Lab::in_ns(&lab.ns_srv, move || std::net::TcpListener::bind(addr).unwrap());
        listener.set_nonblocking(true).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hold = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (s, h, a) = (stop.clone(), hold.clone(), accepted.clone());
        let thread = std::thread::spawn(move || {
            let mut kept = Vec::new();
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                match listener.accept() {
                    Ok((c, _)) => {
                        a.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if h.load(std::sync::atomic::Ordering::Relaxed) {
                            kept.push(c);
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        Self { stop, hold, accepted, thread: Some(thread) }
    }

    /// Keep accepted connections open (or close them at once again).
    fn hold(&self, on: bool) {
        self.hold.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Stops the server; returns how many connections it accepted.
    fn stop(mut self) -> u64 {
        self.halt();
        self.accepted.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn halt(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Connects from the client namespace until `max` attempts or `budget` time;
/// returns (established, attempts, seconds until the last success). The 200
/// ms connect timeout is shorter than the first SYN retransmission (1 s), so
/// every attempt is exactly one SYN.
fn connect_many(lab: &Lab, port: u16, max: u64, budget: Duration) -> (u64, u64, f64) {
    let target: std::net::SocketAddr = format!("{}:{port}", lab.ip_srv).parse().unwrap();
    Lab::in_ns(&lab.ns_cli, move || {
        let start = Instant::now();
        let (mut ok, mut n) = (0u64, 0u64);
        let mut last_ok = start;
        while start.elapsed() < budget && n < max {
            n += 1;
            if std::net::TcpStream::connect_timeout(&target, Duration::from_millis(200)).is_ok() {
                ok += 1;
                last_ok = Instant::now();
            }
        }
        (ok, n, last_ok.duration_since(start).as_secs_f64())
    })
}

/// A connection quota end to end: "at most 5 new TCP connections per 10 s
/// per source /24" admits exactly 5 of a stream of connects, refusing the
/// rest by dropping their SYNs (reason `quota`).
fn tcp_connection_quota() {
    let lab = Lab::new("fquota", 221);
    let prof = profile_file("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\nquota_table_entries = 4096\n[[rule]]\nname = \"conns\"\nproto = \"tcp\"\ndport = 7300\nunit = \"connections\"\nquota = 5\nquota_window = \"10s\"\nkey = \"src_prefix\"\nprefix_v4 = 24\n");
    let server = TcpServer::start(&lab, 7300);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let (ok, attempts, _) = connect_many(&lab, 7300, 12, Duration::from_secs(5));
    let r = rule(&lab.veth_srv, "conns");
    println!(
        "{attempts} connects, {ok} established; quota drops {}",
        r["dropped_by_reason"]["quota"]
    );
    assert_eq!(ok, 5, "exactly the quota within one window");
    assert_eq!(r["dropped_by_reason"]["quota"].as_u64().unwrap(), attempts - ok);
    assert_eq!(server.stop(), 5);
    agent.stop();
}

/// An interface that already runs someone else's XDP program is left alone,
/// with a message that says how to look at and remove it.
fn foreign_xdp_program_is_not_replaced() {
    let lab = Lab::new("fxdp", 216);
    let prof = profile_file(UDP_RULE);
    let (ns, dev, path, bin) =
        (lab.ns_srv.clone(), lab.veth_srv.clone(), prof.path().to_string(), bin());
    let out = Lab::in_ns(&lab.ns_srv, move || {
        let mut ebpf = aya::EbpfLoader::new().load(flowctl_bench::bench_object()).unwrap();
        let prog: &mut aya::programs::Xdp =
            ebpf.program_mut("bench_pass").unwrap().try_into().unwrap();
        prog.load().unwrap();
        prog.attach(&dev, aya::programs::XdpMode::Driver).unwrap();
        let out = Command::new(bin)
            .args(["attach", &dev, "--netns", &ns, "--profile", &path])
            .output()
            .unwrap();
        drop(ebpf);
        out
    });
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("already has another XDP program") && err.contains("xdp off"), "{err}");
    assert!(attachment(&lab.veth_srv).is_none(), "nothing left behind");
}

/// One agent per attachment; pins of another layout version are refused, and
/// `--replace` starts over.
fn one_agent_per_attachment_and_layout_versions_are_checked() {
    let lab = Lab::new("flock", 217);
    let prof = profile_file(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let out = flowctl(&["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already running"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    agent.kill9();
    // Pretend the pins were written by a future flowctl.
    let a = attachment(&lab.veth_srv).unwrap();
    let dir = format!(
        "{}/v{}/ifaces/{}-{}",
        flowctl_common::PIN_ROOT,
        flowctl_common::LAYOUT_VERSION,
        a["netns_inode"],
        a["ifindex"]
    );
    let mut global: aya::maps::Array<_, flowctl_common::GlobalRecord> =
        aya::maps::Array::try_from(aya::maps::Map::Array(
            aya::maps::MapData::from_pin(format!("{dir}/{}", flowctl_common::map_names::GLOBAL))
                .unwrap(),
        ))
        .unwrap();
    let mut g = global.get(&0, 0).unwrap();
    g.layout_version = 99;
    global.set(0, g, 0).unwrap();
    let out = flowctl(&["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("layout version Some(99)") && err.contains("--replace"), "{err}");
    let agent = Agent::start(&lab, prof.path(), &["--replace"]);
    assert_eq!(attachment(&lab.veth_srv).unwrap()["generation"], 1, "started over");
    agent.stop();
}

/// GET a path over plain HTTP/1.0 from inside namespace `ns`.
fn http_get(ns: &str, addr: &str, path: &str) -> String {
    let (addr, path) = (addr.to_string(), path.to_string());
    Lab::in_ns(ns, move || {
        use std::io::Read;
        let mut s = std::net::TcpStream::connect(&addr).expect("connect to the metrics endpoint");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
}

/// The metrics endpoint serves valid text exposition format whose numbers
/// are the kernel's (the same as `status --json`).
fn metrics_endpoint_matches_status() {
    let lab = Lab::new("fmet", 218);
    let prof = profile_file(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--metrics", "127.0.0.1:19464"]);
    blast(&lab, 7000, 1000, 0.5, 800);
    let resp = http_get(&lab.ns_srv, "127.0.0.1:19464", "/metrics");
    let (head, body) = resp.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.") && head.contains(" 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: text/plain"), "{head}");
    // Every line is a comment or `name{labels} value`.
    let mut samples = std::collections::HashMap::new();
    for line in body.lines().filter(|l| !l.is_empty()) {
        if line.starts_with('#') {
            assert!(
                line.starts_with("# HELP ") || line.starts_with("# TYPE ") || line == "# EOF",
                "{line}"
            );
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line}"));
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && name.starts_with("flowctl_"),
            "{name}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "{series}"
            );
        }
        samples.insert(series.to_string(), v);
    }
    let r = rule(&lab.veth_srv, "udp");
    let get = |k: &str| *samples.get(k).unwrap_or_else(|| panic!("missing {k} in\n{body}"));
    assert_eq!(
        get("flowctl_offered_packets_total{rule=\"udp\"}") as u64,
        r["offered_pkts"].as_u64().unwrap()
    );
    assert_eq!(
        get("flowctl_packets_total{rule=\"udp\",verdict=\"passed\",reason=\"\"}") as u64,
        r["passed_pkts"].as_u64().unwrap()
    );
    assert_eq!(
        get("flowctl_packets_total{rule=\"udp\",verdict=\"dropped\",reason=\"rate\"}") as u64,
        r["dropped_by_reason"]["rate"].as_u64().unwrap()
    );
    assert_eq!(get("flowctl_admission_ratio{rule=\"udp\"}"), 1.0);
    assert_eq!(get("flowctl_rules"), 1.0);
    assert!(get("flowctl_kernel_memory_bytes") > 0.0);
    let missing = http_get(&lab.ns_srv, "127.0.0.1:19464", "/nope");
    assert!(missing.contains(" 404"), "{missing}");
    agent.stop();
}

/// `top --once --json` agrees with what the harness sent, and its totals
/// with `status`.
fn top_once_json_agrees_with_traffic() {
    let lab = Lab::new("ftop", 219);
    let prof = profile_file("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"udp\"\nproto = \"udp\"\ndport = 7000\nrate = \"100/s\"\nburst = 20\nkey = \"src\"\n");
    let agent = Agent::start(&lab, prof.path(), &[]);
    let (sent, secs, v) = std::thread::scope(|scope| {
        let sender = scope.spawn(|| blast(&lab, 7000, 1000, 2.5, 3000));
        std::thread::sleep(Duration::from_millis(500));
        let out = flowctl(&["top", "--once", "--json", "--interval", "1"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let (sent, first, last) = sender.join().unwrap();
        (sent, last.duration_since(first).as_secs_f64(), v)
    });
    assert_eq!(v["schema"], 1);
    let a = v["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["iface"] == lab.veth_srv.as_str())
        .unwrap()
        .clone();
    let r = a["rules"][0].clone();
    let rate = sent as f64 / secs;
    println!(
        "harness sent {rate:.0} pps; top: offered {} passed {} dropped {} drop% {}",
        r["offered_pps"], r["passed_pps"], r["dropped_pps"], r["drop_pct"]
    );
    let offered = r["offered_pps"].as_f64().unwrap();
    assert!(offered > 0.7 * rate && offered < 1.3 * rate, "offered {offered} vs sent {rate}");
    let passed = r["passed_pps"].as_f64().unwrap();
    assert!(
        (100.0 * 0.75..=100.0 * 1.25 + 20.0).contains(&passed),
        "passed {passed} pps against a 100/s limit"
    );
    assert_eq!(r["top_reason"], "rate");
    // The agent's CPU signal (host source by default), from its record.
    let cpu = a["cpu"].as_str().unwrap();
    assert!(cpu.ends_with("% (host)"), "{cpu}");
    let permille = a["cpu_permille"].as_u64().expect("cpu_permille with a running agent");
    assert!(permille <= 1000);
    // One client source: the source cache holds exactly one entry (the
    // agent walked the empty table at start, the insert counter adds it).
    let sources = a["key_tables"]
        .as_array()
        .expect("key tables with a running agent")
        .iter()
        .find(|t| t["table"] == "sources")
        .unwrap()
        .clone();
    assert_eq!(sources["entries"], 1, "{sources}");
    assert!(a["key_tables_note"].as_str().unwrap().starts_with("approximate"));
    // After the traffic: totals agree with status exactly.
    let out = flowctl(&["top", "--once", "--json", "--interval", "0.2", &lab.veth_srv]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let r2 = &v["attachments"][0]["rules"][0];
    let st = rule(&lab.veth_srv, "udp");
    assert_eq!(r2["offered_total"], st["offered_pkts"]);
    assert_eq!(r2["offered_total"].as_u64().unwrap(), sent);
    assert_eq!(r2["offered_pps"].as_f64().unwrap(), 0.0);
    agent.stop();
}

/// `top --keys` names the heaviest sources in order with rates near what
/// was sent, through the agent and, with the agent gone (--keep), by
/// sampling itself.
fn top_keys_finds_the_heaviest_sources() {
    let lab = Lab::new("fkey", 222);
    let srcs = ["10.201.222.10", "10.201.222.11", "10.201.222.12"];
    for a in srcs {
        flowctl_tests::lab::sh(&[
            "ip",
            "-n",
            &lab.ns_cli,
            "addr",
            "add",
            &format!("{a}/24"),
            "dev",
            &lab.veth_cli,
        ]);
    }
    let prof = profile_file(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let run_phase = |label: &str| {
        let (v, sent) = std::thread::scope(|scope| {
            let lab = &lab;
            let senders: Vec<_> = srcs
                .iter()
                .zip([600u64, 200, 50])
                .map(|(a, pps)| scope.spawn(move || blast_from(lab, a, 7000, pps, 3.5, u64::MAX).0))
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            let out = flowctl(&[
                "top",
                &lab.veth_srv,
                "--keys",
                "udp",
                "--once",
                "--json",
                "--interval",
                "2.5",
                "--count",
                "5",
            ]);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let v: Value = serde_json::from_slice(&out.stdout).unwrap();
            let sent: Vec<u64> = senders.into_iter().map(|h| h.join().unwrap()).collect();
            (v, sent)
        });
        println!("{label}: sent {sent:?} over 3.5 s; top --keys: {v}");
        let keys = v["keys"].as_array().unwrap();
        assert!(keys.len() >= 3, "{v}");
        for (i, (addr, pps)) in srcs.iter().zip([600.0, 200.0]).enumerate() {
            assert_eq!(keys[i]["key"], *addr, "{label}: rank {i}");
            let est = keys[i]["pps"].as_f64().unwrap();
            assert!(
                est > 0.6 * pps && est < 1.4 * pps,
                "{label}: {addr} estimated {est} pps, sent {pps}"
            );
        }
        assert!(
            v["bound_pps"].as_f64().unwrap() >= 0.0 && v["sample_every"].as_u64().unwrap() >= 1
        );
    };
    run_phase("through the agent");
    agent.stop();
    // Agent-computed fields say so at once, never the stopped agent's values.
    let out = flowctl(&["top", &lab.veth_srv, "--once", "--json", "--interval", "0.1"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let a = &v["attachments"][0];
    assert_eq!(
        (a["agent_running"].clone(), a["cpu"].clone()),
        (Value::Bool(false), Value::from("agent not running"))
    );
    assert!(a["cpu_permille"].is_null() && a["key_tables"].is_null(), "{a}");
    run_phase("without an agent");
    let g = flowctl(&["status", "--json"]);
    assert!(g.status.success());
    let out = flowctl(&["detach", &lab.veth_srv, "--netns", &lab.ns_srv]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A real run in a terminal (tmux): the view draws, the sort key works, and
/// quitting restores the terminal (the alternate screen is gone).
fn top_runs_in_a_terminal_and_restores_it() {
    let lab = Lab::new("ftui", 220);
    let prof = profile_file(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let session = flowctl_tests::unique("flowctl-top-");
    let tmux = |args: &[&str]| Command::new("tmux").args(args).output().expect("tmux");
    // The exit status goes to a file: tmux's #{pane_dead_status} is not
    // always filled in by the time the pane is reported dead.
    let status_file = std::env::temp_dir().join(format!("{session}.status"));
    let _ = std::fs::remove_file(&status_file);
    let cmd = format!(
        "sh -c '{} top --interval 0.3; echo $? > {}'",
        bin().display(),
        status_file.display()
    );
    let out = tmux(&["new-session", "-d", "-s", &session, "-x", "220", "-y", "30", &cmd]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    tmux(&["set-option", "-t", &session, "remain-on-exit", "on"]);
    let screen = || {
        String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", &session]).stdout).to_string()
    };
    let wait_for = |needle: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = screen();
            if s.contains(needle) {
                return s;
            }
            assert!(Instant::now() < deadline, "`{needle}` never appeared:\n{s}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let s = wait_for("sort: profile order");
    assert!(s.contains(&lab.veth_srv) && s.contains("udp"), "{s}");
    tmux(&["send-keys", "-t", &session, "s"]);
    wait_for("sort: offered pps");
    tmux(&["send-keys", "-t", &session, "q"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dead = String::from_utf8_lossy(
            &tmux(&["display-message", "-p", "-t", &session, "#{pane_dead} #{alternate_on}"])
                .stdout,
        )
        .trim()
        .to_string();
        if dead.starts_with('1') {
            assert_eq!(dead, "1 0", "the alternate screen is off");
            let status = std::fs::read_to_string(&status_file).unwrap_or_default();
            assert_eq!(status.trim(), "0", "top exited with status 0");
            let _ = std::fs::remove_file(&status_file);
            break;
        }
        assert!(Instant::now() < deadline, "top did not quit: {dead}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!screen().contains("keys: s sort"), "the TUI is gone from the screen");
    tmux(&["kill-session", "-t", &session]);
    agent.stop();
}

/// Paced UDP streams from the client namespace to each of `ports`, one
/// packet per `gap`, until stopped or dropped (or `limit` passes).
struct UdpStreams {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl UdpStreams {
    fn start(lab: &Lab, ports: &[u16], gap: Duration, limit: Duration) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = ports
            .iter()
            .map(|port| {
                let (stop, src, dst, ns) = (
                    stop.clone(),
                    lab.ip_cli.clone(),
                    format!("{}:{port}", lab.ip_srv),
                    lab.ns_cli.clone(),
                );
                std::thread::spawn(move || {
                    flowctl::system::netns::enter_netns(&ns).unwrap();
                    let s = UdpSocket::bind(format!("{src}:0")).unwrap();
                    let t = Instant::now();
                    let mut n = 0u32;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) && t.elapsed() < limit {
                        let _ = s.send_to(b"x", &dst);
                        n += 1;
                        if let Some(d) = (t + gap * n).checked_duration_since(Instant::now()) {
                            std::thread::sleep(d);
                        }
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }

    fn stop(mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

impl Drop for UdpStreams {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What `connect_each` saw.
#[derive(Debug, Default)]
struct Attempts {
    open: Vec<std::net::TcpStream>,
    refused: u64,
    timed_out: u64,
    /// The slowest refusal, ms.
    slowest_refusal_ms: f64,
}

/// `n` connects from the client namespace, `gap` apart; established ones
/// are kept open when `keep`, else closed at once.
fn connect_each(lab: &Lab, port: u16, n: u32, gap: Duration, keep: bool) -> Attempts {
    let target: std::net::SocketAddr = format!("{}:{port}", lab.ip_srv).parse().unwrap();
    Lab::in_ns(&lab.ns_cli, move || {
        let mut a = Attempts::default();
        for _ in 0..n {
            let t = Instant::now();
            match std::net::TcpStream::connect_timeout(&target, Duration::from_millis(300)) {
                Ok(s) if keep => a.open.push(s),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    a.refused += 1;
                    a.slowest_refusal_ms =
                        a.slowest_refusal_ms.max(t.elapsed().as_secs_f64() * 1e3);
                }
                Err(_) => a.timed_out += 1,
            }
            std::thread::sleep(gap);
        }
        a
    })
}

/// BBR end to end with real TCP: under a high CPU signal (a file source),
/// connections in flight beyond what the window's completions and round
/// trips support are refused at the SYN with a RST (clients fail fast) while
/// established ones continue; the refusals are counted by reason; with the
/// agent killed the stage fails open after the grace period; a restarted
/// agent adopts the data plane, and below the threshold refuses nothing.
fn bbr_refuses_connections_beyond_the_limit_and_fails_open() {
    let lab = Lab::new("fbbr", 223);
    // XDP_TX replies on a veth reach the peer only when the peer runs its
    // NAPI; an XDP program there turns it on (GRO alone did not, here).
    let (ns, dev) = (lab.ns_cli.clone(), lab.veth_cli.clone());
    let _peer_xdp = Lab::in_ns(&lab.ns_cli, move || {
        let _ = &ns;
        let mut ebpf = aya::EbpfLoader::new().load(flowctl_bench::bench_object()).unwrap();
        let prog: &mut aya::programs::Xdp =
            ebpf.program_mut("bench_pass").unwrap().try_into().unwrap();
        prog.load().unwrap();
        prog.attach(&dev, aya::programs::XdpMode::Driver).unwrap();
        ebpf
    });
    let cpu = std::env::temp_dir().join(format!("flowctl-e2e-cpu-{}", std::process::id()));
    std::fs::write(&cpu, "950\n").unwrap();
    let prof = profile_file(&format!(
        "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\ncpu = \"file:{}\"\ngrace_period = \"1s\"\n\
[[rule]]\nname = \"web\"\nproto = \"tcp\"\ndport = 7400\nunit = \"connections\"\nrate = \"100000/s\"\n\
bbr = {{ cpu_threshold = 800, window = \"10s\", buckets = 100, idle_timeout = \"10s\", reject = \"reset\" }}\n",
        cpu.display()
    ));
    let server = TcpServer::start(&lab, 7400);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);

    // 1. Short connections fill the window: completions and round trips.
    //    At most one is in flight at a time, so none is refused.
    let warm = connect_each(&lab, 7400, 30, Duration::from_millis(20), false);
    assert_eq!((warm.refused, warm.timed_out), (0, 0), "{warm:?}");
    std::thread::sleep(Duration::from_millis(400));
    let v: Value = serde_json::from_slice(
        &flowctl(&["top", &lab.veth_srv, "--once", "--json", "--interval", "0.1"]).stdout,
    )
    .unwrap();
    let bbr = v["attachments"][0]["rules"][0]["bbr"].clone();
    println!("after the warm-up: {bbr}");
    assert!(
        bbr["max_pass"].as_u64().unwrap() >= 1 && bbr["min_rt_ms"].as_u64().unwrap() >= 1,
        "{bbr}"
    );
    assert_eq!(bbr["overloaded"], true, "CPU 950 is over the threshold");
    let limit = bbr["max_in_flight"].as_u64().expect("a limit once the window has data");

    // 2. Held connections: beyond the limit, SYNs are refused with a RST.
    server.hold(true);
    let held = connect_each(&lab, 7400, 40, Duration::from_millis(25), true);
    let drops = rule(&lab.veth_srv, "web")["dropped_by_reason"]["bbr"].as_u64().unwrap_or(0);
    println!(
        "holding: {} established, {} refused (slowest {:.1} ms), {} timed out; limit {limit}; BBR drops {drops}",
        held.open.len(),
        held.refused,
        held.slowest_refusal_ms,
        held.timed_out
    );
    if held.timed_out > 0 {
        for (ns, dev) in [(&lab.ns_srv, &lab.veth_srv), (&lab.ns_cli, &lab.veth_cli)] {
            let st = flowctl_tests::lab::sh(&["ip", "netns", "exec", ns, "ethtool", "-S", dev]);
            println!(
                "{dev}: {}",
                st.lines()
                    .filter(|l| l.contains("xdp") || l.contains("drop") || l.contains("peer"))
                    .collect::<Vec<_>>()
                    .join(" |")
            );
            println!(
                "{}",
                flowctl_tests::lab::sh(&["ip", "-n", ns, "-s", "-s", "link", "show", "dev", dev])
            );
        }
    }
    assert!(
        held.refused >= 20,
        "most of 40 held connections beyond a limit of {limit} are refused: {held:?}"
    );
    assert_eq!(held.timed_out, 0, "refused with a RST, not left to time out");
    assert!(
        held.slowest_refusal_ms < 100.0,
        "clients fail fast: {:.1} ms",
        held.slowest_refusal_ms
    );
    assert_eq!(drops, held.refused, "every refusal counted as a BBR drop");
    // The in-flight snapshot lags the kernel by at most one 100 ms tick
    // (four connects at this pace).
    assert!(
        (held.open.len() as u64) <= limit.max(1) + 5,
        "{} held over a limit of {limit}",
        held.open.len()
    );

    // 3. Fail-safe: the agent dies; after the grace period BBR is open.
    agent.kill9();
    std::thread::sleep(Duration::from_millis(1500));
    let open = connect_each(&lab, 7400, 3, Duration::from_millis(10), true);
    assert_eq!(
        open.open.len(),
        3,
        "no agent for longer than the grace period: admitted ({open:?})"
    );

    // 4. A restarted agent adopts the data plane; with the CPU low it admits.
    std::fs::write(&cpu, "100\n").unwrap();
    let ids = map_ids(&lab.veth_srv);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    assert_eq!(map_ids(&lab.veth_srv), ids, "the pinned maps were adopted, not recreated");
    std::thread::sleep(Duration::from_millis(600));
    let v: Value = serde_json::from_slice(
        &flowctl(&["top", &lab.veth_srv, "--once", "--json", "--interval", "0.1"]).stdout,
    )
    .unwrap();
    println!(
        "after the restart: cpu {} bbr {}",
        v["attachments"][0]["cpu"], v["attachments"][0]["rules"][0]["bbr"]
    );
    // Below the threshold nothing is refused, however many are in flight.
    let again = connect_each(&lab, 7400, 10, Duration::from_millis(20), true);
    assert_eq!(again.open.len(), 10, "CPU below threshold: all admitted ({again:?})");
    // The connections held through the refusals are intact.
    for s in &held.open {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 1];
        let e = std::io::Read::read(&mut &*s, &mut b).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "a held connection was cut: {e}");
    }
    drop((held, open, again));
    agent.stop();
    let out = flowctl(&["detach", &lab.veth_srv, "--netns", &lab.ns_srv]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_file(&cpu);
}

/// KLimiter end to end: a gauge file says the database is over its
/// threshold; the agent cuts the low-priority rule first (its admitted
/// traffic falls with its ratio), shows why in `top`, holds when the gauge
/// turns to garbage, and releases once the level is low.
fn klimiter_cuts_low_priority_first_and_holds_on_garbage() {
    let lab = Lab::new("fklim", 224);
    let gauge = std::env::temp_dir().join(format!("flowctl-e2e-gauge-{}", std::process::id()));
    std::fs::write(&gauge, "300\n").unwrap();
    let prof = profile_file(&format!(
        "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n\
[klimiter]\nsample_period = \"200ms\"\ncontrol_period = \"400ms\"\nstale_after = \"2s\"\n\
[[rule]]\nname = \"batch\"\nproto = \"udp\"\ndport = 7700\nrate = \"1000000/s\"\nadmission = \"packet\"\npriority = 0.0\n\
[[rule]]\nname = \"checkout\"\nproto = \"udp\"\ndport = 7701\nrate = \"1000000/s\"\npriority = 0.9\n\
[[baseline]]\nname = \"db\"\nthreshold = 60\nentries = [\"batch\", \"checkout\"]\nsource = {{ kind = \"gauge\", file = \"{}\" }}\n",
        gauge.display()
    ));
    let agent = Agent::start(&lab, prof.path(), &[]);
    let top = || -> Value {
        let out = flowctl(&["top", &lab.veth_srv, "--once", "--json", "--interval", "0.5"]);
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["attachments"][0].clone()
    };
    let ratio = |a: &Value, rule: &str| {
        a["rules"].as_array().unwrap().iter().find(|r| r["rule"] == rule).unwrap()
            ["admission_ratio"]
            .as_f64()
            .unwrap()
    };
    // Traffic on both rules for the whole test (bounded: 30 s at most).
    let streams =
        UdpStreams::start(&lab, &[7700, 7701], Duration::from_millis(5), Duration::from_secs(30));
    // Over the threshold: both are cut 0.05 per period until checkout sits
    // at its floor of 0.9; batch keeps going down.
    std::thread::sleep(Duration::from_secs(5));
    let a = top();
    let k = a["klimiter"].clone();
    println!("cutting: batch {} checkout {}; {}", ratio(&a, "batch"), ratio(&a, "checkout"), k);
    assert_eq!(k["baselines"][0]["band"], "cut");
    assert_eq!(k["baselines"][0]["level"], 300.0);
    assert!(ratio(&a, "checkout") >= 0.9 - 1e-6, "checkout's priority floor holds in round 1");
    assert!(
        ratio(&a, "batch") < 0.7,
        "batch is cut below checkout's floor: {}",
        ratio(&a, "batch")
    );
    let reason = k["entries"].as_array().unwrap().iter().find(|e| e["rule"] == "batch").unwrap()
        ["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.starts_with("cut") && reason.contains("db: level 300.0 over threshold 60.0"),
        "{reason}"
    );
    // The kernel admits batch at about its ratio (per packet).
    let r = a["rules"].as_array().unwrap().iter().find(|r| r["rule"] == "batch").unwrap().clone();
    let frac = r["passed_pps"].as_f64().unwrap() / r["offered_pps"].as_f64().unwrap().max(1.0);
    assert!(
        (frac - ratio(&a, "batch")).abs() < 0.25,
        "admitted fraction {frac} vs ratio {}",
        ratio(&a, "batch")
    );
    assert!(r["top_reason"] == "admission", "{r}");
    // Garbage: hold.
    std::fs::write(&gauge, "banana\n").unwrap();
    std::thread::sleep(Duration::from_millis(900));
    let held = ratio(&top(), "batch");
    std::thread::sleep(Duration::from_millis(600));
    let a = top();
    assert_eq!(a["klimiter"]["baselines"][0]["band"], "stale");
    assert!(
        (ratio(&a, "batch") - held).abs() < 1e-9,
        "garbage never cuts: {held} -> {}",
        ratio(&a, "batch")
    );
    // A low level: ratios climb back.
    std::fs::write(&gauge, "10\n").unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let a = top();
    println!("recovering: batch {} checkout {}", ratio(&a, "batch"), ratio(&a, "checkout"));
    assert!(ratio(&a, "batch") > held, "released");
    streams.stop();
    agent.stop();
    let _ = std::fs::remove_file(&gauge);
}

/// KLimiter's kernel-assisted case: a relay in the protected namespace sends
/// a downstream (a third namespace) two packets per admitted packet of the
/// low-priority rule and one per packet of the high-priority rule; the TC
/// egress counter on the link to the downstream is the baseline's level.
/// Both entries start above the threshold; the level is held within 5% of
/// it, the low-priority entry cut first.
fn klimiter_holds_an_egress_level_by_cutting_low_priority_first() {
    let lab = Lab::new("fegr", 225);
    // The downstream: a third namespace behind a second veth pair.
    let down = format!("{}d", &lab.ns_srv[..lab.ns_srv.len() - 1]);
    let (a, b) = (
        format!("{}a", &lab.veth_srv[..lab.veth_srv.len() - 2]),
        format!("{}b", &lab.veth_srv[..lab.veth_srv.len() - 2]),
    );
    struct DropNs(String);
    impl Drop for DropNs {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    flowctl_tests::lab::sh(&["ip", "netns", "add", &down]);
    let _down_guard = DropNs(down.clone());
    flowctl_tests::lab::sh(&[
        "ip",
        "link",
        "add",
        &a,
        "netns",
        &lab.ns_srv,
        "type",
        "veth",
        "peer",
        "name",
        &b,
        "netns",
        &down,
    ]);
    for (ns, dev, ip) in [(&lab.ns_srv, &a, "10.201.226.1/24"), (&down, &b, "10.201.226.2/24")] {
        flowctl_tests::lab::sh(&["ip", "-n", ns, "addr", "add", ip, "dev", dev]);
        flowctl_tests::lab::sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
    }
    let prof = profile_file(&format!(
        "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n\
[klimiter]\nsample_period = \"200ms\"\ncontrol_period = \"1s\"\n\
[[rule]]\nname = \"low\"\nproto = \"udp\"\ndport = 7800\nrate = \"1000000/s\"\nadmission = \"packet\"\npriority = 0.0\n\
[[rule]]\nname = \"high\"\nproto = \"udp\"\ndport = 7801\nrate = \"1000000/s\"\nadmission = \"packet\"\npriority = 0.8\n\
[[baseline]]\nname = \"downstream\"\nthreshold = 1200\nentries = [\"low\", \"high\"]\n\
source = {{ kind = \"egress\", iface = \"{a}\", dst = \"10.201.226.2/32\", dport = 9000, proto = \"udp\" }}\n"
    ));
    let agent = Agent::start(&lab, prof.path(), &[]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The relay: what the XDP program admits reaches these sockets.
    let relayed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let relay = {
        let (stop, ns, ip, relayed) =
            (stop.clone(), lab.ns_srv.clone(), lab.ip_srv.clone(), relayed.clone());
        std::thread::spawn(move || {
            flowctl::system::netns::enter_netns(&ns).unwrap();
            let rx = [
                UdpSocket::bind(format!("{ip}:7800")).unwrap(),
                UdpSocket::bind(format!("{ip}:7801")).unwrap(),
            ];
            for s in &rx {
                s.set_nonblocking(true).unwrap();
            }
            let tx = UdpSocket::bind("10.201.226.1:0").unwrap();
            let mut buf = [0u8; 64];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut idle = true;
                for (k, s) in rx.iter().enumerate() {
                    while s.recv(&mut buf).is_ok() {
                        idle = false;
                        for _ in 0..(2 - k) {
                            if tx.send_to(b"q", "10.201.226.2:9000").is_ok() {
                                relayed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                    }
                }
                if idle {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
    };
    // 800 packets/s offered to each rule: 2400 downstream packets/s at full
    // admission, twice the threshold (high rates keep the per-packet
    // admission's sampling noise to ~2% per period).
    let streams = UdpStreams::start(
        &lab,
        &[7800, 7801],
        Duration::from_micros(1250),
        Duration::from_secs(if in_vm() { 120 } else { 40 }),
    );
    let top = || -> Value {
        let out = flowctl(&["top", &lab.veth_srv, "--once", "--json", "--interval", "0.2"]);
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["attachments"][0].clone()
    };
    let ratio = |a: &Value, rule: &str| {
        a["rules"].as_array().unwrap().iter().find(|r| r["rule"] == rule).unwrap()
            ["admission_ratio"]
            .as_f64()
            .unwrap()
    };
    let first = top();
    println!("start: level {}", first["klimiter"]["baselines"][0]["level"]);
    // Settle: both cut 0.05 a period until "high" sits at 0.8 (4 periods),
    // then "low" on to about 0.34 (another 9): 13 periods of 1 s, and margin.
    std::thread::sleep(Duration::from_secs(17));
    // Each published level is one control period's mean of 200 ms rates of
    // ~1200 packets/s: the mean of twelve periods is the held level.
    let mut levels = Vec::new();
    let mut last = Value::Null;
    for _ in 0..12 {
        last = top();
        levels.push(last["klimiter"]["baselines"][0]["level"].as_f64().unwrap_or(0.0));
        std::thread::sleep(Duration::from_millis(1000));
    }
    println!("relayed {} packets", relayed.load(std::sync::atomic::Ordering::Relaxed));
    println!(
        "held: levels {levels:?}; low {} high {}; {}",
        ratio(&last, "low"),
        ratio(&last, "high"),
        last["klimiter"]
    );
    streams.stop();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    relay.join().unwrap();
    agent.stop();
    let mean = levels.iter().sum::<f64>() / levels.len() as f64;
    // Under TCG (the kernel matrix's VMs) the relay and the senders run at
    // whatever speed emulation leaves them: rates are not the point there,
    // the egress counter's attachment and the cut order are. On the host the
    // level is held within 5%.
    let tolerance = if in_vm() { 0.5 } else { 0.05 };
    assert!(
        (mean - 1200.0).abs() <= tolerance * 1200.0,
        "the level is held within {:.0}% of 1200: mean {mean:.0} of {levels:?}",
        tolerance * 100.0
    );
    assert!(
        ratio(&last, "high") >= 0.8 - 1e-6,
        "the high-priority entry stays at or above its floor"
    );
    assert!(ratio(&last, "low") < ratio(&last, "high"), "the low-priority entry was cut first");
}

// ---------------------------------------------------------------------------
// Circuit breakers: the real binary attached to a cgroup v2 directory, real
// sockets from client processes placed in it, a downstream in the lab's
// server namespace switched between healthy, refusing and black-holed.

/// A client process: joins cgroup `argv[1]` (unless "-"), then connects to
/// `argv[2]:argv[3]` from `argv[6]` threads, each connect with a timeout of
/// `argv[5]` s, one every `argv[4]` ms per thread, for `argv[7]` s. Prints
/// every attempt as [monotonic start s, errno or 0, microseconds].
const BREAKER_CLIENT: &str = r#"
import json, os, socket, sys, threading, time
cg, ip, port, gap, tmo, nthreads, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) / 1000, float(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
if cg != "-":
    open(cg + "/cgroup.procs", "w").write(str(os.getpid()))
out, lock = [], threading.Lock()
end = time.monotonic() + secs
def run():
    while time.monotonic() < end:
        s = socket.socket(); s.settimeout(tmo)
        t = time.monotonic()
        try:
            s.connect((ip, port)); r = 0
        except socket.timeout:
            r = 110
        except OSError as e:
            r = e.errno
        us = (time.monotonic() - t) * 1e6
        s.close()
        with lock:
            out.append([t, r, us])
        time.sleep(gap)
ts = [threading.Thread(target=run) for _ in range(nthreads)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps(out))
"#;

/// ECONNABORTED: what the test's breakers refuse with, so a local refusal
/// is told apart from the downstream's own RST (ECONNREFUSED).
const LOCAL: i64 = 103;
const REFUSED: i64 = 111;

struct Attempt {
    t: f64,
    errno: i64,
    us: f64,
}

fn client(
    lab: &Lab,
    cgroup: &str,
    port: u16,
    gap_ms: u64,
    timeout_s: f64,
    threads: u32,
    secs: f64,
) -> Vec<Attempt> {
    // nsenter, not `ip netns exec`: the latter remounts /sys, hiding the
    // cgroup hierarchy the client must join.
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", lab.ns_cli))
        .args(["python3", "-c", BREAKER_CLIENT, cgroup, &lab.ip_srv])
        .args([
            port.to_string(),
            gap_ms.to_string(),
            timeout_s.to_string(),
            threads.to_string(),
            secs.to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "client: {}", String::from_utf8_lossy(&out.stderr));
    let v: Vec<(f64, i64, f64)> = serde_json::from_slice(&out.stdout).unwrap();
    let mut v: Vec<Attempt> =
        v.into_iter().map(|(t, errno, us)| Attempt { t, errno, us }).collect();
    v.sort_by(|a, b| a.t.total_cmp(&b.t));
    v
}

fn count(a: &[Attempt], errno: i64) -> usize {
    a.iter().filter(|x| x.errno == errno).count()
}

/// nftables in the server namespace: counts the SYNs that reach the
/// downstream's veth per port (before anything else sees them) and drops
/// them while black-holed.
struct Downstream {
    ns: String,
}

impl Downstream {
    fn new(lab: &Lab, ports: &[u16]) -> Self {
        let mut rules = String::from("table inet flowctl_test {\n chain bh {\n }\n chain pre {\n  type filter hook prerouting priority -300;\n");
        for p in ports {
            rules += &format!("  tcp dport {p} tcp flags & (syn | ack) == syn counter\n");
        }
        rules += "  jump bh\n }\n}\n";
        let f = profile_file(&rules);
        flowctl_tests::lab::sh(&["ip", "netns", "exec", &lab.ns_srv, "nft", "-f", f.path()]);
        Self { ns: lab.ns_srv.clone() }
    }

    /// SYNs seen so far for `port`.
    fn syns(&self, port: u16) -> u64 {
        let text = flowctl_tests::lab::sh(&[
            "ip",
            "netns",
            "exec",
            &self.ns,
            "nft",
            "list",
            "chain",
            "inet",
            "flowctl_test",
            "pre",
        ]);
        let line =
            text.lines().find(|l| l.contains(&format!("dport {port} "))).expect("counter rule");
        let n = line.split("packets ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap();
        n.parse().unwrap()
    }

    fn black_hole(&self, port: u16, on: bool) {
        if on {
            flowctl_tests::lab::sh(&[
                "ip",
                "netns",
                "exec",
                &self.ns,
                "nft",
                "add",
                "rule",
                "inet",
                "flowctl_test",
                "bh",
                "tcp",
                "dport",
                &port.to_string(),
                "drop",
            ]);
        } else {
            flowctl_tests::lab::sh(&[
                "ip",
                "netns",
                "exec",
                &self.ns,
                "nft",
                "flush",
                "chain",
                "inet",
                "flowctl_test",
                "bh",
            ]);
        }
    }
}

/// A cgroup v2 directory with a child `app`, removed on drop (after its
/// processes, all short-lived clients, have exited).
struct TestCgroup {
    parent: PathBuf,
}

impl TestCgroup {
    fn new() -> Self {
        let mount = flowctl::system::cgroup::cgroup2_mount()
            .expect("a cgroup v2 hierarchy (the test declares Need::CgroupV2)");
        let parent = mount.join(flowctl_tests::unique("flowctl-e2e-"));
        std::fs::create_dir(&parent).unwrap();
        std::fs::create_dir(parent.join("app")).unwrap();
        Self { parent }
    }
    fn app(&self) -> String {
        self.parent.join("app").display().to_string()
    }
    fn parent(&self) -> String {
        self.parent.display().to_string()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(self.parent.join("app"));
        let _ = std::fs::remove_dir(&self.parent);
    }
}

impl Agent {
    /// `flowctl attach --cgroup PATH --profile P`, ready once `status`
    /// shows its breakers.
    fn start_breakers(cgroup: &str, profile: &str) -> Self {
        Self::spawn_until(&["attach", "--cgroup", cgroup, "--profile", profile], || {
            breakers_of(cgroup).is_some()
        })
    }
}

/// The published breakers of a cgroup attachment, from `status --json`.
fn breakers_of(cgroup: &str) -> Option<Value> {
    let out = flowctl(&["status", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v.as_array()?.iter().find(|a| a["cgroup"] == cgroup).cloned()
}

fn breaker(cgroup: &str, name: &str) -> Value {
    breakers_of(cgroup).expect("breakers published")["breakers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == name)
        .cloned()
        .expect("breaker")
}

/// SRE mode through the CLI: healthy -> no refusals; the downstream refuses
/// -> fail-fast refusals at the predicted share within one window, with the
/// configured errno and no SYN sent for them; healed -> no refusals within
/// the documented bound; black-holed -> refusals at the cap again, what went
/// out timing out; exempt targets and processes outside the breaker's
/// cgroup untouched; dry-run (applied live, state kept) counts without
/// refusing; a stopped agent's breakers fail open after the grace period.
fn breaker_sre_fails_fast_at_the_predicted_share_and_recovers() {
    let cg = TestCgroup::new();
    let lab = Lab::new("fbrk", 233);
    let down = Downstream::new(&lab, &[7100, 7101]);
    flowctl_tests::lab::sh(&[
        "ip",
        "netns",
        "exec",
        &lab.ns_cli,
        "sysctl",
        "-qw",
        "net.ipv4.tcp_syn_retries=1",
    ]);
    let profile = |dry: bool| {
        format!(
            "[settings]\ngrace_period = \"1s\"\n\n[[breaker]]\nname = \"db\"\ntarget = \"{}\"\nport = 7100\ncgroup = \"{}\"\nmin_requests = 20\nerrno = \"ECONNABORTED\"\nexempt = [\"{}:7101\"]\ndry_run = {dry}\n",
            lab.ip_srv,
            cg.app(),
            lab.ip_srv
        )
    };
    let p = profile_file(&profile(false));
    let agent = Agent::start_breakers(&cg.parent(), p.path());

    // Healthy: every connect succeeds, nothing is refused.
    let server = TcpServer::start(&lab, 7100);
    let healthy = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 0.5);
    assert!(
        healthy.len() >= 30 && healthy.iter().all(|a| a.errno == 0),
        "healthy: {} attempts",
        healthy.len()
    );
    assert_eq!(breaker(&cg.parent(), "db")["state"], "closed");
    drop(server);

    // Refusing: the downstream answers every SYN with an RST.
    let syn0 = down.syns(7100);
    let t0 = flowctl::system::clock::monotonic_ns() as f64 / 1e9;
    let refusing = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 5.0);
    let (local, real) = (count(&refusing, LOCAL), count(&refusing, REFUSED));
    assert_eq!(
        local + real,
        refusing.len(),
        "every connect fails, locally or by the downstream's RST"
    );
    assert_eq!(down.syns(7100) - syn0, real as u64, "a locally refused connect sends nothing");
    let first_local =
        refusing.iter().find(|a| a.errno == LOCAL).expect("the breaker refuses").t - t0;
    assert!(first_local < 3.0, "refusing within one window: first after {first_local:.2} s");
    // Once the healthy phase's accepts have left the window (3 s and a
    // bucket) and it holds >= 20 failed requests, p = min(cap, R/(R+1)) = 0.9.
    let late: Vec<&Attempt> = refusing.iter().filter(|a| a.t - t0 > 3.4).collect();
    let share = late.iter().filter(|a| a.errno == LOCAL).count() as f64 / late.len() as f64;
    assert!(
        (0.82..=0.97).contains(&share),
        "refused share {share:.3} of {} (predicted 0.90)",
        late.len()
    );
    let slowest = refusing.iter().filter(|a| a.errno == LOCAL).map(|a| a.us).fold(0.0, f64::max);
    println!("refusing: {local} local, {real} real; share {share:.3}; slowest local refusal {slowest:.0} us");
    let b = breaker(&cg.parent(), "db");
    assert_eq!(b["state"], "throttling");
    assert!(b["drop_probability"].as_f64().unwrap() > 0.85, "{b}");

    // While it throttles: the exempt port, and processes outside the
    // breaker's cgroup (the attach point's other processes, and the host's),
    // go out untouched.
    let exempt = client(&lab, &cg.app(), 7101, 5, 1.0, 1, 0.5);
    assert_eq!(count(&exempt, LOCAL), 0, "exempt target");
    let outside = client(&lab, &cg.parent(), 7100, 5, 1.0, 1, 0.5);
    assert_eq!(count(&outside, LOCAL), 0, "a process in the attach cgroup but not the breaker's");
    let host = client(&lab, "-", 7100, 5, 1.0, 1, 0.5);
    assert_eq!(count(&host, LOCAL), 0, "a process outside the attach cgroup");

    // Re-armed (the checks above let the window age), then healed: the
    // refusals stop within one window (3 s) plus a bucket and a tick of the
    // agent, since local refusals are not requests.
    let rearm = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 2.0);
    assert!(count(&rearm, LOCAL) > 0);
    let server = TcpServer::start(&lab, 7100);
    let p_at_heal = breaker(&cg.parent(), "db")["drop_probability"].as_f64().unwrap();
    assert!(p_at_heal > 0.5, "throttling when the downstream heals: p = {p_at_heal}");
    let healed_at = flowctl::system::clock::monotonic_ns() as f64 / 1e9;
    let healing = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 4.5);
    let last_local =
        healing.iter().filter(|a| a.errno == LOCAL).map(|a| a.t - healed_at).fold(0.0, f64::max);
    println!(
        "recovered {last_local:.2} s after the downstream healed ({} local refusals after healing)",
        count(&healing, LOCAL)
    );
    assert!(
        last_local <= 3.5,
        "recovery bound 3.4 s: last refusal {last_local:.2} s after healing"
    );
    assert!(healing.iter().rev().take(50).all(|a| a.errno == 0));

    // Black-holed (SYNs dropped at the downstream): no accepts, so once the
    // healthy accepts have left the window (3.4 s) the breaker refuses at
    // the cap again; what goes out times out at the first retransmission.
    down.black_hole(7100, true);
    let syn0 = down.syns(7100);
    let t0 = flowctl::system::clock::monotonic_ns() as f64 / 1e9;
    // 24 callers blocked 1.5 s each: about 48 requests per window, over the minimum of 20.
    let hole = client(&lab, &cg.app(), 7100, 5, 1.5, 24, 6.0);
    down.black_hole(7100, false);
    let timeouts = count(&hole, 110);
    assert_eq!(
        count(&hole, LOCAL) + timeouts + count(&hole, 0),
        hole.len(),
        "only timeouts, local refusals, and successes before the hole"
    );
    let late: Vec<&Attempt> = hole.iter().filter(|a| a.t - t0 > 4.0).collect();
    let share = late.iter().filter(|a| a.errno == LOCAL).count() as f64 / late.len().max(1) as f64;
    println!(
        "black-holed: {timeouts} timeouts, {} local refusals; share after 4 s {share:.3} of {}",
        count(&hole, LOCAL),
        late.len()
    );
    assert!(
        share > 0.75,
        "refusing at about the cap (0.9) once the window holds only the outage: {share:.3}"
    );
    let syns = down.syns(7100) - syn0;
    assert!(syns <= 2 * timeouts as u64 + count(&hole, 0) as u64, "{syns} SYNs for {timeouts} timed-out connects (each one SYN and one retransmission): refused ones sent nothing");
    assert!(breaker(&cg.parent(), "db")["totals"]["timeouts"].as_u64().unwrap() > 0);
    drop(server);

    // Dry-run, applied live: the breaker keeps its state and throttles on
    // paper only.
    let p2 = profile_file(&profile(true));
    let out = flowctl(&["apply", "--cgroup", &cg.parent(), p2.path()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let syn0 = down.syns(7100);
    let dry = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 2.0);
    assert_eq!(count(&dry, LOCAL), 0, "dry-run refuses nothing");
    let syns = down.syns(7100) - syn0;
    // Each connect's SYN, and at most one retransmission of it
    // (tcp_syn_retries = 1 in the client namespace) when the machine is slow
    // to answer within the initial 1 s RTO.
    let n = dry.len() as u64;
    assert!(syns >= n && syns <= 2 * n, "every connect went out: {syns} SYNs for {n} connects");
    let b = breaker(&cg.parent(), "db");
    assert!(b["totals"]["would_refuse"].as_u64().unwrap() > 0 && b["dry_run"] == true, "{b}");

    // A hung agent: its deadline lapses and the hooks fail open.
    let p3 = profile_file(&profile(false));
    assert!(flowctl(&["apply", "--cgroup", &cg.parent(), p3.path()]).status.success());
    let _ = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 1.0);
    assert_eq!(breaker(&cg.parent(), "db")["state"], "throttling");
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(1300));
    let hung = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 0.5);
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGCONT) };
    assert_eq!(
        count(&hung, LOCAL),
        0,
        "fail open once the agent's deadline (grace 1 s) has passed"
    );
    agent.stop();
    assert!(breakers_of(&cg.parent()).is_none(), "gone from status once the agent stops");
}

/// State mode through the CLI: a black-holed downstream (SYNs dropped; the
/// client namespace gives up after one retransmission) opens the breaker on
/// handshake timeouts; open refuses everything at once; after the sleep,
/// half-open probes go out, fail and reopen it; healed, the probes succeed
/// and close it.
fn breaker_state_opens_on_timeouts_probes_and_closes() {
    let cg = TestCgroup::new();
    let lab = Lab::new("fbst", 234);
    let down = Downstream::new(&lab, &[7200]);
    flowctl_tests::lab::sh(&[
        "ip",
        "netns",
        "exec",
        &lab.ns_cli,
        "sysctl",
        "-qw",
        "net.ipv4.tcp_syn_retries=1",
    ]);
    let p = profile_file(&format!(
        "[[breaker]]\nname = \"api\"\ntarget = \"{}/32\"\nport = \"7200-7200\"\nmode = \"state\"\nwindow = \"2s\"\nmin_requests = 10\nfailure_ratio = 0.5\nsleep = \"1s\"\nprobes = 2\nerrno = \"ECONNABORTED\"\n",
        lab.ip_srv
    ));
    let agent = Agent::start_breakers(&cg.app(), p.path());
    let _server = TcpServer::start(&lab, 7200);
    down.black_hole(7200, true);

    // Black-holed: 12 callers hang until their first SYN retransmission
    // times out (1 s), which counts as a failure and opens the breaker.
    let t0 = flowctl::system::clock::monotonic_ns() as f64 / 1e9;
    let cgp = cg.app();
    let watcher = std::thread::spawn(move || {
        let mut seen: Vec<String> = Vec::new();
        let end = Instant::now() + Duration::from_secs(if in_vm() { 30 } else { 5 });
        while Instant::now() < end {
            let s = breaker(&cgp, "api")["state"].as_str().unwrap().to_string();
            if seen.last() != Some(&s) {
                seen.push(s);
            }
            std::thread::sleep(Duration::from_millis(30));
        }
        seen
    });
    let hole = client(&lab, &cg.app(), 7200, 20, 1.5, 12, if in_vm() { 20.0 } else { 4.0 });
    let seen = watcher.join().unwrap();
    println!("states seen while black-holed: {seen:?}");
    assert!(
        seen.windows(3).any(|w| w == ["open", "half-open", "open"]),
        "open -> half-open (probes) -> open on a failed probe: {seen:?}"
    );
    let first_local = hole.iter().find(|a| a.errno == LOCAL).expect("opened").t - t0;
    assert!(
        first_local < if in_vm() { 8.0 } else { 2.0 },
        "open within the first timeouts: {first_local:.2} s"
    );
    let timeouts = count(&hole, 110);
    let local = count(&hole, LOCAL);
    assert!(timeouts >= 10 && local > timeouts, "{timeouts} timeouts, {local} local refusals");
    // "At once" against a black hole's 1 s SYN timeout: the 95th percentile
    // of the Python client's own timings, which carry its scheduling (a
    // single 7.5 ms outlier was seen on a busy host).
    let mut refusals: Vec<f64> = hole.iter().filter(|a| a.errno == LOCAL).map(|a| a.us).collect();
    refusals.sort_by(f64::total_cmp);
    let p95 = refusals[(refusals.len() * 95 / 100).min(refusals.len() - 1)];
    let slowest = refusals.last().copied().unwrap_or(0.0);
    assert!(
        p95 < if in_vm() { 1_000_000.0 } else { 20_000.0 },
        "open fails at once: p95 {p95:.0} us (slowest {slowest:.0} us)"
    );
    let b = breaker(&cg.app(), "api");
    assert!(
        b["totals"]["timeouts"].as_u64().unwrap() >= 10
            && b["totals"]["probes"].as_u64().unwrap() >= 2,
        "{b}"
    );

    // Healed: two probes succeed and close it. Bound: a probe still out
    // (it fails at its first retransmission timeout, 1 s, and reopens it),
    // the 1 s sleep, and a tick.
    let syn0 = down.syns(7200);
    down.black_hole(7200, false);
    let healed = flowctl::system::clock::monotonic_ns() as f64 / 1e9;
    let after = client(&lab, &cg.app(), 7200, 20, 1.5, 1, if in_vm() { 8.0 } else { 3.5 });
    let first_ok = after.iter().find(|a| a.errno == 0).expect("closes").t - healed;
    let b = breaker(&cg.app(), "api");
    assert_eq!(b["state"], "closed", "{b}");
    assert_eq!(b["last_transition"]["reason"], "2 probes succeeded", "{b}");
    println!("first success {first_ok:.2} s after healing");
    assert!(
        first_ok <= if in_vm() { 6.0 } else { 2.3 },
        "closed within a pending probe's timeout, the sleep and a tick: {first_ok:.2} s"
    );
    assert_eq!(
        down.syns(7200) - syn0,
        count(&after, 0) as u64,
        "only admitted connects reached the downstream"
    );
    agent.stop();
}

/// The tests and what each needs (flowctl_tests::need): root for the
/// namespaces and the agent; the breakers' tests a cgroup v2 hierarchy,
/// `bpf_set_retval` (5.18), python3 clients and nftables counters.
fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        udp_limit_holds_within_bounds_then_detaches: [Root],
        keep_survives_sigkill_and_restart_adopts_state: [Root],
        apply_through_the_agent_is_all_or_nothing: [Root],
        error_paths_say_how_to_fix: [Root],
        tcp_connection_rate_within_bounds: [Root],
        tcp_connection_quota: [Root],
        foreign_xdp_program_is_not_replaced: [Root],
        one_agent_per_attachment_and_layout_versions_are_checked: [Root],
        metrics_endpoint_matches_status: [Root],
        top_once_json_agrees_with_traffic: [Root],
        top_keys_finds_the_heaviest_sources: [Root],
        top_runs_in_a_terminal_and_restores_it: [Root, Command("tmux")],
        bbr_refuses_connections_beyond_the_limit_and_fails_open: [Root],
        klimiter_cuts_low_priority_first_and_holds_on_garbage: [Root],
        klimiter_holds_an_egress_level_by_cutting_low_priority_first: [Root],
        breaker_sre_fails_fast_at_the_predicted_share_and_recovers: [Root, CgroupV2, Kernel(5, 18), Command("python3"), Command("nft")],
        breaker_state_opens_on_timeouts_probes_and_closes: [Root, CgroupV2, Kernel(5, 18), Command("python3"), Command("nft")],
    ]);
}
