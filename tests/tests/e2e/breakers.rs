//! Circuit breakers end to end: the real binary attached to a cgroup v2
//! directory, real sockets from client processes placed in it, a downstream
//! in the lab's server namespace switched between healthy, refusing and
//! black-holed.

use flowctl_tests::{
    agent::Agent,
    breaker_client::{client, count, Attempt, LOCAL, REFUSED},
    cgroup::TestCgroup,
    cli::{breaker, breakers_of, flowctl},
    downstream::Downstream,
    lab::{sh_ns, Lab},
    need::in_vm,
    tempfile::TempFile,
    traffic::TcpServer,
};
use std::time::{Duration, Instant};

/// The client namespace gives up a connect after one SYN retransmission.
fn one_syn_retry(lab: &Lab) {
    sh_ns(&lab.ns_cli, &["sysctl", "-qw", "net.ipv4.tcp_syn_retries=1"]);
}

/// SRE mode through the CLI: healthy -> no refusals; the downstream refuses
/// -> fail-fast refusals at the predicted share within one window, with the
/// configured errno and no SYN sent for them; healed -> no refusals within
/// the documented bound; black-holed -> refusals at the cap again, what went
/// out timing out; exempt targets and processes outside the breaker's
/// cgroup untouched; dry-run (applied live, state kept) counts without
/// refusing; a stopped agent's breakers fail open after the grace period.
pub fn breaker_sre_fails_fast_at_the_predicted_share_and_recovers() {
    let cg = TestCgroup::new();
    let lab = Lab::new("fbrk", 233);
    let down = Downstream::new(&lab, &[7100, 7101]);
    one_syn_retry(&lab);
    let profile = |dry: bool| {
        format!(
            "[settings]\ngrace_period = \"1s\"\n\n[[breaker]]\nname = \"db\"\ntarget = \"{}\"\nport = 7100\ncgroup = \"{}\"\nmin_requests = 20\nerrno = \"ECONNABORTED\"\nexempt = [\"{}:7101\"]\ndry_run = {dry}\n",
            lab.ip_srv,
            cg.app(),
            lab.ip_srv
        )
    };
    let p = TempFile::profile(&profile(false));
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
    let p2 = TempFile::profile(&profile(true));
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
    let p3 = TempFile::profile(&profile(false));
    assert!(flowctl(&["apply", "--cgroup", &cg.parent(), p3.path()]).status.success());
    let _ = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 1.0);
    assert_eq!(breaker(&cg.parent(), "db")["state"], "throttling");
    agent.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(1300));
    let hung = client(&lab, &cg.app(), 7100, 5, 1.0, 1, 0.5);
    agent.signal(libc::SIGCONT);
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
pub fn breaker_state_opens_on_timeouts_probes_and_closes() {
    let cg = TestCgroup::new();
    let lab = Lab::new("fbst", 234);
    let down = Downstream::new(&lab, &[7200]);
    one_syn_retry(&lab);
    let p = TempFile::profile(&format!(
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
    // The states the agent publishes, each with the state it came from
    // (its own record of the transition), so a poll that misses a short
    // state (status is slow under TCG) cannot hide a transition.
    let watcher = std::thread::spawn(move || {
        let mut seen: Vec<(String, String)> = Vec::new();
        let end = Instant::now() + Duration::from_secs(if in_vm() { 30 } else { 5 });
        while Instant::now() < end {
            let b = breaker(&cgp, "api");
            let s = b["state"].as_str().unwrap().to_string();
            let from = b["last_transition"]["from"].as_str().unwrap_or("").to_string();
            if seen.last().map(|(x, _)| x) != Some(&s) {
                seen.push((s, from));
            }
            std::thread::sleep(Duration::from_millis(30));
        }
        seen
    });
    let hole = client(&lab, &cg.app(), 7200, 20, 1.5, 12, if in_vm() { 20.0 } else { 4.0 });
    let seen = watcher.join().unwrap();
    println!("states (and where from) seen while black-holed: {seen:?}");
    // Half-open is entered only from open (after the sleep); a failed
    // probe goes back to open: seen as open, come from half-open.
    assert!(
        seen.iter().any(|(s, from)| s == "open" && from == "half-open"),
        "open -> half-open (probes) -> open on a failed probe: {seen:?}"
    );
    // It opens at the first timeouts: measured from the end of the first
    // connect that timed out (the 1 s SYN retransmission timeout, which
    // TCG stretches), not from the start.
    let first_timeout = hole
        .iter()
        .filter(|a| a.errno == 110)
        .map(|a| a.t + a.us / 1e6)
        .fold(f64::INFINITY, f64::min);
    let first_local = hole.iter().find(|a| a.errno == LOCAL).expect("opened").t;
    let after_timeout = first_local - first_timeout.min(first_local);
    assert!(
        after_timeout < if in_vm() { 5.0 } else { 1.0 },
        "open within the first timeouts: first local refusal {after_timeout:.2} s after the first timeout ({:.2} s after the start)",
        first_local - t0
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
    // Measured from the client's first connect, not from the heal: the
    // bound is the breaker's, and starting Python under TCG took up to a
    // second of it (CI saw 6.02 s from the heal against a 6 s bound).
    let started = after.first().map_or(healed, |a| a.t.max(healed));
    let first_ok = after.iter().find(|a| a.errno == 0).expect("closes").t - started;
    let b = breaker(&cg.app(), "api");
    assert_eq!(b["state"], "closed", "{b}");
    // Closed by its probes: at least the 2 it needs. Under TCG a third
    // probe's success has been counted in the same round before the agent's
    // tick (CI, 6.1 guest, 2026-12-04: "3 probes succeeded"); how a round
    // admits a third probe is open (noted on the issue), the state is right.
    let reason = b["last_transition"]["reason"].as_str().unwrap_or_default();
    let n: u32 = reason.strip_suffix(" probes succeeded").and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(n >= 2, "closed by at least 2 successful probes: {b}");
    println!(
        "first success {first_ok:.2} s after the client's first connect ({:.2} s after healing)",
        first_ok + started - healed
    );
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
