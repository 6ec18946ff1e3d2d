//! Kernel features (flowctl/src/kernel/features.rs) against the real binary
//! (env FLOWCTL_BIN): `doctor --json` verifies every program and leaves
//! nothing behind; the TC egress counter's clsact fallback adds and removes
//! its qdisc; a profile needing a missing feature is rejected whole; jumbo
//! frames through the xdp.frags program on veth with MTU 9000.
//!
//! A feature this kernel has is taken away with FLOWCTL_DISABLE_FEATURES
//! (how the fallbacks run on a kernel that has everything). Each test makes
//! its own namespaces and interfaces (unique names, removed on drop) and
//! bounds its traffic in packets and seconds.

use flowctl_tests::{
    agent::Agent,
    cli::{agent_ready, attachment, bin, rule},
    lab::{sh, sh_ns, Lab},
    tempfile::TempFile,
};
use serde_json::Value;
use std::{
    collections::BTreeSet,
    net::UdpSocket,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

/// The agent with the features `disable` taken away. Generous: under TCG
/// (the kernel matrix's VMs) verifying the XDP program alone takes 15-40 s
/// on 6.1; and on drop an agent still loading holds SIGINT until it is up,
/// then detaches: wait for that rather than leave pins behind.
fn start_agent(lab: &Lab, profile: &TempFile, extra: &[&str], disable: &str) -> Agent {
    let mut cmd = Agent::attach(lab, profile.path(), extra);
    cmd.env("FLOWCTL_DISABLE_FEATURES", disable);
    let (up_within, grace) = (Duration::from_secs(240), Duration::from_secs(120));
    Agent::spawn(cmd, up_within, grace, || agent_ready(&lab.veth_srv))
}

/// Runs `flowctl ARGS` that must exit by itself within `secs` (killed and
/// failed otherwise).
fn flowctl_exits(args: &[&str], disable: &str, secs: u64) -> Output {
    let mut child = Command::new(bin())
        .args(args)
        .env("FLOWCTL_DISABLE_FEATURES", disable)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return child.wait_with_output().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    std::thread::sleep(Duration::from_secs(2));
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    panic!(
        "flowctl {args:?} did not exit within {secs} s: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every path under `root` (empty when it does not exist).
fn tree(root: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![std::path::PathBuf::from(root)];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            out.insert(p.display().to_string());
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(p);
            }
        }
    }
    out
}

