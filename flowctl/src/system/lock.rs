//! Exclusive `flock`s on files: one agent per attachment.
use anyhow::{Context, Result};
use std::{fs, os::fd::AsRawFd, path::Path};

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
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        false
    } else {
        true
    }
}
