//! An attachment's life: a kept data plane outliving a SIGKILLed agent and
//! re-adopted by the next, hot reloads through the agent (all or nothing),
//! what the errors say, someone else's XDP program, one agent per
//! attachment and the pins' layout version, a new agent waiting for a
//! stopping one, and `detach` leaving nothing behind.

use crate::UDP_RULE;
use flowctl_tests::{
    agent::{Agent, DetachOnDrop},
    cli::{
        agent_ready, attachment, bin, flowctl, leftovers, map_ids, pin_dir, roots_left, rule,
        run_dir,
    },
    lab::{attach_pass_xdp, sh_ns, Lab},
    tempfile::TempFile,
    traffic::blast,
};
use std::{
    io::Write,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

/// `--keep`: a SIGKILLed agent's data plane enforces alone and takes an
/// agent-less apply; a restarted agent adopts the pinned maps (the same
/// ids) with their state (the drained key stays refused).
pub fn keep_survives_sigkill_and_restart_adopts_state() {
    let lab = Lab::new("fkeep", 212);
    let _detach = DetachOnDrop::new(&lab);
    // One token an hour: the test can take minutes under TCG (two agent
    // starts, each verifying the program), and must never see a refill.
    let prof = TempFile::profile("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"slow\"\nproto = \"udp\"\nrate = \"1/h\"\nburst = 3\nkey = \"src\"\n");
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let ids = map_ids(&lab.veth_srv);
    let (sent, _, _) = blast(&lab, 7100, 200, 0.5, 20);
    let r = rule(&lab.veth_srv, "slow");
    assert_eq!(r["passed_pkts"].as_u64().unwrap(), 3, "burst of 3 then refused (sent {sent})");
    agent.kill9();
    // The kept data plane enforces alone.
    blast(&lab, 7100, 100, 0.2, 5);
    let r = rule(&lab.veth_srv, "slow");
    assert_eq!(r["passed_pkts"].as_u64().unwrap(), 3);
    let a = attachment(&lab.veth_srv).unwrap();
    assert_eq!(a["agent_running"], false);
    // Agent-less apply works on the kept data plane.
    let out = flowctl(&["apply", &lab.veth_srv, prof.path(), "--netns", &lab.ns_srv]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Restart: adopts pins, the drained key is still refused, maps unchanged.
    let agent = Agent::start(&lab, prof.path(), &[]);
    assert_eq!(map_ids(&lab.veth_srv), ids, "map ids unchanged across restart");
    blast(&lab, 7100, 100, 0.2, 5);
    let r = rule(&lab.veth_srv, "slow");
    assert_eq!(
        r["passed_pkts"].as_u64().unwrap(),
        3,
        "drained key still refused after re-adoption"
    );
    agent.stop();
}

/// `apply` through the agent: a bad profile changes nothing (and says
/// where it is wrong), a good one is applied at once, also while a silent
/// client holds the control socket.
pub fn apply_through_the_agent_is_all_or_nothing() {
    let lab = Lab::new("fapply", 213);
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &[]);
    let gen0 = attachment(&lab.veth_srv).unwrap()["generation"].as_u64().unwrap();
    let bad = TempFile::profile("[[rule]]\nname = \"x\"\nrate = \"0/s\"\n");
    let out = flowctl(&["apply", &lab.veth_srv, bad.path(), "--netns", &lab.ns_srv]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:3:", bad.path())) && err.contains("greater than zero"),
        "{err}"
    );
    assert_eq!(
        attachment(&lab.veth_srv).unwrap()["generation"].as_u64().unwrap(),
        gen0,
        "nothing applied"
    );
    let good = TempFile::profile(&format!(
        "{UDP_RULE}[[rule]]\nname = \"icmp\"\nproto = \"icmp\"\nrate = \"10/s\"\n"
    ));
    // A client that connects to the control socket and says nothing must not
    // hold up the agent: the apply must be answered before the agent gives up
    // on the silent client (5 s), which a serial agent would do first. Judged
    // by order, not by a wall-clock bound: under TCG on a busy host one apply
    // can take seconds. An attempt where the apply itself outlasted the
    // silent client's wait proves nothing either way and is repeated.
    let a = attachment(&lab.veth_srv).unwrap();
    let sock = format!("/run/flowctl/{}-{}/agent.sock", a["netns_inode"], a["ifindex"]);
    let mut applies = 0;
    let concurrent = (0..3).any(|_| {
        let silent = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let out = flowctl(&["apply", &lab.veth_srv, good.path(), "--netns", &lab.ns_srv]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        applies += 1;
        silent.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        // Still waiting for its answer: the agent served the apply first.
        matches!(
            std::io::Read::read(&mut &silent, &mut byte),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
        )
    });
    assert!(concurrent, "every apply waited until the agent gave up on the silent client");
    assert_eq!(attachment(&lab.veth_srv).unwrap()["generation"].as_u64().unwrap(), gen0 + applies);
    assert_eq!(attachment(&lab.veth_srv).unwrap()["rules"].as_array().unwrap().len(), 2);
    agent.stop();
}

/// The errors say how to fix them: a missing interface, missing
/// capabilities, a bad profile (file and line, nothing attached); `check`
/// for CI; native XDP refused on lo falls back to generic mode, loudly.
pub fn error_paths_say_how_to_fix() {
    let lab = Lab::new("ferr", 214);
    let prof = TempFile::profile(UDP_RULE);
    // Missing interface.
    let out = flowctl(&["attach", "nosuchdev0", "--netns", &lab.ns_srv, "--profile", prof.path()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no interface named `nosuchdev0`"));
    // Missing capabilities: drop them all with setpriv.
    let out = Command::new("setpriv")
        .args(["--inh-caps=-all", "--bounding-set=-all", "--"])
        .arg(bin())
        .args(["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs root"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A bad profile is rejected with file and line before anything happens.
    let bad = TempFile::profile("[[rule]]\nname = \"x\"\nsrc = \"10.0.0.1/8\"\nrate = \"1/s\"\n");
    let out = flowctl(&["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", bad.path()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("{}:3:", bad.path())));
    assert!(attachment(&lab.veth_srv).is_none());
    // `check` for CI pipelines.
    let out = flowctl(&["check", prof.path()]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("kernel memory"));
    // And for a bigger host: the default tables and rings (sized for the
    // default max_rules, 128) fit 128 CPUs in the default budget, not 256;
    // rings for all 256 rules do not fit 128 (the per-CPU rings).
    let defaults = TempFile::profile("[[rule]]\nname = \"d\"\nrate = \"1/s\"\n");
    let all_rules =
        TempFile::profile("[settings]\nmax_rules = 256\n[[rule]]\nname = \"d\"\nrate = \"1/s\"\n");
    let on = |p: &TempFile, cpus: &str| flowctl(&["check", p.path(), "--cpus", cpus]);
    let text = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).to_string();
    let fits = on(&defaults, "128");
    assert!(
        fits.status.success()
            && text(&fits).contains("on 128 CPUs: 752.5 MiB preallocated, within"),
        "{}",
        text(&fits)
    );
    for (p, cpus, need) in [(&defaults, "256", "1.10 GiB"), (&all_rules, "128", "1.08 GiB")] {
        let over = on(p, cpus);
        assert_eq!(over.status.code(), Some(1), "{}", text(&over));
        assert!(
            text(&over).contains(&format!("on {cpus} CPUs: {need} preallocated, over the budget")),
            "{}",
            text(&over)
        );
    }
    // Native XDP is refused on a fresh namespace's lo: auto falls back loudly.
    let child = Command::new(bin())
        .args(["attach", "lo", "--netns", &lab.ns_srv, "--profile", prof.path()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while attachment("lo").is_none_or(|a| a["agent_ready"] != true) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(attachment("lo").expect("attached to lo")["mode"], "generic");
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("generic (skb) mode"));
    let _ = std::io::stdout().flush();
}

/// An interface that already runs someone else's XDP program is left alone,
/// with a message that says how to look at and remove it.
pub fn foreign_xdp_program_is_not_replaced() {
    let lab = Lab::new("fxdp", 216);
    let prof = TempFile::profile(UDP_RULE);
    let (ns, dev, path, bin) =
        (lab.ns_srv.clone(), lab.veth_srv.clone(), prof.path().to_string(), bin());
    let out = Lab::in_ns(&lab.ns_srv, move || {
        let ebpf = attach_pass_xdp(&dev);
        let out = Command::new(bin)
            .args(["attach", &dev, "--netns", &ns, "--profile", &path])
            .output()
            .unwrap();
        drop(ebpf);
        out
    });
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("already has another XDP program") && err.contains("xdp off"), "{err}");
    assert!(attachment(&lab.veth_srv).is_none(), "nothing left behind");
}

/// One agent per attachment; pins of another layout version are refused, and
/// `--replace` starts over.
pub fn one_agent_per_attachment_and_layout_versions_are_checked() {
    let lab = Lab::new("flock", 217);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let out = flowctl(&["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already running"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    agent.kill9();
    // Pretend the pins were written by a future flowctl.
    let a = attachment(&lab.veth_srv).unwrap();
    set_pinned_layout(&pin_dir(&a), 99);
    let out = flowctl(&["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("layout version Some(99)") && err.contains("--replace"), "{err}");
    let agent = Agent::start(&lab, prof.path(), &["--replace"]);
    // Started over, keeping the link: the profile went into fresh maps
    // before the new program took the link, and again as the agent adopted
    // them (generations 1 and 2, not the old data plane's count).
    assert_eq!(attachment(&lab.veth_srv).unwrap()["generation"], 2, "started over");
    agent.stop();
}

/// A new agent started while the last one stops waits for it and starts
/// (adopting its kept data plane, or attaching afresh after its detach),
/// never "already running"; one started while an agent serves is refused,
/// naming that agent's pid and how to stop it.
pub fn a_new_agent_waits_for_a_stopping_one() {
    let lab = Lab::new("fwait", 228);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(UDP_RULE);
    let mut agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let out = flowctl(&["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("already running")
            && err.contains(&format!("pid {}, serving", agent.pid()))
            && err.contains(&format!("flowctl detach {} --netns {}", lab.veth_srv, lab.ns_srv)),
        "{err}"
    );
    let veth = lab.veth_srv.clone();
    let serving = |pid: u32| {
        let veth = veth.clone();
        move || attachment(&veth).is_some_and(|a| a["agent_ready"] == true && a["agent_pid"] == pid)
    };
    // Each stops (SIGINT) as the next starts: after a kept one the next
    // adopts, after one that detaches the next attaches afresh.
    for extra in [&[][..], &["--keep"], &[]] {
        agent.signal(libc::SIGINT);
        let mut next = Agent::spawn(
            Agent::attach(&lab, prof.path(), extra),
            Duration::from_secs(15),
            Duration::from_secs(3),
            || true,
        );
        next.wait_until("serving", serving(next.pid()));
        let previous = std::mem::replace(&mut agent, next);
        previous.exited_within(Duration::from_secs(10));
        blast(&lab, 7000, 100, 0.2, 20);
        assert!(rule(&lab.veth_srv, "udp")["offered_pkts"].as_u64().unwrap() > 0, "enforcing");
    }
    let a = attachment(&lab.veth_srv).unwrap();
    agent.stop();
    assert_eq!(leftovers(&a), Vec::<String>::new(), "the last one detached everything");
}

/// `detach` leaves nothing of an attachment in /run/flowctl or on bpffs:
/// with its agent running (stopped first, exiting cleanly; its data plane
/// kept until then), after an agent's own detach (SIGINT), for a kept data
/// plane whose agent was SIGKILLed, and run again (nothing attached,
/// nothing made by asking).
pub fn detach_leaves_nothing_behind() {
    let lab = Lab::new("fdet", 227);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(UDP_RULE);
    let detach = || {
        let out = flowctl(&["detach", &lab.veth_srv, "--netns", &lab.ns_srv]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        text
    };
    let xdp_on = || sh_ns(&lab.ns_srv, &["ip", "link", "show", &lab.veth_srv]).contains("xdp");
    let none = Vec::<String>::new();

    // A running agent that keeps its data plane: only detach removes it.
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let a = attachment(&lab.veth_srv).unwrap();
    let run = run_dir(&a);
    for f in ["agent.lock", "state.json", "profile.toml", "agent.sock"] {
        assert!(std::path::Path::new(&format!("{run}/{f}")).exists(), "{run}/{f}");
    }
    assert!(xdp_on());
    blast(&lab, 7000, 200, 0.3, 60);
    let pid = agent.pid();
    let text = detach();
    assert!(
        text.contains(&format!("stopped its agent (pid {pid}) and detached from {}", lab.veth_srv)),
        "{text}"
    );
    agent.exited_within(Duration::from_secs(5));
    assert_eq!(leftovers(&a), none, "after detaching a running agent");
    assert_eq!(
        roots_left(),
        none,
        "the last attachment gone, so are the roots: after detaching a running agent"
    );
    assert!(!xdp_on(), "the program is off the interface");
    assert!(attachment(&lab.veth_srv).is_none());

    // An agent's own detach (Ctrl-C) leaves no lock file either.
    let agent = Agent::start(&lab, prof.path(), &[]);
    let a = attachment(&lab.veth_srv).unwrap();
    agent.stop();
    assert_eq!(leftovers(&a), none, "after SIGINT");
    assert_eq!(roots_left(), none, "the last attachment gone, so are the roots: after SIGINT");
    assert!(!xdp_on());

    // A kept data plane whose agent was killed: its files stay until detach.
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let a = attachment(&lab.veth_srv).unwrap();
    agent.kill9();
    assert_ne!(leftovers(&a), none, "kept");
    assert!(detach().contains(&format!("detached from {}", lab.veth_srv)));
    assert_eq!(leftovers(&a), none, "after detaching a kept data plane");
    assert_eq!(
        roots_left(),
        none,
        "the last attachment gone, so are the roots: after detaching a kept data plane"
    );
    assert!(!xdp_on());

    // Again: nothing to do, and nothing made by asking.
    assert!(detach().contains("nothing attached"));
    assert_eq!(leftovers(&a), none, "after a detach of nothing");
    assert_eq!(
        roots_left(),
        none,
        "the last attachment gone, so are the roots: after a detach of nothing"
    );
}

/// Without TCX (taken away here; absent on 6.1) the egress counter is a
/// netlink filter on a clsact qdisc: `detach` with the agent running stops
/// the agent first, whose end removes its filter and the qdisc it added,
/// and then leaves nothing of the attachment either.
pub fn detach_stops_the_agent_before_its_egress_filters_go() {
    let lab = Lab::new("fdeg", 247);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(&lab.egress_klimiter_profile());
    let mut cmd = Agent::attach(&lab, prof.path(), &["--keep"]);
    cmd.env("FLOWCTL_DISABLE_FEATURES", "tcx");
    let veth = lab.veth_srv.clone();
    let agent = Agent::spawn_until(cmd, move || agent_ready(&veth));
    let tc = |what: &str| sh_ns(&lab.ns_srv, &["tc", what, "show", "dev", &lab.veth_srv]);
    let filters = || sh_ns(&lab.ns_srv, &["tc", "filter", "show", "dev", &lab.veth_srv, "egress"]);
    assert!(filters().contains("flowctl_egress"), "{}", filters());
    assert!(tc("qdisc").contains("clsact"));
    let a = attachment(&lab.veth_srv).unwrap();
    assert!(std::path::Path::new(&format!("{}/egress-netlink.json", run_dir(&a))).exists());
    let out = flowctl(&["detach", &lab.veth_srv, "--netns", &lab.ns_srv]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("stopped its agent"), "{text}");
    agent.exited_within(Duration::from_secs(5));
    assert!(!filters().contains("flowctl_egress"), "the filter is gone: {}", filters());
    assert!(!tc("qdisc").contains("clsact"), "the clsact flowctl added is gone: {}", tc("qdisc"));
    assert_eq!(leftovers(&a), Vec::<String>::new());
}

/// The systemd unit's `Type=notify` and `WatchdogSec=` (docs/packaging.md),
/// with the test as the service manager: a datagram socket in
/// `NOTIFY_SOCKET` and a 200 ms `WATCHDOG_USEC`. `READY=1` (with its
/// status) comes once the agent serves: `status` shows it ready and an
/// `apply` through its socket works at once; the watchdog is pinged every
/// half period while the loop runs; SIGINT brings `STOPPING=1`.
pub fn the_agent_tells_its_service_manager_ready_watchdog_and_stopping() {
    use std::{cell::RefCell, os::unix::net::UnixDatagram};
    let lab = Lab::new("fntf", 249);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(UDP_RULE);
    // A unique path, removed on drop; the socket is bound in its place.
    let file = TempFile::new("flowctl-notify-", ".sock", "");
    let path = file.path().to_string();
    std::fs::remove_file(&path).unwrap();
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let got = RefCell::new(Vec::<(Instant, String)>::new());
    let recv = || {
        let mut buf = [0u8; 1024];
        while let Ok(n) = sock.recv(&mut buf) {
            got.borrow_mut().push((Instant::now(), String::from_utf8_lossy(&buf[..n]).into()));
        }
    };
    let said = |what: &str| got.borrow().iter().filter(|(_, m)| m.contains(what)).count();
    // systemd names the watched process in WATCHDOG_PID: a shell that sets
    // it to its own pid and execs the agent (the same pid).
    let attach = Agent::attach(&lab, prof.path(), &[]);
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "WATCHDOG_PID=$$ exec \"$0\" \"$@\""]).arg(attach.get_program());
    cmd.args(attach.get_args());
    cmd.env("NOTIFY_SOCKET", &path).env("WATCHDOG_USEC", "200000");
    let agent = Agent::spawn_until(cmd, || {
        recv();
        said("READY=1") > 0
    });
    // Ready means serving: the status says so and the socket answers.
    assert!(agent_ready(&lab.veth_srv), "READY=1 before the agent serves");
    let out = flowctl(&["apply", &lab.veth_srv, prof.path(), "--netns", &lab.ns_srv]);
    assert!(
        out.status.success(),
        "apply right after READY: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ready = got.borrow().iter().find(|(_, m)| m.contains("READY=1")).unwrap().1.clone();
    assert!(ready.contains(&format!("STATUS=1 rules on {}", lab.veth_srv)), "{ready:?}");
    assert_eq!(said("READY=1"), 1, "ready once");
    // The watchdog: every 100 ms while the loop runs.
    let before = said("WATCHDOG=1");
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(1) {
        recv();
    }
    let pings = said("WATCHDOG=1") - before;
    println!("{pings} watchdog pings in 1 s (WATCHDOG_USEC 200 ms)");
    assert!(pings >= 5, "pinged every half period: {pings} in 1 s");
    assert_eq!(said("STOPPING=1"), 0);
    agent.stop();
    recv();
    assert_eq!(said("STOPPING=1"), 1, "STOPPING=1 on the signal: {:?}", got.borrow());
}

/// Re-pins everything of the pin directory `dir` under layout `version`'s
/// root, as the flowctl of that version leaves it (its global record says
/// so too), and removes `dir`. Returns the new directory.
fn move_pins_to_layout(dir: &str, version: u32) -> String {
    let (root, rest) = dir.split_once("/ifaces/").unwrap();
    let base = root.rsplit_once('/').unwrap().0;
    let to_dir = format!("{base}/v{version}/ifaces/{rest}");
    std::fs::create_dir_all(&to_dir).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        let to = format!("{to_dir}/{name}");
        if name == "link" {
            let l: aya::programs::links::FdLink =
                aya::programs::links::PinnedLink::from_pin(&p).unwrap().into();
            drop(l.pin(&to).unwrap());
        } else {
            aya::maps::MapData::from_pin(&p).unwrap().pin(&to).unwrap();
        }
        std::fs::remove_file(&p).unwrap();
    }
    std::fs::remove_dir(dir).unwrap();
    let _ = std::fs::remove_dir(format!("{root}/ifaces"));
    let _ = std::fs::remove_dir(root);
    set_pinned_layout(&to_dir, version);
    to_dir
}

/// Writes `version` into the global record pinned in `dir`, as the
/// flowctl of that layout version would have.
fn set_pinned_layout(dir: &str, version: u32) {
    let mut global: aya::maps::Array<_, flowctl_common::GlobalRecord> =
        aya::maps::Array::try_from(aya::maps::Map::Array(
            aya::maps::MapData::from_pin(format!("{dir}/{}", flowctl_common::map_names::GLOBAL))
                .unwrap(),
        ))
        .unwrap();
    let mut g = global.get(&0, 0).unwrap();
    g.layout_version = version;
    global.set(0, g, 0).unwrap();
}

/// Upgrades and downgrades over a kept data plane. Its pins re-pinned
/// under a newer layout's root (a downgrade) are refused without
/// `--replace`, saying how to proceed, while the old program goes on
/// enforcing; re-pinned under the previous layout's root (an upgrade),
/// a plain attach takes the same XDP link over. A source the profile
/// blocks sends throughout: not one of its packets reaches the server's
/// IP layer, so the interface was never without a program. The old
/// layout's pins are gone afterwards, and `detach` removes another
/// version's pins too.
pub fn an_older_layouts_data_plane_is_taken_over_without_a_gap() {
    use flowctl_common::LAYOUT_VERSION;
    let lab = Lab::new("fupgr", 239);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(&format!(
        "[[rule]]\nname = \"banned\"\nsrc = \"{}/32\"\naction = \"block\"\n",
        lab.ip_cli
    ));
    let agent = Agent::start(&lab, prof.path(), &["--keep"]);
    let a = attachment(&lab.veth_srv).unwrap();
    let mode = a["mode"].as_str().unwrap().to_string();
    agent.kill9();
    let ip_in = || flowctl_tests::lab::nstat(&lab.ns_srv, "IpInReceives");
    let before = ip_in();

    // A newer flowctl's data plane: refused, and it goes on enforcing.
    let newer = move_pins_to_layout(&pin_dir(&a), LAYOUT_VERSION + 1);
    assert!(attachment(&lab.veth_srv).is_none(), "another layout is not ours to show");
    let out = flowctl(&["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("layout v{}", LAYOUT_VERSION + 1))
            && err.contains("--replace")
            && err.contains("without a gap"),
        "{err}"
    );
    let (sent, _, _) = blast(&lab, 7000, 500, 0.5, 1000);
    assert_eq!(ip_in() - before, 0, "the old program still blocks all {sent}");

    // The previous flowctl's: taken over by a plain attach, under traffic.
    let old = move_pins_to_layout(&newer, LAYOUT_VERSION - 1);
    let (agent, sent) = std::thread::scope(|s| {
        let traffic = s.spawn(|| blast(&lab, 7000, 1000, 6.0, 10_000).0);
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let agent = Agent::start(&lab, prof.path(), &[]);
        println!("taken over in {:.2} s", t.elapsed().as_secs_f64());
        (agent, traffic.join().unwrap())
    });
    let reached = ip_in() - before;
    println!("{sent} packets of a blocked source during the takeover: {reached} reached IP");
    assert_eq!(reached, 0, "a packet passed unchecked: the interface was without a program");
    let a = attachment(&lab.veth_srv).unwrap();
    assert_eq!(a["mode"].as_str(), Some(mode.as_str()), "the link's mode is kept");
    let offered = rule(&lab.veth_srv, "banned")["offered_pkts"].as_u64().unwrap();
    assert!(offered > 0, "the new program counts");
    assert!(!std::path::Path::new(&old).exists(), "the old layout's pins are gone");

    // Another version's pins are detached too.
    agent.kill9();
    let old = move_pins_to_layout(&pin_dir(&a), LAYOUT_VERSION - 1);
    let out = flowctl(&["detach", &lab.veth_srv, "--netns", &lab.ns_srv]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!std::path::Path::new(&old).exists());
    assert_eq!(leftovers(&a), Vec::<String>::new(), "nothing of the attachment is left");
    assert_eq!(roots_left(), Vec::<String>::new(), "nor the roots");
    let before = ip_in();
    blast(&lab, 7000, 500, 0.3, 100);
    assert!(ip_in() > before, "detached: traffic reaches the server");
}

/// `FLOWCTL_PREVIOUS_BIN`'s attachments in its own `status --json`, which
/// has the same shape as this build's.
fn previous_ready(previous: &str, iface: &str) -> bool {
    let Ok(out) = Command::new(previous).args(["status", "--json"]).output() else { return false };
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v.as_array().into_iter().flatten().any(|a| a["iface"] == iface && a["agent_ready"] == true)
}

/// An upgrade from the previous pinned layout's release, for real: that
/// version's binary (built from its commit by `cargo xtask test --full`,
/// `FLOWCTL_PREVIOUS_BIN`) attaches with `--keep` and is stopped as a unit
/// stop would, its data plane left enforcing; this build's agent takes the
/// data plane over under traffic from a source whose bucket is spent, and
/// no packet reaches the server's IP layer but the one the new layout's
/// fresh bucket admits (that version has no `action = "block"`). The previous layout's pins are
/// gone afterwards, and this build's `status` and `detach` see the
/// attachment as their own.
pub fn the_previous_layouts_release_is_taken_over_without_a_gap() {
    use flowctl_common::LAYOUT_VERSION;
    let previous = std::env::var("FLOWCTL_PREVIOUS_BIN").unwrap();
    let lab = Lab::new("fprev", 205);
    let _detach = DetachOnDrop::new(&lab);
    let prof = TempFile::profile(&format!(
        "[[rule]]\nname = \"banned\"\nsrc = \"{}/32\"\nrate = \"1/h\"\nburst = 1\n",
        lab.ip_cli
    ));
    let mut cmd = Command::new(&previous);
    cmd.args(["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", prof.path(), "--keep"]);
    let old_agent = Agent::spawn_until(cmd, || previous_ready(&previous, &lab.veth_srv));
    let version = |v: u32| format!("{}/v{v}", flowctl_common::PIN_ROOT);
    assert!(
        std::path::Path::new(&version(LAYOUT_VERSION - 1)).exists(),
        "the previous layout's pins"
    );
    assert!(attachment(&lab.veth_srv).is_none(), "another layout is not ours to show");
    let ip_in = || flowctl_tests::lab::nstat(&lab.ns_srv, "IpInReceives");
    // Its burst of 1 spent, the source is blocked.
    blast(&lab, 7000, 100, 0.1, 5);
    let before = ip_in();
    old_agent.stop();
    let (sent, _, _) = blast(&lab, 7000, 500, 0.5, 1000);
    assert_eq!(ip_in() - before, 0, "the kept data plane still refuses all {sent}");

    let (agent, sent) = std::thread::scope(|s| {
        let traffic = s.spawn(|| blast(&lab, 7000, 1000, 6.0, 10_000).0);
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let agent = Agent::start(&lab, prof.path(), &[]);
        println!("layout v{} taken over in {:.2} s", LAYOUT_VERSION - 1, t.elapsed().as_secs_f64());
        (agent, traffic.join().unwrap())
    });
    let reached = ip_in() - before;
    let banned = rule(&lab.veth_srv, "banned");
    let passed = banned["passed_pkts"].as_u64().unwrap();
    println!(
        "{sent} packets of a limited source during the upgrade: {reached} reached IP, {passed} admitted by the new program"
    );
    // The new layout starts every bucket afresh (RESET_ON_TAKEOVER), so its
    // bucket admits its burst of one; any other packet reaching IP would
    // have passed with no program at all.
    assert!(passed <= 1, "more than the fresh bucket's burst: {passed}");
    assert_eq!(reached, passed, "a packet passed unchecked: the interface was without a limit");
    assert!(banned["offered_pkts"].as_u64().unwrap() > 0, "the new program counts");
    let a = attachment(&lab.veth_srv).unwrap();
    assert!(
        !std::path::Path::new(&version(LAYOUT_VERSION - 1)).exists(),
        "the old layout's pins are gone"
    );
    agent.stop();
    assert_eq!(leftovers(&a), Vec::<String>::new(), "nothing of the attachment is left");
    assert_eq!(roots_left(), Vec::<String>::new(), "nor the roots");
}
