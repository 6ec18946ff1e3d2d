//! Profiles from etcd (docs/fleet.md, "Profiles from etcd"): a real etcd
//! the test starts in its own namespace, linked by a veth to each agent's
//! lab; `flowctl publish` and `status --fleet` run in etcd's namespace.
//! Rollout to every agent (timed), a bad profile rejected whole (the error
//! with key, line and column in `status`, the metrics and `status
//! --fleet`), etcd gone (enforcement goes on, an agent restarted starts
//! from its disk copy), one agent cut off across a compaction (it relists
//! and lands on the newest, never on anything in between),
//! authentication, and TLS with client certificates.

use flowctl_tests::{
    agent::Agent,
    cli::{attachment, rule},
    etcd::{wait_for, Etcd, Pki, TempDir},
    lab::Lab,
    tempfile::TempFile,
    traffic::blast,
    unique,
};
use serde_json::Value;
use std::{
    process::{Output, Stdio},
    time::{Duration, Instant},
};

/// Silence after which an agent reconnects its watch (seconds), short for
/// the tests; etcd sends progress every second (`Etcd::start`).
const WATCH_TIMEOUT: &str = "3";

/// One UDP rule on port 7100 named `name`: `burst` packets per source, then
/// one an hour, so a count of passed packets is exact. Each profile names
/// its rule anew, so its counters start at zero when it is applied.
fn slow(name: &str, burst: u32) -> String {
    format!("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"{name}\"\nproto = \"udp\"\ndport = 7100\nrate = \"1/h\"\nburst = {burst}\nkey = \"src\"\n")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// `flowctl publish` from etcd's namespace; the generation it wrote.
fn publish(etcd: &Etcd, prefix: &str, profile: &str, extra: &[&str]) -> u64 {
    let f = TempFile::profile(profile);
    let url = Etcd::local_url(prefix);
    let mut args = vec!["publish", &url, f.path()];
    args.extend_from_slice(extra);
    let out = etcd.flowctl(&args);
    assert!(out.status.success(), "publish: {}", text(&out));
    let s = String::from_utf8_lossy(&out.stdout).to_string();
    let g = s.split("generation ").nth(1).and_then(|r| r.split(' ').next());
    g.and_then(|g| g.parse().ok()).unwrap_or_else(|| panic!("publish said: {s}"))
}

/// The agent's etcd state from `status --json`.
fn etcd_state(lab: &Lab) -> Value {
    attachment(&lab.veth_srv).map(|a| a["etcd"].clone()).unwrap_or(Value::Null)
}

fn applied(lab: &Lab) -> Option<u64> {
    etcd_state(lab)["applied"]["generation"].as_u64()
}

fn store(lab: &Lab) -> String {
    etcd_state(lab)["store"]["state"].as_str().unwrap_or("").to_string()
}

/// An agent following `etcd://ENDPOINT/PREFIX`, its disk copy under
/// `cache`; its log (info) to `log` when given.
fn follow(
    lab: &Lab,
    endpoint: &str,
    prefix: &str,
    cache: &TempDir,
    log: Option<&TempFile>,
) -> Agent {
    let url = format!("etcd://{endpoint}{prefix}");
    let mut cmd = Agent::attach(
        lab,
        &url,
        &[
            "--etcd-cache",
            cache.path(),
            "--etcd-watch-timeout",
            WATCH_TIMEOUT,
            "--metrics",
            &lab.metrics_addr(),
        ],
    );
    if let Some(l) = log {
        let f = std::fs::OpenOptions::new().append(true).open(l.path()).expect("agent log");
        cmd.env("FLOWCTL_LOG", "info").stderr(Stdio::from(f));
    }
    let iface = lab.veth_srv.clone();
    Agent::spawn_until(cmd, move || flowctl_tests::cli::agent_ready(&iface))
}

/// The generations an agent's log says it applied, in order.
fn applied_in_log(log: &TempFile) -> Vec<u64> {
    let text = std::fs::read_to_string(log.path()).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split("etcd: applied generation ").nth(1))
        .filter_map(|r| r.split(' ').next()?.parse().ok())
        .collect()
}

