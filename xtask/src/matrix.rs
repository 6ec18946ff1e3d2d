//! The test tiers and the kernel matrix.
//!
//! On the host kernel: the unit and property tests, then every privileged
//! test binary (kernel tier: `kernel`, `breaker`, `cgroup`; end-to-end tier:
//! `e2e`), serially. Then one VM boot per kernel of the matrix (vm.rs) runs
//! the kernel tier and the end-to-end subset below. Every tier runs even
//! when an earlier one failed, so that one run reports everything; the
//! command fails at the end if any did.

use crate::{
    kernels::{Kernel, KERNELS},
    root, setup, tee,
    tiers::{KernelRun, Row, TestBin, KERNEL_TIER},
    vm,
};
use anyhow::{bail, Context, Result};
use std::{path::PathBuf, process::Command, time::Instant};

/// Which tiers `cargo xtask test` runs.
pub struct Selection {
    pub host: bool,
    pub vms: Vec<&'static Kernel>,
    pub full: bool,
}

impl Selection {
    /// From `--kernel` values: none or `all` is everything; `host` is the
    /// unit tier and the host kernel's tiers; `6.1`, `6.12` one VM each.
    pub fn parse(kernels: &[String], full: bool) -> Result<Self> {
        let mut s = Selection { host: false, vms: Vec::new(), full };
        let all = kernels.is_empty() || kernels.iter().any(|k| k == "all");
        for k in kernels.iter().filter(|k| *k != "all") {
            if k == "host" {
                s.host = true;
            } else if let Some(vm) = KERNELS.iter().find(|v| v.version == k) {
                if !s.vms.iter().any(|v| v.version == vm.version) {
                    s.vms.push(vm);
                }
            } else {
                bail!(
                    "--kernel {k}: not one of host, all, {}",
                    KERNELS.iter().map(|k| k.version).collect::<Vec<_>>().join(", ")
                );
            }
        }
        if all {
            s.host = true;
            s.vms = KERNELS.iter().collect();
        }
        Ok(s)
    }
}

/// An executable a cargo build wrote, from its JSON messages.
struct Artifact {
    name: String,
    kinds: Vec<String>,
    /// Built as a test harness.
    test: bool,
    path: PathBuf,
}

fn cargo_executables(args: &[&str]) -> Result<Vec<Artifact>> {
    let out = Command::new("cargo")
        .args(args)
        .arg("--message-format=json")
        .current_dir(root())
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("cargo {args:?} failed: {}", out.status);
    }
    let mut v = Vec::new();
    for line in out.stdout.split(|b| *b == b'\n') {
        let Ok(m) = serde_json::from_slice::<serde_json::Value>(line) else { continue };
        let (Some(exe), Some(name)) = (m["executable"].as_str(), m["target"]["name"].as_str())
        else {
            continue;
        };
        let kinds = m["target"]["kind"]
            .as_array()
            .map(|a| a.iter().filter_map(|k| k.as_str().map(String::from)).collect())
            .unwrap_or_default();
        v.push(Artifact {
            name: name.to_string(),
            kinds,
            test: m["profile"]["test"].as_bool().unwrap_or(false),
            path: PathBuf::from(exe),
        });
    }
    Ok(v)
}

