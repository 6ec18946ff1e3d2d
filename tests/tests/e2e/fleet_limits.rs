//! Global limits (docs/fleet.md, "Global limits"): three real agents on
//! three labs share one per-source global rule through a real Redis the
//! test starts in its own namespace (linked by a veth to each lab). The
//! same source address sends to all three at skewed rates; what the fleet
//! admits is counted from the agents' kernel counters and held to the
//! bound L*t + B (`default_share = "none"`: exactly that, docs/design.md),
//! with the store healthy, paused (SIGSTOP: no spike when it comes back),
//! and flushed (a new epoch: learning mode).

use flowctl_tests::{
    cli::attachment,
    fleet_lab::{self, Fleet, DPORT, SRC},
    lab::Lab,
    traffic::blast_from,
};
use std::time::{Duration, Instant};

/// L and B, per source, across the fleet.
const RATE: f64 = fleet_lab::RATE as f64;
const BURST: f64 = fleet_lab::BURST as f64;
/// Offered per lab, packets per second: skewed.
const OFFERED: [u64; 3] = [600, 300, 100];

/// Packets the fleet admitted so far (each agent's kernel counter).
fn admitted(labs: &[Lab]) -> Vec<u64> {
    fleet_lab::counters(labs).unwrap().into_iter().map(|(_, passed)| passed).collect()
}

/// Every lab's client sends for `secs` at its rate, together, and halfway
/// through `during` runs (checks of what shows while traffic flows);
/// returns the span from the first packet sent to the last.
fn traffic(labs: &[Lab], secs: f64, during: &(dyn Fn() + Sync)) -> f64 {
    std::thread::scope(|s| {
        let check = s.spawn(move || {
            std::thread::sleep(Duration::from_secs_f64(secs / 2.0));
            during();
        });
        let runs: Vec<_> = labs
            .iter()
            .zip(OFFERED)
            .map(|(lab, pps)| {
                s.spawn(move || blast_from(lab, SRC, DPORT, pps, secs, (pps as f64 * secs) as u64))
            })
            .collect();
        let spans: Vec<(Instant, Instant)> =
            runs.into_iter().map(|h| h.join().unwrap()).map(|(_, a, b)| (a, b)).collect();
        check.join().unwrap();
        let first = spans.iter().map(|s| s.0).min().unwrap();
        let last = spans.iter().map(|s| s.1).max().unwrap();
        last.duration_since(first).as_secs_f64()
    })
}

/// Runs a phase; checks the fleet admitted at most L*t + B over it (t the
/// traffic's span, plus the kernel's 50 ms grant re-read once); returns
/// what each lab admitted.
fn phase(labs: &[Lab], what: &str, secs: f64, during: &(dyn Fn() + Sync)) -> Vec<u64> {
    let before = admitted(labs);
    let span = traffic(labs, secs, during);
    // The last packets may still be in flight to the counters.
    std::thread::sleep(Duration::from_millis(200));
    let got: Vec<u64> = admitted(labs).iter().zip(&before).map(|(a, b)| a - b).collect();
    let total: u64 = got.iter().sum();
    let bound = RATE * (span + 0.05) + BURST;
    println!("{what}: admitted {got:?} = {total} in {span:.2} s; bound L*t + B = {bound:.0}");
    assert!(total as f64 <= bound, "{what}: the fleet admitted {total}, over L*t + B = {bound:.0}");
    got
}

pub fn global_limit_holds_across_three_agents_through_redis() {
    let mut fleet = Fleet::start("frd", "fgl", [233, 234, 235]);
    let (labs, redis) = (&fleet.labs, &fleet.redis);
    // A fresh store learns for one lease (2 s): nothing is granted then
    // (the hosts hold nothing to echo) and `none` admits nothing before a
    // lease. The bound holds through it.
    let warm = phase(labs, "first lease (learning)", 4.0, &|| {});
    // Then the leases follow the demand; status shows the store and each
    // host's lease of the key.
    let shows_leases = || {
        for lab in labs {
            let l = attachment(&lab.veth_srv).unwrap()["leases"].clone();
            assert_eq!(l["store"]["up"], true, "{l}");
            assert_eq!(l["store"]["hosts"].as_u64(), Some(3), "three live hosts: {l}");
            assert_eq!(l["rules"][0]["rate"].as_u64(), Some(RATE as u64), "{l}");
            // `none`: the live hosts' default allowances cost nothing.
            assert!(l["rules"][0]["default_share"].is_null(), "{l}");
            assert_eq!(l["rules"][0]["default_allowance"].as_f64(), Some(0.0), "{l}");
            let lease = &l["rules"][0]["leases"][0];
            assert_eq!(lease["key"], SRC, "{l}");
            assert!(lease["rate"].as_u64().is_some_and(|r| r > 0 && r <= RATE as u64), "{l}");
            assert!(lease["demand"].as_u64().is_some_and(|d| d > 0), "{l}");
        }
    };
    let steady = phase(labs, "steady", 6.0, &shows_leases);
    let total: u64 = steady.iter().sum();
    assert!(
        total as f64 >= 0.6 * RATE * 6.0,
        "leases granted: {total} admitted in 6 s against L = {RATE}/s (first phase {warm:?})"
    );
    // Demand-weighted max-min: every host offers at least L/3 (600, 300,
    // 100 pps against 300/s), so each gets about a third.
    for (i, n) in steady.iter().enumerate() {
        assert!(*n as f64 >= 0.5 * RATE / 3.0 * 6.0, "host {i} starved: {steady:?}");
    }
    // The store hangs (SIGSTOP): no host raises a rate; leases end, the
    // keys fall back to `none`.
    redis.server.pause();
    let shows_outage = || {
        let l = attachment(&labs[0].veth_srv).unwrap()["leases"].clone();
        assert_eq!(l["store"]["up"], false, "the outage shows: {l}");
    };
    phase(labs, "store paused", 4.0, &shows_outage);
    redis.server.resume();
    // Back: no spike.
    phase(labs, "store back", 4.0, &|| {});
    // Flushed: a new epoch, learning again.
    assert!(redis.cli(&["FLUSHALL"]).contains("OK"));
    phase(labs, "store flushed", 5.0, &|| {});
    fleet.stop_agents();
}
