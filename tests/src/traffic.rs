//! Traffic through a lab, from its client namespace to its protected side:
//! paced UDP (a bounded blast, or streams until stopped), TCP connects
//! (counted, or one by one with their outcomes), a TCP server that counts
//! what it accepts, and a GET of an agent's metrics. Each records its own timestamps, so
//! the tests' bounds come from when packets really went out.

use crate::lab::Lab;
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

/// Sends UDP from the client namespace's address at about `pps` for `secs`
/// (at most `max` packets); returns (sent, first send, last send).
pub fn blast(lab: &Lab, dport: u16, pps: u64, secs: f64, max: u64) -> (u64, Instant, Instant) {
    blast_from(lab, &lab.ip_cli, dport, pps, secs, max)
}

/// `blast` from `src`, any address of the client namespace.
pub fn blast_from(
    lab: &Lab,
    src: &str,
    dport: u16,
    pps: u64,
    secs: f64,
    max: u64,
) -> (u64, Instant, Instant) {
    blast_between(lab, src, &lab.ip_srv, dport, pps, secs, max)
}

/// `blast` from `src` to `dst`, any addresses of the client and the
/// protected namespace.
pub fn blast_between(
    lab: &Lab,
    src: &str,
    dst: &str,
    dport: u16,
    pps: u64,
    secs: f64,
    max: u64,
) -> (u64, Instant, Instant) {
    let (first, last, sent) = blast_timed(lab, src, dst, dport, pps, secs, max);
    (sent.len() as u64, first, last)
}

/// `blast_between`, with when each packet the socket took was sent: a
/// sender stalled (a TCG guest's threads stop for hundreds of ms) sends
/// in bursts after, and a bucket admits less of bursts than of a steady
/// stream; `admitted_by_bucket` gives what it admits of these times.
pub fn blast_timed(
    lab: &Lab,
    src: &str,
    dst: &str,
    dport: u16,
    pps: u64,
    secs: f64,
    max: u64,
) -> (Instant, Instant, Vec<Instant>) {
    let (src, dst) = (src.to_string(), format!("{dst}:{dport}"));
    Lab::in_ns(&lab.ns_cli, move || {
        let s = UdpSocket::bind(format!("{src}:0")).unwrap();
        let gap = Duration::from_secs_f64(1.0 / pps as f64);
        let first = Instant::now();
        let mut last = first;
        let mut sent = Vec::new();
        let mut attempts = 0u64;
        while attempts < max && first.elapsed().as_secs_f64() < secs {
            // Only what the socket took counts as sent; the pacing goes
            // by attempts.
            attempts += 1;
            if s.send_to(b"flowctl-e2e", &dst).is_ok() {
                sent.push(Instant::now());
            }
            last = Instant::now();
            let next = first + gap * attempts as u32;
            if let Some(d) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
        }
        (first, last, sent)
    })
}

/// How many packets sent at `times` a token bucket of `interval_fp` and
/// `burst_ns` (a rule's, as the profile compiles it) admits, by the
/// kernel's own GCRA (`flowctl_common::gcra`) on the send times: the
/// kernel sees each packet a little later, never in another order.
pub fn admitted_by_bucket(times: &[Instant], interval_fp: u64, burst_ns: u64) -> u64 {
    let Some(&first) = times.first() else { return 0 };
    let increment = flowctl_common::gcra::increment_ns(interval_fp, 1);
    let mut tat = 0u64;
    let mut admitted = 0;
    for t in times {
        // From 1 s on, so a TAT of 0 (a new bucket) is a full one.
        let now = 1_000_000_000 + t.duration_since(first).as_nanos() as u64;
        if let Some(next) = flowctl_common::gcra::admit(tat, now, increment, burst_ns) {
            tat = next;
            admitted += 1;
        }
    }
    admitted
}

