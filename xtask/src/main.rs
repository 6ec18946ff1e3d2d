//! Project tasks: `cargo xtask setup|test|demo|bench|package`.
//!
//! `setup` (setup.rs) installs what the build and tests need, idempotently
//! and quickly when present. `test` (matrix.rs) runs every tier: on the host
//! kernel, then in one VM per kernel of the matrix (vm.rs). `test` and
//! `demo` call `setup` first.

mod bench;
mod disk;
mod kernels;
mod matrix;
mod package;
mod previous;
mod setup;
mod tee;
mod tiers;
mod vm;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::{
    path::{Path, PathBuf},
    process::Command,
};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install toolchain parts, packages, QEMU, virtme-ng and the matrix's kernels (idempotent).
    Setup,
    /// Every test tier: unit and property tests, the privileged kernel and
    /// end-to-end tests on the host kernel (root, serial), then the kernel
    /// tier and an end-to-end subset in one VM per kernel of the matrix.
    Test {
        /// Run only these: `host` (unit tier and the host kernel's tiers),
        /// `6.1`, `6.12` (one VM each), or `all` (the default). Repeatable.
        #[arg(long = "kernel", value_name = "KERNEL")]
        kernels: Vec<String>,
        /// Also the long tiers: the previous pinned layout's flowctl built
        /// from its commit for the upgrade test (xtask/src/previous.rs).
        #[arg(long)]
        full: bool,
    },
    /// Build the previous pinned layout's flowctl from its commit and print
    /// its path (for the upgrade test by hand: FLOWCTL_PREVIOUS_BIN).
    Previous,
    /// Build, make a throwaway veth lab, attach, drive traffic, show counters, clean up.
    /// `demo fleet`: three agents sharing one etcd profile and one global
    /// rule through Redis, the fleet's admitted rate against the limit.
    Demo {
        /// `fleet` for the fleet variant (docs/fleet.md); none: the main demo.
        #[arg(value_enum)]
        variant: Option<DemoVariant>,
    },
    /// The differential fuzzer (docs/classification.md): N generated frames
    /// through the real XDP program, compared with the reference classifier;
    /// disagreeing frames go to target/fuzz with a replay command each.
    Fuzz {
        /// Frames to run (the test suite runs a smoke of 200,000).
        #[arg(default_value_t = 10_000_000)]
        frames: u64,
        /// Passed to the fuzzer (`--seed S`, `--max-failures K`, `--per-profile M`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The Debian package (docs/packaging.md): the release binary, the
    /// systemd unit, man pages, completions and the default profile, as
    /// target/debian/flowctl_VERSION_ARCH.deb.
    Package {
        /// Package this flowctl binary instead of building the release one.
        #[arg(long, value_name = "PATH")]
        binary: Option<PathBuf>,
        /// Write the .deb here (default: target/debian).
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// gzip -1 instead of xz (a test package of a debug binary).
        #[arg(long)]
        quick: bool,
    },
    /// Benchmarks: prints ratios measured in one run (docs/benchmarks.md).
    /// `bench matrix [quick]` runs the BPF_PROG_TEST_RUN sections on the
    /// host and in a VM per kernel of the matrix (indicative under TCG).
    Bench {
        /// Passed to the bench runner (e.g. `quick`, `path`, `matrix`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DemoVariant {
    /// Real etcd and Redis in namespaces, three labs, three agents, one global rule.
    Fleet,
}

pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {:?}", cmd);
    let st = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

pub fn output_ok(cmd: &mut Command) -> Option<String> {
    let o = cmd.output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).to_string())
}

pub fn is_root() -> bool {
    output_ok(Command::new("id").arg("-u")).is_some_and(|s| s.trim() == "0")
}

/// The workspace root (xtask's parent), wherever `cargo xtask` was run from.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::setup(),
        Cmd::Previous => previous::flowctl().map(|p| println!("{}", p.display())),
        Cmd::Test { kernels, full } => matrix::test(matrix::Selection::parse(&kernels, full)?),
        Cmd::Demo { variant: None } => {
            privileged("the demo creates network namespaces and loads XDP", "demo")?;
            let bin = release_flowctl()?;
            run(tests_bin("flowctl-demo").env("FLOWCTL_BIN", bin))
        }
        Cmd::Demo { variant: Some(DemoVariant::Fleet) } => {
            privileged(
                "the fleet demo creates network namespaces, starts etcd and Redis and loads XDP",
                "demo fleet",
            )?;
            let bin = release_flowctl()?;
            run(tests_bin("flowctl-demo-fleet").env("FLOWCTL_BIN", bin))
        }
        Cmd::Fuzz { frames, args } => {
            privileged(
                "the fuzzer loads the XDP program for BPF_PROG_TEST_RUN",
                &format!("fuzz {frames}"),
            )?;
            let out = root().join("target/fuzz");
            run(tests_bin("flowctl-fuzz")
                .arg(frames.to_string())
                .arg("--out")
                .arg(&out)
                .args(args)
                .current_dir(root()))
        }
        Cmd::Package { binary, out, quick } => package::package(binary, out, quick).map(drop),
        Cmd::Bench { args } => {
            privileged("the benchmarks load XDP programs and make veth labs", "bench")?;
            // The agent benchmark runs the real release binary.
            let bin = release_flowctl()?;
            if args.first().map(String::as_str) == Some("matrix") {
                return bench::matrix(args.iter().any(|a| a == "quick"), &bin);
            }
            run(tests_bin("flowctl-bench").args(args).env("FLOWCTL_BIN", bin))
        }
    }
}

/// Setup, then root: `what` needs it, `sudo -E cargo xtask VERB` gives it.
fn privileged(what: &str, verb: &str) -> Result<()> {
    setup::setup()?;
    if !is_root() {
        bail!("{what}: run `sudo -E cargo xtask {verb}`");
    }
    Ok(())
}

/// Builds the release `flowctl` and returns its path.
pub fn release_flowctl() -> Result<PathBuf> {
    run(Command::new("cargo").args(["build", "--release", "--package", "flowctl"]))?;
    Ok(root().join("target/release/flowctl"))
}

/// `cargo run --release` of one of flowctl-tests' binaries; arguments after.
fn tests_bin(name: &str) -> Command {
    let mut c = Command::new("cargo");
    c.args(["run", "--release", "--quiet", "--package", "flowctl-tests", "--bin", name, "--"]);
    c
}
