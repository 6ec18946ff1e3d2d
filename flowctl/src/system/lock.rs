//! Exclusive `flock`s on files: one agent per attachment.
//!
//! A lock file exists only while it is held: its holder removes it when it
//! lets go (still holding it), and an acquirer checks that the file it
//! locked is still the one the path names, so a waiter that opened the file
//! just before it was removed opens the path again instead of holding a lock
//! nobody else sees. The holder writes what it is doing into the file
//! (`pid N PHASE`) for the next one to read. The lock's directory goes with
//! the file when nothing else is in it.
use anyhow::{bail, Context, Result};
use std::{
    fs,
    os::{fd::AsRawFd, unix::fs::FileExt, unix::fs::MetadataExt},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// What a lock's holder says it is doing (the second word of its note).
pub mod phase {
    /// Just taken; its holder says what it does next.
    pub const LOCKED: &str = "locked";
    /// An agent loading and attaching.
    pub const STARTING: &str = "starting";
    /// An agent serving its attachment.
    pub const SERVING: &str = "serving";
    /// An agent that got its signal: winding down, detaching, exiting.
    pub const STOPPING: &str = "stopping";
    /// An agent-less `flowctl apply` writing into a kept data plane.
    pub const APPLYING: &str = "applying";
    /// `flowctl detach` removing what is left.
    pub const DETACHING: &str = "detaching";

    /// A phase whose holder lets go on its own soon: waiting for it is
    /// better than refusing.
    pub fn is_transient(p: &str) -> bool {
        matches!(p, STOPPING | APPLYING | DETACHING)
    }
}

/// An exclusive `flock` on a file: held while the value lives, released by
/// the kernel when the process exits, however it exits. Dropping it removes
/// the file first (a killed holder leaves it; the next holder removes it).
pub struct FileLock {
    file: fs::File,
    path: PathBuf,
}

impl FileLock {
    /// `Ok(None)` when another process holds it.
    pub fn try_acquire(path: &Path) -> Result<Option<Self>> {
        // A holder removes the file as it lets go: whoever opened it just
        // before locks a file the path no longer names, and tries again.
        for _ in 0..100 {
            if let Some(dir) = path.parent() {
                fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            let f = match fs::OpenOptions::new().create(true).truncate(false).write(true).open(path)
            {
                Ok(f) => f,
                // The directory went between creating it and opening the file.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
            };
            let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc != 0 {
                return Ok(None);
            }
            if same_file(&f, path) {
                let lock = Self { file: f, path: path.to_path_buf() };
                lock.note(phase::LOCKED);
                return Ok(Some(lock));
            }
        }
        bail!("the lock {} keeps being removed under this process", path.display())
    }

    /// [`try_acquire`](Self::try_acquire), trying again for up to `within`
    /// while another holds it (`Ok(None)` when it still does then).
    pub fn acquire_within(path: &Path, within: Duration) -> Result<Option<Self>> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(l) = Self::try_acquire(path)? {
                return Ok(Some(l));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Says what the holder does now, in the file: `pid N PHASE` (read by
    /// [`holder`]).
    pub fn note(&self, phase: &str) {
        write_note(&self.file, phase);
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // Still held here; the flock goes with the file right after. Its
        // directory goes too when nothing else is in it (an acquirer that
        // loses it then makes it again).
        let _ = fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            let _ = fs::remove_dir(dir);
        }
    }
}

/// Whether `f` is the file `path` names now.
fn same_file(f: &fs::File, path: &Path) -> bool {
    match (f.metadata(), fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Overwrites the note in place (no moment with an empty file); a longer
/// old note's tail is cut after, and readers take the first line only.
fn write_note(f: &fs::File, phase: &str) {
    let text = note_text(std::process::id(), phase);
    if f.write_at(text.as_bytes(), 0).is_ok() {
        let _ = f.set_len(text.len() as u64);
    }
}

fn note_text(pid: u32, phase: &str) -> String {
    format!("pid {pid} {phase}\n")
}

/// Writes `phase` into the lock file at `path`, which this process holds
/// (through another open file of it).
pub fn note_held(path: &Path, phase: &str) {
    if let Ok(f) = fs::OpenOptions::new().write(true).open(path) {
        write_note(&f, phase);
    }
}

/// Who holds a lock and what it says it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The holding process, from the kernel's lock table (`None`: not
    /// found there).
    pub pid: Option<u32>,
    /// Its note's phase; empty when the note is not the holder's own (a
    /// killed predecessor's, or not written yet).
    pub phase: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            Some(p) => write!(f, "pid {p}")?,
            None => write!(f, "a process")?,
        }
        if !self.phase.is_empty() {
            write!(f, ", {}", self.phase)?;
        }
        Ok(())
    }
}

/// The holder of the lock at `path`, if one holds it.
pub fn holder(path: &Path) -> Option<Holder> {
    if !lock_held(path) {
        return None;
    }
    let meta = fs::metadata(path).ok();
    let pid = meta.and_then(|m| {
        let locks = fs::read_to_string("/proc/locks").ok()?;
        flock_holder(&locks, m.dev(), m.ino())
    });
    let note = fs::read_to_string(path).unwrap_or_default();
    let phase = match (parse_note(&note), pid) {
        (Some((p, phase)), Some(holding)) if p == holding => phase.to_string(),
        // No lock table to check against: the note as it stands.
        (Some((_, phase)), None) => phase.to_string(),
        _ => String::new(),
    };
    Some(Holder { pid, phase })
}

/// `pid N PHASE` (the first line of a note).
fn parse_note(text: &str) -> Option<(u32, &str)> {
    let mut w = text.lines().next()?.split_whitespace();
    if w.next()? != "pid" {
        return None;
    }
    let pid = w.next()?.parse().ok()?;
    Some((pid, w.next().unwrap_or("")))
}

/// The pid holding a `flock` on the file (`dev`, `ino`) in `/proc/locks`
/// (`1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF`; waiters, marked
/// `->`, are not holders).
fn flock_holder(locks: &str, dev: u64, ino: u64) -> Option<u32> {
    let want = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    locks.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        if w.len() < 6 || w[1] != "FLOCK" {
            return None;
        }
        (w[5] == want).then(|| w[4].parse().ok()).flatten()
    })
}