fn doctor_verifies_every_program_and_leaves_nothing_behind() {
    flowctl::dataplane::pins::ensure_bpffs().unwrap();
    let (bpf_before, run_before) = (tree("/sys/fs/bpf"), tree("/run/flowctl"));
    let started = Instant::now();
    let out = flowctl_exits(&["doctor", "--json"], "", 600);
    let took = started.elapsed();
    let (bpf_after, run_after) = (tree("/sys/fs/bpf"), tree("/run/flowctl"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "doctor failed ({}): {stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&stdout).unwrap();
    println!("doctor took {took:?} on {}", v["kernel"]);
    assert_eq!(v["ok"], true);
    let progs = v["programs"].as_array().unwrap();
    let names: Vec<&str> = progs.iter().map(|p| p["program"].as_str().unwrap()).collect();
    for want in ["flowctl_egress", "flowctl_connect4", "flowctl_connect6", "flowctl_sock_ops"] {
        assert!(names.contains(&want), "{want} in {names:?}");
    }
    assert!(
        names.contains(&v["xdp_program"].as_str().unwrap()),
        "the XDP program the loader chooses is tried"
    );
    for p in progs {
        println!(
            "{}: verifies {}, {} instructions",
            p["program"], p["verifies"], p["verified_insns"]
        );
        assert_eq!(p["verifies"], true, "{p}");
        assert!(p["verified_insns"].as_u64().unwrap_or(0) > 0, "{p}");
    }
    assert_eq!(v["features"].as_array().unwrap().len(), 13);
    // Other tests on this machine may pin and unpin meanwhile (their own
    // attachments and test planes): only what doctor could have made counts,
    // which is anything but those.
    let foreign = |p: &&String| {
        let under = |root: &str| {
            p.strip_prefix(root)
                .and_then(|r| r.split('/').next())
                .is_some_and(|d| !d.starts_with("0-"))
        };
        under("/sys/fs/bpf/flowctl/v1/ifaces/") || under("/run/flowctl/")
    };
    let new_bpf: Vec<&String> = bpf_after.difference(&bpf_before).filter(|p| !foreign(p)).collect();
    let new_run: Vec<&String> = run_after.difference(&run_before).filter(|p| !foreign(p)).collect();
    assert!(new_bpf.is_empty(), "doctor left pins behind: {new_bpf:?}");
    assert!(new_run.is_empty(), "doctor left files in /run/flowctl: {new_run:?}");
}

fn doctor_with_a_profile_names_what_this_kernel_lacks() {
    let prof = TempFile::profile(
        "[[rule]]\nname = \"a\"\nproto = \"udp\"\ndport = 53\nrate = \"10/s\"\nburst = 5\n\n[[breaker]]\nname = \"db\"\ntarget = \"192.0.2.10\"\nport = 5432\n",
    );
    let out = flowctl_exits(&["doctor", "--profile", prof.path()], "set_retval,tcx", 600);
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert_eq!(out.status.code(), Some(1), "a part that cannot run fails doctor");
    assert!(
        text.contains("[[rule]]s (XDP data plane)") && text.contains("can run on this kernel"),
        "{text}"
    );
    assert!(
        text.contains("CANNOT RUN on this kernel")
            && text.contains("bpf_set_retval")
            && text.contains("Linux 5.18+"),
        "{text}"
    );
}

fn a_profile_needing_a_missing_feature_is_rejected_whole() {
    let lab = Lab::new("ffrj", 241);
    let both = TempFile::profile(&format!(
        "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"a\"\nproto = \"udp\"\ndport = 53\nrate = \"10/s\"\nburst = 5\n\n[[breaker]]\nname = \"db\"\ntarget = \"{}\"\nport = 5432\n",
        lab.ip_cli
    ));
    let out = flowctl_exits(
        &["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", both.path()],
        "set_retval",
        120,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{err}");
    assert!(!out.status.success());
    assert!(
        err.contains("[[breaker]]")
            && err.contains("bpf_set_retval")
            && err.contains("Linux 5.18+")
            && err.contains("this kernel is"),
        "{err}"
    );
    assert!(attachment(&lab.veth_srv).is_none(), "nothing was attached");
    let ip_link = sh_ns(&lab.ns_srv, &["ip", "link", "show", &lab.veth_srv]);
    assert!(!ip_link.contains("xdp"), "no XDP program on the interface: {ip_link}");
    // Without breakers the same kernel attaches the rules.
    let rules = TempFile::profile("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"a\"\nproto = \"udp\"\ndport = 53\nrate = \"10/s\"\nburst = 5\n");
    let agent = start_agent(&lab, &rules, &[], "set_retval");
    agent.stop();
}

/// The clsact fallback: with TCX taken away (or absent, on 6.1), the egress
/// counter goes on a clsact qdisc flowctl adds and removes, or on one that
/// was there, which stays; the filter a SIGKILLed agent left is removed by
/// the next agent of the attachment.
fn egress_counter_without_tcx_uses_clsact_and_leaves_nothing() {
    for preexisting in [false, true] {
        let lab = Lab::new("ffeg", 242);
        if preexisting {
            sh_ns(&lab.ns_srv, &["tc", "qdisc", "add", "dev", &lab.veth_srv, "clsact"]);
        }
        let prof = TempFile::profile(&lab.egress_klimiter_profile());
        let agent = start_agent(&lab, &prof, &[], "tcx");
        let filters = sh_ns(&lab.ns_srv, &["tc", "filter", "show", "dev", &lab.veth_srv, "egress"]);
        assert!(filters.contains("flowctl_egress"), "a netlink filter on egress: {filters}");
        assert!(
            sh_ns(&lab.ns_srv, &["tc", "qdisc", "show", "dev", &lab.veth_srv]).contains("clsact")
        );
        // 50 datagrams out of the interface to the counted target.
        let (ip_srv, ip_cli, veth) = (lab.ip_srv.clone(), lab.ip_cli.clone(), lab.veth_srv.clone());
        let counted = Lab::in_ns(&lab.ns_srv, move || {
            let s = UdpSocket::bind(format!("{ip_srv}:0")).unwrap();
            for _ in 0..50 {
                let _ = s.send_to(b"q", format!("{ip_cli}:9000"));
                std::thread::sleep(Duration::from_millis(2));
            }
            std::thread::sleep(Duration::from_millis(200));
            let id = flowctl::dataplane::pins::AttachId::of(&veth).unwrap();
            let maps = flowctl::dataplane::Maps::open(&id).unwrap();
            maps.egress_counts.get(&0, 0).unwrap().iter().sum::<u64>()
        });
        println!("preexisting clsact {preexisting}: the egress counter counted {counted} of 50 datagrams");
        assert!((50..=60).contains(&counted), "counted {counted}");
        let agent = if preexisting {
            agent
        } else {
            // A killed agent cannot remove its netlink filter; the next agent
            // of the attachment removes exactly that one before adding its own.
            agent.kill9();
            let filters =
                sh_ns(&lab.ns_srv, &["tc", "filter", "show", "dev", &lab.veth_srv, "egress"]);
            assert!(
                filters.contains("flowctl_egress"),
                "the killed agent's filter stays: {filters}"
            );
            let again = start_agent(&lab, &prof, &[], "tcx");
            let filters =
                sh_ns(&lab.ns_srv, &["tc", "filter", "show", "dev", &lab.veth_srv, "egress"]);
            assert_eq!(
                filters.lines().filter(|l| l.contains("flowctl_egress")).count(),
                1,
                "one filter, the new agent's: {filters}"
            );
            again
        };
        agent.stop();
        let filters = sh_ns(&lab.ns_srv, &["tc", "filter", "show", "dev", &lab.veth_srv, "egress"]);
        assert!(!filters.contains("flowctl_egress"), "the filter is gone: {filters}");
        let qdiscs = sh_ns(&lab.ns_srv, &["tc", "qdisc", "show", "dev", &lab.veth_srv]);
        assert_eq!(
            qdiscs.contains("clsact"),
            preexisting,
            "a clsact flowctl added goes, one that was there stays: {qdiscs}"
        );
    }
}

/// Sends `count` UDP datagrams of `size` bytes from the client namespace to
/// the server's `port`, 2 ms apart (bounded: a few hundred ms).
fn send_datagrams(lab: &Lab, port: u16, size: usize, count: usize) {
    let (src, dst) = (lab.ip_cli.clone(), format!("{}:{port}", lab.ip_srv));
    Lab::in_ns(&lab.ns_cli, move || {
        let s = UdpSocket::bind(format!("{src}:0")).unwrap();
        let buf = vec![0x5au8; size];
        for _ in 0..count {
            let _ = s.send_to(&buf, &dst);
            std::thread::sleep(Duration::from_millis(2));
        }
    });
}

fn jumbo_case(mtu: u32, size: usize, disable: &str) {
    let lab = Lab::new("ffjm", 243);
    for (ns, dev) in [(&lab.ns_srv, &lab.veth_srv), (&lab.ns_cli, &lab.veth_cli)] {
        sh(&["ip", "-n", ns, "link", "set", "dev", dev, "mtu", &mtu.to_string()]);
    }
    let prof = TempFile::profile(
        "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"big\"\nproto = \"udp\"\ndport = 7900\nrate = \"1/min\"\nburst = 5\nkey = \"src\"\n",
    );
    let agent = start_agent(&lab, &prof, &["--mode", "native"], disable);
    assert_eq!(attachment(&lab.veth_srv).unwrap()["mode"], "native");
    let n = 60;
    send_datagrams(&lab, 7900, size, n);
    std::thread::sleep(Duration::from_millis(300));
    let r = rule(&lab.veth_srv, "big");
    println!("MTU {mtu}, {size}-byte datagrams: {r}");
    let offered = r["offered_pkts"].as_u64().unwrap();
    assert_eq!(offered, n as u64, "every datagram is one frame the rule saw");
    assert_eq!(r["passed_pkts"].as_u64().unwrap(), 5, "the burst passes");
    assert_eq!(r["dropped_pkts"].as_u64().unwrap(), n as u64 - 5, "the rest is dropped");
    let per_frame = r["offered_bytes"].as_u64().unwrap() / offered;
    // Ethernet 14 + IPv4 20 + UDP 8 + payload: the whole frame, all buffers.
    assert_eq!(per_frame, size as u64 + 42, "bytes count the whole frame");
    agent.stop();
}

fn jumbo_frames_on_a_9000_mtu_veth_in_native_mode() {
    jumbo_case(9000, 8000, "");
    // And a 1500-MTU interface as before.
    jumbo_case(1500, 1000, "");
}

/// The kernel refuses a single-buffer XDP program in native mode on a veth
/// whose peer's MTU does not fit one page (drivers/net/veth.c,
/// veth_xdp_set: "Peer MTU is too large to set XDP", ERANGE), which is why
/// flowctl loads the xdp.frags program.
fn a_single_buffer_program_is_refused_on_a_jumbo_veth() {
    let lab = Lab::new("ffsb", 244);
    for (ns, dev) in [(&lab.ns_srv, &lab.veth_srv), (&lab.ns_cli, &lab.veth_cli)] {
        sh(&["ip", "-n", ns, "link", "set", "dev", dev, "mtu", "9000"]);
    }
    let prof = TempFile::profile("[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n[[rule]]\nname = \"big\"\nproto = \"udp\"\nrate = \"1/min\"\nburst = 5\n");
    let out = flowctl_exits(
        &[
            "attach",
            &lab.veth_srv,
            "--netns",
            &lab.ns_srv,
            "--profile",
            prof.path(),
            "--mode",
            "native",
        ],
        "xdp_frags",
        120,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{err}");
    assert!(
        !out.status.success(),
        "the single-buffer program must not attach natively at MTU 9000"
    );
    assert!(err.contains("multi-buffer XDP") && err.contains("5.18"), "{err}");
    assert!(attachment(&lab.veth_srv).is_none(), "nothing left attached");
}

/// Why the benchmark loads the single-buffer variant: `bench_spread` (a
/// single-buffer program) tail-calls into flowctl's program, and the kernel
/// refuses a frags program in a program array a single-buffer program
/// owns (tail calls between the two kinds are not allowed).
fn tail_calls_need_the_single_buffer_variant() {
    use aya::{maps::ProgramArray, programs::Xdp};
    use flowctl::dataplane::XdpVariant;
    let profile = "[settings]\nkey_table_entries = 1024\nsource_cache_entries = 1024\n[[rule]]\nname = \"a\"\nrate = \"10/s\"\nburst = 5\n";
    let mut refs =
        aya::EbpfLoader::new().load(flowctl_bench::bench_object()).expect("load bench object");
    let spread: &mut Xdp = refs.program_mut("bench_spread").unwrap().try_into().unwrap();
    spread.load().unwrap();
    for (variant, ok) in [(XdpVariant::Single, true), (XdpVariant::Frags, false)] {
        let plane = flowctl_tests::testrun::TestPlane::new_variant(profile, |_| {}, variant);
        assert_eq!(plane.prog_name(), variant.program());
        let fd = plane.prog().fd().unwrap().try_clone().unwrap();
        let mut next: ProgramArray<_> =
            ProgramArray::try_from(refs.map_mut("BENCH_NEXT").unwrap()).unwrap();
        let r = next.set(0, &fd, 0);
        println!(
            "{}: tail call target {}",
            variant.program(),
            if r.is_ok() { "accepted" } else { "refused" }
        );
        assert_eq!(r.is_ok(), ok, "{:?}", r.err());
        let _ = next.clear_index(&0);
    }
}

/// The tests and what each needs (flowctl_tests::need). The jumbo test
/// needs multi-buffer XDP (xdp.frags, Linux 5.18).
fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        doctor_verifies_every_program_and_leaves_nothing_behind: [Root],
        doctor_with_a_profile_names_what_this_kernel_lacks: [Root],
        a_profile_needing_a_missing_feature_is_rejected_whole: [Root],
        egress_counter_without_tcx_uses_clsact_and_leaves_nothing: [Root, Command("tc")],
        jumbo_frames_on_a_9000_mtu_veth_in_native_mode: [Root, Kernel(5, 18)],
        a_single_buffer_program_is_refused_on_a_jumbo_veth: [Root],
        tail_calls_need_the_single_buffer_variant: [Root, Kernel(5, 18)],
    ]);
}
