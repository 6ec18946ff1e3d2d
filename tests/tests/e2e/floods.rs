//! Floods from many spoofed sources against a connection limit, with
//! brand-new legitimate clients connecting throughout.

use flowctl_tests::{
    agent::Agent,
    cli::rule,
    flood::{blackhole_replies, clients_from, syn_flood, tx_dropped, FIRST_SYN, FLOOD_NET},
    lab::{nstat, Lab},
    tempfile::TempFile,
    traffic::{blast, TcpServer},
};
use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// A SYN flood from 1,000,000 distinct spoofed sources (three SYNs each, a
/// pass over all of them at a time, at most 3M frames and 60 s) against a
/// per-source connection limit of 1/min with a burst of 1, while 200
/// brand-new client addresses connect one after another during the passes
/// that are refused (every flood source in debt):
/// - at most 1% of the new clients' first SYNs are refused (the untagged
///   debt slots this replaced started most new sources in a flood source's
///   debt);
/// - the flood gets at most `sources * (burst + rate * t)` SYNs in;
/// - another rule's drained key is still refused afterwards (at the default
///   1M-entry source cache the flood may or may not evict it; the kernel
///   test `eviction_hands_no_fresh_burst_to_refused_keys` forces that case).
pub fn a_million_source_syn_flood_spares_new_clients() {
    const SOURCES: u32 = 1_000_000;
    const PASSES: u32 = 3;
    let lab = Lab::new("fflood", 250);
    blackhole_replies(&lab);
    let prof = TempFile::profile(
        "[[rule]]\nname = \"syn\"\nproto = \"tcp\"\ndport = 7500\nunit = \"connections\"\nrate = \"1/min\"\nburst = 1\nkey = \"src\"\n\
[[rule]]\nname = \"other\"\nproto = \"udp\"\ndport = 7501\nrate = \"1/min\"\nburst = 3\nkey = \"src\"\n",
    );
    let server = TcpServer::start(&lab, 7500);
    let agent = Agent::start(&lab, prof.path(), &[]);
    // The other rule's key, drained before the flood: 3 in, 2 refused.
    blast(&lab, 7501, 200, 1.0, 5);
    let other = rule(&lab.veth_srv, "other");
    assert_eq!(other["passed_pkts"].as_u64(), Some(3), "{other}");
    let addrs: Vec<String> = (20..220).map(|h| format!("10.201.250.{h}")).collect();
    for a in &addrs {
        lab.add_client_address(a);
    }

    let dropped_before = tx_dropped(&lab.ns_cli, &lab.veth_cli);
    let t0 = Instant::now();
    let (sent, clients) = std::thread::scope(|s| {
        static PROGRESS: AtomicU64 = AtomicU64::new(0);
        let flood = s.spawn(|| syn_flood(&lab, 7500, (SOURCES, PASSES, 250_000), 60.0, &PROGRESS));
        // From the second pass on, every source the flood sends from is
        // refused and in debt: the clients meet a million debtors.
        let wait = Instant::now();
        while PROGRESS.load(Ordering::Relaxed) < SOURCES as u64 && wait.elapsed().as_secs() < 30 {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            PROGRESS.load(Ordering::Relaxed) >= SOURCES as u64,
            "the first pass took over 30 s"
        );
        let clients = clients_from(&lab, addrs.clone(), 7500, Duration::from_millis(15));
        (flood.join().unwrap(), clients)
    });
    let t = t0.elapsed().as_secs_f64();
    // What is still in the veth's queue reaches XDP first.
    std::thread::sleep(Duration::from_millis(300));
    let r = rule(&lab.veth_srv, "syn");
    let got = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"));
    let (seen, passed, dropped) = (got("syn_seen"), got("syn_passed"), got("syn_dropped"));
    // The server's count of the flood: every SYN from the flood's range the
    // limiter passed reached the listener and was dropped there, its
    // SYN-ACK's route being the blackhole (and nothing else drops here).
    let flood_in = nstat(&lab.ns_srv, "TcpExtListenDrops");
    // So the new clients' SYNs the limiter refused are the rule's refusals
    // less the flood's: the frames the sender's kernel took, less those the
    // veth dropped without saying so (at most: a client's SYN may be one).
    let veth_drops = tx_dropped(&lab.ns_cli, &lab.veth_cli) - dropped_before;
    let silent = veth_drops.saturating_sub(sent.refused_sends) as i64;
    let flood_refused = sent.frames as i64 - flood_in as i64;
    let clients_refused = dropped as i64 - flood_refused + silent;
    let bound = SOURCES as f64 * (1.0 + t / 60.0);
    println!(
        "flood: {} frames in {:.1} s ({:.0}/s, {} not taken) from {SOURCES} sources of {}/{}; the rule saw {seen} SYNs, passed {passed}, dropped {dropped}; {flood_in} reached the listener, bound {bound:.0} (t = {t:.1} s)",
        sent.frames,
        sent.secs,
        sent.frames as f64 / sent.secs,
        sent.lost,
        FLOOD_NET.0,
        FLOOD_NET.1
    );
    println!(
        "clients: {} new addresses, about {} SYNs seen, at most {clients_refused} refused by the limiter; {} established, {} within {:?} (the rest lost a SYN to the veth's full queue); veth drops {veth_drops}, {silent} untold",
        clients.attempts,
        seen as i64 - sent.frames as i64 + silent,
        clients.established,
        clients.first_syn,
        FIRST_SYN
    );
    assert!(
        clients_refused as f64 <= 0.01 * clients.attempts as f64,
        "{clients_refused} of {} new clients' SYNs refused",
        clients.attempts
    );
    assert_eq!(clients.established, clients.attempts, "every new client connects");
    assert!(clients.first_syn as f64 >= 0.9 * clients.attempts as f64, "{clients:?}");
    assert!(passed >= flood_in + clients.established as u64, "a SYN in per client");
    assert!((flood_in as f64) <= bound, "the flood got {flood_in} SYNs in, bound {bound:.0}");
    // The other rule's drained key is still refused.
    let (sent_after, _, _) = blast(&lab, 7501, 100, 1.0, 1);
    assert_eq!(sent_after, 1);
    let other = rule(&lab.veth_srv, "other");
    assert_eq!(other["passed_pkts"].as_u64(), Some(3), "the drained key stays drained: {other}");
    server.stop();
    agent.stop();
}

