//! `cargo xtask bench shaper` (and section 9 of the full run): what the
//! egress shaper costs per packet.
//!
//! - 9a. `BPF_PROG_TEST_RUN` of the TC programs on one 60-byte frame,
//!   kernel-reported ns/packet, interleaved rounds, medians: the shaper with
//!   a shaper for another target (parse, one miss, the end of the table: the
//!   base), an aggregate shaper and a per-flow shaper stamping every
//!   packet, and for scale KLimiter's egress counter (it reads all 16 of its
//!   target slots, used or not).
//! - 9b. The sending CPU per packet of a UDP blast through a veth (one
//!   sender thread; its own user + system time, `RUSAGE_THREAD`), with the
//!   veth's default `noqueue`, with `tbf` and with `htb` at a rate far above
//!   what one thread sends (so they classify, enqueue and dequeue but never
//!   hold), and with the shaper program on the veth's egress stamping every
//!   packet. The host has no fq, so the shaper's stamps are not acted on
//!   there: 9b compares what each costs the sender, not a queue's wait.

use crate::{
    lab::{sh_ns, veth_pair, Lab, Netns},
    packet::{L4, V4},
    testrun::TestPlane,
};
use aya::programs::{tc, SchedClassifier, TcAttachType, TestRun, TestRunOptions};
use std::{net::UdpSocket, time::Instant};

const ROUNDS: usize = 9;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The kernel-reported mean ns of `repeat` runs of `prog` on `frame`.
fn ns_per_run(prog: &SchedClassifier, frame: &[u8], repeat: u32) -> f64 {
    let ctx_in = [0u8; 192];
    let mut ctx_out = [0u8; 192];
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(frame);
    opts.ctx_in = Some(&ctx_in);
    opts.ctx_out = Some(&mut ctx_out);
    opts.repeat = repeat;
    prog.test_run(opts).expect("BPF_PROG_TEST_RUN").duration.as_nanos() as f64
}

fn loaded<'a>(p: &'a mut TestPlane, name: &str) -> &'a SchedClassifier {
    let prog: &mut SchedClassifier = p.ebpf.program_mut(name).unwrap().try_into().unwrap();
    if prog.fd().is_err() {
        prog.load().unwrap();
    }
    prog
}

pub fn run(quick: bool) {
    crate::testrun::pin_to_cpu(0);
    let repeat = if quick { 20_000 } else { 100_000 };
    let shaper = |dst: &str, per: &str| {
        format!("[settings]\nkey_table_entries = 4096\nsource_cache_entries = 4096\n[[shaper]]\nname = \"s\"\ndst = \"{dst}\"\nrate = \"1000000000/s\"\nper = \"{per}\"\n")
    };
    let mut counter = TestPlane::new(&shaper("10.99.0.9", "aggregate"));
    let mut miss = TestPlane::new(&shaper("10.99.0.9", "aggregate"));
    let mut agg = TestPlane::new(&shaper("10.99.0.1", "aggregate"));
    let mut flow = TestPlane::new(&shaper("10.99.0.1", "flow"));
    let frame = V4::new([10, 1, 0, 1]).build(L4::Udp { sport: 4000, dport: 9005 }, 18);
    let names = ["KLimiter counter", "shaper, no target", "aggregate", "per flow"];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); 4];
    for _ in 0..ROUNDS {
        runs[0].push(ns_per_run(
            loaded(&mut counter, flowctl_common::EGRESS_PROGRAM),
            &frame,
            repeat,
        ));
        runs[1].push(ns_per_run(loaded(&mut miss, flowctl_common::SHAPER_PROGRAM), &frame, repeat));
        runs[2].push(ns_per_run(loaded(&mut agg, flowctl_common::SHAPER_PROGRAM), &frame, repeat));
        runs[3].push(ns_per_run(loaded(&mut flow, flowctl_common::SHAPER_PROGRAM), &frame, repeat));
    }
    let med: Vec<f64> = runs.into_iter().map(median).collect();
    println!("9a. TC egress programs, BPF_PROG_TEST_RUN ns/packet (60-byte IPv4/UDP, {ROUNDS} interleaved rounds, medians)");
    for (n, m) in names.iter().zip(&med) {
        println!("  {n:<20} {m:>7.1} ns/packet   {:.2}x no target", m / med[1]);
    }
    let stamped = agg.maps.shaper_counters(0).unwrap();
    assert!(stamped.offered_pkts > 0, "the aggregate shaper matched the frame");
    drop((counter, miss, flow));

    println!("9b. Sending CPU per packet through a veth: noqueue, tbf, htb, the shaper program (UDP, 64-byte payload, one sender thread)");
    let n: u64 = if quick { 100_000 } else { 400_000 };
    let mut results = Vec::new();
    for kind in ["noqueue", "tbf", "htb", "flowctl shaper"] {
        let mut per = Vec::new();
        for _ in 0..if quick { 3 } else { 5 } {
            per.push(veth_send_cost(kind, n, &mut agg));
        }
        results.push((kind, median(per)));
    }
    let base = results[0].1;
    for (kind, ns) in &results {
        println!("  {kind:<16} {ns:>7.0} ns of sender CPU per packet   {:.2}x noqueue", ns / base);
    }
}

