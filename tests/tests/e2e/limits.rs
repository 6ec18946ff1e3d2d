//! Limits end to end: a per-source UDP token bucket, a TCP connection rate
//! (`unit = "connections"`) and a connection quota, each admitting within
//! bounds computed from the harness's own timestamps.

use crate::UDP_RULE;
use flowctl_tests::{
    agent::Agent,
    cli::{attachment, flowctl, rule},
    lab::Lab,
    tempfile::TempFile,
    traffic::{blast, connect_many, TcpServer},
};
use std::time::Duration;

/// A UDP rate limit (100/s, burst 20, per source) admits between 90% of
/// b + r*t (or what was sent) and b + r*t + 1 of a 1000 pps blast, and
/// counts the rest as rate drops; `explain` agrees with the profile; SIGINT
/// detaches, and `detach` is idempotent.
pub fn udp_limit_holds_within_bounds_then_detaches() {
    let lab = Lab::new("fe2e", 211);
    let prof = TempFile::profile(UDP_RULE);
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

/// New TCP connections: a `connections` rule admits at most b + r*t SYNs;
/// refused SYNs are dropped, so those connects time out at the client.
pub fn tcp_connection_rate_within_bounds() {
    let lab = Lab::new("ftcp", 215);
    let prof = TempFile::profile("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"conns\"\nproto = \"tcp\"\ndport = 7200\nunit = \"connections\"\nrate = \"20/s\"\nburst = 5\nkey = \"src\"\n");
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

/// A connection quota end to end: "at most 5 new TCP connections per 10 s
/// per source /24" admits exactly 5 of a stream of connects, refusing the
/// rest by dropping their SYNs (reason `quota`).
pub fn tcp_connection_quota() {
    let lab = Lab::new("fquota", 221);
    let prof = TempFile::profile("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\nquota_table_entries = 4096\n[[rule]]\nname = \"conns\"\nproto = \"tcp\"\ndport = 7300\nunit = \"connections\"\nquota = 5\nquota_window = \"10s\"\nkey = \"src_prefix\"\nprefix_v4 = 24\n");
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
