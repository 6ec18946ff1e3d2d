//! `cargo xtask demo fleet` runs this: the fleet variant of the demo
//! (docs/fleet.md). With a built flowctl (FLOWCTL_BIN), it starts a real
//! etcd and a real Redis, each in a namespace of its own, makes three
//! throwaway labs, publishes one profile to etcd (one global per-source
//! rule and its `[fleet]` section), attaches an agent per lab following
//! that profile, sends skewed UDP traffic from one source address to all
//! three hosts, prints each host's admitted rate and the fleet's against
//! the global limit every second, then `status` (one agent's leases) and
//! `status --fleet` (the rollout), and cleans up: agents stopped, servers
//! killed by PID, namespaces removed (the harnesses' drops, also when it
//! fails midway).

use flowctl_tests::{
    agent::Agent,
    cli::{agent_ready, flowctl},
    etcd::{wait_for, Etcd, TempDir},
    fleet_lab::{add_source, counters, store_sees_fleet, BURST, DPORT, RATE, SRC},
    lab::{sh, Lab},
    redis::{Redis, PORT as REDIS_PORT},
    tempfile::TempFile,
    traffic::blast_from,
    unique,
};
use std::{
    error::Error,
    process::Output,
    time::{Duration, Instant},
};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// Redis's one address that every lab reaches (on its loopback, routed to
/// over each lab's own link), so one profile names it for all agents.
const REDIS_IP: &str = "10.204.0.1";
/// Offered per host, packets per second: skewed.
const OFFERED: [u64; 3] = [600, 300, 100];
const SECS: u64 = 10;
/// The labs' subnets (10.201.S.0/24, and S on the etcd and Redis links).
const SUBNETS: [u8; 3] = [236, 237, 238];

fn profile(redis: &Redis) -> String {
    format!(
        "# The demo fleet's profile: one global rule, shared by every agent.\n{}",
        flowctl_tests::fleet_lab::profile(
            &redis.access(&format!("redis://{REDIS_IP}:{REDIS_PORT}"))
        )
    )
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}

/// The block of `status` (text) about `iface`: its headline and the
/// indented lines under it (status lists every attachment on the host).
fn status_of(iface: &str) -> String {
    let all = text(&flowctl(&["status"]));
    let head = format!("{iface} (");
    let mut lines = all.lines().skip_while(|l| !l.starts_with(&head));
    let mut block: Vec<&str> = lines.next().into_iter().collect();
    block.extend(lines.take_while(|l| l.starts_with(' ')));
    block.join("\n")
}

