//! Helpers for the privileged tests: crafted packets, throwaway network
//! namespaces joined by veth (removed on drop, also when a test fails), and a
//! data plane loaded for `BPF_PROG_TEST_RUN` under a unique pin directory;
//! for the end-to-end tests, the real binary ([`cli`]), its agent
//! ([`agent`]), traffic ([`traffic`]), cgroups, a downstream and client
//! processes for the breakers; and the harness ([`need`]) that reports a test
//! the host cannot run as ignored.

pub mod agent;
pub mod breaker_bench;
pub mod breaker_client;
pub mod cgroup;
pub mod cli;
pub mod downstream;
pub mod etcd;
pub mod fleet_bench;
pub mod fleet_lab;
pub mod flood;
pub mod fuzz;
pub mod jit_profile;
pub mod lab;
pub mod need;
pub mod overload;
pub mod packet;
pub mod packet_socket;
pub mod pki;
pub mod redis;
pub mod server;
pub mod shaper_bench;
pub mod tempfile;
pub mod testrun;
pub mod tmux;
pub mod traffic;
pub mod web;

/// A name unique to this process and call, short enough for an interface name.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}{n}", std::process::id() % 100_000)
}
