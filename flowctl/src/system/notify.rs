//! The agent's words to its service manager (systemd's notification
//! protocol, sd_notify(3)): ready once it serves, stopping when a signal
//! ends it, and the watchdog's pings while its loop runs. Without
//! `NOTIFY_SOCKET` (not started by systemd) every call does nothing.

use sd_notify::NotifyState;
use std::time::Duration;

/// Sends `states` (nothing without `NOTIFY_SOCKET`: sd-notify checks); a
/// failure is logged, never fatal (the data plane does not depend on the
/// manager hearing it).
fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!("telling the service manager {states:?}: {e}");
    }
}

/// The agent serves: attached (or adopted), control socket bound.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// A signal came: the agent winds down.
pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
}

/// One watchdog ping.
pub fn watchdog() {
    send(&[NotifyState::Watchdog]);
}

/// How often to ping the watchdog, when the manager asks for it
/// (`WatchdogSec=`, passed as `WATCHDOG_USEC`): half its period, so one
/// late tick is not a missed ping.
pub fn watchdog_every() -> Option<Duration> {
    let mut usec = 0;
    sd_notify::watchdog_enabled(false, &mut usec).then(|| Duration::from_micros(usec / 2))
}
