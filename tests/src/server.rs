//! A real server process a test starts itself (Redis, etcd): in a network
//! namespace the test created, with its data in a fresh temporary directory,
//! waited for until it answers, paused and resumed by signal for fault
//! tests, and killed by its PID on drop (also when the test fails), with
//! its directory removed.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

pub struct Server {
    name: String,
    child: Child,
    dir: PathBuf,
}

impl Server {
    /// Starts `program args` inside `netns` (`None`: this namespace),
    /// stdout and stderr to `server.log` in its directory, then waits up to
    /// `ready_within` for `ready` (say, a client that connects) to hold.
    /// `args` may use `{dir}` for the server's own directory.
    pub fn start(
        name: &str,
        netns: Option<&str>,
        program: &str,
        args: &[&str],
        ready: impl Fn(&Self) -> bool,
        ready_within: Duration,
    ) -> Self {
        let dir = std::env::temp_dir().join(crate::unique(&format!("flowctl-{name}-")));
        std::fs::create_dir_all(&dir).expect("server dir");
        let log = std::fs::File::create(dir.join("server.log")).expect("server log");
        let args: Vec<String> =
            args.iter().map(|a| a.replace("{dir}", &dir.display().to_string())).collect();
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, program]);
                c
            }
            None => Command::new(program),
        };
        let child = cmd
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {program}: {e}"));
        let server = Self { name: name.to_string(), child, dir };
        let deadline = Instant::now() + ready_within;
        while !ready(&server) {
            assert!(
                Instant::now() < deadline,
                "{name} not ready within {ready_within:?}; its log:\n{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's own directory (data, sockets, its log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// SIGSTOP: the process stays, answers nothing (a hung store).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: i32) {
        // `ip netns exec` execs the program, so the PID is the server's.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "signal {sig} to {} ({})", self.name, self.child.id());
    }

    /// Kills it now (SIGKILL by PID) and waits for it; the directory stays
    /// until drop, so a restarted server can reuse its data.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