/// Paced UDP streams from the client namespace to each of `ports`, one
/// packet per `gap`, until stopped or dropped (or `limit` passes).
pub struct UdpStreams {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl UdpStreams {
    pub fn start(lab: &Lab, ports: &[u16], gap: Duration, limit: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
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
                    while !stop.load(Ordering::Relaxed) && t.elapsed() < limit {
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

    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

impl Drop for UdpStreams {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A real TCP server in the protected namespace, counting accepted
/// connections until stopped (or dropped). It closes what it accepts at
/// once, or keeps it open while `hold` is on.
pub struct TcpServer {
    stop: Arc<AtomicBool>,
    hold: Arc<AtomicBool>,
    accepted: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl TcpServer {
    pub fn start(lab: &Lab, port: u16) -> Self {
        Self::start_at(lab, &lab.ip_srv, port)
    }

    /// Counts what arrives at `ip` (an address of the protected side).
    pub fn start_at(lab: &Lab, ip: &str, port: u16) -> Self {
        let addr = format!("{ip}:{port}");
        let listener = Lab::in_ns(&lab.ns_srv, move || TcpListener::bind(addr).unwrap());
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let hold = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU64::new(0));
        let (s, h, a) = (stop.clone(), hold.clone(), accepted.clone());
        let thread = std::thread::spawn(move || {
            let mut kept = Vec::new();
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((c, _)) => {
                        a.fetch_add(1, Ordering::Relaxed);
                        if h.load(Ordering::Relaxed) {
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
    pub fn hold(&self, on: bool) {
        self.hold.store(on, Ordering::Relaxed);
    }

    /// Stops the server; returns how many connections it accepted.
    pub fn stop(mut self) -> u64 {
        self.halt();
        self.accepted.load(Ordering::Relaxed)
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
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
pub fn connect_many(lab: &Lab, port: u16, max: u64, budget: Duration) -> (u64, u64, f64) {
    let target: SocketAddr = format!("{}:{port}", lab.ip_srv).parse().unwrap();
    Lab::in_ns(&lab.ns_cli, move || {
        let start = Instant::now();
        let (mut ok, mut n) = (0u64, 0u64);
        let mut last_ok = start;
        while start.elapsed() < budget && n < max {
            n += 1;
            if TcpStream::connect_timeout(&target, Duration::from_millis(200)).is_ok() {
                ok += 1;
                last_ok = Instant::now();
            }
        }
        (ok, n, last_ok.duration_since(start).as_secs_f64())
    })
}

/// What `connect_each` saw.
#[derive(Debug, Default)]
pub struct Attempts {
    pub open: Vec<TcpStream>,
    pub refused: u64,
    pub timed_out: u64,
    /// The slowest refusal, ms.
    pub slowest_refusal_ms: f64,
}

/// `n` connects from the client namespace, `gap` apart; established ones
/// are kept open when `keep`, else closed at once.
pub fn connect_each(lab: &Lab, port: u16, n: u32, gap: Duration, keep: bool) -> Attempts {
    let target: SocketAddr = format!("{}:{port}", lab.ip_srv).parse().unwrap();
    Lab::in_ns(&lab.ns_cli, move || {
        let mut a = Attempts::default();
        for _ in 0..n {
            let t = Instant::now();
            match TcpStream::connect_timeout(&target, Duration::from_millis(300)) {
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

/// GET `path` from an agent's metrics endpoint at `addr` over plain
/// HTTP/1.0, from this process's network namespace (the agent serves its
/// metrics where it was started, not in the interface's namespace), with
/// an `Accept` header when given: the raw response.
pub fn metrics_get(addr: &str, path: &str, accept: Option<&str>) -> String {
    try_metrics_get(addr, path, accept)
        .unwrap_or_else(|e| panic!("GET {path} from the metrics endpoint {addr}: {e}"))
}

/// [`metrics_get`], failing softly (for polls and benchmarks).
pub fn try_metrics_get(addr: &str, path: &str, accept: Option<&str>) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{accept}\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// Counts the UDP datagrams that reach `port` on the lab's protected side,
/// until dropped.
pub struct UdpCounter {
    n: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl UdpCounter {
    pub fn start(lab: &Lab, port: u16) -> Self {
        Self::start_at(lab, &lab.ip_srv, port)
    }

    /// Counts what arrives at `ip` (an address of the protected side).
    pub fn start_at(lab: &Lab, ip: &str, port: u16) -> Self {
        let addr = format!("{ip}:{port}");
        let sock = Lab::in_ns(&lab.ns_srv, move || UdpSocket::bind(addr).unwrap());
        sock.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let (n, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (n2, stop2) = (n.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !stop2.load(Ordering::Relaxed) {
                if sock.recv(&mut buf).is_ok() {
                    n2.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Self { n, stop, thread: Some(thread) }
    }

    /// Received so far.
    pub fn count(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }

    /// Received so far, once what is in flight has arrived: the count
    /// unchanged over 300 ms (at most 5 s: a guest under TCG lags).
    pub fn settled(&self) -> u64 {
        let mut last = self.count();
        for _ in 0..16 {
            std::thread::sleep(Duration::from_millis(300));
            let now = self.count();
            if now == last {
                break;
            }
            last = now;
        }
        last
    }
}

impl Drop for UdpCounter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
