//! Where an attachment lives: its identity (network-namespace inode and
//! ifindex, so two namespaces can both have `veth0`), its pinned data plane on
//! bpffs and its run-time files (state, lock, control socket).
//!
//! Layout (version `LAYOUT_VERSION` is part of the path and of the pinned
//! global record, so a newer flowctl never misreads an older layout):
//!   /sys/fs/bpf/flowctl/v<LAYOUT_VERSION>/ifaces/<netns-ino>-<ifindex>/{link, FLOWCTL_*}
//!   /sys/fs/bpf/flowctl/v<LAYOUT_VERSION>/cgroups/, egress/ (links of those hooks)
//!   /run/flowctl/<netns-ino>-<ifindex>/{state.json, agent.lock, agent.sock, profile.toml, syn-totals.json, ...}
//!   /run/flowctl/cgroup-<id>/{agent.lock, agent.sock, profile.toml, breakers.json}
//!
//! The lock file exists while something holds it (an agent, an agent-less
//! `apply`, a `detach`); the run directory of an interface as long as its
//! data plane is pinned (or an agent is starting). `detach` removes both
//! and every pin: nothing of the attachment stays, and after the last one
//! the roots go too (`prune_empty_roots`).

use crate::system::{
    lock::{self, lock_held, FileLock, Holder},
    netns::{current_netns_ino, ifindex},
};
use anyhow::{bail, Context, Result};
use flowctl_common::{LAYOUT_VERSION, PIN_ROOT, RUN_ROOT};
use serde::{Deserialize, Serialize};
use std::{
    fs,
    path::{Path, PathBuf},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AttachId {
    pub netns_ino: u64,
    pub ifindex: u32,
}

/// The files of a run directory (an attachment's or a cgroup agent's), named
/// once here.
pub mod run_file {
    /// The attachment's rule identities and table shapes (`AttachState`).
    pub const STATE: &str = "state.json";
    /// The agent's exclusive `flock`, held for its lifetime.
    pub const LOCK: &str = "agent.lock";
    /// The agent's control socket.
    pub const SOCKET: &str = "agent.sock";
    /// The profile last applied, for `status`, `top` and `explain`.
    pub const PROFILE: &str = "profile.toml";
    /// SYNs since attach per rule, which the kernel counts only in its
    /// statistics rings (`agent::syn_totals`).
    pub const SYN_TOTALS: &str = "syn-totals.json";
}

impl AttachId {
    pub fn dir_name(&self) -> String {
        format!("{}-{}", self.netns_ino, self.ifindex)
    }

    pub fn pin_dir(&self) -> PathBuf {
        ifaces_root().join(self.dir_name())
    }

    pub fn run_dir(&self) -> PathBuf {
        Path::new(RUN_ROOT).join(self.dir_name())
    }

    /// The attachment of interface `iface` in the current network namespace.
    pub fn of(iface: &str) -> Result<Self> {
        let netns_ino = current_netns_ino()?;
        let ifindex = ifindex(iface)?;
        Ok(Self { netns_ino, ifindex })
    }
}

pub fn layout_root() -> PathBuf {
    Path::new(PIN_ROOT).join(format!("v{LAYOUT_VERSION}"))
}

pub fn ifaces_root() -> PathBuf {
    layout_root().join("ifaces")
}

/// Mounts bpffs at /sys/fs/bpf when it is missing (fresh machines lack it).
pub fn ensure_bpffs() -> Result<()> {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    let p = std::ffi::CString::new("/sys/fs/bpf").unwrap();
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(p.as_ptr(), &mut st) } == 0 && st.f_type as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    fs::create_dir_all("/sys/fs/bpf").ok();
    let src = std::ffi::CString::new("bpf").unwrap();
    let rc = unsafe { libc::mount(src.as_ptr(), p.as_ptr(), src.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        bail!("bpffs is not mounted at /sys/fs/bpf and mounting it failed: {} (try `mount -t bpf bpf /sys/fs/bpf`)", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Creates the pin root's layout: `ifaces/` and the places reserved for cgroup
/// and egress attachments.
pub fn ensure_layout() -> Result<()> {
    for d in ["ifaces", "cgroups", "egress"] {
        let p = layout_root().join(d);
        fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
    }
    Ok(())
}

/// Every attachment with pins under the layout root.
pub fn list_attachments() -> Vec<AttachId> {
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir(ifaces_root()) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some((a, b)) = name.split_once('-') {
                if let (Ok(netns_ino), Ok(ifindex)) = (a.parse(), b.parse()) {
                    out.push(AttachId { netns_ino, ifindex });
                }
            }
        }
    }
    out.sort_by_key(|a| (a.netns_ino, a.ifindex));
    out
}

/// The exclusive agent lock of an attachment: held for the agent's lifetime
/// (and briefly by an agent-less `apply` or a `detach`); `Ok(None)` when
/// another holds it. Tries again for a moment: a reader asking whether it
/// is held (`agent_running`) holds it for an instant.
pub fn lock_attachment(id: &AttachId) -> Result<Option<FileLock>> {
    FileLock::acquire_within(&lock_path(id), std::time::Duration::from_millis(100))
}

/// The same, waiting up to `within` for its holder to let go.
pub fn wait_for_lock(id: &AttachId, within: std::time::Duration) -> Result<Option<FileLock>> {
    FileLock::acquire_within(&lock_path(id), within)
}

pub fn lock_path(id: &AttachId) -> PathBuf {
    id.run_dir().join(run_file::LOCK)
}

/// Who holds the attachment's lock (its pid and phase), if anyone does.
pub fn lock_holder(id: &AttachId) -> Option<Holder> {
    lock::holder(&lock_path(id))
}

/// The agent of `id` (this process, holding its lock) says what it does
/// now (`system::lock::phase`).
pub fn note_phase(id: &AttachId, phase: &str) {
    lock::note_held(&lock_path(id), phase);
}

/// True when an agent holds the attachment's lock.
pub fn agent_running(id: &AttachId) -> bool {
    lock_held(&lock_path(id))
}

/// Removes the attachment's run directory, holding its lock: every file in
/// it, the lock file last, as the lock is let go. Never without the lock:
/// removing a lock file another holds would let a second agent start.
pub fn remove_run_dir(id: &AttachId, lock: FileLock) {
    let dir = id.run_dir();
    debug_assert_eq!(lock.path(), lock_path(id));
    if let Ok(rd) = fs::read_dir(&dir) {
        for e in rd.flatten() {
            let p = e.path();
            if e.file_name() == run_file::LOCK {
                continue;
            }
            let _ = if p.is_dir() { fs::remove_dir_all(&p) } else { fs::remove_file(&p) };
        }
    }
    drop(lock);
    // Empty now, unless a new agent has just made its lock here.
    let _ = fs::remove_dir(&dir);
    prune_empty_roots();
}

/// Runs [`prune_empty_roots`] when dropped: a field declared after the lock
/// of a run directory (fields drop in order), so the roots are pruned once
/// that directory has gone with its lock.
pub struct PruneRootsOnDrop;

impl Drop for PruneRootsOnDrop {
    fn drop(&mut self) {
        prune_empty_roots();
    }
}

/// Removes the pin root's layout and the run root where nothing is left in
/// them, so the last detach leaves nothing on the machine. Only empty
/// directories go (`rmdir`), innermost first; one another attachment is
/// using stays. Safe against an attach racing it: everything that makes a
/// directory under these roots makes its parents too (`create_dir_all`) at
/// the moment it needs them.
pub fn prune_empty_roots() {
    prune_empty_layout(&layout_root());
    let _ = fs::remove_dir(PIN_ROOT);
    let _ = fs::remove_dir(RUN_ROOT);
}

/// One layout's root (`/sys/fs/bpf/flowctl/vN`), where nothing is left in it.
fn prune_empty_layout(layout: &Path) {
    for d in ["ifaces", "cgroups", "egress"] {
        let _ = fs::remove_dir(layout.join(d));
    }
    let _ = fs::remove_dir(layout);
}

/// The pin directories of this attachment that another flowctl version
/// left under its own layout (`/sys/fs/bpf/flowctl/vN/ifaces/<id>`, N not
/// ours): a kept data plane this flowctl cannot adopt, but can take over
/// (`attach::replace_keeping_link`).
pub fn other_layout_dirs(id: &AttachId) -> Vec<(u32, PathBuf)> {
    let Ok(versions) = fs::read_dir(PIN_ROOT) else { return Vec::new() };
    let mut out: Vec<(u32, PathBuf)> = versions
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.strip_prefix('v')?.parse().ok()?;
            let dir = e.path().join("ifaces").join(id.dir_name());
            (v != LAYOUT_VERSION && dir.exists()).then_some((v, dir))
        })
        .collect();
    out.sort();
    out
}

/// Removes another layout's pin directory of an attachment (its link pin
/// included: a link pinned elsewhere too stays attached) and that layout's
/// roots where they are left empty.
pub fn remove_other_layout_dir(dir: &Path) -> Result<()> {
    fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    if let Some(layout) = dir.parent().and_then(Path::parent) {
        prune_empty_layout(layout);
    }
    Ok(())
}