/// A SYN flood from 200,000 spoofed sources spread over four /16s (two
/// SYNs each, at most 30 s) passes a per-source limit of one connection a
/// minute at every source; the rule's nested per-/16 limit (burst 50) holds
/// it to about 4 x 50 SYNs, the refused sources get no bucket in either
/// limit, and new clients from another /16 all connect at their first SYN.
pub fn a_flood_spread_over_prefixes_is_held_by_a_nested_prefix_limit() {
    const SOURCES: u32 = 200_000;
    const PREFIX_BURST: u64 = 50;
    let lab = Lab::new("fnest", 251);
    blackhole_replies(&lab);
    let prof = TempFile::profile(&format!(
        "[[rule]]\nname = \"syn\"\nproto = \"tcp\"\ndport = 7510\nunit = \"connections\"\nrate = \"1/min\"\nburst = 1\nkey = \"src\"\n\
[[rule.limit]]\nrate = \"1/min\"\nburst = {PREFIX_BURST}\nkey = \"src_prefix\"\nprefix_v4 = 16\n"
    ));
    let server = TcpServer::start(&lab, 7510);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let addrs: Vec<String> = (20..60).map(|h| format!("10.201.251.{h}")).collect();
    for a in &addrs {
        lab.add_client_address(a);
    }
    let dropped_before = tx_dropped(&lab.ns_cli, &lab.veth_cli);
    let t0 = Instant::now();
    static PROGRESS: AtomicU64 = AtomicU64::new(0);
    let sent = syn_flood(&lab, 7510, (SOURCES, 2, 250_000), 30.0, &PROGRESS);
    let clients = clients_from(&lab, addrs, 7510, Duration::from_millis(10));
    let t = t0.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));
    let r = rule(&lab.veth_srv, "syn");
    let got = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"));
    let flood_in = nstat(&lab.ns_srv, "TcpExtListenDrops");
    let veth_drops = tx_dropped(&lab.ns_cli, &lab.veth_cli) - dropped_before;
    let silent = veth_drops.saturating_sub(sent.refused_sends);
    let prefixes = u64::from((SOURCES - 1) >> 16) + 1;
    let bound = prefixes as f64 * (PREFIX_BURST as f64 + t / 60.0);
    let by_prefix = r["limit_refusals"][0].as_u64().expect("limit_refusals");
    println!(
        "flood: {} frames in {:.1} s from {SOURCES} sources in {prefixes} /16s; {flood_in} reached the listener (bound {bound:.0}); the /16 limit refused {by_prefix}, the rule passed {} and created {} buckets; clients {clients:?}",
        sent.frames,
        sent.secs,
        got("syn_passed"),
        got("key_inserts")
    );
    assert!((flood_in as f64) <= bound, "the flood got {flood_in} SYNs in, bound {bound:.0}");
    assert!(
        flood_in >= prefixes * PREFIX_BURST * 9 / 10,
        "each /16 gets its burst: {flood_in} of {}",
        prefixes * PREFIX_BURST
    );
    // Every other frame of the flood the veth delivered was the /16's to
    // refuse: the per-source limit only refuses a source it admitted once.
    let delivered = sent.frames - silent;
    assert!(
        by_prefix + 2 * flood_in + silent >= delivered,
        "the /16 limit refused {by_prefix} of {delivered} delivered"
    );
    // Buckets only for what got in: two limits per admitted source, and the
    // /16s' and the clients'.
    let most = 2 * (flood_in + clients.attempts as u64) + prefixes + 1;
    assert!(got("key_inserts") <= most, "{} buckets, at most {most}", got("key_inserts"));
    assert_eq!(clients.established, clients.attempts, "every new client connects");
    assert!(clients.first_syn as f64 >= 0.9 * clients.attempts as f64, "{clients:?}");
    server.stop();
    agent.stop();
}

