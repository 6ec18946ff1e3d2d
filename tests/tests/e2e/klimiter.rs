//! KLimiter end to end: a gauge file and the TC egress counter as a
//! baseline's level, the low-priority rules cut first, the level held.

use flowctl_tests::{
    agent::Agent,
    cli::top_once,
    lab::{veth_pair, Lab, Netns},
    need::in_vm,
    tempfile::TempFile,
    traffic::UdpStreams,
};
use serde_json::Value;
use std::{
    net::UdpSocket,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

/// Rule `name` of an attachment in `top --json`.
fn rule_of<'a>(a: &'a Value, name: &str) -> &'a Value {
    a["rules"].as_array().unwrap().iter().find(|r| r["rule"] == name).unwrap()
}

/// A rule's admission ratio in `top --json`.
fn ratio(a: &Value, rule: &str) -> f64 {
    rule_of(a, rule)["admission_ratio"].as_f64().unwrap()
}

/// KLimiter end to end: a gauge file says the database is over its
/// threshold; the agent cuts the low-priority rule first (its admitted
/// traffic falls with its ratio), shows why in `top`, holds when the gauge
/// turns to garbage, and releases once the level is low.
pub fn klimiter_cuts_low_priority_first_and_holds_on_garbage() {
    let lab = Lab::new("fklim", 224);
    let gauge = TempFile::new("flowctl-e2e-gauge-", "", "300\n");
    let prof = TempFile::profile(&format!(
        "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n\
[klimiter]\nsample_period = \"200ms\"\ncontrol_period = \"400ms\"\nstale_after = \"2s\"\n\
[[rule]]\nname = \"batch\"\nproto = \"udp\"\ndport = 7700\nrate = \"1000000/s\"\nadmission = \"packet\"\npriority = 0.0\n\
[[rule]]\nname = \"checkout\"\nproto = \"udp\"\ndport = 7701\nrate = \"1000000/s\"\npriority = 0.9\n\
[[baseline]]\nname = \"db\"\nthreshold = 60\nentries = [\"batch\", \"checkout\"]\nsource = {{ kind = \"gauge\", file = \"{}\" }}\n",
        gauge.path()
    ));
    let agent = Agent::start(&lab, prof.path(), &[]);
    let top = || top_once(&lab.veth_srv, "0.5")["attachments"][0].clone();
    // Traffic on both rules for the whole test (bounded: 30 s at most).
    let streams =
        UdpStreams::start(&lab, &[7700, 7701], Duration::from_millis(5), Duration::from_secs(30));
    // Over the threshold: both are cut 0.05 per period until checkout sits
    // at its floor of 0.9; batch keeps going down.
    std::thread::sleep(Duration::from_secs(5));
    let a = top();
    let k = a["klimiter"].clone();
    println!("cutting: batch {} checkout {}; {}", ratio(&a, "batch"), ratio(&a, "checkout"), k);
    assert_eq!(k["baselines"][0]["band"], "cut");
    assert_eq!(k["baselines"][0]["level"], 300.0);
    assert!(ratio(&a, "checkout") >= 0.9 - 1e-6, "checkout's priority floor holds in round 1");
    assert!(
        ratio(&a, "batch") < 0.7,
        "batch is cut below checkout's floor: {}",
        ratio(&a, "batch")
    );
    let reason = k["entries"].as_array().unwrap().iter().find(|e| e["rule"] == "batch").unwrap()
        ["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.starts_with("cut") && reason.contains("db: level 300.0 over threshold 60.0"),
        "{reason}"
    );
    // The kernel admits batch at about its ratio (per packet).
    let r = rule_of(&a, "batch").clone();
    let frac = r["passed_pps"].as_f64().unwrap() / r["offered_pps"].as_f64().unwrap().max(1.0);
    assert!(
        (frac - ratio(&a, "batch")).abs() < 0.25,
        "admitted fraction {frac} vs ratio {}",
        ratio(&a, "batch")
    );
    assert!(r["top_reason"] == "admission", "{r}");
    // Garbage: hold.
    gauge.write("banana\n");
    std::thread::sleep(Duration::from_millis(900));
    let held = ratio(&top(), "batch");
    std::thread::sleep(Duration::from_millis(600));
    let a = top();
    assert_eq!(a["klimiter"]["baselines"][0]["band"], "stale");
    assert!(
        (ratio(&a, "batch") - held).abs() < 1e-9,
        "garbage never cuts: {held} -> {}",
        ratio(&a, "batch")
    );
    // A low level: ratios climb back.
    gauge.write("10\n");
    std::thread::sleep(Duration::from_secs(3));
    let a = top();
    println!("recovering: batch {} checkout {}", ratio(&a, "batch"), ratio(&a, "checkout"));
    assert!(ratio(&a, "batch") > held, "released");
    streams.stop();
    agent.stop();
}