fn main() -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        return Err("the demo creates network namespaces and loads XDP: run `sudo -E cargo xtask demo fleet`".into());
    }
    std::env::var_os(flowctl_tests::cli::BIN_ENV)
        .ok_or("set FLOWCTL_BIN (cargo xtask demo fleet does)")?;
    let t_start = Instant::now();

    // The stores, each in its own namespace; dropped last (declared first).
    let mut etcd = Etcd::start("fde");
    let mut redis = Redis::start("fdr");
    sh(&["ip", "-n", &redis.net.ns.0, "addr", "add", &format!("{REDIS_IP}/32"), "dev", "lo"]);
    println!(
        "etcd in {} (127.0.0.1:2379 there), redis in {} ({REDIS_IP}:{REDIS_PORT})",
        etcd.net.ns.0, redis.net.ns.0
    );

    // Three labs; each protected side gets a link to etcd and one to Redis
    // (with a route to Redis's shared address), each client the fleet's
    // one source address.
    let labs: Vec<Lab> =
        SUBNETS.iter().enumerate().map(|(i, &s)| Lab::new(&format!("fdl{i}"), s)).collect();
    let mut endpoints = Vec::new();
    for (i, (lab, &s)) in labs.iter().zip(&SUBNETS).enumerate() {
        endpoints.push(etcd.link(lab, s));
        let via = redis.net.link(lab, s);
        sh(&["ip", "-n", &lab.ns_srv, "route", "add", &format!("{REDIS_IP}/32"), "via", &via]);
        add_source(lab);
        println!(
            "lab {}: {} ({}) <-> {} ({} and {SRC}); etcd at {}, redis via {via}",
            i + 1,
            lab.ns_cli,
            lab.ip_cli,
            lab.ns_srv,
            lab.ip_srv,
            endpoints.last().unwrap(),
        );
    }

    // One profile for the fleet, published to etcd (from etcd's namespace).
    let prefix = format!("/flowctl-demo/{}", unique("fleet"));
    let file = TempFile::profile(&profile(&redis));
    let out = etcd.flowctl(&["publish", &Etcd::local_url(&prefix), file.path()]);
    if !out.status.success() {
        return Err(format!("publish: {}", text(&out)).into());
    }
    println!("\n$ flowctl publish {} PROFILE\n{}", Etcd::local_url(&prefix), indent(&text(&out)));
    print!("{}", indent(&profile(&redis)));

    // An agent per lab following it.
    let cache = TempDir::new("flowctl-demo-etcd-cache-");
    let mut agents = Vec::new();
    for (lab, ep) in labs.iter().zip(&endpoints) {
        let url = format!("etcd://{ep}{prefix}");
        let cmd = Agent::attach(lab, &url, &["--etcd-cache", cache.path()]);
        let iface = lab.veth_srv.clone();
        agents.push(Agent::spawn_until(cmd, move || agent_ready(&iface)));
        println!("attached {} in {} with --profile {url}", lab.veth_srv, lab.ns_srv);
    }
    let fleet = ["status", "--fleet", &Etcd::local_url(&prefix)];
    let rolled = wait_for("every agent current", Duration::from_secs(20), || {
        etcd.flowctl(&fleet).status.success()
    });
    let seen = wait_for("every agent sees Redis and 3 hosts", Duration::from_secs(20), || {
        labs.iter().all(store_sees_fleet)
    });
    println!(
        "\nall 3 agents apply the profile ({:.1} s after the last attach) and see Redis with 3 live hosts",
        (rolled + seen).as_secs_f64()
    );
    println!(
        "\n$ flowctl status --fleet {}\n{}",
        Etcd::local_url(&prefix),
        indent(&text(&etcd.flowctl(&fleet)))
    );

    // Skewed traffic from the one source to all three hosts for SECS s,
    // read every second from the kernels' counters.
    println!(
        "{SRC} sends UDP to port {DPORT} of each host at {} pps for {SECS} s; the fleet may admit {RATE}/s (burst {BURST}):\n",
        OFFERED.map(|p| p.to_string()).join(", ")
    );
    let head: Vec<String> = (1..=labs.len()).map(|i| format!("host {i} (offered)")).collect();
    println!("  {:>4}  {:>18} {:>18} {:>18}  {:>8}", "t", head[0], head[1], head[2], "fleet");
    let mut status_at_8s = String::new();
    let before = counters(&labs)?;
    let (span, samples) = std::thread::scope(|s| -> Result<_> {
        let senders: Vec<_> = labs
            .iter()
            .zip(OFFERED)
            .map(|(lab, pps)| {
                s.spawn(move || blast_from(lab, SRC, DPORT, pps, SECS as f64, pps * SECS))
            })
            .collect();
        let t0 = Instant::now();
        let mut prev = before.clone();
        let mut samples = Vec::new();
        for k in 1..=SECS {
            if let Some(d) = (t0 + Duration::from_secs(k)).checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
            let now = counters(&labs)?;
            let d: Vec<(u64, u64)> =
                now.iter().zip(&prev).map(|(a, b)| (a.0 - b.0, a.1 - b.1)).collect();
            let fleet: u64 = d.iter().map(|x| x.1).sum();
            let cell = |(o, p): (u64, u64)| format!("{p:>5}/s ({o:>4}/s)");
            let note = if fleet == 0 {
                "  (learning: a fresh store grants nothing for one lease)"
            } else {
                ""
            };
            println!(
                "  {:>3}s  {:>18} {:>18} {:>18}  {:>6}/s{note}",
                k,
                cell(d[0]),
                cell(d[1]),
                cell(d[2]),
                fleet,
            );
            samples.push(fleet);
            prev = now;
            if k == SECS - 2 {
                status_at_8s = status_of(&labs[0].veth_srv);
            }
        }
        let spans: Vec<(Instant, Instant)> = senders
            .into_iter()
            .map(|h| h.join().expect("a sender panicked"))
            .map(|(_, a, b)| (a, b))
            .collect();
        let first = spans.iter().map(|s| s.0).min().unwrap();
        let last = spans.iter().map(|s| s.1).max().unwrap();
        Ok((last.duration_since(first).as_secs_f64(), samples))
    })?;
    // The last packets may still be on their way to the counters.
    std::thread::sleep(Duration::from_millis(200));
    let after = counters(&labs)?;
    let got: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a.1 - b.1).collect();
    let total: u64 = got.iter().sum();
    let bound = RATE as f64 * span + BURST as f64;
    // Steady: the seconds after the store's first lease (learning) ended.
    let steady: Vec<u64> = samples.iter().copied().skip_while(|&n| n == 0).skip(1).collect();
    println!(
        "\nin {span:.1} s the fleet admitted {total} ({} per host), under the bound L*t + B = {bound:.0}",
        got.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" + ")
    );
    if !steady.is_empty() {
        let rate = steady.iter().sum::<u64>() as f64 / steady.len() as f64;
        println!(
            "fleet admitted {rate:.0}/s against the global limit {RATE}/s (the last {} s; {:.0}% of L), while {} pps were offered",
            steady.len(),
            100.0 * rate / RATE as f64,
            OFFERED.iter().sum::<u64>()
        );
    }
    if total as f64 > bound + 0.05 * RATE as f64 {
        return Err(format!("the fleet admitted {total}, over L*t + B = {bound:.0}").into());
    }

    println!(
        "\n$ flowctl status   (host 1, at {} s while traffic flowed)\n{}",
        SECS - 2,
        indent(&status_at_8s)
    );

    for a in agents {
        a.stop();
    }
    drop(labs);
    drop(redis);
    drop(etcd);
    println!(
        "demo done in {:.0} s: agents stopped, XDP detached, etcd and redis killed, namespaces removed",
        t_start.elapsed().as_secs_f64()
    );
    Ok(())
}
