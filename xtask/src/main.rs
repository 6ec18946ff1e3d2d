//! Project tasks: `cargo xtask setup|test|demo|bench`.
//!
//! `setup` installs what the build and tests need, idempotently and quickly
//! when present: the nightly's rust-src, bpf-linker 0.10.3 (matches the
//! nightly's LLVM 22; 0.11+ targets LLVM 23) and Debian packages. `test` and
//! `demo` call it first.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::process::Command;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install toolchain parts and packages (idempotent).
    Setup,
    /// Every test tier: unit and property tests, then the privileged kernel and
    /// end-to-end tests (root, serial).
    Test,
    /// Build, make a throwaway veth lab, attach, drive traffic, show counters, clean up.
    Demo,
    /// Benchmarks: prints ratios measured in one run (docs/benchmarks.md).
    Bench {
        /// Passed to the bench runner (e.g. `quick`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

const BPF_LINKER_VERSION: &str = "0.10.3";
const DEBIAN_PACKAGES: &[&str] = &["iproute2", "nftables", "bpftool", "iputils-ping", "ethtool", "util-linux", "tmux", "python3"];

pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {:?}", cmd);
    let st = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

fn output_ok(cmd: &mut Command) -> Option<String> {
    let o = cmd.output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).to_string())
}

fn setup() -> Result<()> {
    let have_src = output_ok(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", "nightly"]))
        .is_some_and(|s| s.lines().any(|l| l.starts_with("rust-src")));
    if !have_src {
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))?;
    }
    let linker_ok = output_ok(Command::new("bpf-linker").arg("--version")).is_some_and(|v| v.contains(BPF_LINKER_VERSION));
    if !linker_ok {
        run(Command::new("cargo").args(["install", &format!("bpf-linker@{BPF_LINKER_VERSION}"), "--locked", "--force"]))?;
    }
    let missing: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|p| !output_ok(Command::new("dpkg-query").args(["-W", "-f=${Status}", p])).is_some_and(|s| s.contains("install ok installed")))
        .collect();
    if !missing.is_empty() {
        if !is_root() {
            bail!("missing Debian packages {missing:?}: run `sudo cargo xtask setup` or install them with apt-get");
        }
        run(Command::new("apt-get").arg("update").arg("-qq"))?;
        run(Command::new("apt-get").args(["install", "-y", "-qq"]).args(&missing).env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    eprintln!("setup: rust-src, bpf-linker {BPF_LINKER_VERSION} and {DEBIAN_PACKAGES:?} present");
    Ok(())
}

pub fn is_root() -> bool {
    output_ok(Command::new("id").arg("-u")).is_some_and(|s| s.trim() == "0")
}

fn test() -> Result<()> {
    setup()?;
    // Tier 1: pure logic and property tests (no root).
    run(Command::new("cargo").args(["test", "--workspace", "--exclude", "flowctl-tests", "--exclude", "flowctl-ebpf", "--exclude", "flowctl-bench-ebpf"]))?;
    if !is_root() {
        bail!("the kernel and end-to-end tiers need root: run `sudo -E cargo xtask test`");
    }
    // Tiers 2-3: the real program under BPF_PROG_TEST_RUN, then the real
    // binary on veth pairs in namespaces. Serial: they share the kernel.
    run(Command::new("cargo").args(["build", "--package", "flowctl"]))?;
    let bin = std::env::current_dir()?.join("target/debug/flowctl");
    run(Command::new("cargo")
        .args(["test", "--package", "flowctl-tests", "--", "--test-threads=1"])
        .env("FLOWCTL_BIN", bin))?;
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup(),
        Cmd::Test => test(),
        Cmd::Demo => {
            setup()?;
            if !is_root() {
                bail!("the demo creates network namespaces and loads XDP: run `sudo -E cargo xtask demo`");
            }
            run(Command::new("cargo").args(["build", "--release", "--package", "flowctl"]))?;
            let bin = std::env::current_dir()?.join("target/release/flowctl");
            run(Command::new("cargo")
                .args(["run", "--release", "--quiet", "--package", "flowctl-tests", "--bin", "flowctl-demo"])
                .env("FLOWCTL_BIN", bin))
        }
        Cmd::Bench { args } => {
            setup()?;
            if !is_root() {
                bail!("the benchmarks load XDP programs and make veth labs: run `sudo -E cargo xtask bench`");
            }
            // The agent benchmark runs the real release binary.
            run(Command::new("cargo").args(["build", "--release", "--package", "flowctl"]))?;
            let bin = std::env::current_dir()?.join("target/release/flowctl");
            run(Command::new("cargo")
                .args(["run", "--release", "--quiet", "--package", "flowctl-tests", "--bin", "flowctl-bench", "--"])
                .args(args)
                .env("FLOWCTL_BIN", bin))
        }
    }
}
