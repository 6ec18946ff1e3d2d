//! Global limits (docs/fleet.md, "Global limits"): three real agents on
//! three labs share one per-source global rule through a real Redis the
//! test starts in its own namespace (linked by a veth to each lab), which
//! they log in to as an ACL user whose password the profile names by file.
//! The same source address sends to all three at skewed rates; what the
//! fleet admits is read from the agents' kernel counters every 200 ms and
//! held to the bound L*t + B in *every* window between two readings
//! (`default_share = "none"`: exactly that, docs/design.md), with the store
//! healthy, paused (SIGSTOP: no host raises a lease's rate while it hangs,
//! and no window overshoots when it comes back), and flushed (a new epoch:
//! learning mode).

use flowctl_tests::{
    cli::attachment,
    fleet_lab::{self, Fleet, DPORT, SRC},
    lab::Lab,
    redis::AGENT_USER,
    traffic::blast_from,
};
use serde_json::Value;
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        OnceLock,
    },
    time::{Duration, Instant},
};

/// L and B, per source, across the fleet.
const RATE: f64 = fleet_lab::RATE as f64;
const BURST: f64 = fleet_lab::BURST as f64;
/// Offered per lab, packets per second: skewed.
const OFFERED: [u64; 3] = [600, 300, 100];
/// The kernel re-reads a key's grant at most this often (seconds): a
/// lowered grant may be late by that much once.
const GRANT_REREAD_S: f64 = 0.05;
/// How often the fleet's counters are read during a phase.
const READ_EVERY: Duration = Duration::from_millis(200);

/// One reading of the fleet's kernel counters: taken somewhere between
/// `from` and `to` (the `status` call's span), what each lab admitted.
struct Reading {
    from: Instant,
    to: Instant,
    passed: Vec<u64>,
}

/// Reads the fleet once; `each` checks the attachments too.
fn read(labs: &[Lab], each: &(dyn Fn(&[Value]) + Sync)) -> Reading {
    let from = Instant::now();
    let all = fleet_lab::attachments(labs).unwrap();
    let to = Instant::now();
    each(&all);
    let passed = all.iter().map(|a| fleet_lab::rule_counters(a).unwrap().1).collect();
    Reading { from, to, passed }
}

/// Every lab's client sends for `secs` at its rate, together, while the
/// fleet is read every [`READ_EVERY`] (`each` sees every reading) and,
/// halfway through, `during` runs (checks of what shows while traffic
/// flows). Returns the readings, the first before any packet and the last
/// after the counters settled.
fn traffic(
    labs: &[Lab],
    secs: f64,
    during: &(dyn Fn() + Sync),
    each: &(dyn Fn(&[Value]) + Sync),
) -> Vec<Reading> {
    let mut readings = vec![read(labs, each)];
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let check = s.spawn(|| {
            std::thread::sleep(Duration::from_secs_f64(secs / 2.0));
            during();
        });
        let reader = s.spawn(|| {
            let mut got = Vec::new();
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(READ_EVERY);
                got.push(read(labs, each));
            }
            got
        });
        let runs: Vec<_> = labs
            .iter()
            .zip(OFFERED)
            .map(|(lab, pps)| {
                s.spawn(move || blast_from(lab, SRC, DPORT, pps, secs, (pps as f64 * secs) as u64))
            })
            .collect();
        for r in runs {
            r.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        check.join().unwrap();
        readings.extend(reader.join().unwrap());
    });
    // The last packets may still be in flight to the counters.
    std::thread::sleep(Duration::from_millis(200));
    readings.push(read(labs, each));
    readings
}

/// Runs a phase and checks that in every window between two readings the
/// fleet admitted at most L*t + B, t the window's longest possible span
/// (from the start of the first reading to the end of the second) plus
/// the kernel's grant re-read once; returns what each lab admitted.
fn phase(
    labs: &[Lab],
    what: &str,
    secs: f64,
    during: &(dyn Fn() + Sync),
    each: &(dyn Fn(&[Value]) + Sync),
) -> Vec<u64> {
    let readings = traffic(labs, secs, during, each);
    let total = |r: &Reading| r.passed.iter().sum::<u64>();
    let (mut worst, mut worst_at) = (0.0f64, (0, 0));
    for (i, a) in readings.iter().enumerate() {
        for (j, b) in readings.iter().enumerate().skip(i + 1) {
            let t = b.to.duration_since(a.from).as_secs_f64() + GRANT_REREAD_S;
            let ratio = (total(b) - total(a)) as f64 / (RATE * t + BURST);
            if ratio > worst {
                (worst, worst_at) = (ratio, (i, j));
            }
        }
    }
    let (first, last) = (&readings[0], &readings[readings.len() - 1]);
    let got: Vec<u64> = last.passed.iter().zip(&first.passed).map(|(a, b)| a - b).collect();
    let (i, j) = worst_at;
    let (a, b) = (&readings[i], &readings[j]);
    println!(
        "{what}: admitted {got:?} = {}; {} readings, worst window {:.2} s from reading {i} to {j}: {} admitted, {:.3} of L*t + B",
        got.iter().sum::<u64>(),
        readings.len(),
        b.to.duration_since(a.from).as_secs_f64(),
        total(b) - total(a),
        worst,
    );
    assert!(worst <= 1.0, "{what}: a window admitted {:.3} of L*t + B", worst);
    got
}

