//! flowctl: the agent and CLI of a kernel-assisted rate limiter.
//!
//! Why each dependency is there: docs/dependencies.md.

/// `println!` that returns the write error (through `?`) instead of
/// panicking, so `flowctl status | head` ends with the broken pipe that main
/// turns into exit 0.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($t)*)?;
    }};
}

// The wings, from the top down: each imports only from the ones below it.
/// The agent: the serve loop, its control socket and the control loops.
pub mod agent;
/// The command line: one module per verb, and `top`.
pub mod cli;
/// The controllers: KLimiter and the CPU signal.
pub mod controllers;
/// The kernel side: the embedded object, pins, loading, attaching, applying.
pub mod dataplane;
/// The fleet: profiles shared through etcd, global limits through Redis.
pub mod fleet;
/// What this kernel supports, and the TC attachment without TCX.
pub mod kernel;
/// Profiles: parsed, validated, with file:line errors.
pub mod profile;
/// Operating-system plumbing: cgroups, namespaces, locks, clocks.
pub mod system;
