//! The kernels of the matrix: which Debian packages bring them and where
//! their images are. Shared by setup (installs them) and the test tiers
//! (boots them).

use crate::output_ok;
use anyhow::{Context, Result};
use std::{path::PathBuf, process::Command};

/// A kernel of the matrix: Debian's generic `-amd64` flavour (the
/// `-cloud-amd64` one has no 9p, so the host's root filesystem cannot be
/// shared with it).
pub struct Kernel {
    /// What `--kernel` takes, and the prefix of the image in /boot.
    pub version: &'static str,
    package: Package,
}

enum Package {
    /// `prefix` + the newest ABI number in the archive + `suffix`.
    Newest {
        prefix: &'static str,
        suffix: &'static str,
    },
    Fixed(&'static str),
}

pub const KERNELS: &[Kernel] = &[
    // 6.1 LTS: Debian 12's own kernel (and most 6.1-based distributions').
    Kernel {
        version: "6.1",
        package: Package::Newest { prefix: "linux-image-6.1.0-", suffix: "-amd64-unsigned" },
    },
    // 6.12 LTS: Debian 12's backports.
    Kernel { version: "6.12", package: Package::Fixed("linux-image-6.12-amd64") },
];

pub const BOOT_PREFIX: &str = "/boot/vmlinuz-";

impl Kernel {
    /// The newest `/boot/vmlinuz-VERSION.*-amd64`.
    pub fn image(&self) -> Option<PathBuf> {
        let want = format!("vmlinuz-{}.", self.version);
        let mut found: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir("/boot")
            .ok()?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_string();
                (name.starts_with(&want) && name.ends_with("-amd64"))
                    .then(|| (natural(&name), e.path()))
            })
            .collect();
        found.sort();
        found.pop().map(|(_, p)| p)
    }

    /// The Debian package that installs this kernel, resolved now.
    pub fn package(&self) -> Result<String> {
        match self.package {
            Package::Newest { prefix, suffix } => newest_package(prefix, suffix),
            Package::Fixed(name) => Ok(name.to_string()),
        }
    }
}

/// The numbers in a name, for sorting `6.1.0-9` before `6.1.0-54`.
fn natural(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit()).filter_map(|s| s.parse().ok()).collect()
}

/// The newest package in the archive named `prefix` + ABI number + `suffix`
/// (e.g. `linux-image-6.1.0-` 57 `-amd64-unsigned`): ABI numbers disappear
/// from the archive, so the name is resolved when it is installed.
pub fn newest_package(prefix: &str, suffix: &str) -> Result<String> {
    let names = output_ok(Command::new("apt-cache").args(["pkgnames", prefix])).unwrap_or_default();
    names
        .lines()
        .filter_map(|n| n.strip_prefix(prefix)?.strip_suffix(suffix)?.parse::<u32>().ok())
        .max()
        .map(|abi| format!("{prefix}{abi}{suffix}"))
        .with_context(|| format!("no package {prefix}N{suffix} in the apt lists (apt-get update?)"))
}
