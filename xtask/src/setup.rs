//! `cargo xtask setup`: installs what the build and the tests need,
//! idempotently, and quickly when everything is present.
//!
//! - the nightly's rust-src and bpf-linker 0.10.3 (matches the nightly's
//!   LLVM 22; 0.11+ targets LLVM 23);
//! - the Debian packages the host tiers use;
//! - the kernel matrix's tools: QEMU, a static busybox (virtme-ng's guest
//!   init needs one), virtme-ng from PyPI and one Debian kernel image per
//!   kernel of the matrix (`kernels::KERNELS`).

use crate::{is_root, kernels, output_ok, run};
use anyhow::{bail, Context, Result};
use std::{
    path::{Path, PathBuf},
    process::Command,
};

const BPF_LINKER_VERSION: &str = "0.10.3";
const DEBIAN_PACKAGES: &[&str] = &[
    "iproute2",
    "nftables",
    "bpftool",
    "iputils-ping",
    "ethtool",
    "util-linux",
    "tmux",
    "python3",
    // Real HTTP server and client for the connection-rate test
    // (tests/src/web.rs).
    "nginx-light",
    "wrk",
    // promtool, which checks the metrics endpoint's text.
    "prometheus",
    // The fleet's stores, started by the tests themselves (docs/fleet.md),
    // and protoc for etcd-client's generated gRPC code.
    "redis-server",
    "etcd-server",
    "etcd-client",
    "protobuf-compiler",
    // `cargo xtask package` (dpkg-shlibdeps) and the package's tests: lintian,
    // and zsh and fish to load the completions in (docs/packaging.md).
    "dpkg-dev",
    "lintian",
    "zsh",
    "fish",
    // xdp-filter and xdp-loader, and libxdp's dispatcher object, which
    // `attach --multiprog` loads (docs/coexistence.md) and the
    // co-existence test runs beside flowctl.
    "xdp-tools",
];
/// The kernel matrix's Debian packages: QEMU for the VMs, and a statically
/// linked busybox ("a statically linked busybox could not be found" without).
const VM_DEBIAN_PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static"];
const VIRTME_NG: &str = "virtme-ng";

pub fn setup() -> Result<()> {
    let mut installed: Vec<String> = Vec::new();
    let have_src = output_ok(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "nightly",
    ]))
    .is_some_and(|s| s.lines().any(|l| l.starts_with("rust-src")));
    if !have_src {
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
        installed.push("rust-src".into());
    }
    // The lint tier's tools (rust-toolchain.toml lists them; an older
    // rustup that installed the toolchain before they were listed does not
    // add them by itself).
    for (tool, component) in [("fmt", "rustfmt"), ("clippy", "clippy")] {
        if output_ok(Command::new("cargo").args([tool, "--version"]).current_dir(crate::root()))
            .is_none()
        {
            run(Command::new("rustup")
                .args(["component", "add", component])
                .current_dir(crate::root()))?;
            installed.push(component.into());
        }
    }
    let linker_ok = output_ok(Command::new("bpf-linker").arg("--version"))
        .is_some_and(|v| v.contains(BPF_LINKER_VERSION));
    if !linker_ok {
        run(Command::new("cargo").args([
            "install",
            &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            "--locked",
            "--force",
        ]))?;
        installed.push(format!("bpf-linker {BPF_LINKER_VERSION}"));
    }
    let mut missing: Vec<String> = DEBIAN_PACKAGES
        .iter()
        .chain(VM_DEBIAN_PACKAGES)
        .filter(|p| !dpkg_installed(p))
        .map(|p| p.to_string())
        .collect();
    let missing_kernels: Vec<&kernels::Kernel> =
        kernels::KERNELS.iter().filter(|k| k.image().is_none()).collect();
    if !missing.is_empty() || !missing_kernels.is_empty() {
        if !is_root() {
            bail!("missing Debian packages {missing:?} or kernel images {:?}: run `sudo cargo xtask setup`", missing_kernels.iter().map(|k| k.version).collect::<Vec<_>>());
        }
        apt_get(&["update", "-qq"])?;
        for k in &missing_kernels {
            missing.push(k.package()?);
        }
        let mut args = vec!["install", "-y", "-qq"];
        args.extend(missing.iter().map(String::as_str));
        apt_get(&args)?;
        for k in &missing_kernels {
            k.image().with_context(|| {
                format!(
                    "installed {:?} but found no {}{}* in /boot",
                    k.package(),
                    kernels::BOOT_PREFIX,
                    k.version
                )
            })?;
        }
        installed.extend(missing);
    }
    if vng().is_none() {
        pip_install(VIRTME_NG)?;
        vng().context("installed virtme-ng but `vng --version` does not run")?;
        installed.push(VIRTME_NG.into());
    }
    if installed.is_empty() {
        eprintln!("setup: everything present (rust-src, bpf-linker {BPF_LINKER_VERSION}, {DEBIAN_PACKAGES:?}, {VM_DEBIAN_PACKAGES:?}, virtme-ng, kernels {})", kernel_list());
    } else {
        eprintln!("setup: installed {installed:?}; kernels {}", kernel_list());
    }
    Ok(())
}

fn kernel_list() -> String {
    kernels::KERNELS
        .iter()
        .map(|k| {
            format!(
                "{} ({})",
                k.version,
                k.image().map(|p| p.display().to_string()).unwrap_or_else(|| "missing".into())
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn dpkg_installed(p: &str) -> bool {
    output_ok(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
        .is_some_and(|s| s.contains("install ok installed"))
}

/// apt-get, waiting for another apt's lock instead of failing at once.
fn apt_get(args: &[&str]) -> Result<()> {
    run(Command::new("apt-get")
        .args(["-o", "DPkg::Lock::Timeout=600"])
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// The `vng` to run: on PATH (through pyenv's shims, here), else in the
/// scripts directory of the python3 on PATH (where pip put it; `sudo`
/// may drop the shims from PATH).
pub fn vng() -> Option<PathBuf> {
    let scripts = output_ok(
        Command::new("python3")
            .args(["-c", "import sysconfig; print(sysconfig.get_path('scripts'))"]),
    )
    .map(|s| Path::new(s.trim()).join("vng"));
    [Some(PathBuf::from("vng")), scripts].into_iter().flatten().find(|p| {
        output_ok(Command::new(p).arg("--version")).is_some_and(|v| v.contains("virtme-ng"))
    })
}

fn pip_install(pkg: &str) -> Result<()> {
    let plain = run(Command::new("python3").args(["-m", "pip", "install", "-q", pkg]));
    if plain.is_err() {
        // Debian's own python3 refuses pip installs without this (PEP 668).
        run(Command::new("python3").args([
            "-m",
            "pip",
            "install",
            "-q",
            "--break-system-packages",
            pkg,
        ]))?;
    }
    // pyenv's shims appear only after a rehash.
    let _ = output_ok(Command::new("pyenv").arg("rehash"));
    Ok(())
}
