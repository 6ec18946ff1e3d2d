//! BBR end to end: the SYN stage refusing new connections with a RST while
//! the CPU signal is high, failing open without an agent, and re-adopted.

use flowctl_tests::{
    agent::{Agent, DetachOnDrop},
    cli::{flowctl, map_ids, rule, top_once},
    lab::{attach_pass_xdp, sh, sh_ns, Lab},
    tempfile::TempFile,
    traffic::{connect_each, TcpServer},
};
use std::time::Duration;

/// BBR end to end with real TCP: under a high CPU signal (a file source),
/// connections in flight beyond what the window's completions and round
/// trips support are refused at the SYN with a RST (clients fail fast) while
/// established ones continue; the refusals are counted by reason; with the
/// agent killed the stage fails open after the grace period; a restarted
/// agent adopts the data plane, and below the threshold refuses nothing.
pub fn bbr_refuses_connections_beyond_the_limit_and_fails_open() {
    let lab = Lab::new("fbbr", 223);
    let _detach = DetachOnDrop::new(&lab);
    // XDP_TX replies on a veth reach the peer only when the peer runs its
    // NAPI; an XDP program there turns it on (GRO alone did not, here).
    let dev = lab.veth_cli.clone();
    let _peer_xdp = Lab::in_ns(&lab.ns_cli, move || attach_pass_xdp(&dev));
    let cpu = TempFile::new("flowctl-e2e-cpu-", "", "950\n");
    let prof = TempFile::profile(&format!(
        "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\ncpu = \"file:{}\"\ngrace_period = \"1s\"\n\
[[rule]]\nname = \"web\"\nproto = \"tcp\"\ndport = 7400\nunit = \"connections\"\nrate = \"100000/s\"\n\
bbr = {{ cpu_threshold = 800, window = \"10s\", buckets = 100, idle_timeout = \"10s\", reject = \"reset\" }}\n",
        cpu.path()
    ));
    let server = TcpServer::start(&lab, 7400);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);

    // 1. Short connections fill the window: completions and round trips.
    //    At most one is in flight at a time, so none is refused.
    let warm = connect_each(&lab, 7400, 30, Duration::from_millis(20), false);
    assert_eq!((warm.refused, warm.timed_out), (0, 0), "{warm:?}");
    std::thread::sleep(Duration::from_millis(400));
    let v = top_once(&lab.veth_srv, "0.1");
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
            let st = sh_ns(ns, &["ethtool", "-S", dev]);
            println!(
                "{dev}: {}",
                st.lines()
                    .filter(|l| l.contains("xdp") || l.contains("drop") || l.contains("peer"))
                    .collect::<Vec<_>>()
                    .join(" |")
            );
            println!("{}", sh(&["ip", "-n", ns, "-s", "-s", "link", "show", "dev", dev]));
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
    cpu.write("100\n");
    let ids = map_ids(&lab.veth_srv);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    assert_eq!(map_ids(&lab.veth_srv), ids, "the pinned maps were adopted, not recreated");
    std::thread::sleep(Duration::from_millis(600));
    let v = top_once(&lab.veth_srv, "0.1");
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
}
