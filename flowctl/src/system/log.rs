//! Where the agent's words go (docs/packaging.md, "Logs"): one stream on
//! stderr, as text lines for a terminal or as one JSON object per line for
//! a collector (`--log-format json`), with the same events either way.
//!
//! Two kinds of words: log events (`tracing`, filtered by `FLOWCTL_LOG`,
//! default `warn`; aya's own `log` records are bridged into them, so
//! `FLOWCTL_LOG=aya=debug` shows the loader's), and the operator's status
//! lines (attached, detached, the data plane kept, ...), which are always
//! shown: `flowctl: ...` in text, an event of target [`STATUS_TARGET`] in
//! JSON. A status line is written once, in the stream's format, never
//! as both a text line and an event.

use std::sync::OnceLock;
use tracing_subscriber::EnvFilter;

/// The event target of status lines in JSON: always enabled, whatever
/// `FLOWCTL_LOG` says about the rest.
pub const STATUS_TARGET: &str = "flowctl::status";

/// How stderr is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people: `flowctl: ...` status lines, tracing's compact
    /// lines for log events.
    #[default]
    Text,
    /// One JSON object per line (tracing-subscriber's JSON layer):
    /// `timestamp`, `level`, `target`, `message` and the event's fields.
    Json,
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Whether this process's log shows the kernel's events (target
/// `KERNEL_EVENTS_TARGET`, relayed by `dataplane::kernel_log`), so the
/// program should be loaded with them on (`FLOWCTL_LOG=flowctl::kernel=debug`).
pub fn kernel_events() -> bool {
    tracing::enabled!(target: flowctl_common::KERNEL_EVENTS_TARGET, tracing::Level::DEBUG)
}

/// Installs the subscriber for the process (once, before anything logs).
pub fn init(format: LogFormat) {
    let _ = FORMAT.set(format);
    let filter = EnvFilter::try_from_env("FLOWCTL_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let filter =
        filter.add_directive(format!("{STATUS_TARGET}=info").parse().expect("a valid directive"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // `try_init` also installs the `log` bridge (the `tracing-log`
    // feature), so aya's records arrive as events.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

fn format() -> LogFormat {
    FORMAT.get().copied().unwrap_or_default()
}

/// A status line: `flowctl: MSG` in text, an info event in JSON.
pub fn status(msg: impl std::fmt::Display) {
    match format() {
        LogFormat::Text => eprintln!("flowctl: {msg}"),
        LogFormat::Json => tracing::info!(target: STATUS_TARGET, "{msg}"),
    }
}

/// A warning the operator must see: `flowctl: warning: MSG` in text, a
/// warn event in JSON.
pub fn warning(msg: impl std::fmt::Display) {
    match format() {
        LogFormat::Text => eprintln!("flowctl: warning: {msg}"),
        LogFormat::Json => tracing::warn!(target: STATUS_TARGET, "{msg}"),
    }
}

/// The error a command ends with: `flowctl: error: MSG` in text, an error
/// event in JSON.
pub fn error(msg: impl std::fmt::Display) {
    match format() {
        LogFormat::Text => eprintln!("flowctl: error: {msg}"),
        LogFormat::Json => tracing::error!(target: STATUS_TARGET, "{msg}"),
    }
}