/// The agent's metrics, from its endpoint in this namespace (where the
/// agent was started), on its lab's own port.
fn metrics(lab: &Lab) -> String {
    flowctl_tests::traffic::metrics_get(&lab.metrics_addr(), "/metrics", None)
}

/// Packets of a 200/s UDP burst from the client side that the rule passed.
fn passed_after_blast(lab: &Lab, rule_name: &str) -> u64 {
    blast(lab, 7100, 200, 0.3, 40);
    rule(&lab.veth_srv, rule_name)["passed_pkts"].as_u64().unwrap()
}

/// Two agents on their own labs follow one prefix: a publish reaches both
/// (timed, and enforced: the new burst is what passes); a profile that
/// fails validation is refused by `publish` itself and, written around
/// it, rejected whole by every agent, which keep the running one and show
/// the error with the etcd key, line and column.
pub fn fleet_profiles_roll_out_and_bad_ones_are_rejected_whole() {
    let mut etcd = Etcd::start("fpe");
    let labs = [Lab::new("fpa", 230), Lab::new("fpb", 231)];
    let mut eps: Vec<String> = labs.iter().zip(1u8..).map(|(l, k)| etcd.link(l, k)).collect();
    // The second agent is given two endpoints, the first with nobody
    // there: the client balances over the ones that answer.
    eps[1] = format!("10.203.2.9:2379,{}", eps[1]);
    let prefix = format!("/flowctl-test/{}", unique("roll"));
    let cache = TempDir::new("flowctl-etcd-cache-");
    assert_eq!(publish(&etcd, &prefix, &slow("slow1", 3), &[]), 1);
    let agents: Vec<Agent> =
        labs.iter().zip(&eps).map(|(l, ep)| follow(l, ep, &prefix, &cache, None)).collect();
    for l in &labs {
        assert_eq!(applied(l), Some(1), "{}", etcd_state(l));
        assert_eq!(passed_after_blast(l, "slow1"), 3);
    }
    // An agent that follows etcd takes no local apply.
    let local = TempFile::profile(&slow("local", 9));
    let out = flowctl_tests::cli::flowctl(&[
        "apply",
        &labs[0].veth_srv,
        local.path(),
        "--netns",
        &labs[0].ns_srv,
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("follows a profile in etcd"), "{}", text(&out));
    // The rollout, timed from the publish to both agents enforcing it.
    let t0 = Instant::now();
    assert_eq!(publish(&etcd, &prefix, &slow("slow2", 5), &[]), 2);
    wait_for("both agents apply generation 2", Duration::from_secs(10), || {
        labs.iter().all(|l| applied(l) == Some(2))
    });
    let took = t0.elapsed();
    println!(
        "rollout: generation 2 applied by {} agents {took:?} after publish started",
        labs.len()
    );
    for l in &labs {
        assert_eq!(passed_after_blast(l, "slow2"), 5, "the new profile enforces");
    }
    let fleet = ["status", "--fleet", &Etcd::local_url(&prefix)];
    wait_for("status --fleet: every agent current", Duration::from_secs(10), || {
        etcd.flowctl(&fleet).status.success()
    });
    let out = etcd.flowctl(&fleet);
    assert!(text(&out).contains("2 of 2 agents current"), "{}", text(&out));

    // `publish` refuses a bad profile itself, naming file, line and column.
    let bad_text = "[[rule]]\nname = \"bad\"\nproto = \"udp\"\nrate = \"0/s\"\n";
    let bad = TempFile::profile(bad_text);
    let out = etcd.flowctl(&["publish", &Etcd::local_url(&prefix), bad.path()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains(&format!("{}:4:8:", bad.path())), "{}", text(&out));
    // Written around it (another writer), the agents reject it whole.
    etcd.ctl_ok(&["put", &format!("{prefix}/profile"), bad_text]);
    for (l, ep) in labs.iter().zip(&eps) {
        let at = format!("etcd://{ep}{prefix}/profile:4:8:");
        wait_for("the agent shows the rejection", Duration::from_secs(10), || {
            etcd_state(l)["error"].as_str().is_some_and(|e| e.contains(&at))
        });
        let st = etcd_state(l);
        assert_eq!(st["applied"]["generation"], 2, "the running profile stays: {st}");
        assert!(st["error"].as_str().unwrap().contains("greater than zero"), "{st}");
        assert_eq!(st["rejected_total"], 1);
        // In `status` (text), the metrics, and the kernel still enforces slow2.
        let status = text(&flowctl_tests::cli::flowctl(&["status"]));
        assert!(status.contains(&at), "{status}");
        let m = metrics(l);
        assert!(
            m.lines().any(|x| x.starts_with("flowctl_etcd_profile_error{")
                && x.contains(&at)
                && x.ends_with(" 1")),
            "{m}"
        );
        assert!(m.contains("flowctl_etcd_applied_generation 2"), "{m}");
        assert_eq!(passed_after_blast(l, "slow2"), 5, "still the old profile");
    }
    wait_for("status --fleet shows the agents' errors", Duration::from_secs(10), || {
        let out = etcd.flowctl(&fleet);
        out.status.code() == Some(1) && text(&out).matches("greater than zero").count() == 2
    });
    for a in agents {
        a.stop();
    }
}

/// etcd killed: both agents keep enforcing (kernel counters) and say etcd
/// is unreachable; one restarted meanwhile starts from its disk copy (and
/// says so); etcd back on the same data: both watch again and take the
/// next publish.
pub fn fleet_profiles_outlive_etcd_and_restart_from_the_disk_copy() {
    let mut etcd = Etcd::start("fde");
    let labs = [Lab::new("fda", 232), Lab::new("fdb", 233)];
    let eps: Vec<String> = labs.iter().zip(1u8..).map(|(l, k)| etcd.link(l, k)).collect();
    let prefix = format!("/flowctl-test/{}", unique("down"));
    let cache = TempDir::new("flowctl-etcd-cache-");
    publish(&etcd, &prefix, &slow("slow1", 3), &[]);
    let mut agents: Vec<Agent> =
        labs.iter().zip(&eps).map(|(l, ep)| follow(l, ep, &prefix, &cache, None)).collect();
    etcd.kill();
    for l in &labs {
        wait_for("the agent sees etcd gone", Duration::from_secs(15), || store(l) == "unreachable");
        assert_eq!(applied(l), Some(1));
        assert_eq!(passed_after_blast(l, "slow1"), 3, "enforcement goes on without etcd");
        let dropped = rule(&l.veth_srv, "slow1")["dropped_pkts"].as_u64().unwrap();
        assert!(dropped > 0);
    }
    // Restart the first agent while etcd is down: its disk copy.
    agents.remove(0).stop();
    let log = TempFile::new("flowctl-agent-log-", ".log", "");
    agents.insert(0, follow(&labs[0], &eps[0], &prefix, &cache, Some(&log)));
    let st = etcd_state(&labs[0]);
    assert_eq!(
        (st["applied"]["generation"].as_u64(), st["from_disk_copy"].as_bool()),
        (Some(1), Some(true)),
        "{st}"
    );
    let said = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        said.contains("enforcing the disk copy of generation 1")
            && said.contains("cannot reach etcd"),
        "{said}"
    );
    assert_eq!(passed_after_blast(&labs[0], "slow1"), 3, "the disk copy enforces");
    // etcd back: both watch again and take the next publish.
    etcd.restart();
    for l in &labs {
        wait_for("the agent watches again", Duration::from_secs(20), || store(l) == "watching");
    }
    publish(&etcd, &prefix, &slow("slow2", 4), &[]);
    for l in &labs {
        wait_for("generation 2 applied after the outage", Duration::from_secs(10), || {
            applied(l) == Some(2)
        });
        assert_eq!(etcd_state(l)["from_disk_copy"], false);
        assert_eq!(passed_after_blast(l, "slow2"), 4);
    }
    for a in agents {
        a.stop();
    }
}

/// One agent's link to etcd down while three publishes go in and the
/// history is compacted: the other follows each; the cut-off one finds
/// its watch silent, and once the link is back its resumed watch hits the
/// compaction, it relists and applies the newest directly: nothing
/// partial, nothing older, nothing in between.
pub fn fleet_profiles_relist_after_a_compaction_and_never_go_back() {
    let mut etcd = Etcd::start("fce");
    let labs = [Lab::new("fca", 234), Lab::new("fcb", 235)];
    let eps: Vec<String> = labs.iter().zip(1u8..).map(|(l, k)| etcd.link(l, k)).collect();
    let prefix = format!("/flowctl-test/{}", unique("comp"));
    let cache = TempDir::new("flowctl-etcd-cache-");
    publish(&etcd, &prefix, &slow("slow1", 3), &[]);
    let logs = [
        TempFile::new("flowctl-agent-log-", ".log", ""),
        TempFile::new("flowctl-agent-log-", ".log", ""),
    ];
    let agents: Vec<Agent> = labs
        .iter()
        .zip(&eps)
        .zip(&logs)
        .map(|((l, ep), log)| follow(l, ep, &prefix, &cache, Some(log)))
        .collect();
    let (cut, other) = (&labs[0], &labs[1]);
    etcd.set_link(cut, false);
    for (g, burst) in [(2, 4), (3, 5), (4, 6)] {
        assert_eq!(publish(&etcd, &prefix, &slow(&format!("slow{g}"), burst), &[]), g);
        wait_for("the connected agent follows", Duration::from_secs(10), || {
            applied(other) == Some(g)
        });
    }
    let rev = etcd.revision();
    etcd.ctl_ok(&["compaction", &rev.to_string()]);
    wait_for("the cut-off agent finds its watch silent", Duration::from_secs(20), || {
        store(cut) == "unreachable"
    });
    assert_eq!(applied(cut), Some(1), "nothing reached it");
    etcd.set_link(cut, true);
    let took = wait_for("the cut-off agent converges", Duration::from_secs(30), || {
        applied(cut) == Some(4)
    });
    println!("converged {took:?} after the link came back");
    assert_eq!(passed_after_blast(cut, "slow4"), 6);
    let log = std::fs::read_to_string(logs[0].path()).unwrap();
    assert!(log.contains("relisting"), "the resumed watch met the compaction: {log}");
    assert_eq!(applied_in_log(&logs[0]), [1, 4], "straight to the newest: {log}");
    assert_eq!(applied_in_log(&logs[1]), [1, 2, 3, 4], "in order, each once");
    for a in agents {
        a.stop();
    }
}

/// etcd with authentication on: no user and a wrong password are refused
/// with what to do; the right password (from a file) publishes and an
/// agent follows; an agent with a wrong password and no disk copy does
/// not start, and says why.
pub fn fleet_profiles_need_the_right_password() {
    let mut etcd = Etcd::start("fwe");
    let lab = Lab::new("fwa", 236);
    let ep = etcd.link(&lab, 1);
    etcd.ctl_ok(&["user", "add", "root", "--new-user-password", "s3cret"]);
    etcd.ctl_ok(&["auth", "enable"]);
    let prefix = format!("/flowctl-test/{}", unique("auth"));
    let url = Etcd::local_url(&prefix);
    let prof = TempFile::profile(&slow("slow1", 3));
    let out = etcd.flowctl(&["publish", &url, prof.path()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("requires authentication") && text(&out).contains("--etcd-user"),
        "{}",
        text(&out)
    );
    let out = etcd.flowctl(&["publish", &url, prof.path(), "--etcd-user", "root:wrong"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("refused user `root`: wrong user name or password"),
        "{}",
        text(&out)
    );
    let pw = TempFile::new("flowctl-etcd-pw-", "", "s3cret\n");
    let creds = ["--etcd-user", "root", "--etcd-password-file", pw.path()];
    assert_eq!(publish(&etcd, &prefix, &slow("slow1", 3), &creds), 1);
    // A wrong password and no disk copy: the agent refuses to start.
    let cache = TempDir::new("flowctl-etcd-cache-");
    let mut cmd = Agent::attach(
        &lab,
        &format!("etcd://{ep}{prefix}"),
        &["--etcd-cache", cache.path(), "--etcd-user", "root:wrong"],
    );
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("an agent with a wrong password kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let said = text(&out);
    assert!(said.contains("refused user `root`") && said.contains("no disk copy"), "{said}");
    // The right one: it follows.
    let mut extra = vec!["--etcd-cache", cache.path(), "--etcd-watch-timeout", WATCH_TIMEOUT];
    extra.extend_from_slice(&creds);
    let cmd = Agent::attach(&lab, &format!("etcd://{ep}{prefix}"), &extra);
    let iface = lab.veth_srv.clone();
    let agent = Agent::spawn_until(cmd, move || flowctl_tests::cli::agent_ready(&iface));
    assert_eq!(applied(&lab), Some(1));
    let mut fleet = vec!["status", "--fleet", &url];
    fleet.extend_from_slice(&creds);
    wait_for("status --fleet with the password: current", Duration::from_secs(10), || {
        etcd.flowctl(&fleet).status.success()
    });
    agent.stop();
}

/// etcd over TLS that requires client certificates: without one, or
/// without TLS, `publish` is refused; with the CA, certificate and key,
/// `publish` and an agent work and a publish reaches the agent.
pub fn fleet_profiles_over_tls_with_client_certificates() {
    let pki = Pki::new(&["127.0.0.1", "10.203.1.1"]);
    let mut etcd = Etcd::start_tls("fte", &pki);
    let lab = Lab::new("fta", 237);
    let ep = etcd.link(&lab, 1);
    let prefix = format!("/flowctl-test/{}", unique("tls"));
    let url = Etcd::local_url(&prefix);
    let (ca, crt, key) = (pki.file("ca.crt"), pki.file("client.crt"), pki.file("client.key"));
    let tls = ["--etcd-ca", ca.as_str(), "--etcd-cert", crt.as_str(), "--etcd-key", key.as_str()];
    let prof = TempFile::profile(&slow("slow1", 3));
    for (what, extra, hint) in [
        (
            "no client certificate",
            vec!["--etcd-ca", ca.as_str()],
            "--etcd-cert FILE --etcd-key FILE",
        ),
        ("no TLS", vec![], "if etcd serves TLS: --etcd-ca FILE"),
    ] {
        let mut args = vec!["publish", url.as_str(), prof.path()];
        args.extend_from_slice(&extra);
        let out = etcd.flowctl(&args);
        assert_eq!(out.status.code(), Some(2), "{what}: {}", text(&out));
        assert!(text(&out).contains(hint), "{what}: {}", text(&out));
    }
    assert_eq!(publish(&etcd, &prefix, &slow("slow1", 3), &tls), 1);
    let cache = TempDir::new("flowctl-etcd-cache-");
    let mut extra = vec!["--etcd-cache", cache.path(), "--etcd-watch-timeout", WATCH_TIMEOUT];
    extra.extend_from_slice(&tls);
    let cmd = Agent::attach(&lab, &format!("etcd://{ep}{prefix}"), &extra);
    let iface = lab.veth_srv.clone();
    let agent = Agent::spawn_until(cmd, move || flowctl_tests::cli::agent_ready(&iface));
    assert_eq!(applied(&lab), Some(1));
    assert_eq!(publish(&etcd, &prefix, &slow("slow2", 4), &tls), 2);
    wait_for("the agent applies over TLS", Duration::from_secs(10), || applied(&lab) == Some(2));
    assert_eq!(passed_after_blast(&lab, "slow2"), 4);
    agent.stop();
}
