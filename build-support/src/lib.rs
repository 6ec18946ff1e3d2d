//! Builds an eBPF crate for the BPF target from a build script, quietly.
//!
//! aya-build forwards every line the nested `cargo build` prints (hundreds of
//! `Compiling ...` lines on a first build) as a `cargo:warning=`, which cargo
//! shows as warnings of the host crate. Here the build script's standard
//! output is captured while aya-build runs; afterwards the build directives
//! (`cargo:rerun-if-*`) are passed on, the nested cargo's progress lines are
//! dropped, and compiler diagnostics (real warnings in the eBPF code) are kept.
//! When the build fails, everything is passed on, so the error is in front of
//! whoever runs the build.
use std::{
    fs::File,
    io::{Read, Seek, Write},
    os::fd::AsRawFd,
};

/// The eBPF crate's `[[bin]]`s require this feature, so host builds of the
/// workspace (`cargo build/test --workspace`) skip them; only the nested BPF
/// build turns it on.
pub const BPF_FEATURE: &str = "bpf-target";

/// Builds `name` (a crate at `root_dir`) with aya-build into `OUT_DIR`, or
/// panics with `hint` after passing the whole output on.
pub fn build_ebpf(name: &str, root_dir: &str, hint: &str) {
    let package =
        aya_build::Package { name, root_dir, features: &[BPF_FEATURE], ..Default::default() };
    let (result, captured) =
        capture_stdout(|| aya_build::build_ebpf([package], aya_build::Toolchain::default()));
    let failed = result.is_err();
    let mut out = std::io::stdout().lock();
    for line in captured.lines() {
        if failed || !is_progress(line) {
            let _ = writeln!(out, "{line}");
        }
    }
    drop(out);
    if let Err(e) = result {
        panic!("building {name} for the BPF target failed: {e:#}\nhint: {hint}");
    }
}

/// A line of the nested cargo's progress report, forwarded as a warning.
fn is_progress(line: &str) -> bool {
    let Some(text) = line.strip_prefix("cargo:warning=") else { return false };
    let first = text.split_whitespace().next().unwrap_or("");
    text.trim().is_empty()
        || matches!(
            first,
            "Compiling"
                | "Finished"
                | "Fresh"
                | "Updating"
                | "Downloading"
                | "Downloaded"
                | "Locking"
                | "Adding"
                | "Blocking"
                | "Checking"
                | "Running"
        )
}

/// Runs `f` with file descriptor 1 pointed at a temporary file and returns
/// what was written there. If the redirection cannot be set up, `f` runs
/// with the real standard output (loud, but correct).
fn capture_stdout<T>(f: impl FnOnce() -> T) -> (T, String) {
    let Some(dir) = std::env::var_os("OUT_DIR") else { return (f(), String::new()) };
    let path = std::path::Path::new(&dir).join("ebpf-build.log");
    let Ok(mut file) =
        File::options().read(true).write(true).create(true).truncate(true).open(&path)
    else {
        return (f(), String::new());
    };
    let _ = std::io::stdout().flush();
    // SAFETY: plain descriptor calls on descriptors this function owns or on 1.
    let saved = unsafe { libc::dup(1) };
    if saved < 0 || unsafe { libc::dup2(file.as_raw_fd(), 1) } < 0 {
        return (f(), String::new());
    }
    let result = f();
    let _ = std::io::stdout().flush();
    // SAFETY: as above; `saved` is the descriptor dup'ed from 1.
    unsafe {
        libc::dup2(saved, 1);
        libc::close(saved);
    }
    let mut captured = String::new();
    let _ = file.rewind().and_then(|_| file.read_to_string(&mut captured));
    (result, captured)
}
