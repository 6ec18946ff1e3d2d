//! flowctl beside another XDP program (`attach --multiprog`): xdp-filter,
//! loaded by libxdp itself (xdp-tools), and flowctl in one libxdp
//! dispatcher on one veth, each enforcing its own rule on real traffic,
//! through libxdp's rebuilds and flowctl's restarts and detach. Needs a
//! kernel that loads extension programs: the kernel matrix's VMs (this
//! project's host kernel refuses them, and libxdp falls back to a single
//! program there, so the test reports itself skipped).

use crate::UDP_RULE;
use flowctl_tests::{
    agent::{Agent, DetachOnDrop},
    cli::attachment,
    lab::Lab,
    tempfile::TempFile,
    traffic::{blast, UdpCounter},
};
use std::process::Command;

/// xdp-tools' commands in the lab's protected namespace, sharing this
/// process's bpffs (`ip netns exec` would mount a fresh /sys without it).
fn xdp_tool(lab: &Lab, args: &[&str]) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", lab.ns_srv))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{args:?}: {text}");
    text
}

/// xdp-filter on the lab's protected veth, unloaded when dropped (with its
/// port rule, so its pinned maps go with the last interface).
struct XdpFilter<'a> {
    lab: &'a Lab,
    loaded: bool,
}

impl<'a> XdpFilter<'a> {
    fn load(lab: &'a Lab) -> Self {
        xdp_tool(lab, &["xdp-filter", "load", &lab.veth_srv, "--mode", "native"]);
        // The guard first: a failed port rule still unloads.
        let filter = Self { lab, loaded: true };
        xdp_tool(lab, &["xdp-filter", "port", "7001", "--proto", "udp"]);
        filter
    }

    fn unload(&mut self) {
        if std::mem::take(&mut self.loaded) {
            xdp_tool(self.lab, &["xdp-filter", "unload", &self.lab.veth_srv]);
        }
    }
}

impl Drop for XdpFilter<'_> {
    fn drop(&mut self) {
        if self.loaded {
            let _ = Command::new("nsenter")
                .arg(format!("--net=/run/netns/{}", self.lab.ns_srv))
                .args(["xdp-filter", "unload", &self.lab.veth_srv])
                .status();
        }
    }
}

/// The programs libxdp's `xdp-loader status` lists in the interface's
/// dispatcher, in run order: (name, priority).
fn loader_chain(lab: &Lab) -> Vec<(String, u32)> {
    xdp_tool(lab, &["xdp-loader", "status", &lab.veth_srv])
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("=>"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[1].to_string(), f[0].parse().unwrap())
        })
        .collect()
}

/// flowctl's view of the chain (`status --json`): (name, prio, prog id,
/// flowctl's).
fn status_chain(lab: &Lab) -> Vec<(String, u64, u64, bool)> {
    let a = attachment(&lab.veth_srv).expect("attached");
    a["dispatcher"]
        .as_array()
        .unwrap_or_else(|| panic!("no dispatcher in status: {a}"))
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["run_prio"].as_u64().unwrap(),
                c["prog_id"].as_u64().unwrap(),
                c["flowctl"] == true,
            )
        })
        .collect()
}

/// The packets of `send` that reached the receiver `on`.
fn through(on: &UdpCounter, send: impl FnOnce() -> u64) -> (u64, u64) {
    let before = on.settled();
    let sent = send();
    (sent, on.settled() - before)
}

