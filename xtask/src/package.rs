//! `cargo xtask package`: the Debian package, built with `dpkg-deb` from a
//! staging tree (docs/packaging.md says what it holds and why it is not
//! cargo-deb).
//!
//! The binary is the release build (`cargo build --release -p flowctl`,
//! whose build script embeds the BPF programs), or `--binary PATH` (the test
//! runner packages the binary under test). Its manual pages and completions
//! come from the binary itself (`flowctl generate`, hidden), so they
//! describe exactly the command line that ships; the unit, the maintainer
//! scripts, the default profile, the changelog and the copyright are the
//! files under `packaging/`.

use crate::{output_ok, root, run};
use anyhow::{bail, ensure, Context, Result};
use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

/// Where the completions go, per shell: Debian's paths (bash-completion's
/// on-demand directory, zsh's and fish's vendor directories).
const COMPLETIONS: &[(&str, &str, &str)] = &[
    ("bash", "flowctl.bash", "usr/share/bash-completion/completions/flowctl"),
    ("zsh", "_flowctl", "usr/share/zsh/vendor-completions/_flowctl"),
    ("fish", "flowctl.fish", "usr/share/fish/vendor_completions.d/flowctl.fish"),
];
/// The unit: /lib/systemd/system, where bookworm's packages put theirs.
pub const UNIT: &str = "lib/systemd/system/flowctl@.service";
/// The default profile (a conffile).
pub const DEFAULT_PROFILE: &str = "etc/flowctl/default.toml";
const DOC: &str = "usr/share/doc/flowctl";

/// `cargo xtask package [--binary PATH] [--out DIR] [--quick]`: builds the release
/// binary unless given one, then the .deb; prints and returns its path.
pub fn package(binary: Option<PathBuf>, out: Option<PathBuf>, quick: bool) -> Result<PathBuf> {
    let binary = match binary {
        Some(b) => fs::canonicalize(&b).with_context(|| format!("--binary {}", b.display()))?,
        None => crate::release_flowctl()?,
    };
    let out = match out {
        Some(o) => std::env::current_dir()?.join(o), // a relative one from here
        None => root().join("target/debian"),
    };
    let deb = build(&binary, &out, quick)?;
    println!("{}", deb.display());
    Ok(deb)
}

