//! `flowctl detach IFACE`: idempotent; a running agent is stopped first
//! (SIGTERM, then its own end runs: leases given back, egress filters
//! removed), then what is left goes: the pins, the egress filters a killed
//! agent left, and the run directory with its lock. Nothing of the
//! attachment stays in /run/flowctl or on bpffs.

use crate::{
    agent::{preflight::require_root, STOP_WAIT},
    cli::enter,
    dataplane::{
        self,
        pins::{self, AttachId},
    },
    system::lock::{phase, FileLock},
};
use anyhow::{bail, Result};
use std::time::{Duration, Instant};

pub fn detach(iface: &str, netns: &Option<String>) -> Result<()> {
    require_root()?;
    enter(netns)?;
    let id = AttachId::of(iface)?;
    let (lock, stopped) = match pins::lock_attachment(&id)? {
        Some(l) => (l, None),
        None => stop_holder(&id, iface)?,
    };
    lock.note(phase::DETACHING);
    // Only now, holding the lock: egress filters a killed agent left
    // (kernels without TCX); a running agent removed its own as it stopped.
    drop(dataplane::Egress::for_attachment(&id));
    let detached = dataplane::detach(&id)?;
    pins::remove_run_dir(&id, lock);
    let agent = stopped.map(|p| format!("stopped its agent (pid {p}) and ")).unwrap_or_default();
    if detached {
        out!("{agent}detached from {iface}");
    } else if stopped.is_some() {
        out!("{agent}found nothing else attached to {iface}");
    } else {
        out!("nothing attached to {iface}");
    }
    Ok(())
}

/// Something holds the attachment's lock: an agent (starting or serving)
/// is asked to stop (SIGTERM: it winds down and ends as on Ctrl-C); one
/// already stopping, an agent-less `apply` or another `detach` is waited
/// for; a holder that does not say what it is (a flowctl older than this
/// one) is not signalled. Returns the lock and the pid of the agent stopped.
fn stop_holder(id: &AttachId, iface: &str) -> Result<(FileLock, Option<u32>)> {
    // What the holder says, given a moment to say it (a lock just taken).
    let deadline = Instant::now() + Duration::from_millis(500);
    let h = loop {
        match pins::lock_holder(id) {
            // Let go between the two looks.
            None => {
                return match pins::wait_for_lock(id, STOP_WAIT)? {
                    Some(l) => Ok((l, None)),
                    None => bail!("the lock of {iface} is taken again and again; try again"),
                }
            }
            Some(h)
                if [phase::LOCKED, ""].contains(&h.phase.as_str()) && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20))
            }
            Some(h) => break h,
        }
    };
    let hint = h.pid.map(|p| format!(" (if it hangs: kill -9 {p}, then detach again)"));
    let signalled = match (h.pid, h.phase.as_str()) {
        (Some(pid), phase::STARTING | phase::SERVING) => {
            crate::system::log::status(format_args!("stopping the agent of {iface} (pid {pid})"));
            if unsafe { libc::kill(pid as i32, libc::SIGTERM) } != 0 {
                let e = std::io::Error::last_os_error();
                bail!("stopping the agent of {iface} (pid {pid}): {e}; nothing was detached");
            }
            Some(pid)
        }
        (pid, phase::STOPPING) => pid,
        (_, p) if phase::is_transient(p) => None,
        _ => bail!(
            "the lock of {iface} is held by {h}, which does not say it is an agent of this flowctl (an older one?); stop it (Ctrl-C{}) and run detach again; nothing was detached",
            h.pid.map(|p| format!(", or kill {p}")).unwrap_or_default()
        ),
    };
    match pins::wait_for_lock(id, STOP_WAIT)? {
        Some(l) => Ok((l, signalled)),
        None => bail!(
            "the agent of {iface} ({h}) did not let go of its lock within {} s; nothing was detached{}",
            STOP_WAIT.as_secs(),
            hint.unwrap_or_default()
        ),
    }
}
