//! Client processes for the circuit breakers' end-to-end tests: python3 in a
//! lab's client namespace, joined to a cgroup, connecting to the server side
//! from threads, each attempt recorded with its start (monotonic clock, as
//! the agent's), its errno and how long it took.

use crate::lab::Lab;
use std::process::Command;

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
pub const LOCAL: i64 = 103;
pub const REFUSED: i64 = 111;

/// One connect: when it started (monotonic s), its errno (0: established;
/// 110: timed out) and how long it took (us).
pub struct Attempt {
    pub t: f64,
    pub errno: i64,
    pub us: f64,
}

/// Runs a client process in `cgroup` ("-": the test's own) against the
/// lab's server address and `port`; its attempts, in start order.
pub fn client(
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

/// How many of `a` ended with `errno`.
pub fn count(a: &[Attempt], errno: i64) -> usize {
    a.iter().filter(|x| x.errno == errno).count()
}
