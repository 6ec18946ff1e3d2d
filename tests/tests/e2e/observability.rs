//! What flowctl shows: the Prometheus endpoint, `top --once --json` (rules,
//! the CPU signal, the key tables), `top --keys` (the heaviest sources,
//! with and without an agent) and `top` in a real terminal.

use crate::UDP_RULE;
use flowctl_tests::{
    agent::Agent,
    cli::{bin, flowctl, rule, top_once},
    lab::Lab,
    tempfile::TempFile,
    traffic::{blast, blast_from, http_get},
};
use serde_json::Value;
use std::{
    process::Command,
    time::{Duration, Instant},
};

/// The metrics endpoint serves valid text exposition format whose numbers
/// are the kernel's (the same as `status --json`).
pub fn metrics_endpoint_matches_status() {
    let lab = Lab::new("fmet", 218);
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--metrics", "127.0.0.1:19464"]);
    blast(&lab, 7000, 1000, 0.5, 800);
    let resp = http_get(&lab.ns_srv, "127.0.0.1:19464", "/metrics");
    let (head, body) = resp.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.") && head.contains(" 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: text/plain"), "{head}");
    // Every line is a comment or `name{labels} value`.
    let mut samples = std::collections::HashMap::new();
    for line in body.lines().filter(|l| !l.is_empty()) {
        if line.starts_with('#') {
            assert!(
                line.starts_with("# HELP ") || line.starts_with("# TYPE ") || line == "# EOF",
                "{line}"
            );
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line}"));
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && name.starts_with("flowctl_"),
            "{name}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "{series}"
            );
        }
        samples.insert(series.to_string(), v);
    }
    let r = rule(&lab.veth_srv, "udp");
    let get = |k: &str| *samples.get(k).unwrap_or_else(|| panic!("missing {k} in\n{body}"));
    assert_eq!(
        get("flowctl_offered_packets_total{rule=\"udp\"}") as u64,
        r["offered_pkts"].as_u64().unwrap()
    );
    assert_eq!(
        get("flowctl_packets_total{rule=\"udp\",verdict=\"passed\",reason=\"\"}") as u64,
        r["passed_pkts"].as_u64().unwrap()
    );
    assert_eq!(
        get("flowctl_packets_total{rule=\"udp\",verdict=\"dropped\",reason=\"rate\"}") as u64,
        r["dropped_by_reason"]["rate"].as_u64().unwrap()
    );
    assert_eq!(get("flowctl_admission_ratio{rule=\"udp\"}"), 1.0);
    assert_eq!(get("flowctl_rules"), 1.0);
    assert!(get("flowctl_kernel_memory_bytes") > 0.0);
    let missing = http_get(&lab.ns_srv, "127.0.0.1:19464", "/nope");
    assert!(missing.contains(" 404"), "{missing}");
    agent.stop();
}