/// The package of `binary`, written into `out` as
/// `flowctl_VERSION_ARCH.deb`; compressed with xz, or with `quick`, gzip -1
/// (the test runner's package of a debug binary: 2 s instead of 40).
pub fn build(binary: &Path, out: &Path, quick: bool) -> Result<PathBuf> {
    let src = root().join("packaging");
    let entry = Changelog::newest(&src.join("debian/changelog"))?;
    let upstream = env!("CARGO_PKG_VERSION"); // xtask's version is the workspace's
    ensure!(
        entry.upstream() == upstream,
        "packaging/debian/changelog's newest entry is {}, the workspace is at {upstream}: add an entry for {upstream}-1",
        entry.version
    );
    let reported = output_ok(Command::new(binary).arg("--version")).unwrap_or_default();
    ensure!(
        reported.trim() == format!("flowctl {upstream}"),
        "{} --version says {:?}, not flowctl {upstream}",
        binary.display(),
        reported.trim()
    );
    let arch = output_ok(Command::new("dpkg").arg("--print-architecture"))
        .context("dpkg --print-architecture (building the package needs dpkg)")?
        .trim()
        .to_string();
    let epoch = entry.epoch()?;
    let name = format!("flowctl_{}_{arch}", entry.version);
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let stage = out.join(&name);
    if stage.exists() {
        fs::remove_dir_all(&stage)?;
    }
    let stage_rel = |p: &str| stage.join(p);

    // The binary, stripped as Debian's policy wants (the BPF programs are
    // data in .rodata; stripping leaves them as they are).
    let bin = stage_rel("usr/bin/flowctl");
    copy(binary, &bin, 0o755)?;
    run(Command::new("strip").args(["--strip-unneeded", "--remove-section=.comment"]).arg(&bin))?;

    // Manual pages and completions, from the packaged binary.
    let gen = out.join(format!("{name}.generated"));
    if gen.exists() {
        fs::remove_dir_all(&gen)?;
    }
    let generate = |args: &[&str]| -> Result<()> {
        run(Command::new(&bin)
            .arg("generate")
            .args(args)
            .env("SOURCE_DATE_EPOCH", &epoch)
            .stdout(std::process::Stdio::null()))
    };
    let man_dir = gen.join("man");
    generate(&["man", path_str(&man_dir)?])?;
    let mut pages = 0;
    for e in fs::read_dir(&man_dir)? {
        let p = e?.path();
        let file = p.file_name().unwrap().to_string_lossy().to_string();
        gzip_to(&p, &stage_rel(&format!("usr/share/man/man1/{file}.gz")))?;
        pages += 1;
    }
    ensure!(pages >= 2, "flowctl generate man wrote {pages} pages");
    for (shell, file, dest) in COMPLETIONS {
        let dir = gen.join("completions");
        generate(&["completions", shell, path_str(&dir)?])?;
        copy(&dir.join(file), &stage_rel(dest), 0o644)?;
    }
    fs::remove_dir_all(&gen)?;

    copy(&src.join("systemd/flowctl@.service"), &stage_rel(UNIT), 0o644)?;
    let profile = stage_rel(DEFAULT_PROFILE);
    copy(&src.join("default.toml"), &profile, 0o644)?;
    // The default profile must pass `flowctl check` (with the binary it ships with).
    run(Command::new(&bin).arg("check").arg(&profile).stdout(std::process::Stdio::null()))?;

    // /usr/share/doc/flowctl: copyright, changelog, README.Debian.
    let copyright =
        fs::read_to_string(src.join("debian/copyright"))?.replace("@CRATES@", &linked_crates()?);
    write(&stage_rel(&format!("{DOC}/copyright")), &copyright, 0o644)?;
    gzip_to(&src.join("debian/changelog"), &stage_rel(&format!("{DOC}/changelog.Debian.gz")))?;
    copy(&root().join("docs/packaging.md"), &stage_rel(&format!("{DOC}/README.Debian")), 0o644)?;
    copy(&src.join("lintian/overrides"), &stage_rel("usr/share/lintian/overrides/flowctl"), 0o644)?;

    // DEBIAN/: control, conffiles, maintainer scripts, md5sums.
    let installed_kib = installed_size(&stage)?;
    let control = fs::read_to_string(src.join("debian/control"))?
        .replace("@VERSION@", &entry.version)
        .replace("@ARCH@", &arch)
        .replace("@INSTALLED_SIZE@", &installed_kib.to_string())
        .replace("@DEPENDS@", &shlib_depends(&bin, &out.join(format!("{name}.shlibdeps")))?);
    ensure!(
        !["@VERSION@", "@ARCH@", "@INSTALLED_SIZE@", "@DEPENDS@"]
            .iter()
            .any(|p| control.contains(p)),
        "packaging/debian/control has a placeholder left: {control}"
    );
    let md5sums = md5sums(&stage)?;
    write(&stage_rel("DEBIAN/control"), &control, 0o644)?;
    write(&stage_rel("DEBIAN/conffiles"), &format!("/{DEFAULT_PROFILE}\n"), 0o644)?;
    for script in ["postinst", "prerm", "postrm"] {
        copy(&src.join("debian").join(script), &stage_rel(&format!("DEBIAN/{script}")), 0o755)?;
    }
    write(&stage_rel("DEBIAN/md5sums"), &md5sums, 0o644)?;
    normalize_dirs(&stage)?;

    let deb = out.join(format!("{name}.deb"));
    // Owned by root whoever builds (no fakeroot); SOURCE_DATE_EPOCH sets
    // the archive's timestamps and clamps the files' (reproducible builds).
    run(Command::new("dpkg-deb")
        .arg("--root-owner-group")
        .args(if quick { ["-Zgzip", "-z1"] } else { ["-Zxz", "-z6"] })
        .arg("--build")
        .arg(&stage)
        .arg(&deb)
        .env("SOURCE_DATE_EPOCH", &epoch))?;
    fs::remove_dir_all(&stage)?;
    Ok(deb)
}

/// The newest entry of a Debian changelog: its version and its date.
struct Changelog {
    version: String,
    date: String,
}

impl Changelog {
    fn newest(path: &Path) -> Result<Self> {
        let text =
            fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let first = text.lines().next().unwrap_or_default();
        // flowctl (0.1.0-1) unstable; urgency=medium
        let version = first
            .strip_prefix("flowctl (")
            .and_then(|r| r.split_once(')'))
            .map(|(v, _)| v.to_string())
            .with_context(|| format!("{}:1: not `flowctl (VERSION) ...`", path.display()))?;
        //  -- NAME <MAIL>  DATE
        let date = text
            .lines()
            .find(|l| l.starts_with(" -- "))
            .and_then(|l| l.split_once(">  "))
            .map(|(_, d)| d.trim().to_string())
            .with_context(|| format!("{}: no ` -- NAME <MAIL>  DATE` line", path.display()))?;
        Ok(Self { version, date })
    }

    /// The upstream version: the Debian version without its revision.
    fn upstream(&self) -> &str {
        self.version.rsplit_once('-').map_or(&self.version, |(u, _)| u)
    }

    /// The entry's date as seconds since the epoch (SOURCE_DATE_EPOCH).
    fn epoch(&self) -> Result<String> {
        let s = output_ok(Command::new("date").args(["-d", &self.date, "+%s"]))
            .with_context(|| format!("the changelog's date {:?} does not parse", self.date))?;
        Ok(s.trim().to_string())
    }
}

