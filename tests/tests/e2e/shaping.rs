//! The egress shaper (`[[shaper]]`) with fq, end to end: real TCP and UDP
//! senders on the attached interface's side, their receivers across the
//! veth. Needs a kernel with fq (the kernel matrix's VMs; this project's
//! host kernel has none, so the test reports itself skipped there).

use flowctl_tests::{
    agent::Agent,
    cli::attachment,
    lab::{nstat, Lab},
    tempfile::TempFile,
};
use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream, UdpSocket},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// (seconds since the start, cumulative count) samples.
type Samples = Arc<Mutex<Vec<(f64, u64)>>>;

/// The rate of `s` between `from` and `to` seconds (counts per second).
fn rate_between(s: &[(f64, u64)], from: f64, to: f64) -> f64 {
    let at = |t: f64| s.iter().rev().find(|(x, _)| *x <= t).copied().unwrap_or((0.0, 0));
    let ((t0, n0), (t1, n1)) = (at(from), at(to));
    (n1 - n0) as f64 / (t1 - t0)
}

/// The `dropped` count of `tc -s qdisc show`'s root qdisc.
fn fq_dropped(stats: &str) -> Option<u64> {
    let after = stats.split("dropped ").nth(1)?;
    after.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

fn shaper_json(iface: &str, name: &str) -> serde_json::Value {
    let a = attachment(iface).expect("attached");
    a["shapers"].as_array().unwrap().iter().find(|s| s["shaper"] == name).cloned().expect("shaper")
}

/// A TCP sender and a UDP sender in the attached namespace, each faster
/// than its shaper (4 Mbit/s aggregate for TCP to port 7600; 500 packets/s
/// with a 200 ms horizon for UDP to 7601), through the fq the agent
/// installed on the interface:
/// - TCP: over a window after start-up the receiver's goodput is within 2%
///   of what the rate allows (the rate counts bytes at the link; the
///   payload's share comes from the shaper's own count), never above it,
///   and below it only where the sender could not keep the shaper busy
///   (TCG, with the guest's CPUs shared, can starve the sender: reported);
///   the sender's own write rate over the window matches the goodput (it
///   is paced by backpressure) and TCP retransmits nothing;
/// - UDP: the receiver gets 500/s within 2%; what the horizon cannot hold
///   is dropped and counted, and every datagram is either received or
///   counted as dropped;
/// - the agent restores the interface's root qdisc when it stops.
pub fn shaper_paces_tcp_and_udp_senders() {
    const WIRE: f64 = 500_000.0; // 4 Mbit/s in bytes
    const UDP_RATE: f64 = 500.0;
    let lab = Lab::new("fshape", 253);
    let prof = TempFile::profile(&format!(
        "[[shaper]]\nname = \"tcp\"\ndst = \"{cli}\"\nproto = \"tcp\"\ndport = 7600\nrate = \"4Mbit/s\"\n\
         [[shaper]]\nname = \"udp\"\ndst = \"{cli}\"\nproto = \"udp\"\ndport = 7601\nrate = \"500/s\"\nhorizon = \"200ms\"\n",
        cli = lab.ip_cli
    ));
    let root = |ns: &str, dev: &str| {
        flowctl_tests::lab::sh_ns(ns, &["tc", "-s", "qdisc", "show", "dev", dev, "root"])
    };
    let before = root(&lab.ns_srv, &lab.veth_srv);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let during = root(&lab.ns_srv, &lab.veth_srv);
    assert!(during.contains("qdisc fq"), "the agent installed fq: {during}");

    // TCP: a receiver across the veth, a sender here, 8 s.
    let received: Samples = Arc::default();
    let (rx, cli) = (received.clone(), lab.ip_cli.clone());
    let listener =
        Lab::in_ns(&lab.ns_cli, move || TcpListener::bind((cli.as_str(), 7600)).unwrap());
    let t0 = Instant::now();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    total += n as u64;
                    rx.lock().unwrap().push((t0.elapsed().as_secs_f64(), total));
                }
            }
        }
    });
    let retrans_before = nstat(&lab.ns_srv, "TcpRetransSegs");
    let written: Samples = Arc::default();
    let (wx, cli) = (written.clone(), lab.ip_cli.clone());
    Lab::in_ns(&lab.ns_srv, move || {
        let mut s = TcpStream::connect((cli.as_str(), 7600)).unwrap();
        // A fixed send buffer: autotuning would grow it over the run, and
        // the write rate would count the growth.
        let size: libc::c_int = 64 * 1024;
        use std::os::fd::AsRawFd;
        let rc = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                &size as *const libc::c_int as *const libc::c_void,
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "SO_SNDBUF");
        let chunk = vec![7u8; 16 * 1024];
        let mut total = 0u64;
        while t0.elapsed().as_secs_f64() < 8.0 {
            s.write_all(&chunk).unwrap();
            total += chunk.len() as u64;
            wx.lock().unwrap().push((t0.elapsed().as_secs_f64(), total));
        }
    });
    reader.join().unwrap();
    let retrans = nstat(&lab.ns_srv, "TcpRetransSegs") - retrans_before;
    let (from, to) = (3.0, 7.5);
    let goodput = rate_between(&received.lock().unwrap(), from, to);
    let app = rate_between(&written.lock().unwrap(), from, to);
    let tcp = shaper_json(&lab.veth_srv, "tcp");
    // The rate is in bytes at the link (each packet's length, headers
    // included): the goodput it allows is the rate times the payload's
    // share of what the shaper counted over the run.
    let payload = received.lock().unwrap().last().map_or(0, |s| s.1) as f64;
    let at_link = tcp["offered_bytes"].as_u64().unwrap() as f64;
    let allowed = WIRE * payload / at_link;
    // Saturated: the sender kept the shaper's queue from emptying (a
    // packet that finds it empty leaves at once, undelayed).
    let delayed =
        tcp["delayed_pkts"].as_u64().unwrap() as f64 / tcp["offered_pkts"].as_u64().unwrap() as f64;
    println!(
        "tcp: receiver {goodput:.0} B/s of the {allowed:.0} B/s of payload the rate allows ({:.2}%), sender wrote {app:.0} B/s; {:.1}% of packets held; {retrans} retransmitted",
        100.0 * goodput / allowed,
        100.0 * delayed
    );
    println!("tcp shaper: {tcp}");
    assert!(goodput <= 1.02 * allowed, "never above the rate: {goodput:.0} B/s");
    if delayed >= 0.95 {
        assert!(
            goodput >= 0.98 * allowed,
            "the shaped rate within 2%: {goodput:.0} of {allowed:.0} B/s"
        );
    } else {
        println!(
            "the sender did not keep the shaper busy ({:.0}% held): the lower bound is not checked",
            100.0 * delayed
        );
    }
    assert!(
        (app / goodput - 1.0).abs() <= 0.05,
        "the sender writes at the shaped rate: {app:.0} against {goodput:.0}"
    );
    // No loss: the shaper dropped nothing past its horizon and fq dropped
    // nothing. TCP's own retransmissions must be none too, except in a VM
    // under TCG, where a starved guest fires retransmission timers (and
    // tail-loss probes) with nothing lost: seen in CI on 6.12, 2 of about
    // 2,800 segments with fq and the shaper at 0 drops. Reported there.
    assert_eq!(tcp["horizon_drops"].as_u64(), Some(0), "{tcp}");
    let fq = root(&lab.ns_srv, &lab.veth_srv);
    assert_eq!(fq_dropped(&fq), Some(0), "fq dropped nothing: {fq}");
    if flowctl_tests::need::in_vm() {
        println!("tcp: {retrans} segments retransmitted with no drop by the shaper or fq (TCG)");
    } else {
        assert_eq!(retrans, 0, "no loss: TCP retransmitted {retrans} segments");
    }

    // UDP: 6 s of 200-byte datagrams as fast as the socket takes them.
    let got: Samples = Arc::default();
    let (gx, cli) = (got.clone(), lab.ip_cli.clone());
    let sock = Lab::in_ns(&lab.ns_cli, move || UdpSocket::bind((cli.as_str(), 7601)).unwrap());
    sock.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let t1 = Instant::now();
    let receiver = std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        let mut n = 0u64;
        while t1.elapsed().as_secs_f64() < 7.5 {
            if sock.recv(&mut buf).is_ok() {
                n += 1;
                gx.lock().unwrap().push((t1.elapsed().as_secs_f64(), n));
            }
        }
        n
    });
    // `top` while the UDP sender runs: the shaper's rates over 1 s.
    let veth = lab.veth_srv.clone();
    let top = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        flowctl_tests::cli::top_once(&veth, "1")
    });
    let cli = lab.ip_cli.clone();
    let sent = Lab::in_ns(&lab.ns_srv, move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        let payload = [1u8; 200];
        let mut sent = 0u64;
        while t1.elapsed().as_secs_f64() < 6.0 && sent < 2_000_000 {
            if s.send_to(&payload, (cli.as_str(), 7601)).is_ok() {
                sent += 1;
            }
        }
        sent
    });
    let received_udp = receiver.join().unwrap();
    let top = top.join().unwrap();
    let row = top["attachments"][0]["shapers"]
        .as_array()
        .and_then(|v| v.iter().find(|s| s["shaper"] == "udp").cloned())
        .unwrap_or_else(|| panic!("no udp shaper in top: {top}"));
    println!("top: {row}");
    let top_sent = row["sent_pps"].as_f64().unwrap();
    // Under TCG `top`'s own interval is loose: 10%.
    assert!((top_sent / UDP_RATE - 1.0).abs() <= 0.1, "top shows {top_sent:.0}/s sent");
    assert!(row["horizon_drop_pps"].as_f64().unwrap() > 0.0, "{row}");
    let udp_rate = rate_between(&got.lock().unwrap(), 1.5, 5.5);
    // Inter-arrival spacing at the receiver against 1/rate (2 ms):
    // indicative only under TCG, which keeps no real time for a guest.
    let mut gaps: Vec<f64> = {
        let g = got.lock().unwrap();
        g.windows(2)
            .filter(|w| w[0].0 >= 1.5 && w[1].0 <= 5.5)
            .map(|w| (w[1].0 - w[0].0) * 1e3)
            .collect()
    };
    gaps.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| gaps.get(((gaps.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(0.0);
    println!(
        "udp spacing: p50 {:.3} ms, p99 {:.3} ms against {:.3} ms (indicative under TCG)",
        pct(0.5),
        pct(0.99),
        1e3 / UDP_RATE
    );
    let udp = shaper_json(&lab.veth_srv, "udp");
    let drops = udp["horizon_drops"].as_u64().unwrap();
    println!("udp: sent {sent}, received {received_udp} ({udp_rate:.1}/s against {UDP_RATE}), {drops} dropped past the horizon");
    println!("udp shaper: {udp}");
    assert!((udp_rate / UDP_RATE - 1.0).abs() <= 0.02, "UDP at {udp_rate:.1}/s");
    assert!(drops > 0, "a sender faster than the horizon holds loses datagrams, counted");
    assert_eq!(received_udp + drops, sent, "each datagram received or counted as dropped");

    // A profile without shapers through the running agent: the shaper and
    // its fq go, the root qdisc the interface had comes back.
    let rules_only =
        TempFile::profile("[[rule]]\nname = \"r\"\nproto = \"udp\"\ndport = 9\nrate = \"1/s\"\n");
    let out = flowctl_tests::cli::flowctl(&[
        "apply",
        &lab.veth_srv,
        rules_only.path(),
        "--netns",
        &lab.ns_srv,
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dropped = root(&lab.ns_srv, &lab.veth_srv);
    assert!(!dropped.contains("qdisc fq"), "fq removed with the shapers: {dropped}");
    agent.stop();
    let after = root(&lab.ns_srv, &lab.veth_srv);
    assert!(!after.contains("qdisc fq"), "fq removed: {after}");
    assert_eq!(
        after.split_whitespace().nth(1),
        before.split_whitespace().nth(1),
        "the root qdisc restored: {before} -> {after}"
    );
}

/// Where the kernel has no fq: a profile with shapers is refused with how to
/// fix it, by attach (nothing is attached, nothing stays) and by apply to a
/// running agent (nothing is applied: the rules in force stay, and the
/// interface's qdisc is untouched).
pub fn shapers_are_refused_whole_without_fq() {
    let lab = Lab::new("fnofq", 254);
    let cli = lab.ip_cli.clone();
    let shaper = format!("[[shaper]]\nname = \"s\"\ndst = \"{cli}\"\nrate = \"1000/s\"\n");
    let with_shaper =
        TempFile::profile(&format!("[[rule]]\nname = \"new\"\nrate = \"1/s\"\n{shaper}"));
    let how = "this kernel has none (sch_fq, CONFIG_NET_SCH_FQ): load it with `modprobe sch_fq`";
    let out = flowctl_tests::cli::flowctl(&[
        "attach",
        &lab.veth_srv,
        "--profile",
        with_shaper.path(),
        "--netns",
        &lab.ns_srv,
    ]);
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains(how), "{text}");
    assert!(attachment(&lab.veth_srv).is_none(), "nothing attached");
    let rules = TempFile::profile("[[rule]]\nname = \"old\"\nrate = \"1/s\"\n");
    let agent = Agent::start(&lab, rules.path(), &[]);
    let out = flowctl_tests::cli::flowctl(&[
        "apply",
        &lab.veth_srv,
        with_shaper.path(),
        "--netns",
        &lab.ns_srv,
    ]);
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        !out.status.success() && text.contains(how) && text.contains("nothing was applied"),
        "{text}"
    );
    let a = attachment(&lab.veth_srv).expect("still attached");
    let names: Vec<&str> =
        a["rules"].as_array().unwrap().iter().filter_map(|r| r["rule"].as_str()).collect();
    assert_eq!(names, ["old"], "the rules in force stay: {a}");
    assert_eq!(a["shapers"].as_array().map(|s| s.len()), Some(0), "{a}");
    let q = flowctl_tests::lab::sh_ns(
        &lab.ns_srv,
        &["tc", "qdisc", "show", "dev", &lab.veth_srv, "root"],
    );
    assert!(q.contains("noqueue"), "the qdisc untouched: {q}");
    agent.stop();
}
