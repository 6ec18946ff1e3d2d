//! Where the cgroup hierarchies are mounted, read from /proc/self/mounts: the
//! one place flowctl (the breakers' attach point, the CPU signal's cgroup
//! source) and its tests find them. A pure cgroup v2 host mounts `cgroup2`
//! at `/sys/fs/cgroup`; a hybrid one mounts it at `/sys/fs/cgroup/unified`
//! beside v1 hierarchies (`cgroup`, one per controller set, such as
//! `/sys/fs/cgroup/cpu,cpuacct`).

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// One cgroup mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub path: PathBuf,
    /// `cgroup2` (true) or a v1 `cgroup` hierarchy (false).
    pub v2: bool,
    /// A v1 hierarchy's controllers (from its mount options); empty for v2
    /// (a v2 hierarchy lists its own in `cgroup.controllers`).
    pub controllers: Vec<String>,
}

/// Controllers a v1 hierarchy can carry, as mount options name them.
const V1_CONTROLLERS: &[&str] = &[
    "cpu",
    "cpuacct",
    "cpuset",
    "memory",
    "devices",
    "freezer",
    "net_cls",
    "net_prio",
    "blkio",
    "perf_event",
    "hugetlb",
    "pids",
    "rdma",
    "misc",
];

/// The cgroup mounts of a mount table (the text of /proc/self/mounts).
pub fn parse_mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (path, fstype, opts) = (f.get(1)?, f.get(2)?, f.get(3).copied().unwrap_or(""));
            let v2 = match *fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            let controllers = if v2 {
                Vec::new()
            } else {
                opts.split(',').filter(|o| V1_CONTROLLERS.contains(o)).map(String::from).collect()
            };
            Some(Mount { path: PathBuf::from(unescape(path)), v2, controllers })
        })
        .collect()
}

/// The mount table's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This process's cgroup mounts.
pub fn mounts() -> Result<Vec<Mount>> {
    let text = std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    Ok(parse_mounts(&text))
}

/// The cgroup v2 mount of a mount table: the shortest `cgroup2` path when
/// there are several (a bind mount below the hierarchy's root is longer).
pub fn v2_of(mounts: &[Mount]) -> Option<PathBuf> {
    mounts.iter().filter(|m| m.v2).map(|m| m.path.clone()).min_by_key(|p| p.as_os_str().len())
}

/// The v1 hierarchies carrying `controller`.
pub fn v1_of(mounts: &[Mount], controller: &str) -> Vec<PathBuf> {
    mounts
        .iter()
        .filter(|m| !m.v2 && m.controllers.iter().any(|c| c == controller))
        .map(|m| m.path.clone())
        .collect()
}

/// Where cgroup v2 is mounted (`/sys/fs/cgroup` on pure v2 systems,
/// `/sys/fs/cgroup/unified` on hybrid ones).
pub fn cgroup2_mount() -> Result<PathBuf> {
    v2_of(&mounts()?).context(
        "no cgroup v2 hierarchy is mounted (circuit breakers attach to cgroup v2): mount one with `mount -t cgroup2 none /sys/fs/cgroup/unified`",
    )
}

/// The controllers a v2 cgroup directory offers (`cgroup.controllers`; at
/// the mount, the ones not bound to a v1 hierarchy).
pub fn v2_controllers(dir: &Path) -> Result<Vec<String>> {
    let p = dir.join("cgroup.controllers");
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    Ok(text.split_whitespace().map(String::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "sysfs /sys sysfs rw,nosuid 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/cpuset cgroup rw,relatime,cpuset 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";
    const PURE: &str = "proc /proc proc rw 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0
cgroup2 /srv/with\\040space/cg cgroup2 rw 0 0
";

    #[test]
    fn hybrid_layout() {
        let m = parse_mounts(HYBRID);
        assert_eq!(v2_of(&m), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(v1_of(&m, "cpu"), vec![PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")]);
        assert_eq!(v1_of(&m, "cpuacct"), vec![PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")]);
        assert_eq!(v1_of(&m, "cpuset"), vec![PathBuf::from("/sys/fs/cgroup/cpuset")]);
        assert!(v1_of(&m, "memory").is_empty());
        assert!(
            m.iter().find(|x| x.path.ends_with("systemd")).unwrap().controllers.is_empty(),
            "name=systemd carries no controller"
        );
    }

    #[test]
    fn pure_v2_layout() {
        let m = parse_mounts(PURE);
        assert_eq!(v2_of(&m), Some(PathBuf::from("/sys/fs/cgroup")), "the shortest cgroup2 mount");
        assert!(v1_of(&m, "cpu").is_empty());
        assert!(
            m.iter().any(|x| x.path == Path::new("/srv/with space/cg")),
            "octal escapes decoded"
        );
        assert_eq!(v2_of(&parse_mounts("proc /proc proc rw 0 0\n")), None);
    }
}
