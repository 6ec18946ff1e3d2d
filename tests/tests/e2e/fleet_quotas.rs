//! Global quotas (docs/fleet.md, "Global limits"; the bound in
//! docs/design.md, "Global quotas"): two real agents on two labs share one
//! per-source global rule with a quota through a real Redis the test
//! starts. One host spends the fleet's quota, then the traffic moves to the
//! other: what the first spent stays reserved in the store until it has
//! left the window, so the second gets nothing of it until then, and the
//! fleet never admits more than Q in a window. After the window the quota
//! is there again; agents that stop give their leases back.

use flowctl_tests::{
    cli::{attachment, rule},
    fleet_lab::{Fleet, SRC},
    lab::Lab,
    redis::Access,
    traffic::blast_from,
};
use std::time::{Duration, Instant};

/// Q per source per window, fleet-wide; the window.
const QUOTA: u64 = 200;
const WINDOW_S: f64 = 12.0;

fn profile(store: &Access) -> String {
    format!("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\nglobal_key_entries = 4096\n[fleet]\n{}lease = \"2s\"\nrefresh = \"500ms\"\n[[rule]]\nname = \"metered\"\nproto = \"udp\"\ndport = 7001\nrate = \"400/s\"\nburst = 40\nquota = {QUOTA}\nquota_window = \"{WINDOW_S}s\"\nkey = \"src\"\nscope = \"global\"\ndefault_share = \"none\"\n", store.fleet_keys())
}

fn admitted(lab: &Lab) -> u64 {
    rule(&lab.veth_srv, "metered")["passed_pkts"].as_u64().unwrap()
}

/// `lab`'s client sends 300 pps for `secs`; what its agent admitted.
fn send(lab: &Lab, secs: f64) -> u64 {
    let before = admitted(lab);
    blast_from(lab, SRC, 7001, 300, secs, (300.0 * secs) as u64);
    std::thread::sleep(Duration::from_millis(200));
    admitted(lab) - before
}

pub fn global_quota_moves_between_hosts_without_being_spent_twice() {
    let mut fleet = Fleet::start_with("fqr", "fgq", &[238, 239], profile);
    let (labs, redis) = (&fleet.labs, &fleet.redis);
    let start = Instant::now();
    // Host 0 alone: past the fresh store's learning (one 2 s lease), its
    // lease carries the whole quota, which it spends.
    let first = send(&labs[0], 4.5);
    println!("host 0 alone: admitted {first} of Q = {QUOTA}");
    assert!(first <= QUOTA, "host 0 admitted {first}, over Q = {QUOTA}");
    assert!(first >= QUOTA * 3 / 4, "the lease carried the quota: {first} of {QUOTA}");
    let l = attachment(&labs[0].veth_srv).unwrap()["leases"].clone();
    assert_eq!(l["rules"][0]["quota"].as_u64(), Some(QUOTA), "{l}");
    // The traffic moves to host 1 within the window: host 0 gives its
    // lease back, but what it spent stays reserved, so the fleet admits at
    // most Q - first more.
    let second = send(&labs[1], 4.0);
    let total = first + second;
    println!(
        "host 1 next: admitted {second}; the fleet {total} in {:.1} s against Q = {QUOTA} per {WINDOW_S} s",
        start.elapsed().as_secs_f64()
    );
    assert!(start.elapsed().as_secs_f64() < WINDOW_S, "the test ran within one window");
    assert!(total <= QUOTA, "the fleet admitted {total} within one window, over Q = {QUOTA}");
    // Once host 0's spending has left the window (the end of the newest
    // ring bucket that holds any, about 2.5 s in, plus W; K = 10 buckets of
    // 1.2 s), host 1's share grows back.
    let wait = (WINDOW_S + 5.0 - start.elapsed().as_secs_f64()).max(0.0);
    std::thread::sleep(Duration::from_secs_f64(wait));
    let third = send(&labs[1], 3.0);
    println!("after the window: host 1 admitted {third}");
    assert!(third >= QUOTA / 2, "the quota came back after the window: {third}");
    // Agents that stop give their leases back: stopped while host 1's
    // traffic flows (its lease in use), no host keeps a rate or burst
    // reserved in the store (what they spent may linger, by design).
    std::thread::scope(|s| {
        let lab = &labs[1];
        let traffic = s.spawn(move || blast_from(lab, SRC, 7001, 300, 2.5, 750));
        std::thread::sleep(Duration::from_millis(1200));
        // The agents field alone: the traffic thread borrows the labs.
        for a in fleet.agents.drain(..) {
            a.stop();
        }
        traffic.join().unwrap();
    });
    let cells: Vec<String> =
        redis.cli(&["--scan", "--pattern", "*:cell:*"]).lines().map(str::to_string).collect();
    assert!(!cells.is_empty(), "the key's cell is in the store");
    for cell in &cells {
        let fields = redis.cli(&["HGETALL", cell]);
        let lines: Vec<&str> = fields.lines().collect();
        for pair in lines.chunks(2) {
            let [f, v] = pair else { continue };
            if !f.starts_with("h:") {
                continue;
            }
            let n: Vec<u64> = v.split(',').map(|x| x.parse().unwrap()).collect();
            // granted rate and burst, acked rate and burst, demand.
            assert_eq!([n[0], n[1], n[3], n[4], n[6]], [0; 5], "{cell} {f} = {v}: not released");
        }
    }
}