/// A SYN flood from 1,000,000 spoofed sources (one SYN each, about
/// 100,000/s, at most 30 s) against a per-source limit of 5/s with a burst
/// of 3, with 64k-entry tables, sixteen times smaller than the flood: the
/// agent (with `flood_watch`, so within about 10 ms) sees the rule
/// creating buckets far faster than the tables turn over and lends it a
/// flood sketch (`status` says so), which holds such a
/// flood (rho 0.61 per cell) within 1% of new keys refused. Meanwhile:
/// - another rule's key (1/h, burst 3: no refill within the test, which
///   takes 90 s in a TCG guest), admitted once before the flood, keeps its
///   source-cache entry and its bucket: two more in, then refused (with
///   buckets, the flood evicts it and it comes back with a full burst:
///   three; checked by hand);
/// - 200 brand-new client addresses connect, at most 1% of them refused at
///   their first SYN;
/// - the flood's sources are decided by the sketch, not given buckets, and
///   get in at most `sources * (burst + rate * t)`.
pub fn a_flooded_rule_is_lent_a_sketch_and_spares_other_keys() {
    const SOURCES: u32 = 1_000_000;
    let lab = Lab::new("fsk", 252);
    blackhole_replies(&lab);
    let prof = TempFile::profile(
        "[settings]\nsource_cache_entries = 65536\nkey_table_entries = 65536\nflood_watch = true\n\
[[rule]]\nname = \"syn\"\nproto = \"tcp\"\ndport = 7520\nunit = \"connections\"\nrate = \"5/s\"\nburst = 3\nkey = \"src\"\n\
[[rule]]\nname = \"other\"\nproto = \"udp\"\ndport = 7521\nrate = \"1/h\"\nburst = 3\nkey = \"src\"\n",
    );
    let server = TcpServer::start(&lab, 7520);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let (sent_before, _, _) = blast(&lab, 7521, 200, 1.0, 1);
    assert_eq!(sent_before, 1);
    assert_eq!(rule(&lab.veth_srv, "other")["passed_pkts"].as_u64(), Some(1));
    let addrs: Vec<String> = (20..220).map(|h| format!("10.201.252.{h}")).collect();
    for a in &addrs {
        lab.add_client_address(a);
    }
    let dropped_before = tx_dropped(&lab.ns_cli, &lab.veth_cli);
    let (sent, clients, lent) = std::thread::scope(|s| {
        static PROGRESS: AtomicU64 = AtomicU64::new(0);
        let flood = s.spawn(|| syn_flood(&lab, 7520, (SOURCES, 1, 100_000), 30.0, &PROGRESS));
        // The clients connect once the flood has run for a while, 0.2 s
        // here, 3-4 s in a TCG guest (whose flood runs at about 6,000/s
        // for its 30 s), and the sketch is lent.
        let wait = Instant::now();
        while PROGRESS.load(Ordering::Relaxed) < 20_000 && wait.elapsed().as_secs() < 20 {
            std::thread::sleep(Duration::from_millis(20));
        }
        // The agent watches for the flood every 10 ms (`flood_watch`).
        let mut lent = rule(&lab.veth_srv, "syn")["flood_sketch"].clone();
        while lent.is_null() && wait.elapsed().as_secs() < 20 {
            std::thread::sleep(Duration::from_millis(50));
            lent = rule(&lab.veth_srv, "syn")["flood_sketch"].clone();
        }
        let clients = clients_from(&lab, addrs.clone(), 7520, Duration::from_millis(10));
        (flood.join().unwrap(), clients, lent)
    });
    std::thread::sleep(Duration::from_millis(300));
    let r = rule(&lab.veth_srv, "syn");
    let got = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"));
    let flood_in = nstat(&lab.ns_srv, "TcpExtListenDrops");
    let veth_drops = tx_dropped(&lab.ns_cli, &lab.veth_cli) - dropped_before;
    let silent = veth_drops.saturating_sub(sent.refused_sends) as i64;
    let flood_refused = sent.frames as i64 - flood_in as i64;
    // Two bounds on the clients' SYNs the limiter refused: every refusal
    // of the rule, and those less the flood's (which counts the SYNs the
    // veth dropped untold as refused: at 100,000/s its queue overflows now
    // and then).
    let clients_refused =
        (got("syn_dropped") as i64).min(got("syn_dropped") as i64 - flood_refused + silent);
    println!(
        "flood: {} frames in {:.1} s ({:.0}/s) from {SOURCES} sources; sketch {lent} during it, {} now; the rule passed {} SYNs, dropped {}, made {} buckets ({} claimed entries), its sketch decided {}; {flood_in} reached the listener; clients {clients:?}, at most {clients_refused} refused",
        sent.frames,
        sent.secs,
        sent.frames as f64 / sent.secs,
        r["flood_sketch"],
        got("syn_passed"),
        got("syn_dropped"),
        got("key_inserts"),
        got("source_claims"),
        got("sketched_pkts"),
    );
    assert_eq!(lent.as_u64(), Some(0), "lent the pool's first sketch during the flood");
    assert!(
        got("sketched_pkts") >= sent.frames / 2,
        "most of the flood decided by the sketch: {} of {}",
        got("sketched_pkts"),
        sent.frames
    );
    assert!(
        got("key_inserts") + got("source_claims") < SOURCES as u64 / 2,
        "the flood's sources mostly got no bucket"
    );
    assert!(
        clients_refused as f64 <= 0.01 * clients.attempts as f64,
        "{clients_refused} of {} new clients' SYNs refused",
        clients.attempts
    );
    assert_eq!(clients.established, clients.attempts, "every new client connects");
    let bound = SOURCES as f64 * (3.0 + 5.0 * sent.secs);
    assert!((flood_in as f64) <= bound, "the flood got {flood_in} SYNs in, bound {bound:.0}");
    // The other rule's key kept its bucket: two of its three left.
    let (sent_after, _, _) = blast(&lab, 7521, 200, 1.0, 3);
    assert_eq!(sent_after, 3);
    let other = rule(&lab.veth_srv, "other");
    assert_eq!(other["passed_pkts"].as_u64(), Some(3), "no fresh burst: {other}");
    server.stop();
    agent.stop();
}