/// True when some process holds the lock at `path`. Tests by taking it for
/// an instant, so an acquirer may miss it then: acquirers that matter try
/// again for a moment ([`FileLock::acquire_within`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("flowctl-lock-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d.join("sub").join("agent.lock")
    }

    #[test]
    fn notes_parse_and_only_the_first_line_counts() {
        assert_eq!(parse_note("pid 42 serving\n"), Some((42, "serving")));
        assert_eq!(parse_note("pid 42 stopping\nng\n"), Some((42, "stopping")));
        assert_eq!(parse_note("pid 7\n"), Some((7, "")));
        assert_eq!(parse_note(""), None);
        assert_eq!(parse_note("garbage"), None);
        assert_eq!(note_text(9, phase::STOPPING), "pid 9 stopping\n");
        assert!(phase::is_transient(phase::STOPPING) && !phase::is_transient(phase::SERVING));
    }

    #[test]
    fn proc_locks_lines_give_the_holder() {
        let dev = libc::makedev(0, 0x1a);
        let locks = "1: POSIX  ADVISORY  WRITE 99 00:1a:5678 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 555 00:1a:5678 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 777 00:1a:9999 0 EOF\n";
        assert_eq!(flock_holder(locks, dev, 5678), Some(1234));
        assert_eq!(flock_holder(locks, dev, 9999), Some(777));
        assert_eq!(flock_holder(locks, dev, 1), None);
        assert_eq!(flock_holder(locks, libc::makedev(8, 1), 5678), None);
    }

    #[test]
    fn the_file_exists_only_while_held_and_says_who_holds_it() {
        let p = tmp("held");
        let l = FileLock::try_acquire(&p).unwrap().expect("free");
        assert!(p.exists() && lock_held(&p));
        l.note(phase::SERVING);
        let h = holder(&p).expect("held");
        assert_eq!(h.pid, Some(std::process::id()));
        assert_eq!(h.phase, phase::SERVING);
        note_held(&p, phase::STOPPING);
        assert_eq!(holder(&p).unwrap().phase, phase::STOPPING);
        drop(l);
        assert!(!p.exists(), "removed as it is let go");
        assert!(!p.parent().unwrap().exists(), "and its empty directory");
        assert!(holder(&p).is_none() && !lock_held(&p));
        let l = FileLock::acquire_within(&p, Duration::from_millis(10)).unwrap();
        assert!(l.is_some());
        drop(l);
        let _ = fs::remove_dir_all(p.parent().unwrap().parent().unwrap());
    }

    #[test]
    fn a_lock_on_a_removed_file_is_not_taken_for_the_lock() {
        let p = tmp("removed");
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        // Someone opened the old file; it is removed and another made in
        // its place: locking the old one must not count.
        let old = fs::File::create(&p).unwrap();
        fs::remove_file(&p).unwrap();
        let rc = unsafe { libc::flock(old.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(rc, 0);
        assert!(!same_file(&old, &p));
        let l = FileLock::try_acquire(&p).unwrap().expect("the path's file is free");
        assert!(same_file(&l.file, &p));
        drop(l);
        drop(old);
        let _ = fs::remove_dir_all(p.parent().unwrap().parent().unwrap());
    }
}
