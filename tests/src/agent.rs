//! The agent: `flowctl attach` as a child process for the length of a test,
//! on a lab's protected side or on a cgroup (breakers), waited for until
//! `status` shows it ready.

use crate::{
    cli::{agent_ready, bin, breakers_of},
    lab::Lab,
    need::in_vm,
};
use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A running agent. [`Agent::stop`] ends it with SIGINT (it detaches) and
/// checks its exit status; dropped without that (a failed test), it gets
/// SIGINT, then SIGKILL once its grace has passed.
pub struct Agent {
    child: Child,
    grace: Duration,
}

impl Agent {
    /// `flowctl attach VETH --netns NS --profile PROFILE EXTRA...` on the
    /// lab's protected side, ready once `status` says so.
    pub fn start(lab: &Lab, profile: &str, extra: &[&str]) -> Self {
        Self::spawn_until(Self::attach(lab, profile, extra), || agent_ready(&lab.veth_srv))
    }

    /// `flowctl attach --cgroup PATH --profile P`, ready once `status`
    /// shows its breakers.
    pub fn start_breakers(cgroup: &str, profile: &str) -> Self {
        let mut cmd = Command::new(bin());
        cmd.args(["attach", "--cgroup", cgroup, "--profile", profile]);
        Self::spawn_until(cmd, || breakers_of(cgroup).is_some())
    }

    /// The command [`Agent::start`] runs, for a test to add to (an
    /// environment) before [`Agent::spawn`].
    pub fn attach(lab: &Lab, profile: &str, extra: &[&str]) -> Command {
        let mut cmd = Command::new(bin());
        cmd.args(["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", profile]);
        cmd.args(extra);
        cmd
    }

    /// Runs `cmd` and waits (at most 15 s; 180 s in a VM of the kernel
    /// matrix) until `ready`; on drop, SIGKILL 3 s after SIGINT.
    pub fn spawn_until(cmd: Command, ready: impl Fn() -> bool) -> Self {
        let up_within = Duration::from_secs(if in_vm() { 180 } else { 15 });
        Self::spawn(cmd, up_within, Duration::from_secs(3), ready)
    }

    /// Runs `cmd` (stdin from /dev/null) and waits at most `up_within`
    /// until `ready`, failing at once if it exits; on drop, SIGKILL `grace`
    /// after SIGINT.
    pub fn spawn(
        mut cmd: Command,
        up_within: Duration,
        grace: Duration,
        ready: impl Fn() -> bool,
    ) -> Self {
        let child = cmd.stdin(Stdio::null()).spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        let mut a = Self { child, grace };
        let deadline = Instant::now() + up_within;
        while Instant::now() < deadline {
            if ready() {
                return a;
            }
            if let Ok(Some(st)) = a.child.try_wait() {
                panic!("agent {cmd:?} exited: {st}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("agent {cmd:?} did not come up");
    }

    /// Sends the agent `signal` (SIGSTOP and SIGCONT: a hung agent).
    pub fn signal(&self, signal: i32) {
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// SIGINT: the agent detaches (or, with `--keep`, leaves the data plane)
    /// and must exit successfully.
    pub fn stop(mut self) {
        self.signal(libc::SIGINT);
        let st = self.child.wait().unwrap();
        assert!(st.success(), "agent exit: {st}");
    }

    /// SIGKILL: the agent does nothing more (a kept data plane stays).
    pub fn kill9(mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// Waits (at most 15 s; 180 s in a VM) until `ready`, failing at once
    /// if the agent exits.
    pub fn wait_until(&mut self, what: &str, ready: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(if in_vm() { 180 } else { 15 });
        while !ready() {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("agent exited ({st}) before {what}");
            }
            assert!(Instant::now() < deadline, "the agent did not get to {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The agent's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits (at most `within`) for the agent to exit on its own (another
    /// process stopped it); it must exit successfully.
    pub fn exited_within(mut self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "agent exit: {st}");
                return;
            }
            assert!(Instant::now() < deadline, "the agent did not exit within {within:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Detaches the lab's protected interface when dropped, so a kept data
/// plane (`--keep`, a SIGKILLed agent) goes also when a test fails before
/// its own detach (`flowctl detach` stops an agent still running). Create
/// it after the lab: it must be dropped while the namespace is there.
pub struct DetachOnDrop {
    iface: String,
    netns: String,
}

impl DetachOnDrop {
    pub fn new(lab: &Lab) -> Self {
        Self { iface: lab.veth_srv.clone(), netns: lab.ns_srv.clone() }
    }
}

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        let _ = Command::new(bin())
            .args(["detach", &self.iface, "--netns", &self.netns])
            .stdout(Stdio::null())
            .status();
    }
}

impl Drop for Agent {
    /// On a failed test: SIGINT (the agent detaches; one still loading
    /// holds it until it is up), then SIGKILL after the grace.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal(libc::SIGINT);
            let deadline = Instant::now() + self.grace;
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
