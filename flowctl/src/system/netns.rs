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
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("entering network namespace `{name}`: {}", std::io::Error::last_os_error());
    }
    Ok(())
}
