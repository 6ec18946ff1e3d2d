//! `cargo xtask bench matrix [quick]`: the benchmark's `BPF_PROG_TEST_RUN`
//! sections (`flowctl-bench path`: the full path against the bare
//! reference, the quota stage, the statistics rings) on the host and in one
//! VM per kernel of the matrix, so a program split made for an old
//! verifier cannot cost the fast path unnoticed. The VMs run under TCG,
//! which does not model caches: their ratios are indicative only, the
//! host's are the ones that count (docs/benchmarks.md).

use crate::{kernels::KERNELS, root, run, vm};
use anyhow::{Context, Result};
use std::{fmt::Write as _, path::Path, process::Command};

/// Runs the sections everywhere and prints them side by side; the summary
/// also goes to `target/vm-bench/summary.txt`.
pub fn matrix(quick: bool, flowctl: &Path) -> Result<()> {
    run(Command::new("cargo").args([
        "build",
        "--release",
        "--package",
        "flowctl-tests",
        "--bin",
        "flowctl-bench",
    ]))?;
    let exe = root().join("target/release/flowctl-bench");
    let args: &[&str] = if quick { &["path", "quick"] } else { &["path"] };
    let mut reports = Vec::new();
    eprintln!("xtask: bench matrix: host kernel");
    let host = Command::new(&exe)
        .args(args)
        .current_dir(root().join("tests"))
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    let host_out = String::from_utf8_lossy(&host.stdout).to_string();
    print!("{host_out}");
    reports.push((
        "host".to_string(),
        host.status.success().then_some(host_out.clone()).ok_or_else(|| {
            format!("exit {}: {}", host.status, String::from_utf8_lossy(&host.stderr))
        }),
    ));
    for k in KERNELS {
        let (r, log) = vm::bench(k, &exe, args, flowctl)?;
        let problem: Vec<String> = r.rows.iter().filter_map(|row| row.problem.clone()).collect();
        let outcome = if problem.is_empty() { Ok(log) } else { Err(problem.join("; ")) };
        reports.push((format!("{} (VM, TCG: indicative only)", k.version), outcome));
    }
    let mut summary = String::new();
    for (kernel, outcome) in &reports {
        let _ = writeln!(summary, "==== {kernel} ====");
        match outcome {
            Ok(text) => summary.push_str(&sections(text)),
            Err(e) => {
                let _ = writeln!(summary, "failed: {e}");
            }
        }
    }
    let dir = root().join("target").join(vm::BENCH_DIR);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("summary.txt"), &summary)?;
    println!("\n{summary}");
    if reports.iter().any(|(_, o)| o.is_err()) {
        anyhow::bail!("the bench failed on a kernel (above)");
    }
    Ok(())
}

/// The lines of a bench run from its first section on (the machine line
/// first): what the summary compares.
fn sections(text: &str) -> String {
    let mut out = String::new();
    for l in text.lines() {
        if l.starts_with("machine:") || l.starts_with("frame:") || !out.is_empty() {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_summary_keeps_the_machine_line_and_the_sections() {
        let text = "+ cargo build\nmachine: 2 CPUs online, kernel 6.1.0\nframe: 60 bytes\n\n1. BPF_PROG_TEST_RUN\n  10000 1.0x\n";
        let s = super::sections(text);
        assert!(s.starts_with("machine: 2 CPUs"), "{s}");
        assert!(s.contains("1. BPF_PROG_TEST_RUN\n  10000 1.0x\n"), "{s}");
        assert!(!s.contains("cargo build"), "{s}");
    }
}