/// The Rust crates statically linked into flowctl (normal dependencies, not
/// the build's), one `name version: license` line each, for the copyright
/// file's comment (DEP-5 continuation lines).
fn linked_crates() -> Result<String> {
    let tree = output_ok(
        Command::new("cargo")
            .args(["tree", "--locked", "-p", "flowctl", "-e", "normal", "--prefix", "none"])
            .args(["-f", "{p}|{l}"]) // the host's platform: what is linked here
            .current_dir(root()),
    )
    .context("cargo tree -p flowctl failed")?;
    let mut lines: Vec<String> = tree
        .lines()
        .filter_map(|l| {
            let (p, license) = l.trim_end_matches(" (*)").split_once('|')?;
            // The workspace's own crates (a path in the package id) are the
            // Files: * paragraph.
            if p.contains(" (/") {
                return None;
            }
            let license = if license.is_empty() { "unknown" } else { license };
            Some(format!(" {p}: {license}"))
        })
        .collect();
    lines.sort();
    lines.dedup();
    ensure!(lines.len() > 10, "cargo tree listed {} crates", lines.len());
    Ok(lines.join("\n"))
}

/// `Depends:` from dpkg-shlibdeps (the shared libraries the binary links
/// and the versions their symbols need).
fn shlib_depends(bin: &Path, dir: &Path) -> Result<String> {
    // dpkg-shlibdeps reads debian/control from where it runs (`dir`).
    fs::create_dir_all(dir.join("debian"))?;
    fs::write(
        dir.join("debian/control"),
        "Source: flowctl\n\nPackage: flowctl\nArchitecture: any\n",
    )?;
    let out = Command::new("dpkg-shlibdeps")
        .args(["-O", "-e"])
        .arg(bin)
        .current_dir(dir)
        .output()
        .context("running dpkg-shlibdeps (Debian's dpkg-dev; `cargo xtask setup` installs it)")?;
    fs::remove_dir_all(dir)?;
    if !out.status.success() {
        bail!("dpkg-shlibdeps failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("shlibs:Depends="))
        .map(|d| d.trim().to_string())
        .with_context(|| format!("dpkg-shlibdeps said no shlibs:Depends: {text}"))
}

/// Installed-Size in KiB: each file rounded up to a KiB, each directory one.
fn installed_size(stage: &Path) -> Result<u64> {
    let mut kib = 0;
    for (p, meta) in walk(stage)? {
        if p.starts_with(stage.join("DEBIAN")) {
            continue;
        }
        kib += if meta.is_dir() { 1 } else { meta.len().div_ceil(1024) };
    }
    Ok(kib)
}

/// DEBIAN/md5sums: `md5  relative/path` for every file outside DEBIAN/.
fn md5sums(stage: &Path) -> Result<String> {
    let mut files: Vec<String> = walk(stage)?
        .into_iter()
        .filter(|(p, m)| m.is_file() && !p.starts_with(stage.join("DEBIAN")))
        .map(|(p, _)| p.strip_prefix(stage).unwrap().to_string_lossy().to_string())
        .collect();
    files.sort();
    let out = output_ok(Command::new("md5sum").args(&files).current_dir(stage))
        .context("md5sum failed")?;
    Ok(out)
}

/// Every directory 0755 (whatever the umask made them).
fn normalize_dirs(stage: &Path) -> Result<()> {
    for (p, meta) in walk(stage)? {
        if meta.is_dir() {
            fs::set_permissions(&p, fs::Permissions::from_mode(0o755))?;
        }
    }
    Ok(())
}

/// Every path under `dir` (not `dir` itself), with its metadata.
fn walk(dir: &Path) -> Result<Vec<(PathBuf, fs::Metadata)>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let e = e?;
            let meta = fs::symlink_metadata(e.path())?;
            if meta.is_dir() {
                todo.push(e.path());
            }
            out.push((e.path(), meta));
        }
    }
    Ok(out)
}

fn copy(from: &Path, to: &Path, mode: u32) -> Result<()> {
    fs::create_dir_all(to.parent().unwrap())?;
    fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(mode))?;
    Ok(())
}

fn write(to: &Path, text: &str, mode: u32) -> Result<()> {
    fs::create_dir_all(to.parent().unwrap())?;
    fs::write(to, text).with_context(|| format!("writing {}", to.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// `gzip -9n` (no name or timestamp in the header: reproducible) of `from`.
fn gzip_to(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to.parent().unwrap())?;
    let out = Command::new("gzip")
        .args(["-9n", "--stdout"])
        .arg(from)
        .output()
        .context("running gzip")?;
    ensure!(out.status.success(), "gzip {} failed", from.display());
    write_bytes(to, &out.stdout)
}

fn write_bytes(to: &Path, bytes: &[u8]) -> Result<()> {
    fs::write(to, bytes).with_context(|| format!("writing {}", to.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(0o644))?;
    Ok(())
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().with_context(|| format!("{} is not UTF-8", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_changelog_matches_the_workspace_version() {
        let c = Changelog::newest(&root().join("packaging/debian/changelog")).unwrap();
        assert_eq!(c.upstream(), env!("CARGO_PKG_VERSION"), "add a changelog entry");
        assert!(c.epoch().unwrap().parse::<u64>().unwrap() > 1_700_000_000);
    }

    #[test]
    fn upstream_strips_the_revision_only() {
        let c = |v: &str| Changelog { version: v.into(), date: String::new() };
        assert_eq!(c("0.1.0-1").upstream(), "0.1.0");
        assert_eq!(c("1.0~rc1-2").upstream(), "1.0~rc1");
        assert_eq!(c("0.1.0").upstream(), "0.1.0");
    }
}
