//! `flowctl generate man DIR` and `flowctl generate completions SHELL DIR`
//! (hidden): the manual pages and shell completions, from the same clap
//! definitions the binary parses its command line with. `cargo xtask
//! package` runs them on the binary it packages (docs/packaging.md), so the
//! pages and completions always describe the binary they ship with.

use anyhow::{Context, Result};
use clap::Command;
use clap_mangen::{
    roff::{bold, roman, Roff},
    Man,
};
use std::{
    io::Write,
    path::{Path, PathBuf},
};

/// Writes `flowctl.1` and one `flowctl-VERB.1` per visible verb into `dir`
/// (created if missing); returns the files written, the main page first.
/// Hidden verbs (this one) get no page. The pages' date is
/// `SOURCE_DATE_EPOCH`'s day when set (reproducible builds), else none.
pub fn man(cmd: Command, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Built once from the top, so that each verb's display name is
    // `flowctl-VERB` (what its page is called and what it shows).
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let date = source_date();
    let name = cmd.get_name().to_string();
    let verbs: Vec<Command> = cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned().collect();
    let pages: Vec<String> = verbs.iter().map(page_name).collect();
    let mut written = Vec::new();
    // The main page: every verb's page under SEE ALSO, and the files the
    // package installs.
    let see_also: Vec<&str> = pages.iter().map(String::as_str).collect();
    written.push(write_page(cmd.clone(), dir, &date, &see_also, Some(&main_page_extra()))?);
    for (verb, page) in verbs.into_iter().zip(&pages) {
        let mut others = vec![name.as_str()];
        others.extend(pages.iter().filter(|p| *p != page).map(String::as_str));
        written.push(write_page(verb, dir, &date, &others, None)?);
    }
    Ok(written)
}

/// Writes the completion script of `shell` into `dir` under the name
/// clap_complete gives it (`flowctl.bash`, `_flowctl`, `flowctl.fish`,
/// ...); the packager installs it where the shell looks.
/// Hidden verbs (this one) are left out.
pub fn completions(cmd: Command, shell: clap_complete::Shell, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = cmd.get_name().to_string();
    let mut cmd = visible_only(&cmd);
    clap_complete::generate_to(shell, &mut cmd, name, dir)
        .with_context(|| format!("writing the {shell} completions into {}", dir.display()))
}

