//! The CPU signal's cgroup sources, live: v1 (`cpuacct.usage` against
//! `cpu.cfs_quota_us`) where the cpu and cpuacct controllers are on v1
//! hierarchies (this machine, a hybrid host), v2 (`cpu.stat` against
//! `cpu.max`) where the cgroup v2 hierarchy has the cpu controller (a pure v2
//! host, such as the kernel matrix's VMs). Each is ignored where the host
//! lacks its layout. Root only.

use flowctl::{
    controllers::cpu::CpuSource,
    controllers::cpu::{CgroupFiles, CgroupRoots, Sampler},
};
use std::{path::PathBuf, process::Command, time::Duration};

/// A v1 cgroup in the cpu and cpuacct hierarchies, removed on drop (after
/// its processes are killed).
struct V1Cgroup {
    name: String,
    dirs: Vec<PathBuf>,
    child: Option<std::process::Child>,
}

impl V1Cgroup {
    /// In the hierarchies /proc/self/mounts names for cpu and cpuacct (one
    /// directory when they are mounted together, as `cpu,cpuacct`).
    fn new(quota_us: i64) -> Self {
        let name = flowctl_tests::unique("flowctl-cg-");
        let mounts = flowctl::system::cgroup::mounts().expect("the mount table");
        let mut cg = Self { name, dirs: Vec::new(), child: None };
        for ctl in ["cpu", "cpuacct"] {
            let root = flowctl::system::cgroup::v1_of(&mounts, ctl)
                .into_iter()
                .next()
                .expect("a v1 hierarchy (the test declares Need::CgroupV1Cpu)");
            let d = root.join(&cg.name);
            if !cg.dirs.contains(&d) {
                std::fs::create_dir(&d).expect("create a v1 cgroup");
                cg.dirs.push(d);
            }
        }
        std::fs::write(cg.dirs[0].join("cpu.cfs_period_us"), "100000").unwrap();
        std::fs::write(cg.dirs[0].join("cpu.cfs_quota_us"), quota_us.to_string()).unwrap();
        cg
    }

    /// Starts a busy loop (bounded: it exits after 20 s) inside the cgroup.
    fn spin(&mut self) {
        let child = Command::new("timeout")
            .args(["20", "sh", "-c", "while :; do :; done"])
            .spawn()
            .unwrap();
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

fn cgroup_v1_usage_against_its_quota() {
    let mut cg = V1Cgroup::new(20_000);
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

/// A child of the cgroup v2 root with a `cpu.max` quota, the cpu controller
/// enabled for it in the root's `cgroup.subtree_control` (and disabled again
/// on drop when this test enabled it); on drop its processes are killed and
/// it is removed, also when the test fails.
struct V2Cgroup {
    name: String,
    dir: PathBuf,
    enabled_cpu_in: Option<PathBuf>,
    child: Option<std::process::Child>,
}

impl V2Cgroup {
    fn new(cpu_max: &str) -> Self {
        let mount = flowctl::system::cgroup::cgroup2_mount()
            .expect("a cgroup v2 hierarchy (the test declares Need::CgroupV2Cpu)");
        let name = flowctl_tests::unique("flowctl-cg2-");
        let mut cg = Self { dir: mount.join(&name), name, enabled_cpu_in: None, child: None };
        let control = mount.join("cgroup.subtree_control");
        let enabled =
            std::fs::read_to_string(&control).unwrap().split_whitespace().any(|c| c == "cpu");
        if !enabled {
            std::fs::write(&control, "+cpu")
                .expect("enable the cpu controller in the v2 root's subtree_control");
            cg.enabled_cpu_in = Some(control);
        }
        std::fs::create_dir(&cg.dir).expect("create a v2 cgroup");
        std::fs::write(cg.dir.join("cpu.max"), cpu_max).unwrap();
        cg
    }

    /// Starts a busy loop (bounded: it exits after 20 s) inside the cgroup:
    /// the shell moves itself in, then becomes `timeout`, whose child inherits
    /// the cgroup.
    fn spin(&mut self) {
        let child = Command::new("sh")
            .args([
                "-c",
                r#"echo $$ > "$1/cgroup.procs" && exec timeout 20 sh -c 'while :; do :; done'"#,
                "sh",
            ])
            .arg(&self.dir)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let procs = || {
            std::fs::read_to_string(self.dir.join("cgroup.procs"))
                .unwrap_or_default()
                .split_whitespace()
                .count()
        };
        let t = std::time::Instant::now();
        while procs() < 2 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the busy loop never showed up in {}",
                self.dir.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for V2Cgroup {
    fn drop(&mut self) {
        // cgroup.kill (5.14+) takes every process in the cgroup at once.
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // rmdir succeeds once the killed processes are gone.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(control) = &self.enabled_cpu_in {
            let _ = std::fs::write(control, "-cpu");
        }
    }
}

fn cgroup_v2_usage_against_its_cpu_max() {
    let mut cg = V2Cgroup::new("20000 100000");
    let cgroup = format!("/{}", cg.name);
    let files = CgroupFiles::resolve(&CgroupRoots::default(), &cgroup).unwrap();
    assert!(matches!(files, CgroupFiles::V2 { .. }), "read through the v2 reader: {files:?}");
    assert_eq!(files.capacity_cpus().unwrap(), 0.2, "cpu.max 20000 100000 is 0.2 CPU");
    let mut idle = Sampler::new(CpuSource::Cgroup(cgroup.clone())).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let v = idle.sample().unwrap().unwrap();
    assert!(v < 50.0, "an empty cgroup reads {v} per mille");

    cg.spin();
    std::thread::sleep(Duration::from_millis(300));
    let mut busy = Sampler::new(CpuSource::Cgroup(cgroup)).unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let v = busy.sample().unwrap().unwrap();
    println!("a busy loop under a 0.2-CPU cpu.max reads {v:.0} per mille of its quota");
    assert!(v > 800.0, "a process using its whole 0.2 CPU quota reads {v} per mille");
}

/// The tests and what each needs (flowctl_tests::need): the v1 test a
/// hybrid host's v1 cpu and cpuacct hierarchies, the v2 test a cgroup v2
/// hierarchy with the cpu controller (pure v2).
fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        cgroup_v1_usage_against_its_quota: [Root, CgroupV1Cpu, Command("timeout"), Command("pgrep")],
        cgroup_v2_usage_against_its_cpu_max: [Root, CgroupV2Cpu, Command("timeout")],
    ]);
}