/// xdp-filter (priority 10, denying UDP to 7001) and flowctl (priority 50,
/// 100/s with a burst of 20 per source on UDP to 7000) in one dispatcher:
/// - both enforce: nothing reaches 7001, and 7000 gets at most the burst
///   and the rate over the blast (flowctl's own counters say it dropped);
/// - `xdp-filter unload` and `load` rebuild the dispatcher around
///   flowctl's component, which keeps running (same program, same rule);
/// - a SIGKILLed `--keep` agent's component stays, and a restarted agent
///   (without the flag) adopts it, swapping in its new program;
/// - detach takes flowctl out, xdp-filter enforcing alone; with both
///   gone, nothing is left on the interface or in bpffs.
pub fn flowctl_and_xdp_filter_share_an_interface() {
    flowctl::dataplane::pins::ensure_bpffs().expect("bpffs");
    let lab = Lab::new("fmulti", 202);
    let detach = DetachOnDrop::new(&lab);
    let mut filter = XdpFilter::load(&lab);
    let (r7000, r7001) = (UdpCounter::start(&lab, 7000), UdpCounter::start(&lab, 7001));
    let prof = TempFile::profile(UDP_RULE);
    let agent = Agent::start(&lab, prof.path(), &["--multiprog", "--keep"]);

    let loader = loader_chain(&lab);
    assert_eq!(loader.len(), 2, "{loader:?}");
    assert_eq!(loader[0], ("xdpfilt_alw_all".to_string(), 10), "{loader:?}");
    assert!(loader[1].0.starts_with("flowctl") && loader[1].1 == 50, "{loader:?}");
    let chain = status_chain(&lab);
    assert_eq!(chain.iter().map(|c| c.3).collect::<Vec<_>>(), [false, true], "{chain:?}");
    let flowctl_id = chain[1].2;

    // Both enforce.
    let enforce_7000 = |what: &str| {
        let before = r7000.settled();
        let (sent, first, last) = blast(&lab, 7000, 400, 1.0, 400);
        let got = r7000.settled() - before;
        let bound = 20.0 + 100.0 * ((last - first).as_secs_f64() + 0.1);
        assert!(
            got as f64 <= bound && got < sent,
            "{what}: flowctl let {got} of {sent} to 7000 through (bound {bound:.0})"
        );
        got
    };
    let deny_7001 = |what: &str| {
        let (sent, got) = through(&r7001, || blast(&lab, 7001, 200, 0.5, 100).0);
        assert!(sent > 0 && got == 0, "{what}: xdp-filter let {got} of {sent} to 7001 through");
    };
    enforce_7000("both loaded");
    deny_7001("both loaded");
    let dropped = |a: &serde_json::Value| {
        a["rules"][0]["dropped_pkts"].as_u64().unwrap_or_else(|| panic!("no dropped count: {a}"))
    };
    let dropped_before = dropped(&attachment(&lab.veth_srv).unwrap());
    assert!(dropped_before > 0, "flowctl counted its drops");

    // libxdp rebuilds the dispatcher around flowctl's component.
    filter.unload();
    let chain = status_chain(&lab);
    assert_eq!(chain.len(), 1, "{chain:?}");
    assert!(chain[0].3 && chain[0].2 == flowctl_id, "flowctl's component kept: {chain:?}");
    let (sent, got) = through(&r7001, || blast(&lab, 7001, 200, 0.5, 100).0);
    assert_eq!(got, sent, "without xdp-filter, 7001 passes");
    enforce_7000("xdp-filter unloaded");
    filter = XdpFilter::load(&lab);
    let chain = status_chain(&lab);
    assert_eq!(chain.len(), 2, "{chain:?}");
    assert!(chain[1].3 && chain[1].2 == flowctl_id, "flowctl's component kept: {chain:?}");
    deny_7001("xdp-filter loaded again");
    enforce_7000("xdp-filter loaded again");

    // A kept component outlives its agent; a new agent adopts it.
    agent.kill9();
    assert_eq!(loader_chain(&lab).len(), 2, "the component stays after SIGKILL");
    deny_7001("agent killed");
    enforce_7000("agent killed");
    let agent = Agent::start(&lab, prof.path(), &[]);
    let chain = status_chain(&lab);
    assert_eq!(chain.len(), 2, "{chain:?}");
    assert!(
        chain[1].3 && chain[1].2 != flowctl_id,
        "the new agent's program took the slot: {chain:?}"
    );
    enforce_7000("adopted");
    assert!(
        dropped(&attachment(&lab.veth_srv).unwrap()) > dropped_before,
        "counters adopted and counting"
    );

    // Detach: xdp-filter alone, then nothing.
    agent.stop();
    assert!(attachment(&lab.veth_srv).is_none(), "detached");
    let loader = loader_chain(&lab);
    assert_eq!(loader, [("xdpfilt_alw_all".to_string(), 10)], "{loader:?}");
    deny_7001("flowctl detached");
    let (sent, got) = through(&r7000, || blast(&lab, 7000, 200, 1.0, 200).0);
    assert_eq!(got, sent, "without flowctl, 7000 is not limited");
    filter.unload();
    let out = Command::new("ip")
        .args(["-n", &lab.ns_srv, "link", "show", &lab.veth_srv])
        .output()
        .unwrap();
    let link = String::from_utf8_lossy(&out.stdout);
    assert!(!link.contains("xdp"), "no XDP program left: {link}");
    let ifindex = Lab::in_ns(&lab.ns_srv, {
        let dev = lab.veth_srv.clone();
        move || flowctl::system::netns::ifindex(&dev).unwrap()
    });
    let left: Vec<String> = std::fs::read_dir("/sys/fs/bpf/xdp")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("dispatch-{ifindex}-")))
        .collect();
    assert!(left.is_empty(), "dispatcher pins left: {left:?}");
    drop(detach);
}
