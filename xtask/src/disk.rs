//! Free space for the suite's build, checked before it starts: a disk that
//! fills while rustc links the test binaries fails the run after ten minutes
//! with "No space left on device" (stop 40's CI did), where a check up front
//! says what is needed and how to get it.

use anyhow::{bail, Result};
use std::{ffi::CString, os::unix::ffi::OsStrExt, path::Path};

/// What `cargo xtask test` leaves in a clean clone's `target/`, measured
/// (2026-12-07, with the dev profile's line tables only; 8.9 GiB with full
/// debuginfo), rounded up.
const SUITE_TARGET_BYTES: u64 = 5 << 30;

/// Headroom beyond the build: the tests' own temporary files, logs, and
/// the VMs' scratch space.
const HEADROOM_BYTES: u64 = 1 << 30;

/// The cargo target directory of the workspace at `root`.
pub fn target_dir(root: &Path) -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(Into::into).unwrap_or_else(|| root.join("target"))
}

/// Fails with what to do when the filesystem holding `target` has less free
/// than the rest of the build needs: the suite's size less what `target`
/// already holds, plus headroom.
pub fn preflight(target: &Path) -> Result<()> {
    let held = tree_bytes(target);
    let probe = if target.exists() { target } else { target.parent().unwrap_or(target) };
    let Some(free) = free_bytes(probe) else { return Ok(()) };
    if let Some(needed) = shortfall(free, held) {
        bail!(
            "{} free on the filesystem of {}, and the test suite's build needs about {} more \
             (a clean build fills {} in target/, and {} of it is there): free space (old clones' \
             target/ directories, `cargo clean`) or set CARGO_TARGET_DIR to a larger filesystem",
            gib(free),
            probe.display(),
            gib(needed),
            gib(SUITE_TARGET_BYTES),
            gib(held),
        );
    }
    Ok(())
}

/// What the rest of the build needs when `free` bytes cannot hold it,
/// with `held` bytes of it already in `target/`.
fn shortfall(free: u64, held: u64) -> Option<u64> {
    let needed = SUITE_TARGET_BYTES.saturating_sub(held) + HEADROOM_BYTES;
    (free < needed).then_some(needed)
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Bytes available to an unprivileged writer on the filesystem of `path`
/// (statvfs(3)'s `f_bavail`); None if it cannot be asked.
fn free_bytes(path: &Path) -> Option<u64> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// The bytes of the regular files under `dir` (0 if it does not exist);
/// symbolic links are not followed.
fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_s_bytes_are_its_files_bytes() {
        let dir = std::env::temp_dir().join(format!("xtask-disk-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("one"), [0u8; 100]).unwrap();
        std::fs::write(dir.join("a/b/two"), [0u8; 23]).unwrap();
        let bytes = tree_bytes(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(bytes, 123);
        assert_eq!(tree_bytes(&dir), 0, "a missing directory holds nothing");
    }

    #[test]
    fn a_build_in_progress_needs_only_the_rest() {
        let gib = 1u64 << 30;
        assert_eq!(shortfall(2 * gib, 0), Some(SUITE_TARGET_BYTES + HEADROOM_BYTES));
        assert_eq!(shortfall(SUITE_TARGET_BYTES + HEADROOM_BYTES, 0), None);
        assert_eq!(shortfall(2 * gib, SUITE_TARGET_BYTES), None, "built: headroom only");
        assert_eq!(shortfall(gib / 2, SUITE_TARGET_BYTES), Some(HEADROOM_BYTES));
    }

    #[test]
    fn free_space_is_read_where_the_path_exists() {
        assert!(free_bytes(Path::new("/")).is_some_and(|b| b > 0));
        assert!(free_bytes(Path::new("/no/such/dir")).is_none());
    }
}
