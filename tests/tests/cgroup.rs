//! The CPU signal's cgroup v1 source, live: this machine's cpu and cpuacct
//! controllers are v1 (v2 is mounted without a cpu controller; the v2 reader
//! is tested against fixtures in flowctl's unit tests). Root only.

use flowctl::cpu::{CpuSource, Sampler};
use flowctl_tests::not_root;
use std::{path::PathBuf, process::Command, time::Duration};

/// A v1 cgroup in the cpu and cpuacct hierarchies, removed on drop (after
/// its processes are killed).
struct V1Cgroup {
    name: String,
    dirs: Vec<PathBuf>,
    child: Option<std::process::Child>,
}

impl V1Cgroup {
    fn new(quota_us: i64) -> Option<Self> {
        let name = flowctl_tests::unique("flowctl-cg-");
        let mut dirs = Vec::new();
        for ctl in ["cpu", "cpuacct"] {
            let d = PathBuf::from(format!("/sys/fs/cgroup/{ctl}/{name}"));
            if !PathBuf::from(format!("/sys/fs/cgroup/{ctl}")).exists() {
                return None;
            }
            std::fs::create_dir(&d).expect("create a v1 cgroup");
            dirs.push(d);
        }
        std::fs::write(dirs[0].join("cpu.cfs_period_us"), "100000").unwrap();
        std::fs::write(dirs[0].join("cpu.cfs_quota_us"), quota_us.to_string()).unwrap();
        Some(Self { name, dirs, child: None })
    }

    /// Starts a busy loop (bounded: it exits after 20 s) inside the cgroup.
    fn spin(&mut self) {
        let child = Command::new("timeout").args(["20", "sh", "-c", "while :; do :; done"]).spawn().unwrap();
        // `timeout` forks the shell; move both (the shell inherits the
        // cgroup only if it forks after the move, so move the tree's pids).
        std::thread::sleep(Duration::from_millis(50));
        let pids = Command::new("pgrep").args(["-P", &child.id().to_string()]).output().unwrap();
        let mut all = vec![child.id().to_string()];
        all.extend(String::from_utf8_lossy(&pids.stdout).split_whitespace().map(String::from));
        for d in &self.dirs {
            for p in &all {
                std::fs::write(d.join("cgroup.procs"), p).unwrap();
            }
        }
        self.child = Some(child);
    }
}

impl Drop for V1Cgroup {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("pkill").args(["-P", &c.id().to_string()]).status();
            let _ = c.kill();
            let _ = c.wait();
        }
        std::thread::sleep(Duration::from_millis(100));
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[test]
fn cgroup_v1_usage_against_its_quota() {
    if not_root() {
        return;
    }
    let Some(mut cg) = V1Cgroup::new(20_000) else {
        eprintln!("no cgroup v1 cpu/cpuacct hierarchies here; skipped");
        return;
    };
    let mut idle = Sampler::new(CpuSource::Cgroup(format!("/{}", cg.name))).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let v = idle.sample().unwrap().unwrap();
    assert!(v < 50.0, "an empty cgroup reads {v} per mille");

    cg.spin();
    std::thread::sleep(Duration::from_millis(300));
    let mut busy = Sampler::new(CpuSource::Cgroup(format!("/{}", cg.name))).unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let v = busy.sample().unwrap().unwrap();
    println!("a busy loop under a 0.2-CPU quota reads {v:.0} per mille of its quota");
    assert!(v > 800.0, "a process using its whole 0.2 CPU quota reads {v} per mille");
}
