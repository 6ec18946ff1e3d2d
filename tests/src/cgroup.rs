//! Throwaway cgroup v2 directories for the breakers' tests (the hooks attach
//! to one, client processes join one): unique names, removed on drop, once
//! their processes (all short-lived) have exited.

use std::path::{Path, PathBuf};

pub struct Cgroup(PathBuf);

impl Cgroup {
    /// `TAG<unique>` under the root of the cgroup v2 hierarchy.
    pub fn new(tag: &str) -> Self {
        let mount = flowctl::system::cgroup::cgroup2_mount()
            .expect("a cgroup v2 hierarchy (a test declares Need::CgroupV2)");
        Self::create(mount.join(crate::unique(tag)))
    }

    /// A child directory `name`.
    pub fn child(&self, name: &str) -> Self {
        Self::create(self.0.join(name))
    }

    fn create(path: PathBuf) -> Self {
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Moves this whole process here (a socket belongs to the cgroup of the
    /// process that creates it).
    pub fn enter(&self) {
        std::fs::write(self.0.join("cgroup.procs"), std::process::id().to_string())
            .expect("join the cgroup");
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The end-to-end breaker tests' cgroups: a directory (the agent's attach
/// point) with a child `app` (where the clients run).
pub struct TestCgroup {
    // Fields drop in order: the child first.
    app: Cgroup,
    parent: Cgroup,
}

impl TestCgroup {
    pub fn new() -> Self {
        let parent = Cgroup::new("flowctl-e2e-");
        Self { app: parent.child("app"), parent }
    }

    /// Where the clients run, as `client` takes it.
    pub fn app(&self) -> String {
        self.app.path().display().to_string()
    }

    /// The attach point, as `flowctl attach --cgroup` takes it.
    pub fn parent(&self) -> String {
        self.parent.path().display().to_string()
    }
}

impl Default for TestCgroup {
    fn default() -> Self {
        Self::new()
    }
}
