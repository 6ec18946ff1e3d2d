//! An attachment while an agent holds it: the agent lock, the loaded object
//! and the TC egress filters, and the one rule for cleaning up.
//!
//! While the agent is starting, a failure detaches what this agent attached
//! but leaves a data plane it adopted alone (another agent's `--keep` left it
//! enforcing, and it goes on doing so). Once the agent serves, its end
//! detaches unless `--keep`. Both happen in `Drop`, so every early return
//! and every panic cleans up the same way; `finish` is the normal end, which
//! reports a failed detach instead of only logging it.

use crate::{
    dataplane::{self, pins::AttachId, Egress},
    system::lock::FileLock,
};
use anyhow::Result;

pub struct Attachment {
    pub id: AttachId,
    pub iface: String,
    /// The agent lock, released last (after the detach).
    lock: Option<FileLock>,
    ebpf: Option<aya::Ebpf>,
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
        Self {
            id,
            iface: iface.to_string(),
            lock: Some(lock),
            ebpf: None,
            egress: Egress::for_attachment(&id),
            detach_on_drop: !adopting,
            serving: false,
        }
    }

    /// Stale pins were removed: the start now owns what it creates.
    pub fn not_adopting(&mut self) {
        self.detach_on_drop = true;
    }

    /// The program is loaded and attached.
    pub fn loaded(&mut self, ebpf: aya::Ebpf) {
        self.ebpf = Some(ebpf);
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
    }

    /// The normal end: the egress filters go (also under `--keep`: nothing
    /// reads their counts without the agent), then the detach or the kept
    /// data plane is reported.
    pub fn finish(mut self) -> Result<()> {
        self.egress.release();
        let detach = std::mem::replace(&mut self.detach_on_drop, false);
        self.serving = false;
        if detach {
            dataplane::detach(&self.id)?;
            eprintln!("flowctl: detached from {}", self.iface);
        } else {
            eprintln!(
                "flowctl: agent stopped; the data plane on {} keeps enforcing (--keep)",
                self.iface
            );
        }
        Ok(())
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.egress.release();
        if self.detach_on_drop {
            match dataplane::detach(&self.id) {
                Ok(_) if self.serving => eprintln!("flowctl: detached from {}", self.iface),
                Ok(_) => {}
                Err(e) => eprintln!("flowctl: detaching from {}: {e:#}", self.iface),
            }
        }
        // The program's fds, then the lock: another agent may start only
        // once this one's data plane is gone or left as it should be.
        drop(self.ebpf.take());
        drop(self.lock.take());
    }
}