/// What each lab's lease of the key grants now.
fn lease_rates(labs: &[Lab]) -> Vec<u64> {
    fleet_lab::attachments(labs).unwrap().iter().map(fleet_lab::lease_rate).collect()
}

pub fn global_limit_holds_across_three_agents_through_redis() {
    let mut fleet = Fleet::start("frd", "fgl", [233, 234, 235]);
    let (labs, redis) = (&fleet.labs, &fleet.redis);
    let nothing = |_: &[Value]| {};
    // A fresh store learns for one lease (2 s): nothing is granted then
    // (the hosts hold nothing to echo) and `none` admits nothing before a
    // lease. The bound holds through it.
    let warm = phase(labs, "first lease (learning)", 4.0, &|| {}, &nothing);
    // Then the leases follow the demand; status shows the store and each
    // host's lease of the key; the agents are logged in as their ACL user.
    let shows_leases = || {
        for lab in labs {
            let l = attachment(&lab.veth_srv).unwrap()["leases"].clone();
            assert_eq!(l["store"]["up"], true, "{l}");
            assert_eq!(l["store"]["state"], "ok", "{l}");
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
        let users = redis.client_users();
        assert!(users.len() >= labs.len(), "one connection per agent at least: {users:?}");
        assert!(users.iter().all(|u| u == AGENT_USER), "every agent as {AGENT_USER}: {users:?}");
    };
    let steady = phase(labs, "steady", 6.0, &shows_leases, &nothing);
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
    // The store hangs (SIGSTOP) halfway through a phase, while traffic
    // flows (a host whose traffic ended releases its lease, so leases are
    // only held while it flows): no host raises a rate while it hangs; the
    // leases end, the keys fall back to `none`.
    let held: OnceLock<Vec<u64>> = OnceLock::new();
    let hang = || {
        let before = lease_rates(labs);
        assert!(
            before.iter().all(|&r| r > 0),
            "every host holds a lease before the outage: {before:?}"
        );
        redis.server.pause();
        // The baseline is what the hosts hold once each has seen the store
        // hang: `status` reads a state published every 500 ms, so a reading
        // taken before the pause can miss a grant the store made just
        // before it; from here on no answer can come, and no rate may rise.
        let t0 = Instant::now();
        while !fleet_lab::attachments(labs)
            .unwrap()
            .iter()
            .all(|a| a["leases"]["store"]["state"] == "unreachable")
        {
            assert!(t0.elapsed() < Duration::from_secs(5), "the hang is not seen within 5 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        held.set(lease_rates(labs)).expect("set once");
        let l = attachment(&labs[0].veth_srv).unwrap()["leases"].clone();
        assert_eq!(l["store"]["up"], false, "the outage shows: {l}");
        assert_eq!(l["store"]["state"], "unreachable", "{l}");
    };
    let raises_nothing = |all: &[Value]| {
        let Some(held) = held.get() else { return };
        let now: Vec<u64> = all.iter().map(fleet_lab::lease_rate).collect();
        for (n, h) in now.iter().zip(held) {
            assert!(n <= h, "a lease's rate rose while the store hung: {now:?}, held {held:?}");
        }
    };
    phase(labs, "store paused halfway", 8.0, &hang, &raises_nothing);
    assert!(held.get().is_some(), "the store was paused");
    redis.server.resume();
    // Back: no spike in any window.
    phase(labs, "store back", 4.0, &|| {}, &nothing);
    // Flushed: a new epoch, and every agent sees it and learns again.
    let epoch_changes = || -> Vec<u64> {
        let all = fleet_lab::attachments(labs).unwrap();
        all.iter().map(|a| a["leases"]["epoch_changes"].as_u64().unwrap()).collect()
    };
    let before = epoch_changes();
    assert!(redis.cli(&["FLUSHALL"]).contains("OK"));
    phase(labs, "store flushed", 5.0, &|| {}, &nothing);
    let after = epoch_changes();
    for (a, b) in after.iter().zip(&before) {
        assert!(a > b, "every agent saw the new epoch: {before:?} -> {after:?}");
    }
    fleet.stop_agents();
}
