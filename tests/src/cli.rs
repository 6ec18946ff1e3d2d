//! The real `flowctl` binary for the end-to-end tests: where it is, running
//! it, and reading an attachment out of `status --json`.

use serde_json::Value;
use std::{
    path::PathBuf,
    process::{Command, Output},
};

/// `FLOWCTL_BIN` (set by `cargo xtask test`), else the debug build.
pub fn bin() -> PathBuf {
    std::env::var_os("FLOWCTL_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/flowctl");
        assert!(p.exists(), "build flowctl first (cargo xtask test does) or set FLOWCTL_BIN");
        p
    })
}

/// Runs `flowctl ARGS` to completion.
pub fn flowctl(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("run flowctl")
}

/// The attachment of `iface` in `flowctl status --json`, if any.
pub fn attachment(iface: &str) -> Option<Value> {
    let out = flowctl(&["status", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v.as_array()?.iter().find(|a| a["iface"] == iface).cloned()
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