/// `cmd` without its hidden verbs (clap_complete completes them too): the
/// same name, version and arguments, and the visible verbs as they are.
fn visible_only(cmd: &Command) -> Command {
    // A one-shot command: leaking two short strings is the simple way to
    // the `'static` names clap takes without its `string` feature.
    let leak = |s: &str| -> &'static str { Box::leak(s.to_owned().into_boxed_str()) };
    let mut out = Command::new(leak(cmd.get_name()))
        .args(
            cmd.get_arguments()
                .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
                .cloned(),
        )
        .subcommands(cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
    if let Some(v) = cmd.get_version() {
        out = out.version(leak(v));
    }
    out
}

fn page_name(cmd: &Command) -> String {
    cmd.get_display_name().unwrap_or_else(|| cmd.get_name()).to_string()
}

/// One page: clap_mangen's sections, then FILES and the like (`extra`,
/// roff) and SEE ALSO.
fn write_page(
    cmd: Command,
    dir: &Path,
    date: &str,
    see_also: &[&str],
    extra: Option<&str>,
) -> Result<PathBuf> {
    let man = Man::new(cmd).date(date).manual("flowctl manual");
    let path = dir.join(man.get_filename());
    let mut text = Vec::new();
    man.render(&mut text)?;
    if let Some(extra) = extra {
        text.extend_from_slice(extra.as_bytes());
    }
    let mut roff = Roff::new();
    roff.control("SH", ["SEE ALSO"]);
    let mut line = Vec::new();
    for (i, page) in see_also.iter().enumerate() {
        line.push(bold(*page));
        line.push(roman(if i + 1 < see_also.len() { "(1), " } else { "(1)" }));
    }
    roff.text(line);
    text.extend_from_slice(roff.to_roff().as_bytes());
    let mut f =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(&text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// FILES, ENVIRONMENT and the service, for the main page.
fn main_page_extra() -> String {
    let mut roff = Roff::new();
    roff.control("SH", ["FILES"]);
    for (file, what) in [
        ("/etc/flowctl/IFACE.toml", "the profile the systemd unit flowctl@IFACE.service attaches to IFACE; /etc/flowctl/default.toml is a starting point that drops nothing (every rule is dry-run)"),
        ("/sys/fs/bpf/flowctl/", "the pinned data plane of every attachment (maps and the XDP link); it outlives the agent when attached with --keep"),
        ("/run/flowctl/", "the agents' run-time files: state, the active profile, the lock and the control socket"),
        ("/var/lib/flowctl/etcd/", "the last good copy of each profile followed from etcd"),
    ] {
        roff.control("TP", []);
        roff.text([bold(file)]);
        roff.text([roman(what)]);
    }
    roff.control("SH", ["ENVIRONMENT"]);
    roff.control("TP", []);
    roff.text([bold("FLOWCTL_LOG")]);
    roff.text([roman("the log filter (tracing's EnvFilter syntax); default warn")]);
    roff.control("TP", []);
    roff.text([bold("FLOWCTL_LOG_FORMAT")]);
    roff.text([roman("text (default) or json: what --log-format sets")]);
    roff.control("SH", ["SERVICE"]);
    roff.text([
        roman("systemctl enable --now flowctl@IFACE attaches /etc/flowctl/IFACE.toml to IFACE with --keep; "),
        roman("systemctl reload runs flowctl apply (all or nothing); stopping, restarting or upgrading the package leaves the data plane enforcing and the next agent adopts it. "),
        roman("Protection is removed only by "),
        bold("flowctl detach IFACE"),
        roman(" after the unit is stopped (or by removing the package). docs/packaging.md has the details (in the Debian package: /usr/share/doc/flowctl/README.Debian)."),
    ]);
    roff.to_roff()
}

/// `SOURCE_DATE_EPOCH` as YYYY-MM-DD (UTC), or "" when unset or invalid.
fn source_date() -> String {
    std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .map(|secs| civil_date(secs.div_euclid(86_400)))
        .unwrap_or_default()
}

/// Days since 1970-01-01 to YYYY-MM-DD (Howard Hinnant's civil_from_days).
fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Command {
        Command::new("flowctl")
            .version("1.2.3")
            .about("A tool.")
            .subcommand(Command::new("attach").about("Attach.").arg(clap::arg!(--keep "Keep.")))
            .subcommand(Command::new("detach").about("Detach."))
            .subcommand(Command::new("generate").hide(true))
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(19_723), "2024-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
        assert_eq!(civil_date(-1), "1969-12-31");
    }

    #[test]
    fn a_page_per_visible_verb_with_see_also() {
        let dir = std::env::temp_dir().join(format!("flowctl-man-{}", std::process::id()));
        let files = man(sample(), &dir).unwrap();
        let names: Vec<String> =
            files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["flowctl.1", "flowctl-attach.1", "flowctl-detach.1"]);
        let attach = std::fs::read_to_string(dir.join("flowctl-attach.1")).unwrap();
        assert!(attach.contains("flowctl\\-attach"), "{attach}");
        assert!(attach.contains("\\-\\-keep"), "{attach}");
        assert!(attach.contains(".SH \"SEE ALSO\""), "{attach}");
        assert!(attach.contains("flowctl\\-detach"), "{attach}");
        let main = std::fs::read_to_string(dir.join("flowctl.1")).unwrap();
        assert!(main.contains(".SH FILES") && main.contains("/etc/flowctl/IFACE.toml"), "{main}");
        assert!(!main.contains("generate"), "hidden verbs stay out: {main}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn completions_for_the_three_shells() {
        let dir = std::env::temp_dir().join(format!("flowctl-compl-{}", std::process::id()));
        for (shell, file) in [
            (clap_complete::Shell::Bash, "flowctl.bash"),
            (clap_complete::Shell::Zsh, "_flowctl"),
            (clap_complete::Shell::Fish, "flowctl.fish"),
        ] {
            let p = completions(sample(), shell, &dir).unwrap();
            assert_eq!(p, dir.join(file));
            let text = std::fs::read_to_string(&p).unwrap();
            assert!(text.contains("attach"), "{text}");
            assert!(!text.contains("generate"), "hidden verbs stay out: {text}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
