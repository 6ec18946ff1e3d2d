//! Where an attachment lives: its identity (network-namespace inode and
//! ifindex, so two namespaces can both have `veth0`), its pinned data plane on
//! bpffs and its run-time files (state, lock, control socket).
//!
//! Layout (version `LAYOUT_VERSION` is part of the path and of the pinned
//! global record, so a newer flowctl never misreads an older layout):
//!   /sys/fs/bpf/flowctl/v1/ifaces/<netns-ino>-<ifindex>/{link, FLOWCTL_*}
//!   /sys/fs/bpf/flowctl/v1/cgroups/   (reserved for cgroup attachments)
//!   /sys/fs/bpf/flowctl/v1/egress/    (reserved for TC egress attachments)
//!   /run/flowctl/<netns-ino>-<ifindex>/{state.json, agent.lock, agent.sock, profile.toml}

use anyhow::{bail, Context, Result};
use flowctl_common::{LAYOUT_VERSION, PIN_ROOT, RUN_ROOT};
use serde::{Deserialize, Serialize};
use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachId {
    pub netns_ino: u64,
    pub ifindex: u32,
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

/// One rule's persistent identity across applies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleState {
    pub name: String,
    pub fingerprint: String,
    pub state_id: u32,
    pub record: u32,
}

/// What the agent (or an agent-less apply) records about an attachment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachState {
    pub layout_version: u32,
    pub iface: String,
    pub netns: Option<String>,
    pub id: AttachId,
    /// "native" or "generic".
    pub mode: String,
    pub profile_path: String,
    pub rules: Vec<RuleState>,
    pub next_state_id: u32,
    pub attached_at_unix: u64,
    pub key_table_entries: u32,
    pub source_cache_entries: u32,
    /// Absent in state written before quotas existed: the default then.
    #[serde(default = "default_quota_entries")]
    pub quota_table_entries: u32,
    /// Shape of the statistics rings the program was loaded with.
    #[serde(default)]
    pub stats: crate::profile::StatsSettings,
    #[serde(default = "default_conn_entries")]
    pub connection_table_entries: u32,
}

fn default_conn_entries() -> u32 {
    flowctl_common::DEFAULT_CONN_ENTRIES
}

fn default_quota_entries() -> u32 {
    flowctl_common::DEFAULT_QUOTA_ENTRIES
}

impl AttachState {
    pub fn path(id: &AttachId) -> PathBuf {
        id.run_dir().join("state.json")
    }

    pub fn load(id: &AttachId) -> Result<Option<Self>> {
        let p = Self::path(id);
        match fs::read(&p) {
            Ok(b) => Ok(Some(
                serde_json::from_slice(&b).with_context(|| format!("parsing {}", p.display()))?,
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }

    /// Written to a temporary file and renamed, so readers never see half.
    pub fn save(&self) -> Result<()> {
        let dir = self.id.run_dir();
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let tmp = dir.join("state.json.tmp");
        fs::write(&tmp, serde_json::to_vec_pretty(self)?)?;
        fs::rename(&tmp, Self::path(&self.id))?;
        Ok(())
    }
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

/// An exclusive `flock` on a file: held while the value lives, released by
/// the kernel when the process exits, however it exits.
pub struct FileLock {
    _file: fs::File,
}

impl FileLock {
    /// `Ok(None)` when another process holds it.
    pub fn try_acquire(path: &Path) -> Result<Option<Self>> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        use std::os::fd::AsRawFd;
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            return Ok(None);
        }
        Ok(Some(Self { _file: f }))
    }
}

/// True when some process holds the lock at `path`.
pub fn lock_held(path: &Path) -> bool {
    let Ok(f) = fs::OpenOptions::new().write(true).open(path) else { return false };
    use std::os::fd::AsRawFd;
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        false
    } else {
        true
    }
}

/// The exclusive agent lock of an attachment: held for the agent's lifetime
/// (and briefly by an agent-less `apply`).
pub type AgentLock = FileLock;

impl FileLock {
    pub fn for_attachment(id: &AttachId) -> Result<Option<Self>> {
        Self::try_acquire(&id.run_dir().join("agent.lock"))
    }
}

/// True when an agent holds the attachment's lock.
pub fn agent_running(id: &AttachId) -> bool {
    lock_held(&id.run_dir().join("agent.lock"))
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
    use std::os::fd::AsRawFd;
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("entering network namespace `{name}`: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Monotonic clock in ns, the clock `bpf_ktime_get_ns` reads.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
