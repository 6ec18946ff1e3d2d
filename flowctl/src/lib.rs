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

pub mod adaptive;
pub mod agent;
pub mod breaker_agent;
pub mod cgroup;
pub mod commands;
pub mod control;
pub mod cpu;
pub mod dataplane;
pub mod doctor;
pub mod heavy;
pub mod kernel;
pub mod klimiter;
pub mod klimiter_agent;
pub mod metrics;
pub mod object;
pub mod occupancy;
pub mod pins;
pub mod profile;
pub mod profile_breaker;
pub mod profile_klimiter;
pub mod simulate;
pub mod top;
