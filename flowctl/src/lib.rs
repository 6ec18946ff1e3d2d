//! flowctl: the agent and CLI of a kernel-assisted rate limiter.
//!
//! Dependencies and why: aya (loads and pins the XDP object; pure Rust, no
//! libbpf), clap (the CLI), serde/serde_json/toml (profiles and the agent's
//! state and socket protocol), thiserror/anyhow (errors in library/binary),
//! tokio (the agent's event loop: signals, timers, control socket), tracing
//! (logs), libc (setns, flock, if_nametoindex, capabilities),
//! prometheus-client (metric encoding), procfs (`/proc/stat` for the CPU signal), tiny_http (the metrics endpoint) and
//! ratatui (the `top` view, over its crossterm backend), nnls (non-negative
//! least squares for KLimiter's coefficients), nalgebra (the condition number
//! that decides whether a fit is trusted), ndarray (nnls' matrix type) and
//! plotters (the SVG chart of `flowctl simulate`, SVG backend only).

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
/// What this kernel supports, and the TC attachment without TCX.
pub mod kernel;
/// Profiles: parsed, validated, with file:line errors.
pub mod profile;
/// Operating-system plumbing: cgroups, namespaces, locks, clocks.
pub mod system;