pub fn test(sel: Selection) -> Result<()> {
    setup::setup()?;
    crate::disk::preflight(&crate::disk::target_dir(&root()))?;
    let mut runs: Vec<KernelRun> = Vec::new();
    let t_host = Instant::now();
    let mut host_rows = Vec::new();
    if sel.host {
        // Tier 0: the tree is formatted and lint-free (workspace `[lints]`,
        // warnings denied), so neither drifts.
        let t = Instant::now();
        let problem = lint();
        host_rows.push(Row::new(
            "lint",
            tee::Counts::default(),
            problem,
            Some(t.elapsed().as_secs_f64()),
        ));
        // Tier 1: pure logic and property tests (no root).
        let c = tee::run(
            Command::new("cargo")
                .args([
                    "test",
                    "--workspace",
                    "--exclude",
                    "flowctl-tests",
                    "--exclude",
                    "flowctl-ebpf",
                    "--exclude",
                    "flowctl-bench-ebpf",
                    "--no-fail-fast",
                ])
                .current_dir(root()),
            tee::Opts { log: None, err_log: None, timeout: None, prefix: None },
        )?;
        let problem =
            (!c.status.is_some_and(|s| s.success())).then(|| format!("cargo test: {:?}", c.status));
        host_rows.push(Row::new("unit", c.counts, problem, Some(t_host.elapsed().as_secs_f64())));
    }
    if !crate::is_root() {
        bail!("the kernel and end-to-end tiers need root: run `sudo -E cargo xtask test`");
    }
    // The real binary for the end-to-end tests, and the privileged tests'
    // executables (run directly: the same binaries on the host and in the VMs).
    let flowctl = cargo_executables(&["build", "--package", "flowctl"])?
        .into_iter()
        .find(|a| a.name == "flowctl" && a.kinds.iter().any(|k| k == "bin"))
        .map(|a| a.path)
        .context("cargo build --package flowctl wrote no flowctl executable")?;
    let bins: Vec<TestBin> =
        cargo_executables(&["test", "--package", "flowctl-tests", "--no-run"])?
            .into_iter()
            .filter(|a| a.test || a.kinds.iter().any(|k| k == "test"))
            .map(|a| TestBin { name: a.name, path: a.path })
            .collect();
    for want in KERNEL_TIER.iter().chain(["e2e"].iter()) {
        if !bins.iter().any(|b| b.name == *want) {
            bail!("no test executable `{want}` in flowctl-tests (tests/tests/{want}.rs)");
        }
    }
    if sel.host {
        // The Debian package of the binary under test, for the package
        // target (tests/tests/package.rs: FLOWCTL_DEB; it reports its tests
        // ignored without it, and this row says why).
        let t = Instant::now();
        let deb = crate::package::build(&flowctl, &root().join("target/package-test"), true);
        let problem = deb.as_ref().err().map(|e| format!("cargo xtask package: {e:#}"));
        host_rows.push(Row::new(
            "deb",
            tee::Counts::default(),
            problem,
            Some(t.elapsed().as_secs_f64()),
        ));
        // Under --full, the previous layout's real binary for the upgrade
        // test (it reports itself skipped without one).
        let previous = if sel.full {
            let t = Instant::now();
            let built = crate::previous::flowctl();
            let problem = built.as_ref().err().map(|e| format!("previous layout's flowctl: {e:#}"));
            host_rows.push(Row::new(
                "previous",
                tee::Counts::default(),
                problem,
                Some(t.elapsed().as_secs_f64()),
            ));
            built.ok()
        } else {
            None
        };
        // Tiers 2-3 on the host kernel: the real program under
        // BPF_PROG_TEST_RUN, then the real binary on veth pairs in
        // namespaces. Serial: they share the kernel.
        for b in &bins {
            let t = Instant::now();
            let mut cmd = Command::new(&b.path);
            if let Ok(deb) = &deb {
                cmd.env("FLOWCTL_DEB", deb);
            }
            if let Some(previous) = &previous {
                cmd.env("FLOWCTL_PREVIOUS_BIN", previous);
            }
            let c = tee::run(
                cmd.arg("--test-threads=1")
                    .current_dir(root().join("tests"))
                    .env("FLOWCTL_BIN", &flowctl),
                tee::Opts { log: None, err_log: None, timeout: None, prefix: None },
            )?;
            let problem = match c.status {
                Some(s) if s.success() => None,
                s => Some(format!("exit {s:?}")),
            };
            host_rows.push(Row::new(&b.name, c.counts, problem, Some(t.elapsed().as_secs_f64())));
        }
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        runs.push(KernelRun {
            kernel: format!("host {}", release.trim()),
            rows: host_rows,
            wall: t_host.elapsed(),
            boot_s: None,
            console_tail: None,
        });
    }
    // The VMs side by side: each guest runs its tests one at a time, so
    // under TCG one keeps about one of the machine's two cores busy; in
    // sequence the matrix took twice as long. Each echoes its console with
    // its kernel in front; the summary comes after both.
    let vm_runs: Vec<Result<KernelRun>> = std::thread::scope(|s| {
        let handles: Vec<_> =
            sel.vms.iter().map(|k| s.spawn(|| vm::run(k, &bins, &flowctl, sel.full))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a VM's thread panicked"))))
            .collect()
    });
    for r in vm_runs {
        runs.push(r?);
    }
    summary(&runs);
    let failed: Vec<String> = runs
        .iter()
        .flat_map(|r| {
            r.rows.iter().filter(|x| x.failed()).map(move |x| format!("{} {}", r.kernel, x.tier))
        })
        .collect();
    if !failed.is_empty() {
        bail!("failed tiers: {}", failed.join(", "));
    }
    Ok(())
}

/// `cargo fmt --check` and clippy with warnings denied over every host
/// crate; the eBPF crates' libraries are empty on the host (their programs
/// are `required-features = ["bpf-target"]` binaries).
fn lint() -> Option<String> {
    let checks: [(&str, &[&str]); 2] = [
        ("cargo fmt", &["fmt", "--all", "--", "--check"]),
        ("cargo clippy", &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]),
    ];
    let mut problems = Vec::new();
    for (name, args) in checks {
        let ok = Command::new("cargo")
            .args(args)
            .current_dir(root())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            problems.push(format!("{name} failed (see above)"));
        }
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

fn summary(runs: &[KernelRun]) {
    for r in runs {
        if let Some(tail) = &r.console_tail {
            eprintln!("\n==== {}: the guest console's last lines ====\n{tail}", r.kernel);
        }
    }
    println!(
        "\n{:<22} {:<8} {:>6} {:>6} {:>7} {:>6}  {:<6} notes",
        "kernel", "tier", "passed", "failed", "ignored", "time", "result"
    );
    for r in runs {
        for row in &r.rows {
            let c = &row.counts;
            let mut notes = Vec::new();
            for n in [&row.problem, &row.skipped, &row.note].into_iter().flatten() {
                notes.push(n.clone());
            }
            if !c.skip_lines.is_empty() {
                notes.push(format!("counted as passed but said: {}", c.skip_lines.join(" | ")));
            }
            if !c.failed_names.is_empty() {
                notes.push(format!("failed: {}", c.failed_names.join(" ")));
            }
            let result = if row.failed() {
                "FAILED"
            } else if row.skipped.is_some() {
                "SKIP"
            } else {
                "ok"
            };
            let secs = row.secs.map(|s| format!("{s:.0}s")).unwrap_or_default();
            println!(
                "{:<22} {:<8} {:>6} {:>6} {:>7} {:>6}  {:<6} {}",
                r.kernel,
                row.tier,
                c.passed,
                c.failed,
                c.ignored,
                secs,
                result,
                notes.join("; ")
            );
        }
        let boot = r.boot_s.map(|b| format!(" (boot {b:.0} s)")).unwrap_or_default();
        println!("{:<22} {:<8} wall {:.0} s{boot}", r.kernel, "total", r.wall.as_secs_f64());
    }
    // One closing line over every tier and kernel, in the plain form CI
    // readers take ("total: N passed, N failed, N skipped").
    let sum = |f: fn(&tee::Counts) -> u64| {
        runs.iter().flat_map(|r| r.rows.iter()).map(|row| f(&row.counts)).sum::<u64>()
    };
    println!(
        "total: {} passed, {} failed, {} skipped",
        sum(|c| c.passed),
        sum(|c| c.failed),
        sum(|c| c.ignored)
    );
}
