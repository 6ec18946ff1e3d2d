//! What flowctl shows: the Prometheus endpoint, `top --once --json` (rules,
//! the CPU signal, the key tables), `top --keys` (the heaviest sources,
//! with and without an agent), `top` in a real terminal, `status`'s SYNs
//! since attach, `status` and `top` narrowed to a namespace, and the
//! agent's JSON logs.

use crate::UDP_RULE;
use flowctl_tests::{
    agent::{Agent, DetachOnDrop},
    cli::{attachment, flowctl, rule, run_dir, top_once},
    lab::Lab,
    tempfile::TempFile,
    tmux::TopPane,
    traffic::{blast, blast_from, connect_many, metrics_get, TcpServer},
};
use serde_json::Value;
use std::time::Duration;

/// The metrics endpoint, served in the namespace the agent was started in,
/// answers in the format the scraper asks for (OpenMetrics for
/// Prometheus' default `Accept`, the classic text format otherwise, which
/// promtool checks clean), with the kernel's numbers (the same as
/// `status --json`).
pub fn metrics_endpoint_matches_status() {
    let lab = Lab::new("fmet", 218);
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--metrics", "127.0.0.1:19464"]);
    blast(&lab, 7000, 1000, 0.5, 800);
    // Served where the agent was started (this namespace), not in the
    // interface's namespace, where a host's Prometheus could not scrape it.
    let resp = metrics_get("127.0.0.1:19464", "/metrics", None);
    let in_ns = Lab::in_ns(&lab.ns_srv, || std::net::TcpStream::connect("127.0.0.1:19464").is_ok());
    assert!(!in_ns, "nothing listens in the interface's namespace");
    let (head, body) = resp.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.") && head.contains(" 200"), "{head}");
    // No Accept header: the classic text format, under its own type; a
    // counter family is named after its samples, and nothing closes it.
    assert!(
        head.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(body.contains("# TYPE flowctl_packets_total counter\n"), "{body}");
    assert!(!body.contains("# EOF"), "{body}");
    // promtool, Prometheus' own checker, reads it without a complaint
    // (served as OpenMetrics under text/plain, it found seven counters
    // without help text).
    let mut check = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool");
    std::io::Write::write_all(&mut check.stdin.take().unwrap(), body.as_bytes()).unwrap();
    let checked = check.wait_with_output().unwrap();
    assert!(
        checked.status.success() && checked.stdout.is_empty() && checked.stderr.is_empty(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    // What Prometheus asks for by default: OpenMetrics, under its type.
    let om = metrics_get(
        "127.0.0.1:19464",
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"),
    );
    let (om_head, om_body) = om.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        om_head
            .to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{om_head}"
    );
    assert!(om_body.ends_with("# EOF\n"), "{om_body}");
    assert!(om_body.contains("# TYPE flowctl_packets counter\n"), "{om_body}");
    // Every line is a comment or `name{labels} value`.
    let mut samples = std::collections::HashMap::new();
    for line in body.lines().filter(|l| !l.is_empty()) {
        if line.starts_with('#') {
            assert!(line.starts_with("# HELP ") || line.starts_with("# TYPE "), "{line}");
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
    // A UDP rule sees no SYNs; the series are there (the SYN counts are
    // checked in status_counts_connections_since_attach).
    assert_eq!(get("flowctl_syns_total{rule=\"udp\",verdict=\"passed\"}"), 0.0);
    assert_eq!(get("flowctl_syns_total{rule=\"udp\",verdict=\"dropped\"}"), 0.0);
    assert_eq!(get("flowctl_rules"), 1.0);
    assert!(get("flowctl_kernel_memory_bytes") > 0.0);
    let missing = metrics_get("127.0.0.1:19464", "/nope", None);
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
    let _detach = DetachOnDrop::new(&lab);
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

/// A real run in a terminal (tmux) with an agent and live traffic: the
/// view draws, the sort key works, the arrow keys and Enter open the
/// selected rule's detail view with its sparklines and the traffic's
/// source among the heaviest keys, Esc goes back, and quitting restores
/// the terminal (the alternate screen is gone).
pub fn top_runs_in_a_terminal_and_restores_it() {
    let lab = Lab::new("ftui", 220);
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let pane = TopPane::start("--interval 0.3", 220, 30, "220x30");
    let s = pane.wait_for(|s| s.contains("sort: profile order"), "`sort: profile order`");
    assert!(s.contains(&lab.veth_srv) && s.contains("udp"), "{s}");
    pane.send_keys("s");
    pane.wait_for(|s| s.contains("sort: offered pps"), "`sort: offered pps`");
    // 600 pps for 6 s against 100/s, while the detail view is open.
    std::thread::scope(|scope| {
        let traffic = scope.spawn(|| blast(&lab, 7000, 600, 6.0, 3600));
        pane.send_keys("Down");
        pane.send_keys("Enter");
        let detail = |s: &str| {
            s.contains("details: udp on")
                && s.contains("heaviest keys now |")
                && s.lines().any(|l| l.contains(&format!("│{} ", lab.ip_cli)))
                && s.lines().any(|l| l.contains("dropped pps") && l.contains('█'))
        };
        let s = pane.wait_for(detail, "the detail view with the client among the heaviest keys");
        println!("the detail view at 220x30, live:\n{s}");
        for line in ["offered pps", "passed pps", "dropped pps"] {
            let l = s.lines().find(|l| l.contains(line)).expect(line);
            assert!(l.chars().any(|c| ('▁'..='█').contains(&c)), "a sparkline for {line}: {l}");
        }
        assert!(s.contains("rate ") && s.contains("since attach"), "drops by reason: {s}");
        pane.send_keys("Escape");
        pane.wait_for(|s| s.contains("sort: offered pps") && !s.contains("details:"), "back");
        traffic.join().unwrap();
    });
    pane.quit_and_check_restored("s sort, p pause");
    agent.stop();
}

/// Every header of `top`'s rule table, and the JSON field of each numeric
/// one (docs/top.md).
const TOP_HEADERS: &[(&str, Option<&str>)] = &[
    ("rule", None),
    ("match", None),
    ("key", None),
    ("limit", None),
    ("offered pps", Some("offered_pps")),
    ("offered bit/s", Some("offered_bps")),
    ("passed pps", Some("passed_pps")),
    ("passed bit/s", Some("passed_bps")),
    ("dropped pps", Some("dropped_pps")),
    ("would-drop pps", Some("would_drop_pps")),
    ("drop %", Some("drop_pct")),
    ("offered pkts", Some("offered_total")),
    ("dropped pkts", Some("dropped_total")),
    ("ratio", Some("admission_ratio")),
    ("SYN/s", Some("syn_offered_ps")),
    ("BBR in/max", None),
    ("KLimiter", None),
    ("top reason", None),
    ("drops 20 s", None),
];

/// Cells of a table line: runs separated by two or more spaces.
fn top_cells(line: &str) -> Vec<String> {
    line.trim()
        .trim_matches('│')
        .split("  ")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// Checks a table (header line, the rule's line) against the JSON reading
/// of the same idle state: no header cut, the priority columns there,
/// every number parses (units k/M/G) and agrees with the JSON within its
/// rounding. Returns the headers shown.
fn check_top_table(header: &str, row: &str, json_rule: &Value, what: &str) -> Vec<String> {
    let headers = top_cells(header);
    for h in &headers {
        assert!(TOP_HEADERS.iter().any(|(k, _)| k == h), "{what}: header `{h}` cut:\n{header}");
    }
    for must in ["rule", "offered pps", "dropped pps", "drop %"] {
        assert!(headers.iter().any(|h| h == must), "{what}: no `{must}` in\n{header}");
    }
    let cells = top_cells(row);
    assert_eq!(cells.len(), headers.len(), "{what}: cells of\n{header}\n{row}");
    for (h, c) in headers.iter().zip(&cells) {
        let Some(field) = TOP_HEADERS.iter().find(|(k, _)| k == h).unwrap().1 else { continue };
        let (num, mult) = match c.chars().last() {
            Some('k') => (&c[..c.len() - 1], 1e3),
            Some('M') => (&c[..c.len() - 1], 1e6),
            Some('G') => (&c[..c.len() - 1], 1e9),
            _ => (c.as_str(), 1.0),
        };
        let v: f64 =
            num.parse().unwrap_or_else(|_| panic!("{what}: `{c}` under `{h}` is not a number"));
        let decimals = num.split_once('.').map_or(0, |(_, d)| d.len()) as i32;
        let tol = 0.5 * 10f64.powi(-decimals) * mult + 1e-9;
        let want = json_rule[field].as_f64().unwrap_or_else(|| panic!("{field} in {json_rule}"));
        assert!(
            (v * mult - want).abs() <= tol,
            "{what}: `{h}` shows {c}, the JSON {field} is {want}"
        );
    }
    headers
}

/// `top` at 80x24, 120x40 and 220x50 in tmux against a kept, idle data
/// plane: no header or number is cut, every number agrees with `top --once
/// --json`, the history starts from what the statistics ring still holds
/// (the drops of a moment ago), `?` opens the legend, Enter the detail
/// view, quitting restores the terminal; `--once` text fits `--width` and
/// prints every column into a pipe.
pub fn top_fits_small_terminals_and_agrees_with_json() {
    let lab = Lab::new("ftfit", 226);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    blast(&lab, 7000, 2000, 1.0, 1500);
    agent.stop();
    // Kept and idle: the counters no longer move.
    let v = top_once(&lab.veth_srv, "0.2");
    let rule = v["attachments"][0]["rules"][0].clone();
    assert_eq!(rule["rule"], "udp", "{v}");
    assert!(rule["dropped_total"].as_u64().unwrap() > 1000, "{rule}");
    let is_header = |l: &str| l.trim_matches(['│', ' ']).starts_with("rule  ");
    let is_row = |l: &str| l.trim_matches(['│', ' ']).starts_with("udp  ");

    // --once as text: fitted to --width, everything into a pipe.
    for width in [80usize, 120] {
        let out = flowctl(&[
            "top",
            &lab.veth_srv,
            "--once",
            "--interval",
            "0.2",
            "--width",
            &width.to_string(),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        println!("top --once --width {width}:\n{text}");
        assert!(text.lines().all(|l| l.chars().count() <= width), "{width}:\n{text}");
        let lines: Vec<&str> = text.lines().collect();
        let header = lines.iter().find(|l| is_header(l)).expect("a header");
        let row = lines.iter().find(|l| is_row(l)).expect("the rule's line");
        check_top_table(header, row, &rule, &format!("--once --width {width}"));
    }
    let out = flowctl(&["top", &lab.veth_srv, "--once", "--interval", "0.2"]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    println!("top --once into a pipe:\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    let shown = check_top_table(
        lines.iter().find(|l| is_header(l)).unwrap(),
        lines.iter().find(|l| is_row(l)).unwrap(),
        &rule,
        "--once into a pipe",
    );
    assert_eq!(shown.len(), TOP_HEADERS.len(), "every column into a pipe:\n{text}");

    for (w, h) in [(80u16, 24u16), (120, 40), (220, 50)] {
        let pane =
            TopPane::start(&format!("{} --interval 0.3", lab.veth_srv), w, h, &format!("{w}x{h}"));
        // Past the first (short-interval) picture, so rates are over 0.3 s.
        std::thread::sleep(Duration::from_millis(800));
        // A whole picture (tmux may be caught mid-draw): header, row, bottom.
        let whole = |s: &str| {
            let header = s.lines().find(|l| is_header(l)).map(top_cells);
            let row = s.lines().find(|l| is_row(l)).map(top_cells);
            header.is_some_and(|h| row.is_some_and(|r| r.len() == h.len()))
                && s.lines().any(|l| l.starts_with('└'))
        };
        let s = pane.wait_for(whole, "the rule's row");
        println!("top at {w}x{h}:\n{s}");
        let lines: Vec<&str> = s.lines().collect();
        assert!(lines.iter().all(|l| l.chars().count() <= w as usize));
        assert!(lines[0].contains("? legend"), "{w}x{h}: the key hint:\n{s}");
        let title = lines.iter().find(|l| l.starts_with('┌')).expect("the block");
        assert!(
            title.contains(&format!("┌ {} (netns {}) | ", lab.veth_srv, lab.ns_srv))
                && title.contains(" | agent not running | up ")
                && (title.trim_end().ends_with("─┐") || title.trim_end().ends_with(" ┐")),
            "{w}x{h}: the title is whole: {title}"
        );
        let header = lines.iter().find(|l| is_header(l)).expect("a header");
        let row = lines.iter().find(|l| is_row(l)).unwrap();
        let shown = check_top_table(header, row, &rule, &format!("{w}x{h}"));
        if w >= 80 {
            assert!(shown.iter().any(|s| s == "would-drop pps"), "{w}x{h}: would-drop fits:\n{s}");
        }
        if w >= 120 {
            for more in ["offered pkts", "dropped pkts", "top reason"] {
                assert!(shown.iter().any(|s| s == more), "{w}x{h}: `{more}` fits:\n{s}");
            }
        }
        if w >= 220 {
            for more in ["match", "key", "limit", "drops 20 s", "offered bit/s"] {
                assert!(shown.iter().any(|s| s == more), "{w}x{h}: `{more}` fits:\n{s}");
            }
        }
        // The history pane of the selected (only) rule. On the first
        // terminal, seconds after the traffic, it starts from the ring: the
        // drops show though nothing moves now.
        let pane_title = s.lines().find(|l| l.contains("┌ udp: last ")).expect(&s);
        assert!(pane_title.contains("a bar per second"), "{w}x{h}: {pane_title}");
        if w == 80 {
            let dropped = s.lines().find(|l| l.contains("│dropped pps ")).expect(&s);
            assert!(
                dropped.chars().any(|c| ('▁'..='█').contains(&c)),
                "{w}x{h}: the ring's drops seed the history:\n{s}"
            );
        }
        pane.send_keys("?");
        let l = pane.wait_for(
            |s| {
                s.contains("legend (? or Esc closes)")
                    && TOP_HEADERS.iter().all(|(hd, _)| s.contains(&format!("{hd}  ")))
                    && s.lines().filter(|l| l.contains('└')).count() >= 2
            },
            "the legend",
        );
        println!("legend at {w}x{h}:\n{l}");
        for (hd, _) in TOP_HEADERS {
            assert!(l.lines().any(|x| x.contains(&format!("{hd}  "))), "{w}x{h}: {hd}:\n{l}");
        }
        pane.send_keys("Escape");
        pane.wait_for(|s| !s.contains("legend (?"), "the legend closing");
        pane.send_keys("Enter");
        let d = pane.wait_for(
            |s| s.contains("details: udp on") && s.lines().any(|l| l.starts_with('└')),
            "the detail view",
        );
        println!("detail at {w}x{h}:\n{d}");
        assert!(d.lines().all(|l| l.chars().count() <= w as usize) && !d.contains('…'), "{d}");
        assert!(d.contains("100/s packets burst 20 per src"), "the limit in full: {d}");
        let total = d.lines().find(|l| l.contains("│dropped ")).expect(&d);
        assert!(
            total.contains(&flowctl::cli::format::si(rule["dropped_total"].as_f64().unwrap())),
            "{w}x{h}: dropped since attach as --json says: {total}"
        );
        assert!(d.contains("heaviest keys now"), "{d}");
        pane.send_keys("Escape");
        pane.wait_for(|s| s.contains("sort: profile order"), "back from the detail view");
        pane.quit_and_check_restored("? legend");
    }
    let out = flowctl(&["detach", &lab.veth_srv, "--netns", &lab.ns_srv]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `status` counts SYNs since attach (new TCP connections: what a
/// `connections` rule limits) per rule and per attachment, in the JSON and
/// the text: exactly the connects made (each one SYN), split into passed
/// and dropped as the connects succeeded or not; with the agent killed (a
/// kept data plane) and again after a new agent adopts it, nothing is lost
/// or counted twice, and the agent's file in the run directory agrees.
pub fn status_counts_connections_since_attach() {
    let lab = Lab::new("fsyn", 229);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"conns\"\nproto = \"tcp\"\ndport = 7400\nunit = \"connections\"\nrate = \"20/s\"\nburst = 5\nkey = \"src\"\n");
    let server = TcpServer::start(&lab, 7400);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let (ok, attempts, _) = connect_many(&lab, 7400, 60, Duration::from_secs(2));
    println!("{attempts} connects, {ok} established");
    assert!(ok >= 5 && ok < attempts, "the limit refused some: {ok} of {attempts}");
    let check = |label: &str, seen: u64, passed: u64| {
        let a = attachment(&lab.veth_srv).expect("attached");
        let r = rule(&lab.veth_srv, "conns");
        let got = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{label}: no {k} in {r}"));
        assert_eq!(
            (got("syn_seen"), got("syn_passed"), got("syn_dropped")),
            (seen, passed, seen - passed),
            "{label}: {r}"
        );
        // Only SYNs are refused by a connections rule.
        assert_eq!(got("dropped_pkts"), seen - passed, "{label}: {r}");
        let t = &a["syn_totals"];
        assert_eq!(
            (t["seen"].clone(), t["dropped"].clone()),
            (seen.into(), (seen - passed).into()),
            "{label}: {a}"
        );
        assert_eq!(t["uncounted_s"], 0.0, "{label}");
        // The text: the rule's row ends with its SYN totals.
        let out = flowctl(&["status", "--netns", &lab.ns_srv]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let header = text.lines().find(|l| l.trim_start().starts_with("rule ")).expect(&text);
        assert!(header.trim_end().ends_with("SYNs  SYNs passed SYNs dropped"), "{label}: {header}");
        let row: Vec<&str> = text
            .lines()
            .find(|l| l.trim_start().starts_with("conns "))
            .expect(&text)
            .split_whitespace()
            .collect();
        assert_eq!(
            row[5..],
            [seen.to_string(), passed.to_string(), (seen - passed).to_string()],
            "{label}:\n{text}"
        );
        assert!(
            text.contains(&format!("SYNs since attach (new TCP connections, every rule): {seen} seen, {passed} passed, {} dropped", seen - passed)),
            "{label}:\n{text}"
        );
        println!("{label}:\n{text}");
    };
    check("with the agent", attempts, ok);
    // The agent's own count, in the run directory, catches up within its
    // period (a second, one bucket behind).
    let file = format!("{}/syn-totals.json", run_dir(&attachment(&lab.veth_srv).unwrap()));
    let on_file = || -> Option<u64> {
        let v: Value = serde_json::from_slice(&std::fs::read(&file).ok()?).ok()?;
        v["records"].as_array()?.iter().find(|r| r["rule"] == "conns")?["seen"].as_u64()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while on_file() != Some(attempts) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(on_file(), Some(attempts), "{file}");
    // Killed: the kept data plane goes on counting in its ring; status adds
    // that to the file's.
    agent.kill9();
    let (ok2, attempts2, _) = connect_many(&lab, 7400, 10, Duration::from_secs(1));
    check("kept, no agent", attempts + attempts2, ok + ok2);
    // A new agent adopts and counts from where the file stopped.
    let agent = Agent::start(&lab, prof.path(), &["--metrics", "127.0.0.1:19465"]);
    check("re-adopted", attempts + attempts2, ok + ok2);
    let metrics = metrics_get("127.0.0.1:19465", "/metrics", None);
    for (verdict, n) in [("passed", ok + ok2), ("dropped", attempts + attempts2 - ok - ok2)] {
        let series = format!("flowctl_syns_total{{rule=\"conns\",verdict=\"{verdict}\"}} {n}");
        assert!(metrics.lines().any(|l| l == series), "{series} in\n{metrics}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while on_file() != Some(attempts + attempts2) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(on_file(), Some(attempts + attempts2), "the adopting agent's file");
    check("re-adopted, counted", attempts + attempts2, ok + ok2);
    assert_eq!(server.stop(), ok + ok2);
    agent.stop();
}

/// `status --netns` and `top --netns` (with or without an interface) show
/// that namespace's attachments only, and an interface is looked up there
/// (another namespace's is not found); a dry-run rule under traffic shows
/// its would-drops in `top --once` (JSON and an 80-column table) while it
/// drops nothing.
pub fn status_and_top_take_netns_and_show_would_drops() {
    let lab = Lab::new("fdry", 245);
    let _detach = DetachOnDrop::new(&lab);
    let other = Lab::new("fdro", 246);
    let _detach_other = DetachOnDrop::new(&other);
    let dry = TempFile::profile("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"dry\"\nproto = \"udp\"\ndport = 7000\nrate = \"100/s\"\nburst = 20\nkey = \"src\"\naction = \"dry-run\"\n");
    let plain = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, dry.path(), &[]);
    let agent_other = Agent::start(&other, plain.path(), &[]);
    let ifaces = |args: &[&str]| -> Vec<String> {
        let out = flowctl(args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let list =
            v.as_array().cloned().unwrap_or_else(|| v["attachments"].as_array().unwrap().clone());
        list.iter().filter_map(|a| a["iface"].as_str().map(String::from)).collect()
    };
    for (l, o) in [(&lab, &other), (&other, &lab)] {
        let only = std::slice::from_ref(&l.veth_srv);
        assert_eq!(ifaces(&["status", "--json", "--netns", &l.ns_srv]), only);
        let text =
            String::from_utf8_lossy(&flowctl(&["status", "--netns", &l.ns_srv]).stdout).to_string();
        assert!(text.contains(&l.veth_srv) && !text.contains(&o.veth_srv), "{text}");
        let top = ["top", "--once", "--json", "--interval", "0.1", "--netns", &l.ns_srv];
        assert_eq!(ifaces(&top), only);
        let top_one =
            ["top", &l.veth_srv, "--once", "--json", "--interval", "0.1", "--netns", &l.ns_srv];
        assert_eq!(ifaces(&top_one), only);
    }
    let all = ifaces(&["status", "--json"]);
    assert!(all.contains(&lab.veth_srv) && all.contains(&other.veth_srv), "{all:?}");
    let out = flowctl(&["status", "--netns", "nosuchns-flowctl"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no network namespace `nosuchns-flowctl`")
    );
    let out = flowctl(&["top", &other.veth_srv, "--netns", &lab.ns_srv, "--once"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("no interface named `{}`", other.veth_srv)), "{err}");
    // 1000 pps against a dry-run 100/s: about 900 would-drops per second.
    let (json, text) = std::thread::scope(|scope| {
        let sender = scope.spawn(|| blast(&lab, 7000, 1000, 3.5, 3500));
        std::thread::sleep(Duration::from_millis(300));
        let j = flowctl(&["top", "--once", "--json", "--interval", "1", "--netns", &lab.ns_srv]);
        let t = flowctl(&[
            "top",
            &lab.veth_srv,
            "--netns",
            &lab.ns_srv,
            "--once",
            "--interval",
            "1",
            "--width",
            "80",
        ]);
        sender.join().unwrap();
        (j, t)
    });
    assert!(json.status.success() && text.status.success());
    let v: Value = serde_json::from_slice(&json.stdout).unwrap();
    let r = &v["attachments"][0]["rules"][0];
    println!("top --once --json, rule dry: {r}");
    assert_eq!(r["rule"], "dry");
    let would = r["would_drop_pps"].as_f64().unwrap();
    assert!(would > 450.0 && would < 1300.0, "would-drop {would} pps, about 900 expected");
    assert_eq!(r["dropped_pps"].as_f64().unwrap(), 0.0, "a dry-run drops nothing");
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    println!("top --once --width 80:\n{text}");
    assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
    let cells = |l: &str| -> Vec<String> {
        l.split("  ").map(str::trim).filter(|c| !c.is_empty()).map(String::from).collect()
    };
    let header = cells(text.lines().find(|l| l.trim_start().starts_with("rule  ")).expect(&text));
    let row = cells(text.lines().find(|l| l.trim_start().starts_with("dry  ")).expect(&text));
    assert_eq!(header.len(), row.len(), "{text}");
    let at = |h: &str| {
        row[header.iter().position(|x| x == h).unwrap_or_else(|| panic!("no {h}:\n{text}"))].clone()
    };
    let would: f64 = at("would-drop pps").trim_end_matches('k').parse().unwrap();
    assert!(would > 450.0 || at("would-drop pps").ends_with('k'), "would-drop {would}:\n{text}");
    assert_eq!(at("dropped pps"), "0", "{text}");
    let st = rule(&lab.veth_srv, "dry");
    assert!(st["would_drop_pkts"].as_u64().unwrap() > 1000 && st["dropped_pkts"] == 0, "{st}");
    agent.stop();
    agent_other.stop();
}

/// `--log-format json`: the agent's stderr is one JSON object per line,
/// its status lines (attached, detached) are events of target
/// `flowctl::status` written once each and never also as text, and aya's
/// own `log` records come through the bridge (`FLOWCTL_LOG=aya=debug`).
pub fn json_logs_carry_every_status_line_once() {
    let lab = Lab::new("fjsn", 248);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(UDP_RULE);
    let log_file = TempFile::new("flowctl-json-log-", ".log", "");
    let log = std::fs::File::create(log_file.path()).unwrap();
    let mut cmd = Agent::attach(&lab, prof.path(), &["--log-format", "json"]);
    cmd.env("FLOWCTL_LOG", "warn,aya=debug").stderr(log);
    let agent = Agent::spawn_until(cmd, || {
        attachment(&lab.veth_srv).is_some_and(|a| a["agent_ready"] == true)
    });
    blast(&lab, 7000, 200, 0.3, 60);
    agent.stop();
    let text = std::fs::read_to_string(log_file.path()).unwrap();
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let status: Vec<&str> = events
        .iter()
        .filter(|e| e["target"] == "flowctl::status")
        .map(|e| e["message"].as_str().unwrap())
        .collect();
    println!("{} events; status lines: {status:?}", events.len());
    let once = |prefix: &str| {
        let n = status.iter().filter(|m| m.starts_with(prefix)).count();
        assert_eq!(n, 1, "one `{prefix}` status event: {status:?}");
    };
    once(&format!("attached to {}", lab.veth_srv));
    once(&format!("detached from {}", lab.veth_srv));
    assert!(
        events.iter().all(|e| e["level"].is_string() && e["timestamp"].is_string()),
        "every event has its level and time"
    );
    assert!(
        events.iter().any(|e| e["target"].as_str().is_some_and(|t| t.starts_with("aya"))),
        "aya's log records are bridged: {} events",
        events.len()
    );
}

/// Kernel events end to end: an agent started with
/// `FLOWCTL_LOG=warn,flowctl::kernel=debug` loads the program with its
/// events on; evasive frames (five VLAN tags) sent through the veth are
/// dropped, and one event per second (per CPU) with the frame's first bytes
/// reaches the agent's JSON log under target `flowctl::kernel`. Without
/// that directive (the default `warn`), the same frames log nothing.
pub fn kernel_events_reach_the_agents_log_when_asked() {
    let lab = Lab::new("fkev", 249);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(UDP_RULE);
    let mut tagged = flowctl_tests::packet::V4::new([10, 201, 249, 2]);
    tagged.vlans = vec![10, 20, 30, 40, 50];
    let frame = tagged.build(flowctl_tests::packet::L4::Udp { sport: 9, dport: 7000 }, 16);
    let hex: String = frame[..64].iter().map(|b| format!("{b:02x}")).collect();
    for (filter, want) in [("warn,flowctl::kernel=debug", true), ("warn", false)] {
        let log_file = TempFile::new("flowctl-kernel-log-", ".log", "");
        let log = std::fs::File::create(log_file.path()).unwrap();
        let mut cmd = Agent::attach(&lab, prof.path(), &["--log-format", "json"]);
        cmd.env("FLOWCTL_LOG", filter).stderr(log);
        let agent = Agent::spawn_until(cmd, || {
            attachment(&lab.veth_srv).is_some_and(|a| a["agent_ready"] == true)
        });
        let (dev, f) = (lab.veth_cli.clone(), frame.clone());
        // Twenty frames over about two seconds: two or three sampled events.
        Lab::in_ns(&lab.ns_cli, move || {
            let sock = flowctl_tests::packet_socket::PacketSocket::on(&dev);
            for _ in 0..20 {
                sock.send(&f);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let dropped = attachment(&lab.veth_srv).unwrap()["unmatched"]["dropped_by_reason"]
            ["evasive"]
            .as_u64()
            .unwrap_or(0);
        // The relay reads the ring every 200 ms.
        std::thread::sleep(Duration::from_millis(500));
        agent.stop();
        let text = std::fs::read_to_string(log_file.path()).unwrap();
        let kernel: Vec<String> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["target"] == "flowctl::kernel")
            .map(|e| e["message"].as_str().unwrap_or("").to_string())
            .collect();
        println!(
            "FLOWCTL_LOG={filter}: {dropped} evasive frames dropped; kernel events: {kernel:?}"
        );
        assert_eq!(dropped, 20, "every evasive frame dropped");
        if want {
            assert!(
                (1..=6).contains(&kernel.len())
                    && kernel
                        .iter()
                        .all(|m| m.starts_with(&format!("evasive frame of {} bytes", frame.len()))
                            && m.contains(&hex)),
                "sampled events with the frame's bytes: {kernel:?}"
            );
        } else {
            assert!(kernel.is_empty(), "off by default: {kernel:?}");
        }
    }
}
