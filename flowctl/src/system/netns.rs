//! Network namespaces and interface names.
use anyhow::{bail, Context, Result};
use std::{fs, os::fd::AsRawFd, os::unix::fs::MetadataExt, path::Path};

pub fn current_netns_ino() -> Result<u64> {
    Ok(fs::metadata("/proc/thread-self/ns/net").context("reading /proc/thread-self/ns/net")?.ino())
}

pub fn ifindex(iface: &str) -> Result<u32> {
    let c = std::ffi::CString::new(iface).context("interface name contains NUL")?;
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!(
            "no interface named `{iface}` in this network namespace (list them with `ip link`; use --netns NAME for an interface in another namespace)"
        );
    }
    Ok(idx)
}

/// Enters the network namespace `name` (from `ip netns add`) on this thread
/// only. Unlike `ip netns exec` it keeps the host's /sys, so pins land on the
/// host's bpffs and outlive the process. Call before starting other threads.
pub fn enter_netns(name: &str) -> Result<()> {
    let p = Path::new("/run/netns").join(name);
    let f = fs::File::open(&p).with_context(|| {
        format!(
            "no network namespace `{name}` ({} missing; list them with `ip netns list`)",
            p.display()
        )
    })?;
    setns(&f, &format!("network namespace `{name}`"))
}

/// The network namespace a thread started in, kept open so the thread can
/// make a socket there after entering another one with [`enter_netns`].
pub struct Origin(fs::File);

impl Origin {
    /// This thread's namespace now.
    pub fn here() -> Result<Self> {
        let f = fs::File::open("/proc/thread-self/ns/net")
            .context("opening /proc/thread-self/ns/net")?;
        Ok(Self(f))
    }

    /// Runs `f` in the origin namespace, then returns this thread to the
    /// namespace it was in. A socket made by `f` stays in the origin's.
    pub fn run<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let back = Self::here()?;
        setns(&self.0, "the agent's own network namespace")?;
        let out = f();
        setns(&back.0, "the interface's network namespace")?;
        out
    }
}

fn setns(f: &fs::File, which: &str) -> Result<()> {
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("entering {which}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}