/// Sender CPU (user + system) per packet for `n` datagrams from one
/// namespace to another through a veth whose sending end has `kind`.
fn veth_send_cost(kind: &str, n: u64, plane: &mut TestPlane) -> f64 {
    let id = crate::unique("fshb");
    let (a, b) = (Netns::new(&format!("{id}a")), Netns::new(&format!("{id}b")));
    let (da, db) = (format!("{id}x"), format!("{id}y"));
    veth_pair([(&a.0, &da, "10.99.0.2/24"), (&b.0, &db, "10.99.0.1/24")]);
    match kind {
        "tbf" => {
            sh_ns(
                &a.0,
                &[
                    "tc", "qdisc", "add", "dev", &da, "root", "tbf", "rate", "40gbit", "burst",
                    "10mb", "latency", "50ms",
                ],
            );
        }
        "htb" => {
            sh_ns(
                &a.0,
                &["tc", "qdisc", "add", "dev", &da, "root", "handle", "1:", "htb", "default", "10"],
            );
            sh_ns(
                &a.0,
                &[
                    "tc", "class", "add", "dev", &da, "parent", "1:", "classid", "1:10", "htb",
                    "rate", "40gbit", "ceil", "40gbit",
                ],
            );
        }
        _ => {}
    }
    // The shaper: the plane's object's program on this veth's egress (its
    // table names 10.99.0.1, the receiver).
    let link = if kind == "flowctl shaper" {
        let prog: &mut SchedClassifier =
            plane.ebpf.program_mut(flowctl_common::SHAPER_PROGRAM).unwrap().try_into().unwrap();
        if prog.fd().is_err() {
            prog.load().unwrap();
        }
        let dev = da.clone();
        let ns = a.0.clone();
        let p = prog as *mut SchedClassifier as usize;
        Some(Lab::in_ns(&ns, move || {
            let prog = unsafe { &mut *(p as *mut SchedClassifier) };
            let _ = tc::qdisc_add_clsact(&dev);
            let id = prog.attach(&dev, TcAttachType::Egress).unwrap();
            prog.take_link(id).unwrap()
        }))
    } else {
        None
    };
    let ns = a.0.clone();
    let cpu_ns = Lab::in_ns(&ns, move || {
        let s = UdpSocket::bind("10.99.0.2:0").unwrap();
        let payload = [0u8; 64];
        let cpu = || {
            let mut u: libc::rusage = unsafe { std::mem::zeroed() };
            unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
            let t = |v: libc::timeval| v.tv_sec as f64 * 1e9 + v.tv_usec as f64 * 1e3;
            t(u.ru_utime) + t(u.ru_stime)
        };
        let (c0, t0) = (cpu(), Instant::now());
        let mut sent = 0u64;
        while sent < n && t0.elapsed().as_secs() < 30 {
            if s.send_to(&payload, "10.99.0.1:9").is_ok() {
                sent += 1;
            }
        }
        (cpu() - c0) / sent.max(1) as f64
    });
    drop(link);
    cpu_ns
}
