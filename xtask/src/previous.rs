//! The previous pinned layout's flowctl, built from its commit, for the
//! upgrade test (tests/tests/e2e/lifecycle.rs,
//! `the_previous_layouts_release_is_taken_over_without_a_gap`): a real
//! binary of that version writes the pins this build takes over, rather
//! than this build's pins renamed. `cargo xtask test --full` builds it
//! (a debug build of a whole tree, a few minutes the first time; kept in
//! `target/previous-layout/` afterwards) and hands it over in
//! `FLOWCTL_PREVIOUS_BIN`.

use crate::{root, run};
use anyhow::{bail, Context, Result};
use std::{path::PathBuf, process::Command};

/// The last commit whose pins had the layout before this one (v13: the
/// commit before the flood sketches grew the counter records and the
/// control map and took v14). Move it on with each layout bump (it stayed
/// at v11 through v12 and v13, so the upgrade test's check of
/// `LAYOUT_VERSION - 1` pins failed under `--full` meanwhile).
pub const COMMIT: &str = "f57a104bcd6101a018f8ef84cf92376636d8ddbd";
pub const LAYOUT: u32 = 13;

/// The previous layout's flowctl, built once.
pub fn flowctl() -> Result<PathBuf> {
    let dir = root().join("target/previous-layout");
    let exe = dir.join(format!("flowctl-v{LAYOUT}"));
    if exe.is_file() {
        return Ok(exe);
    }
    let src = dir.join("src");
    if src.exists() {
        std::fs::remove_dir_all(&src).with_context(|| format!("removing {}", src.display()))?;
    }
    std::fs::create_dir_all(&src)?;
    // The tree as it was, without a worktree to clean up: git archive.
    let archive = Command::new("git")
        .args(["-C"])
        .arg(root())
        .args(["archive", "--format=tar", COMMIT])
        .output()
        .context("running git archive")?;
    if !archive.status.success() {
        bail!(
            "git archive {COMMIT}: {} (the upgrade test needs the repository's history: a clone, not an export)",
            String::from_utf8_lossy(&archive.stderr).trim()
        );
    }
    let mut tar = Command::new("tar")
        .args(["-x", "-C"])
        .arg(&src)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("running tar")?;
    std::io::Write::write_all(tar.stdin.as_mut().unwrap(), &archive.stdout)?;
    if !tar.wait()?.success() {
        bail!("unpacking {COMMIT} into {} failed", src.display());
    }
    run(Command::new("cargo")
        .args(["build", "--package", "flowctl"])
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", dir.join("target")))?;
    std::fs::copy(dir.join("target/debug/flowctl"), &exe)?;
    // The tree and its target are large and no longer needed.
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(dir.join("target"));
    Ok(exe)
}
