//! An attachment while an agent holds it: the agent lock, the loaded object
//! and the TC egress filters, and the one rule for cleaning up.
//!
//! While the agent is starting, a failure detaches what this agent attached
//! but leaves a data plane it adopted alone (another agent's `--keep` left it
//! enforcing, and it goes on doing so). Once the agent serves, its end
//! detaches unless `--keep`. Both happen in `Drop`, so every early return
//! and every panic cleans up the same way; `finish` is the normal end, which
//! reports a failed detach instead of only logging it. A detach removes the
//! run directory too, the lock file last as the lock is let go, so nothing
//! of the attachment stays; a kept data plane keeps its run directory (what
//! the next agent adopts) and loses only the lock file.

use crate::{
    dataplane::{self, pins, pins::AttachId, Egress, KernelLog},
    system::lock::{phase, FileLock},
};
use anyhow::Result;

pub struct Attachment {
    pub id: AttachId,
    pub iface: String,
    /// The agent lock, released last (after the detach).
    lock: Option<FileLock>,
    ebpf: Option<aya::Ebpf>,
    /// The program's kernel events relayed into the log, when asked for.
    kernel_log: Option<KernelLog>,
    egress: Egress,
    /// Detach when dropped: `!adopted` while starting, `!keep` once serving.
    detach_on_drop: bool,
    /// Serving: say what happened to the data plane at the end.
    serving: bool,
}

impl Attachment {
    /// Holds the lock for `iface` before anything is loaded. `adopting`: the
    /// pins are there already (a kept data plane); a failed start then
    /// leaves them. Otherwise a failed start removes what loading created.
    pub fn new(id: AttachId, iface: &str, lock: FileLock, adopting: bool) -> Self {
        lock.note(phase::STARTING);
        Self {
            id,
            iface: iface.to_string(),
            lock: Some(lock),
            ebpf: None,
            kernel_log: None,
            egress: Egress::for_attachment(&id),
            detach_on_drop: !adopting,
            serving: false,
        }
    }

    /// Stale pins were removed: the start now owns what it creates.
    pub fn not_adopting(&mut self) {
        self.detach_on_drop = true;
    }

    /// The program is loaded and attached; its kernel events are relayed
    /// into the log when it was loaded with them on
    /// (`Settings::kernel_events`).
    pub fn loaded(&mut self, mut ebpf: aya::Ebpf, kernel_events: bool) -> Result<()> {
        if kernel_events {
            self.kernel_log = Some(KernelLog::start(&mut ebpf)?);
        }
        self.ebpf = Some(ebpf);
        Ok(())
    }

    /// Whether a failed start detaches: the pins are this start's own, not
    /// adopted.
    pub fn owns_pins(&self) -> bool {
        self.detach_on_drop
    }

    /// The loaded object and the egress filters, for the agent's loops.
    pub fn parts(&mut self) -> (&mut aya::Ebpf, &mut Egress) {
        (self.ebpf.as_mut().expect("loaded before use"), &mut self.egress)
    }

    /// The start is over: from now on the end detaches unless `keep`.
    pub fn serve(&mut self, keep: bool) {
        self.detach_on_drop = !keep;
        self.serving = true;
        if let Some(l) = &self.lock {
            l.note(phase::SERVING);
        }
    }

    /// The normal end: the egress filters go (also under `--keep`: nothing
    /// reads their counts without the agent), then the detach or the kept
    /// data plane is reported.
    pub fn finish(mut self) -> Result<()> {
        let detach = self.detach_on_drop;
        let serving = std::mem::replace(&mut self.serving, false);
        self.end()?;
        if detach {
            crate::system::log::status(format_args!("detached from {}", self.iface));
        } else if serving {
            crate::system::log::status(format_args!(
                "agent stopped; the data plane on {} keeps enforcing (--keep)",
                self.iface
            ));
        }
        Ok(())
    }

    /// Egress filters, the detach (when due), the program's fds, then the
    /// run directory and the lock: another agent may start only once this
    /// one's data plane is gone or left as it should be. Runs once.
    fn end(&mut self) -> Result<()> {
        if let Some(l) = &self.lock {
            l.note(phase::STOPPING);
        }
        self.egress.release();
        let detach = std::mem::replace(&mut self.detach_on_drop, false);
        let detached = if detach { dataplane::detach(&self.id).map(|_| true) } else { Ok(false) };
        drop(self.ebpf.take());
        match (self.lock.take(), &detached) {
            (Some(lock), Ok(true)) => pins::remove_run_dir(&self.id, lock),
            (lock, _) => drop(lock),
        }
        detached.map(|_| ())
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        if self.lock.is_none() {
            return; // ended already
        }
        let detach = self.detach_on_drop;
        match self.end() {
            Ok(()) if detach && self.serving => {
                crate::system::log::status(format_args!("detached from {}", self.iface))
            }
            Ok(()) => {}
            Err(e) => {
                crate::system::log::warning(format_args!("detaching from {}: {e:#}", self.iface))
            }
        }
    }
}
