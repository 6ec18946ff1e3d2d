//! The real `flowctl` binary for the end-to-end tests: where it is, running
//! it, and reading what it shows: an attachment (or a cgroup's breakers) out
//! of `status --json`, `top --once --json`, and an attachment's pinned maps.

use serde_json::Value;
use std::{
    path::PathBuf,
    process::{Command, Output},
};

/// The variable naming the binary under test (`cargo xtask test`, `demo`
/// and `bench` set it).
pub const BIN_ENV: &str = "FLOWCTL_BIN";

/// [`BIN_ENV`], else the debug build.
pub fn bin() -> PathBuf {
    std::env::var_os(BIN_ENV).map(PathBuf::from).unwrap_or_else(|| {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/flowctl");
        assert!(p.exists(), "build flowctl first (cargo xtask test does) or set FLOWCTL_BIN");
        p
    })
}

/// Runs `flowctl ARGS` to completion.
pub fn flowctl(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("run flowctl")
}

/// The first entry of `flowctl status --json` that `pick` takes.
fn status_entry(pick: impl Fn(&Value) -> bool) -> Option<Value> {
    let out = flowctl(&["status", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v.as_array()?.iter().find(|a| pick(a)).cloned()
}

/// The attachment of `iface` in `flowctl status --json`, if any.
pub fn attachment(iface: &str) -> Option<Value> {
    status_entry(|a| a["iface"] == iface)
}

/// Whether `iface` is attached with its agent up and ready.
pub fn agent_ready(iface: &str) -> bool {
    attachment(iface).is_some_and(|a| a["agent_ready"] == true)
}

/// One rule's counters of an attached `iface`.
pub fn rule(iface: &str, name: &str) -> Value {
    let a = attachment(iface).expect("attached");
    a["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == name)
        .cloned()
        .expect("rule in status")
}

/// The published breakers of a cgroup attachment, from `status --json`.
pub fn breakers_of(cgroup: &str) -> Option<Value> {
    status_entry(|a| a["cgroup"] == cgroup)
}

/// One breaker of the cgroup attachment `cgroup`.
pub fn breaker(cgroup: &str, name: &str) -> Value {
    breakers_of(cgroup).expect("breakers published")["breakers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == name)
        .cloned()
        .expect("breaker")
}

/// `flowctl top IFACE --once --json --interval SECS`.
pub fn top_once(iface: &str, interval: &str) -> Value {
    let out = flowctl(&["top", iface, "--once", "--json", "--interval", interval]);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The pin directory of an attachment (an entry of `status --json`).
pub fn pin_dir(attachment: &Value) -> String {
    format!(
        "{}/v{}/ifaces/{}-{}",
        flowctl_common::PIN_ROOT,
        flowctl_common::LAYOUT_VERSION,
        attachment["netns_inode"],
        attachment["ifindex"]
    )
}

/// The run directory of an attachment (an entry of `status --json`).
pub fn run_dir(attachment: &Value) -> String {
    format!("{}/{}-{}", flowctl_common::RUN_ROOT, attachment["netns_inode"], attachment["ifindex"])
}

/// What is left of an attachment (an entry of `status --json` taken while
/// it was attached): its run directory and pin directory, where they exist
/// still, with what is in them.
pub fn leftovers(attachment: &Value) -> Vec<String> {
    [run_dir(attachment), pin_dir(attachment)]
        .into_iter()
        .filter(|d| std::path::Path::new(d).exists())
        .map(|d| {
            let files: Vec<String> = std::fs::read_dir(&d)
                .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into()).collect())
                .unwrap_or_default();
            format!("{d} {files:?}")
        })
        .collect()
}

/// The roots of the pins and of the run directories where they exist: once
/// the last attachment is detached, none should (nothing stays on the
/// machine).
pub fn roots_left() -> Vec<String> {
    [flowctl_common::PIN_ROOT, flowctl_common::RUN_ROOT]
        .into_iter()
        .filter(|d| std::path::Path::new(d).exists())
        .map(String::from)
        .collect()
}

/// The ids of an attached `iface`'s pinned maps (the same ids: the same maps).
pub fn map_ids(iface: &str) -> Vec<u32> {
    let dir = pin_dir(&attachment(iface).unwrap());
    flowctl_common::map_names::ALL
        .iter()
        .map(|n| aya::maps::MapData::from_pin(format!("{dir}/{n}")).unwrap().info().unwrap().id())
        .collect()
}