/// KLimiter's kernel-assisted case: a relay in the protected namespace sends
/// a downstream (a third namespace) two packets per admitted packet of the
/// low-priority rule and one per packet of the high-priority rule; the TC
/// egress counter on the link to the downstream is the baseline's level.
/// Both entries start above the threshold; the level is held within 5% of
/// it, the low-priority entry cut first.
pub fn klimiter_holds_an_egress_level_by_cutting_low_priority_first() {
    let lab = Lab::new("fegr", 225);
    // The downstream: a third namespace behind a second veth pair.
    let down = format!("{}d", &lab.ns_srv[..lab.ns_srv.len() - 1]);
    let (a, b) = (
        format!("{}a", &lab.veth_srv[..lab.veth_srv.len() - 2]),
        format!("{}b", &lab.veth_srv[..lab.veth_srv.len() - 2]),
    );
    let _down_ns = Netns::new(&down);
    veth_pair([(&lab.ns_srv, &a, "10.201.226.1/24"), (&down, &b, "10.201.226.2/24")]);
    let prof = TempFile::profile(&format!(
        "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n\
[klimiter]\nsample_period = \"200ms\"\ncontrol_period = \"1s\"\n\
[[rule]]\nname = \"low\"\nproto = \"udp\"\ndport = 7800\nrate = \"1000000/s\"\nadmission = \"packet\"\npriority = 0.0\n\
[[rule]]\nname = \"high\"\nproto = \"udp\"\ndport = 7801\nrate = \"1000000/s\"\nadmission = \"packet\"\npriority = 0.8\n\
[[baseline]]\nname = \"downstream\"\nthreshold = 1200\nentries = [\"low\", \"high\"]\n\
source = {{ kind = \"egress\", iface = \"{a}\", dst = \"10.201.226.2/32\", dport = 9000, proto = \"udp\" }}\n"
    ));
    let agent = Agent::start(&lab, prof.path(), &[]);
    let stop = Arc::new(AtomicBool::new(false));
    // The relay: what the XDP program admits reaches these sockets.
    let relayed = Arc::new(AtomicU64::new(0));
    let relay = {
        let (stop, ns, ip, relayed) =
            (stop.clone(), lab.ns_srv.clone(), lab.ip_srv.clone(), relayed.clone());
        std::thread::spawn(move || {
            flowctl::system::netns::enter_netns(&ns).unwrap();
            let rx = [
                UdpSocket::bind(format!("{ip}:7800")).unwrap(),
                UdpSocket::bind(format!("{ip}:7801")).unwrap(),
            ];
            for s in &rx {
                s.set_nonblocking(true).unwrap();
            }
            let tx = UdpSocket::bind("10.201.226.1:0").unwrap();
            let mut buf = [0u8; 64];
            while !stop.load(Ordering::Relaxed) {
                let mut idle = true;
                for (k, s) in rx.iter().enumerate() {
                    while s.recv(&mut buf).is_ok() {
                        idle = false;
                        for _ in 0..(2 - k) {
                            if tx.send_to(b"q", "10.201.226.2:9000").is_ok() {
                                relayed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
                if idle {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
    };
    // 800 packets/s offered to each rule: 2400 downstream packets/s at full
    // admission, twice the threshold (high rates keep the per-packet
    // admission's sampling noise to ~2% per period). The duration is only
    // the streams' bound: they are stopped once the samples are taken. In a
    // VM the settling and twelve `top` samples took 70-90 s of the 120 s
    // this bound was (2026-12-07), so a slower machine would have sampled
    // after the streams ended.
    let streams = UdpStreams::start(
        &lab,
        &[7800, 7801],
        Duration::from_micros(1250),
        Duration::from_secs(if in_vm() { 300 } else { 40 }),
    );
    let top = || top_once(&lab.veth_srv, "0.2")["attachments"][0].clone();
    let first = top();
    println!("start: level {}", first["klimiter"]["baselines"][0]["level"]);
    // Settle: both cut 0.05 a period until "high" sits at 0.8 (4 periods),
    // then "low" on to about 0.34 (another 9): 13 periods of 1 s, and margin.
    std::thread::sleep(Duration::from_secs(17));
    // Each published level is one control period's mean of 200 ms rates of
    // ~1200 packets/s: the mean of twelve periods is the held level.
    let mut levels = Vec::new();
    let mut last = Value::Null;
    for _ in 0..12 {
        last = top();
        levels.push(last["klimiter"]["baselines"][0]["level"].as_f64().unwrap_or(0.0));
        std::thread::sleep(Duration::from_millis(1000));
    }
    println!("relayed {} packets", relayed.load(Ordering::Relaxed));
    println!(
        "held: levels {levels:?}; low {} high {}; {}",
        ratio(&last, "low"),
        ratio(&last, "high"),
        last["klimiter"]
    );
    streams.stop();
    stop.store(true, Ordering::Relaxed);
    relay.join().unwrap();
    agent.stop();
    let mean = levels.iter().sum::<f64>() / levels.len() as f64;
    // Under TCG (the kernel matrix's VMs) the relay and the senders run at
    // whatever speed emulation leaves them: rates are not the point there,
    // the egress counter's attachment and the cut order are. On the host the
    // level is held within 5%.
    let tolerance = if in_vm() { 0.5 } else { 0.05 };
    assert!(
        (mean - 1200.0).abs() <= tolerance * 1200.0,
        "the level is held within {:.0}% of 1200: mean {mean:.0} of {levels:?}",
        tolerance * 100.0
    );
    assert!(
        ratio(&last, "high") >= 0.8 - 1e-6,
        "the high-priority entry stays at or above its floor"
    );
    assert!(ratio(&last, "low") < ratio(&last, "high"), "the low-priority entry was cut first");
}