/// An isolated rule (`isolate = true`) keeps its keys through a flood on
/// another rule that no sketch can hold and that turns the shared tables
/// over many times, and through its agent's restart:
/// - the agent (`--keep`) makes the rule's own table; one packet of a key
///   leaves it two of its three tokens; the agent is killed and a new one
///   adopts the data plane, and the table with it;
/// - a SYN flood from 200,000 spoofed sources (one SYN each, at most 20 s)
///   on a per-source 1/min rule with 1,024-entry shared tables: beyond what
///   a sketch holds at that rate (173/s), so no sketch is lent, and the
///   flood's buckets evict one another and everything else there;
/// - the isolated key still has two tokens: two more in, then refused;
/// - detach leaves nothing behind (the table goes with its pinned array).
pub fn an_isolated_rule_keeps_its_keys_through_a_flood_and_a_restart() {
    const SOURCES: u32 = 200_000;
    let lab = Lab::new("fiso", 206);
    blackhole_replies(&lab);
    let prof = TempFile::profile(
        "[settings]\nsource_cache_entries = 1024\nkey_table_entries = 1024\n\
[[rule]]\nname = \"syn\"\nproto = \"tcp\"\ndport = 7530\nunit = \"connections\"\nrate = \"1/min\"\nburst = 1\nkey = \"src\"\n\
[[rule]]\nname = \"other\"\nproto = \"udp\"\ndport = 7531\nrate = \"1/h\"\nburst = 3\nkey = \"src\"\nisolate = true\ntable_entries = 1024\n",
    );
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let (sent_before, _, _) = blast(&lab, 7531, 200, 1.0, 1);
    assert_eq!(sent_before, 1);
    assert_eq!(rule(&lab.veth_srv, "other")["passed_pkts"].as_u64(), Some(1));
    agent.kill9();
    let agent = Agent::start(&lab, prof.path(), &[]);
    let other = rule(&lab.veth_srv, "other");
    assert_eq!(other["own_table_entries"].as_u64(), Some(1024), "status shows the table: {other}");
    assert!(rule(&lab.veth_srv, "syn")["own_table_entries"].is_null());

    let sent = {
        static PROGRESS: AtomicU64 = AtomicU64::new(0);
        syn_flood(&lab, 7530, (SOURCES, 1, 100_000), 20.0, &PROGRESS)
    };
    std::thread::sleep(Duration::from_millis(300));
    let r = rule(&lab.veth_srv, "syn");
    let got = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"));
    let made = got("key_inserts") + got("source_claims");
    println!(
        "flood: {} frames in {:.1} s ({:.0}/s); the rule passed {} SYNs, dropped {}, made {made} buckets, sketch {}",
        sent.frames,
        sent.secs,
        sent.frames as f64 / sent.secs,
        got("syn_passed"),
        got("syn_dropped"),
        r["flood_sketch"]
    );
    assert!(
        made >= 8 * 1024,
        "the flood turned the 1,024-entry shared tables over: {made} buckets"
    );
    let (sent_after, _, _) = blast(&lab, 7531, 200, 1.0, 3);
    assert_eq!(sent_after, 3);
    let other = rule(&lab.veth_srv, "other");
    assert_eq!(other["passed_pkts"].as_u64(), Some(3), "two of its three tokens left: {other}");
    assert_eq!(other["dropped_pkts"].as_u64(), Some(1), "{other}");
    agent.stop();
}