/// `top --once --json` agrees with what the harness sent, and its totals
/// with `status`.
pub fn top_once_json_agrees_with_traffic() {
    let lab = Lab::new("ftop", 219);
    let prof = TempFile::profile("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"udp\"\nproto = \"udp\"\ndport = 7000\nrate = \"100/s\"\nburst = 20\nkey = \"src\"\n");
    let agent = Agent::start(&lab, prof.path(), &[]);
    let (sent, secs, v) = std::thread::scope(|scope| {
        let sender = scope.spawn(|| blast(&lab, 7000, 1000, 2.5, 3000));
        std::thread::sleep(Duration::from_millis(500));
        let out = flowctl(&["top", "--once", "--json", "--interval", "1"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let (sent, first, last) = sender.join().unwrap();
        (sent, last.duration_since(first).as_secs_f64(), v)
    });
    assert_eq!(v["schema"], 1);
    let a = v["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["iface"] == lab.veth_srv.as_str())
        .unwrap()
        .clone();
    let r = a["rules"][0].clone();
    let rate = sent as f64 / secs;
    println!(
        "harness sent {rate:.0} pps; top: offered {} passed {} dropped {} drop% {}",
        r["offered_pps"], r["passed_pps"], r["dropped_pps"], r["drop_pct"]
    );
    let offered = r["offered_pps"].as_f64().unwrap();
    assert!(offered > 0.7 * rate && offered < 1.3 * rate, "offered {offered} vs sent {rate}");
    let passed = r["passed_pps"].as_f64().unwrap();
    assert!(
        (100.0 * 0.75..=100.0 * 1.25 + 20.0).contains(&passed),
        "passed {passed} pps against a 100/s limit"
    );
    assert_eq!(r["top_reason"], "rate");
    // The agent's CPU signal (host source by default), from its record.
    let cpu = a["cpu"].as_str().unwrap();
    assert!(cpu.ends_with("% (host)"), "{cpu}");
    let permille = a["cpu_permille"].as_u64().expect("cpu_permille with a running agent");
    assert!(permille <= 1000);
    // One client source: the source cache holds exactly one entry (the
    // agent walked the empty table at start, the insert counter adds it).
    let sources = a["key_tables"]
        .as_array()
        .expect("key tables with a running agent")
        .iter()
        .find(|t| t["table"] == "sources")
        .unwrap()
        .clone();
    assert_eq!(sources["entries"], 1, "{sources}");
    assert!(a["key_tables_note"].as_str().unwrap().starts_with("approximate"));
    // After the traffic: totals agree with status exactly.
    let out = flowctl(&["top", "--once", "--json", "--interval", "0.2", &lab.veth_srv]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let r2 = &v["attachments"][0]["rules"][0];
    let st = rule(&lab.veth_srv, "udp");
    assert_eq!(r2["offered_total"], st["offered_pkts"]);
    assert_eq!(r2["offered_total"].as_u64().unwrap(), sent);
    assert_eq!(r2["offered_pps"].as_f64().unwrap(), 0.0);
    agent.stop();
}

/// `top --keys` names the heaviest sources in order with rates near what
/// was sent, through the agent and, with the agent gone (--keep), by
/// sampling itself.
pub fn top_keys_finds_the_heaviest_sources() {
    let lab = Lab::new("fkey", 222);
    let srcs = ["10.201.222.10", "10.201.222.11", "10.201.222.12"];
    for a in srcs {
        lab.add_client_address(a);
    }
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let run_phase = |label: &str| {
        let (v, sent) = std::thread::scope(|scope| {
            let lab = &lab;
            let senders: Vec<_> = srcs
                .iter()
                .zip([600u64, 200, 50])
                .map(|(a, pps)| scope.spawn(move || blast_from(lab, a, 7000, pps, 3.5, u64::MAX).0))
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            let out = flowctl(&[
                "top",
                &lab.veth_srv,
                "--keys",
                "udp",
                "--once",
                "--json",
                "--interval",
                "2.5",
                "--count",
                "5",
            ]);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let v: Value = serde_json::from_slice(&out.stdout).unwrap();
            let sent: Vec<u64> = senders.into_iter().map(|h| h.join().unwrap()).collect();
            (v, sent)
        });
        println!("{label}: sent {sent:?} over 3.5 s; top --keys: {v}");
        let keys = v["keys"].as_array().unwrap();
        assert!(keys.len() >= 3, "{v}");
        for (i, (addr, pps)) in srcs.iter().zip([600.0, 200.0]).enumerate() {
            assert_eq!(keys[i]["key"], *addr, "{label}: rank {i}");
            let est = keys[i]["pps"].as_f64().unwrap();
            assert!(
                est > 0.6 * pps && est < 1.4 * pps,
                "{label}: {addr} estimated {est} pps, sent {pps}"
            );
        }
        assert!(
            v["bound_pps"].as_f64().unwrap() >= 0.0 && v["sample_every"].as_u64().unwrap() >= 1
        );
    };
    run_phase("through the agent");
    agent.stop();
    // Agent-computed fields say so at once, never the stopped agent's values.
    let v = top_once(&lab.veth_srv, "0.1");
    let a = &v["attachments"][0];
    assert_eq!(
        (a["agent_running"].clone(), a["cpu"].clone()),
        (Value::Bool(false), Value::from("agent not running"))
    );
    assert!(a["cpu_permille"].is_null() && a["key_tables"].is_null(), "{a}");
    run_phase("without an agent");
    let g = flowctl(&["status", "--json"]);
    assert!(g.status.success());
    let out = flowctl(&["detach", &lab.veth_srv, "--netns", &lab.ns_srv]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A real run in a terminal (tmux): the view draws, the sort key works, and
/// quitting restores the terminal (the alternate screen is gone).
pub fn top_runs_in_a_terminal_and_restores_it() {
    let lab = Lab::new("ftui", 220);
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let session = flowctl_tests::unique("flowctl-top-");
    let tmux = |args: &[&str]| Command::new("tmux").args(args).output().expect("tmux");
    // The exit status goes to a file: tmux's #{pane_dead_status} is not
    // always filled in by the time the pane is reported dead.
    let status_file = std::env::temp_dir().join(format!("{session}.status"));
    let _ = std::fs::remove_file(&status_file);
    let cmd = format!(
        "sh -c '{} top --interval 0.3; echo $? > {}'",
        bin().display(),
        status_file.display()
    );
    let out = tmux(&["new-session", "-d", "-s", &session, "-x", "220", "-y", "30", &cmd]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    tmux(&["set-option", "-t", &session, "remain-on-exit", "on"]);
    let screen = || {
        String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", &session]).stdout).to_string()
    };
    let wait_for = |needle: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = screen();
            if s.contains(needle) {
                return s;
            }
            assert!(Instant::now() < deadline, "`{needle}` never appeared:\n{s}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let s = wait_for("sort: profile order");
    assert!(s.contains(&lab.veth_srv) && s.contains("udp"), "{s}");
    tmux(&["send-keys", "-t", &session, "s"]);
    wait_for("sort: offered pps");
    tmux(&["send-keys", "-t", &session, "q"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dead = String::from_utf8_lossy(
            &tmux(&["display-message", "-p", "-t", &session, "#{pane_dead} #{alternate_on}"])
                .stdout,
        )
        .trim()
        .to_string();
        if dead.starts_with('1') {
            assert_eq!(dead, "1 0", "the alternate screen is off");
            let status = std::fs::read_to_string(&status_file).unwrap_or_default();
            assert_eq!(status.trim(), "0", "top exited with status 0");
            let _ = std::fs::remove_file(&status_file);
            break;
        }
        assert!(Instant::now() < deadline, "top did not quit: {dead}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!screen().contains("keys: s sort"), "the TUI is gone from the screen");
    tmux(&["kill-session", "-t", &session]);
    agent.stop();
}
