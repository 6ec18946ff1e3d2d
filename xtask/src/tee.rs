//! Running a command while echoing and keeping its output (the summary
//! reads libtest's result lines from it); a hung command is killed, its
//! whole process group, at a deadline.

use anyhow::{Context, Result};
use std::{
    fs::File,
    io::{BufRead, BufReader, Write},
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Command, ExitStatus, Stdio},
    sync::atomic::{AtomicI32, Ordering},
    time::{Duration, Instant},
};

/// What libtest says at the end of a test binary's run, summed over every
/// "test result:" line seen, with the names of the tests it says failed.
#[derive(Clone, Debug, Default)]
pub struct Counts {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    /// How many "test result:" lines were seen (0: the binary never finished).
    pub results: u32,
    pub failed_names: Vec<String>,
    /// Lines where a test said it skipped itself (`...; skipped`): libtest
    /// counts such a test as passed.
    pub skip_lines: Vec<String>,
    in_failures: bool,
}

impl Counts {
    /// Reads one line of libtest's output: `test result: ok. 27 passed;
    /// 0 failed; 1 ignored; ...`, and the names in the `failures:` list at
    /// the end (`test NAME ... FAILED` lines are often split by the tested
    /// program's own output).
    pub fn line(&mut self, line: &str) {
        let line = line.trim_end();
        if let Some(rest) = line.strip_prefix("test result: ") {
            self.results += 1;
            self.in_failures = false;
            for part in rest.split(';') {
                let mut w = part.split_whitespace().rev();
                let (Some(what), Some(n)) = (w.next(), w.next()) else { continue };
                let Ok(n) = n.parse::<u64>() else { continue };
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    "ignored" => self.ignored += n,
                    _ => {}
                }
            }
        } else if line.ends_with("; skipped") || line.starts_with("skipped: ") {
            if !self.skip_lines.iter().any(|l| l == line) {
                self.skip_lines.push(line.to_string());
            }
        } else if line == "failures:" {
            self.in_failures = true;
        } else if self.in_failures {
            match line.strip_prefix("    ") {
                Some(name) if !name.contains(' ') && !name.is_empty() => {
                    if !self.failed_names.iter().any(|n| n == name) {
                        self.failed_names.push(name.to_string());
                    }
                }
                _ if line.is_empty() => {}
                _ => self.in_failures = false,
            }
        }
    }

    pub fn of_text(text: &str) -> Self {
        let mut c = Self::default();
        text.lines().for_each(|l| c.line(l));
        c
    }
}

pub struct Captured {
    /// None: killed at the deadline.
    pub status: Option<ExitStatus>,
    pub counts: Counts,
}

pub struct Opts {
    /// Standard output is echoed, and appended here too.
    pub log: Option<PathBuf>,
    /// Standard error goes only here (not echoed) when set, else it is inherited.
    pub err_log: Option<PathBuf>,
    /// Kill the command's process group after this long.
    pub timeout: Option<Duration>,
    /// Put before every echoed line (the kernel matrix's VMs run side by
    /// side and echo into one terminal).
    pub prefix: Option<String>,
}

/// The process groups of the commands running under a deadline (the VMs,
/// side by side), for the signal handler: xtask's own Ctrl-C or SIGTERM
/// must not leave a VM behind (each runs in its own group, so the
/// terminal's SIGINT does not reach it).
static GROUPS: [AtomicI32; 4] =
    [AtomicI32::new(0), AtomicI32::new(0), AtomicI32::new(0), AtomicI32::new(0)];

extern "C" fn on_signal(sig: libc::c_int) {
    for g in &GROUPS {
        let g = g.load(Ordering::SeqCst);
        if g > 0 {
            unsafe { libc::kill(-g, libc::SIGKILL) };
        }
    }
    unsafe { libc::_exit(128 + sig) };
}

/// Records a process group for the signal handler (installed once);
/// returns its slot.
fn watch_group(pid: i32) -> Option<usize> {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    });
    GROUPS
        .iter()
        .position(|g| g.compare_exchange(0, pid, Ordering::SeqCst, Ordering::SeqCst).is_ok())
}

pub fn run(cmd: &mut Command, opts: Opts) -> Result<Captured> {
    eprintln!("+ {cmd:?}");
    cmd.stdin(Stdio::null()).stdout(Stdio::piped());
    if opts.err_log.is_some() {
        cmd.stderr(Stdio::piped());
    }
    if opts.timeout.is_some() {
        cmd.process_group(0);
    }
    let mut child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let pid = child.id() as i32;
    let slot = if opts.timeout.is_some() { watch_group(pid) } else { None };
    let err_thread = match (opts.err_log.as_ref(), child.stderr.take()) {
        (Some(path), Some(err)) => {
            let mut f =
                File::create(path).with_context(|| format!("creating {}", path.display()))?;
            Some(std::thread::spawn(move || {
                for line in BufReader::new(err).split(b'\n').map_while(|l| l.ok()) {
                    let _ = f.write_all(&line);
                    let _ = f.write_all(b"\n");
                }
            }))
        }
        _ => None,
    };
    let out = child.stdout.take().unwrap();
    let mut log = match &opts.log {
        Some(p) => Some(File::create(p).with_context(|| format!("creating {}", p.display()))?),
        None => None,
    };
    let prefix = opts.prefix.clone().unwrap_or_default();
    let out_thread = std::thread::spawn(move || {
        let mut counts = Counts::default();
        let stdout = std::io::stdout();
        for line in BufReader::new(out).split(b'\n').map_while(|l| l.ok()) {
            let text = String::from_utf8_lossy(&line).replace('\r', "");
            {
                let mut o = stdout.lock();
                let _ = writeln!(o, "{prefix}{text}");
            }
            if let Some(f) = log.as_mut() {
                let _ = writeln!(f, "{text}");
            }
            counts.line(&text);
        }
        counts
    });
    let deadline = opts.timeout.map(|t| Instant::now() + t);
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            eprintln!(
                "xtask: deadline of {:?} passed: killing process group {pid}",
                opts.timeout.unwrap()
            );
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if let Some(i) = slot {
        GROUPS[i].store(0, Ordering::SeqCst);
    }
    let counts = out_thread.join().unwrap();
    if let Some(t) = err_thread {
        let _ = t.join();
    }
    Ok(Captured { status, counts })
}

#[cfg(test)]
mod tests {
    use super::Counts;

    #[test]
    fn reads_libtest_results_and_the_failures_list() {
        let text = "running 3 tests\ntest a ... flowctl: attached\nFAILED\ntest b ... ok\n\nfailures:\n\n---- a stdout ----\n\
no cgroup v2 hierarchy at /x; skipped\nthread 'a' panicked at x.rs:1:1:\n    left: 1\nstack backtrace:\n   0: f\n             at y.rs:2\n\nfailures:\n    a\n    c\n\n\
test result: FAILED. 1 passed; 2 failed; 1 ignored; 0 measured; 10 filtered out; finished in 1.00s\n";
        let c = Counts::of_text(text);
        assert_eq!((c.passed, c.failed, c.ignored, c.results), (1, 2, 1, 1));
        assert_eq!(c.failed_names, ["a", "c"]);
        assert_eq!(c.skip_lines, ["no cgroup v2 hierarchy at /x; skipped"]);
    }
}
