//! The binary's own contract, without root: `check` output and exit codes.

use std::{
    io::Write,
    process::{Command, Stdio},
};

fn profile(text: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!(
        "flowctl-cli-{}-{}.toml",
        std::process::id(),
        text.len()
    ));
    std::fs::write(&p, text).unwrap();
    p
}

/// A reader that goes away (`flowctl check big.toml | head -1`) ends flowctl
/// quietly with exit 0, not a panic.
#[test]
fn broken_pipe_exits_zero() {
    let mut text = String::from("[settings]\nmax_rules = 256\n");
    for i in 0..200 {
        text += &format!("[[rule]]\nname = \"r{i}\"\nrate = \"{}/s\"\n", i + 1);
    }
    let p = profile(&text);
    let mut child = Command::new(env!("CARGO_BIN_EXE_flowctl"))
        .arg("check")
        .arg(&p)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader closes before flowctl writes
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_file(&p);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

/// A bad profile exits 2 with file:line:column on stderr.
#[test]
fn bad_profile_exits_two_with_location() {
    let p = profile("[[rule]]\nname = \"x\"\nrate = \"fast\"\n");
    let out = Command::new(env!("CARGO_BIN_EXE_flowctl")).arg("check").arg(&p).output().unwrap();
    let _ = std::fs::remove_file(&p);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:3:", p.display())), "{err}");
    let _ = std::io::stderr().flush();
}
