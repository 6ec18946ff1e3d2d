//! The XDP program's kernel events (flowctl-ebpf/src/events.rs) relayed
//! into this process's log. The object carries aya-log's ring buffer
//! (`AYA_LOGS`); a thread of its own waits on it and hands each record to
//! the `log` facade with the target the kernel gave it
//! (`flowctl_common::KERNEL_EVENTS_TARGET`), which the `tracing-log` bridge turns
//! into an event like any other, text or JSON.
//!
//! Only started when the object was loaded with its events on
//! (`Settings::kernel_events`): otherwise nothing is written to the ring.

use anyhow::{anyhow, Result};
use std::{
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

/// How long the relay sleeps in `poll` before it looks at its stop flag.
const POLL: Duration = Duration::from_millis(200);

/// The relay thread; stopped (after a last read) when dropped.
pub struct KernelLog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl KernelLog {
    /// Takes the object's log ring and starts relaying it.
    pub fn start(ebpf: &mut aya::Ebpf) -> Result<Self> {
        let mut logger = aya_log::EbpfLogger::init(ebpf)
            .map_err(|e| anyhow!("reading the XDP program's kernel events: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("flowctl-kernel-log".into())
            .spawn(move || {
                let fd = logger.as_raw_fd();
                while !flag.load(Ordering::Relaxed) {
                    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                    // A failed poll (EINTR) only means an early look.
                    unsafe { libc::poll(&mut p, 1, POLL.as_millis() as i32) };
                    logger.flush();
                }
                logger.flush();
            })
            .map_err(|e| anyhow!("starting the kernel-events thread: {e}"))?;
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for KernelLog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
