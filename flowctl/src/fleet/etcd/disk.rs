//! The last good profile from etcd, on disk: what an agent started while
//! etcd is unreachable enforces.
//!
//! One JSON file per (prefix, namespace, interface), holding the text and
//! where it came from, written whole to a temporary file, synced, then
//! renamed over the old one, so a crash leaves the old copy or the new one,
//! never half of either; its hash is checked when it is read back. The
//! default root is under /var/lib (the FHS place for state a program keeps
//! across reboots): /run is emptied at boot, and an agent that starts at
//! boot while etcd is down is the case the copy exists for. `--etcd-cache
//! DIR` puts it elsewhere (the tests do).

use crate::fleet::etcd::version::{profile_hash, Version};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
};

pub const DEFAULT_ROOT: &str = "/var/lib/flowctl/etcd";
const FILE: &str = "last-good.json";
/// The text being applied: the agent's apply path reads profiles from a file.
const STAGED: &str = "candidate.toml";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Saved {
    /// The profile key, as errors name it.
    pub label: String,
    pub version: Version,
    pub hash: String,
    pub saved_unix: u64,
    pub profile: String,
}

/// The directory of one agent's copy.
#[derive(Clone, Debug)]
pub struct DiskCopy {
    dir: PathBuf,
}

impl DiskCopy {
    /// `ROOT/<prefix>/<netns>/<iface>` (netns `host` without `--netns`),
    /// each part escaped to one file name.
    pub fn new(root: &Path, prefix: &str, netns: Option<&str>, iface: &str) -> Self {
        let ns = match netns {
            Some(n) => escape(n),
            None => "host".into(),
        };
        Self { dir: root.join(escape(prefix)).join(ns).join(escape(iface)) }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn file(&self) -> PathBuf {
        self.dir.join(FILE)
    }

    /// The copy, `None` when there is none; an error when it is unreadable
    /// or its text does not match its hash.
    pub fn load(&self) -> Result<Option<Saved>> {
        let p = self.file();
        let text = match fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
        };
        let s: Saved =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
        if profile_hash(&s.profile) != s.hash {
            bail!("{}: the profile does not match its hash (a damaged copy)", p.display());
        }
        Ok(Some(s))
    }

    /// Replaces the copy, atomically.
    pub fn save(&self, s: &Saved) -> Result<()> {
        fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let tmp = self.dir.join(format!("{FILE}.tmp"));
        let mut f = fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
        f.write_all(serde_json::to_string_pretty(s)?.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, self.file())
            .with_context(|| format!("replacing {}", self.file().display()))?;
        // The rename itself is durable once the directory is synced.
        fs::File::open(&self.dir)?.sync_all()?;
        Ok(())
    }

    /// Writes `text` where the apply path reads it from.
    pub fn stage(&self, text: &str) -> Result<PathBuf> {
        fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let p = self.dir.join(STAGED);
        fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
        Ok(p)
    }

    pub fn unstage(&self) {
        let _ = fs::remove_file(self.dir.join(STAGED));
    }
}

/// A key or name as one file name: `[A-Za-z0-9_-]` kept, anything else as
/// `%XX` (so `.` and `..` cannot occur), so distinct names never share a
/// directory. A namespace named `host` escapes apart from the default.
fn escape(s: &str) -> String {
    let mut out = String::new();
    for b in s.trim_start_matches('/').bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' => out.push(b as char),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    if out.is_empty() {
        out.push('%');
    }
    // `host` is the directory of agents without --netns.
    if out == "host" {
        out = "%68ost".into();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "flowctl-disk-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn saved_then_loaded_and_replaced_whole() {
        let root = scratch();
        let c = DiskCopy::new(&root, "/flowctl/web", Some("ns1"), "eth0");
        assert!(c.dir().starts_with(&root));
        assert_eq!(c.load().unwrap(), None, "no copy yet");
        let mut s = Saved {
            label: "etcd://h:2379/flowctl/web/profile".into(),
            version: Version { generation: 3, revision: 17 },
            hash: profile_hash("[[rule]]\n"),
            saved_unix: 1,
            profile: "[[rule]]\n".into(),
        };
        c.save(&s).unwrap();
        assert_eq!(c.load().unwrap(), Some(s.clone()));
        s.version.generation = 4;
        c.save(&s).unwrap();
        assert_eq!(c.load().unwrap().unwrap().version.generation, 4);
        let staged = c.stage("text").unwrap();
        assert_eq!(fs::read_to_string(&staged).unwrap(), "text");
        c.unstage();
        assert!(!staged.exists());
        // Only the copy is left: no temporary file.
        let names: Vec<_> =
            fs::read_dir(c.dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [FILE]);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_damaged_copy_is_an_error_not_a_profile() {
        let root = scratch();
        let c = DiskCopy::new(&root, "/p", None, "eth0");
        let s = Saved {
            label: "l".into(),
            version: Version::default(),
            hash: profile_hash("a"),
            saved_unix: 1,
            profile: "b".into(),
        };
        c.save(&s).unwrap();
        assert!(c.load().unwrap_err().to_string().contains("does not match its hash"));
        fs::write(c.file(), "{").unwrap();
        assert!(c.load().is_err());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn names_are_escaped_apart() {
        assert_eq!(escape("/flowctl/web"), "flowctl%2Fweb");
        assert_ne!(escape("/a/b"), escape("/a_b"));
        assert_ne!(escape("/a%2Fb"), escape("/a/b"));
        assert_eq!(escape(".."), "%2E%2E");
        let root = Path::new("/r");
        let d = |ns, iface| DiskCopy::new(root, "/p", ns, iface).dir().to_path_buf();
        assert_ne!(d(Some("a"), "b-c"), d(Some("a-b"), "c"));
        assert_ne!(d(Some("host"), "eth0"), d(None, "eth0"));
        assert_eq!(d(None, "eth0"), Path::new("/r/p/host/eth0"));
    }
}
