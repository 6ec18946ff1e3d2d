//! Files the tests hand to `flowctl` or to a tool (profiles, CPU and gauge
//! sources, nftables rule sets): in the temp directory under unique names,
//! removed on drop, also when a test fails.

use std::path::PathBuf;

pub struct TempFile(PathBuf);

impl TempFile {
    /// `text` in a new file named `PREFIX<unique>SUFFIX`.
    pub fn new(prefix: &str, suffix: &str, text: &str) -> Self {
        let p = std::env::temp_dir().join(format!("{}{suffix}", crate::unique(prefix)));
        std::fs::write(&p, text).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
        Self(p)
    }

    /// A profile: `text` in a new `.toml` file.
    pub fn profile(text: &str) -> Self {
        Self::new("flowctl-profile-", ".toml", text)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }

    /// Replaces the file's contents with `text`.
    pub fn write(&self, text: &str) {
        std::fs::write(&self.0, text).unwrap_or_else(|e| panic!("write {}: {e}", self.0.display()));
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A directory of the test's own (agents' disk copies, certificates),
/// removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let p = std::env::temp_dir().join(crate::unique(prefix));
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
