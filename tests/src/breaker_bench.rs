//! `cargo xtask bench breaker`: what the circuit breakers cost and how fast
//! they let go. The bench process moves itself between cgroup v2
//! directories (a socket belongs to the cgroup of the process that creates
//! it) and connects over loopback, with real agents (the release binary)
//! attached to those cgroups:
//!
//! - connect() cost: no hook; the hooks with a breaker that does not match;
//!   the hooks with a matching, closed breaker (the socket is marked by
//!   cookie and its outcome counted). Interleaved rounds, medians.
//! - Recovery: a dependency refusing (nothing listens) for 5 s, then healed;
//!   a caller connecting every 5 ms. The time from healing to the last
//!   local refusal, for `sre` with the default cap (0.9) and without one
//!   (1.0), against the bound in docs/design.md (window + bucket + tick).

use crate::cgroup::Cgroup;
use std::{
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// ECONNABORTED: the benchmark's breakers refuse with it, so a local
/// refusal is told apart from the loopback RST (ECONNREFUSED).
const LOCAL_ERRNO: i32 = 103;

struct Agent {
    child: Child,
    _profile: PathBuf,
}

impl Agent {
    fn start(bin: &Path, cgroup: &Cgroup, profile: &str) -> Self {
        let path = std::env::temp_dir().join(format!("{}.toml", crate::unique("flowctl-bbench-")));
        std::fs::write(&path, profile).unwrap();
        let child = Command::new(bin)
            .args(["attach", "--cgroup"])
            .arg(cgroup.path())
            .arg("--profile")
            .arg(&path)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the agent");
        let dir_id =
            std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(cgroup.path()).unwrap());
        let published = Path::new(flowctl_common::RUN_ROOT)
            .join(format!("cgroup-{dir_id}"))
            .join("breakers.json");
        let deadline = Instant::now() + Duration::from_secs(15);
        while !published.exists() {
            assert!(Instant::now() < deadline, "the breaker agent did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, _profile: path }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self._profile);
    }
}

/// A loopback listener that accepts and closes, on its own thread.
fn listener() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    l.set_nonblocking(true).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        while !s.load(std::sync::atomic::Ordering::Relaxed) {
            match l.accept() {
                Ok(_) => {}
                Err(_) => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    });
    (addr, stop)
}

/// Median connect() time over `n` connects, in microseconds.
fn connect_median_us(addr: SocketAddr, n: usize) -> f64 {
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let s = Instant::now();
        let c = TcpStream::connect(addr).expect("connect");
        t.push(s.elapsed().as_secs_f64() * 1e6);
        drop(c);
    }
    t.sort_by(f64::total_cmp);
    t[n / 2]
}

fn breaker_profile(target: &str, port: u16, extra: &str) -> String {
    format!("[[breaker]]\nname = \"bench\"\ntarget = \"{target}\"\nport = {port}\nerrno = \"ECONNABORTED\"\n{extra}")
}

pub fn run(bin: &Path, quick: bool) {
    let mount = flowctl::system::cgroup::cgroup2_mount().expect("a cgroup v2 hierarchy");
    let home = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("0::"))
                .map(|l| mount.join(l.trim_start_matches("0::").trim_start_matches('/')))
        })
        .unwrap_or(mount.clone());
    let (addr, stop) = listener();

    println!("7a. connect() over loopback, median us (hooks attached by a real agent to the caller's cgroup)");
    let none = Cgroup::new("fbb-none-");
    let other = Cgroup::new("fbb-other-");
    let matching = Cgroup::new("fbb-match-");
    let _a1 = Agent::start(bin, &other, &breaker_profile("192.0.2.1", 9, ""));
    let _a2 = Agent::start(bin, &matching, &breaker_profile("127.0.0.1", addr.port(), ""));
    let rounds = if quick { 3 } else { 7 };
    let n = if quick { 1000 } else { 3000 };
    let mut med = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..rounds {
        for (i, cg) in [&none, &other, &matching].iter().enumerate() {
            cg.enter();
            med[i].push(connect_median_us(addr, n));
        }
    }
    std::fs::write(home.join("cgroup.procs"), std::process::id().to_string()).ok();
    let m: Vec<f64> = med
        .iter_mut()
        .map(|v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect();
    println!("{:>28} {:>10} {:>10}", "", "connect", "added");
    println!("{:>28} {:>10.1} {:>10}", "no hook", m[0], "-");
    println!("{:>28} {:>10.1} {:>+10.2}", "breaker, not matching", m[1], m[1] - m[0]);
    println!("{:>28} {:>10.1} {:>+10.2}", "breaker, matching, closed", m[2], m[2] - m[0]);
    println!("{:>28} {rounds} rounds x {n} connects, interleaved; median of round medians", "");
    drop((_a1, _a2));

    println!("\n7b. Recovery after the dependency heals (sre, window 3 s / 10 buckets, K = 2, min 100 requests; a caller connecting every 5 ms)");
    println!(
        "{:>16} {:>16} {:>16} {:>12}",
        "cap (max_drop)", "refused share", "last refusal", "bound"
    );
    for cap in [0.9, 1.0] {
        let cg = Cgroup::new("fbb-rec-");
        // A port nothing listens on yet: refused by loopback's RST.
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let _agent = Agent::start(
            bin,
            &cg,
            &breaker_profile("127.0.0.1", port, &format!("max_drop = {cap}\n")),
        );
        cg.enter();
        let target: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let outage = Instant::now();
        let (mut local, mut total) = (0u64, 0u64);
        while outage.elapsed() < Duration::from_secs(5) {
            if let Err(e) = TcpStream::connect(target) {
                total += 1;
                local += (e.raw_os_error() == Some(LOCAL_ERRNO)) as u64;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let healed_listener = TcpListener::bind(target).expect("rebind the dependency's port");
        healed_listener.set_nonblocking(true).unwrap();
        let healed = Instant::now();
        let mut last_local = None;
        while healed.elapsed() < Duration::from_secs(6) {
            match TcpStream::connect(target) {
                Err(e) if e.raw_os_error() == Some(LOCAL_ERRNO) => {
                    last_local = Some(healed.elapsed())
                }
                _ => {}
            }
            while healed_listener.accept().is_ok() {}
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::write(home.join("cgroup.procs"), std::process::id().to_string()).ok();
        println!(
            "{:>16} {:>16.3} {:>15.2}s {:>11.1}s",
            cap,
            local as f64 / total.max(1) as f64,
            last_local.map(|d| d.as_secs_f64()).unwrap_or(0.0),
            3.4
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
}
