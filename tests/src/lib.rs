//! Helpers for the privileged tests: crafted packets, throwaway network
//! namespaces joined by veth (removed on drop, also when a test fails), and a
//! data plane loaded for `BPF_PROG_TEST_RUN` under a unique pin directory.

pub mod breaker_bench;
pub mod lab;
pub mod overload;
pub mod packet;
pub mod testrun;

/// A name unique to this process and call, short enough for an interface name.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}{n}", std::process::id() % 100_000)
}

/// Skips (by returning true) when not root, printing why.
pub fn not_root() -> bool {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (run `cargo xtask test`)");
        return true;
    }
    false
}
