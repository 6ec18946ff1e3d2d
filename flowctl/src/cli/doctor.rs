//! `flowctl doctor [--profile FILE] [--json]`: what the running kernel
//! supports (`kernel::features`), each program loaded once to prove the
//! verifier accepts it, and, with a profile, whether each of its parts can
//! run here. `check` stays pure; this is the verb that touches the kernel.
//!
//! The programs are loaded in a private bpffs mounted over /sys/fs/bpf in a
//! mount namespace of this process's own: their pinned maps never appear in
//! the host's bpffs, and everything goes when the process exits (even if it
//! is killed). Nothing is attached and nothing is written under /run.

use crate::{
    dataplane::{self, pins::AttachId},
    kernel::features::{self, Feature, Features, Need, Part, REQUIREMENTS},
    profile::{self, RuleSet, Settings},
};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::Path;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FeatureRow {
    pub feature: Feature,
    pub title: &'static str,
    pub available: bool,
    pub detail: Option<String>,
    /// "5.18" (None: not a kernel version question).
    pub min_version: Option<String>,
    /// "[[breaker]]s (required)", "egress baselines (preferred: ...)".
    pub needed_by: Vec<String>,
    pub how: &'static str,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProgramRow {
    pub program: &'static str,
    pub part: Part,
    pub verifies: bool,
    /// The verifier's processed-instruction count (5.16+ reports it).
    pub verified_insns: Option<u32>,
    /// Why it did not load: the verifier log's tail, or the load error.
    pub error: Option<String>,
    /// Whether the profile (all parts, without one) needs it.
    pub needed: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PartRow {
    pub part: Part,
    pub title: &'static str,
    pub runnable: bool,
    /// Required features the kernel lacks (messages naming the version).
    pub missing: Vec<String>,
    /// Preferred features it runs without, and what that means.
    pub degraded: Vec<String>,
    /// Its programs that did not verify.
    pub failed_programs: Vec<&'static str>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProfileReport {
    pub path: String,
    pub parts: Vec<PartRow>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub kernel: String,
    pub features: Vec<FeatureRow>,
    /// The XDP entry point the loader chooses on this kernel.
    pub xdp_program: &'static str,
    pub programs: Vec<ProgramRow>,
    pub profile: Option<ProfileReport>,
    /// Every needed program verifies and every part of the profile can run.
    pub ok: bool,
}

/// The feature rows: each probe with what needs it (from `REQUIREMENTS`).
pub fn feature_rows(f: &Features) -> Vec<FeatureRow> {
    Feature::ALL
        .iter()
        .map(|&feature| {
            let p = f.probe(feature);
            FeatureRow {
                feature,
                title: feature.title(),
                available: p.map(|p| p.available).unwrap_or(false),
                detail: p.and_then(|p| p.detail.clone()),
                min_version: feature.min_version().map(|(a, b)| format!("{a}.{b}")),
                needed_by: REQUIREMENTS
                    .iter()
                    .filter(|r| r.feature == feature)
                    .map(|r| match r.need {
                        Need::Required => format!("{} (required)", r.part.title()),
                        Need::Preferred(_) => format!("{} (preferred)", r.part.title()),
                    })
                    .collect(),
                how: feature.how(),
            }
        })
        .collect()
}

/// Each part of `set` against the features and the program results.
pub fn part_rows(f: &Features, set: &RuleSet, programs: &[ProgramRow]) -> Vec<PartRow> {
    Part::ALL
        .iter()
        .filter(|p| p.in_profile(set))
        .map(|&part| {
            let missing: Vec<String> = f
                .missing_for(part)
                .iter()
                .map(|r| features::missing_message(r, &f.release))
                .collect();
            let degraded: Vec<String> = f
                .degraded_for(part)
                .iter()
                .map(|r| match r.need {
                    Need::Preferred(without) => format!("no {}: {without}", r.feature.title()),
                    Need::Required => unreachable!("degraded_for lists preferred features"),
                })
                .collect();
            let failed_programs: Vec<&'static str> = programs
                .iter()
                .filter(|p| p.part == part && !p.verifies)
                .map(|p| p.program)
                .collect();
            PartRow {
                part,
                title: part.title(),
                runnable: missing.is_empty() && failed_programs.is_empty(),
                missing,
                degraded,
                failed_programs,
            }
        })
        .collect()
}

pub fn render_text(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "kernel {}", r.kernel);
    let _ = writeln!(s, "features:");
    for f in &r.features {
        let since = f.min_version.as_deref().map(|v| format!("{v}+")).unwrap_or_else(|| "-".into());
        let needed = if f.needed_by.is_empty() {
            "informational".to_string()
        } else {
            f.needed_by.join(", ")
        };
        let _ = writeln!(
            s,
            "  {:<3} {:<62} {:<6} {}",
            if f.available { "yes" } else { "no" },
            f.title,
            since,
            needed
        );
        if let Some(d) = &f.detail {
            let _ = writeln!(s, "      ({d})");
        }
    }
    let _ = writeln!(s, "programs (loaded once in a private bpffs; the XDP entry point is the one attach loads: {}):", r.xdp_program);
    for p in &r.programs {
        let verdict = if p.verifies {
            match p.verified_insns {
                Some(n) => format!("verifies, {n} instructions processed"),
                None => "verifies".to_string(),
            }
        } else {
            "DOES NOT VERIFY".to_string()
        };
        let needed = if p.needed { "" } else { " (not needed by the profile)" };
        let _ = writeln!(s, "  {:<20} {:<40} {}{needed}", p.program, verdict, p.part.title());
        if let Some(e) = &p.error {
            for line in e.lines() {
                let _ = writeln!(s, "      {line}");
            }
        }
    }
    if let Some(pr) = &r.profile {
        let _ = writeln!(s, "profile {}:", pr.path);
        if pr.parts.is_empty() {
            let _ = writeln!(s, "  (no rules, egress baselines or breakers)");
        }
        for p in &pr.parts {
            let _ = writeln!(
                s,
                "  {:<40} {}",
                p.title,
                if p.runnable { "can run on this kernel" } else { "CANNOT RUN on this kernel" }
            );
            for m in &p.missing {
                let _ = writeln!(s, "      {m}");
            }
            for m in &p.failed_programs {
                let _ = writeln!(s, "      program {m} does not verify");
            }
            for d in &p.degraded {
                let _ = writeln!(s, "      degraded: {d}");
            }
        }
    }
    let _ = writeln!(s, "{}", if r.ok { "ok" } else { "NOT OK: see above" });
    s
}

/// `flowctl doctor`. Returns whether everything needed is fine (the exit
/// status).
pub fn run(profile_path: Option<&Path>, json: bool) -> Result<bool> {
    let set = profile_path.map(profile::load).transpose()?;
    crate::agent::preflight::require_root()?;
    // Before any thread exists (unshare(CLONE_NEWNS) refuses a process
    // whose threads share its filesystem context).
    private_bpffs()?;
    let f = features::get();
    let settings = set.as_ref().map(|s| s.settings.clone()).unwrap_or_default();
    let mut programs = load_programs(&settings);
    for p in programs.iter_mut() {
        p.needed = match &set {
            Some(s) => p.part.in_profile(s),
            None => true,
        };
    }
    let profile = set.as_ref().map(|s| ProfileReport {
        path: profile_path.expect("set from a path").display().to_string(),
        parts: part_rows(f, s, &programs),
    });
    let ok = programs.iter().all(|p| p.verifies || !p.needed)
        && profile.as_ref().is_none_or(|p| p.parts.iter().all(|x| x.runnable));
    let report = Report {
        kernel: f.release.clone(),
        features: feature_rows(f),
        xdp_program: dataplane::XdpVariant::for_kernel().program(),
        programs,
        profile,
        ok,
    };
    if json {
        out!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        use std::io::Write as _;
        std::io::stdout().write_all(render_text(&report).as_bytes())?;
    }
    let _ = unsafe { libc::umount2(c"/sys/fs/bpf".as_ptr(), libc::MNT_DETACH) };
    Ok(report.ok)
}

/// A mount namespace of this process's own, with a fresh bpffs over
/// /sys/fs/bpf: what the loader pins there is invisible to the host and
/// gone with the process.
fn private_bpffs() -> Result<()> {
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            bail!("doctor loads its programs in a private mount namespace, and creating one failed: {}", std::io::Error::last_os_error());
        }
        // Nothing mounted from here on propagates to the host.
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            bail!(
                "making the private mount namespace private: {}",
                std::io::Error::last_os_error()
            );
        }
        std::fs::create_dir_all("/sys/fs/bpf").ok();
        if libc::mount(
            c"bpf".as_ptr(),
            c"/sys/fs/bpf".as_ptr(),
            c"bpf".as_ptr(),
            0,
            std::ptr::null(),
        ) != 0
        {
            bail!("mounting a private bpffs over /sys/fs/bpf: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn row(program: &'static str, part: Part, r: Result<Option<u32>>) -> ProgramRow {
    match r {
        Ok(verified_insns) => {
            ProgramRow { program, part, verifies: true, verified_insns, error: None, needed: true }
        }
        Err(e) => ProgramRow {
            program,
            part,
            verifies: false,
            verified_insns: None,
            error: Some(format!("{e:#}")),
            needed: true,
        },
    }
}

/// Loads every program once: the XDP program as attach would choose it
/// and the TC egress counter (one object, pinned under a throwaway
/// attachment id in the private bpffs), then the breakers' three programs.
fn load_programs(settings: &Settings) -> Vec<ProgramRow> {
    use aya::programs::{CgroupSockAddr, SchedClassifier, SockOps, Xdp};
    let mut rows = Vec::new();
    let id = AttachId { netns_ino: 0, ifindex: std::process::id() };
    let xdp_name = dataplane::XdpVariant::for_kernel().program();
    match dataplane::load(&id, settings) {
        Ok(mut ebpf) => {
            let xdp = (|| {
                let p: &Xdp = ebpf.program(xdp_name).context("program missing")?.try_into()?;
                Ok(p.info()?.verified_instruction_count())
            })();
            rows.push(row(xdp_name, Part::Rules, xdp));
            let egress = (|| {
                let p: &mut SchedClassifier = ebpf
                    .program_mut(flowctl_common::EGRESS_PROGRAM)
                    .context("program missing")?
                    .try_into()?;
                p.load().map_err(|e| program_error(e, flowctl_common::EGRESS_PROGRAM))?;
                Ok(p.info()?.verified_instruction_count())
            })();
            rows.push(row(flowctl_common::EGRESS_PROGRAM, Part::EgressBaselines, egress));
        }
        Err(e) => {
            let msg = format!("{e:#}");
            rows.push(row(xdp_name, Part::Rules, Err(anyhow::anyhow!("{msg}"))));
            rows.push(row(
                flowctl_common::EGRESS_PROGRAM,
                Part::EgressBaselines,
                Err(anyhow::anyhow!("not tried: the object it is in did not load")),
            ));
        }
    }
    let _ = std::fs::remove_dir_all(id.pin_dir());
    dataplane::pins::prune_empty_roots();
    match aya::EbpfLoader::new().load(dataplane::object::breaker_object()) {
        Ok(mut ebpf) => {
            for name in ["flowctl_connect4", "flowctl_connect6"] {
                let r = (|| {
                    let p: &mut CgroupSockAddr =
                        ebpf.program_mut(name).context("program missing")?.try_into()?;
                    p.load().map_err(|e| program_error(e, name))?;
                    Ok(p.info()?.verified_instruction_count())
                })();
                rows.push(row(name, Part::Breakers, r));
            }
            let r = (|| {
                let p: &mut SockOps =
                    ebpf.program_mut("flowctl_sock_ops").context("program missing")?.try_into()?;
                p.load().map_err(|e| program_error(e, "flowctl_sock_ops"))?;
                Ok(p.info()?.verified_instruction_count())
            })();
            rows.push(row("flowctl_sock_ops", Part::Breakers, r));
        }
        Err(e) => {
            for name in ["flowctl_connect4", "flowctl_connect6", "flowctl_sock_ops"] {
                rows.push(row(
                    name,
                    Part::Breakers,
                    Err(anyhow::anyhow!("loading the breaker object: {e}")),
                ));
            }
        }
    }
    rows
}

/// A program load failure with the verifier log's last lines.
fn program_error(e: aya::programs::ProgramError, name: &str) -> anyhow::Error {
    match e {
        aya::programs::ProgramError::LoadError { io_error, verifier_log } => {
            let log = verifier_log.to_string();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            anyhow::anyhow!(
                "the verifier rejected {name} ({io_error}); last lines of its log:\n{tail}"
            )
        }
        other => anyhow::anyhow!("loading {name}: {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(missing: &[Feature]) -> Features {
        Features::with_missing("6.1.0-54-amd64", missing)
    }

    fn programs(failing: &[&str]) -> Vec<ProgramRow> {
        [
            ("flowctl_xdp", Part::Rules),
            ("flowctl_egress", Part::EgressBaselines),
            ("flowctl_connect4", Part::Breakers),
        ]
        .iter()
        .map(|&(program, part)| {
            let bad = failing.contains(&program);
            ProgramRow {
                program,
                part,
                verifies: !bad,
                verified_insns: (!bad).then_some(1234),
                error: bad.then(|| "processed 1000001 insns (limit 1000000)".to_string()),
                needed: true,
            }
        })
        .collect()
    }

    #[test]
    fn feature_rows_say_what_needs_each_feature() {
        let rows = feature_rows(&kernel(&[Feature::Tcx]));
        assert_eq!(rows.len(), Feature::ALL.len());
        let tcx = rows.iter().find(|r| r.feature == Feature::Tcx).unwrap();
        assert!(!tcx.available);
        assert_eq!(tcx.min_version.as_deref(), Some("6.6"));
        assert_eq!(
            tcx.needed_by,
            vec!["egress baselines (TC egress counter) (preferred)".to_string()]
        );
        let retval = rows.iter().find(|r| r.feature == Feature::SetRetval).unwrap();
        assert_eq!(
            retval.needed_by,
            vec!["[[breaker]]s (cgroup connect hooks) (required)".to_string()]
        );
        let vmlinux = rows.iter().find(|r| r.feature == Feature::VmlinuxBtf).unwrap();
        assert!(vmlinux.needed_by.is_empty());
    }

    #[test]
    fn parts_are_judged_by_features_and_programs_and_rendered() {
        let set = profile::parse(
            "p.toml",
            "[[rule]]\nname = \"a\"\nproto = \"udp\"\nrate = \"10/s\"\nburst = 1\n\n[[breaker]]\nname = \"db\"\ntarget = \"192.0.2.10\"\nport = 5432\n",
        )
        .unwrap();
        let f = kernel(&[Feature::SetRetval, Feature::XdpFrags]);
        let progs = programs(&["flowctl_egress"]);
        let parts = part_rows(&f, &set, &progs);
        // No egress baseline in the profile: its failing program does not matter.
        assert_eq!(
            parts.iter().map(|p| p.part).collect::<Vec<_>>(),
            vec![Part::Rules, Part::Breakers]
        );
        assert!(parts[0].runnable && parts[0].degraded.len() == 1, "{:?}", parts[0]);
        assert!(!parts[1].runnable);
        assert!(
            parts[1].missing[0].contains("Linux 5.18+")
                && parts[1].missing[0].contains("6.1.0-54-amd64"),
            "{:?}",
            parts[1]
        );
        let report = Report {
            kernel: f.release.clone(),
            features: feature_rows(&f),
            xdp_program: "flowctl_xdp",
            programs: progs,
            profile: Some(ProfileReport { path: "p.toml".into(), parts }),
            ok: false,
        };
        let text = render_text(&report);
        assert!(text.starts_with("kernel 6.1.0-54-amd64\n"), "{text}");
        assert!(
            text.contains("flowctl_xdp") && text.contains("verifies, 1234 instructions processed"),
            "{text}"
        );
        assert!(
            text.contains("DOES NOT VERIFY") && text.contains("processed 1000001 insns"),
            "{text}"
        );
        assert!(
            text.contains("CANNOT RUN on this kernel") && text.contains("bpf_set_retval"),
            "{text}"
        );
        assert!(text.contains("degraded: no multi-buffer XDP"), "{text}");
        assert!(text.trim_end().ends_with("NOT OK: see above"), "{text}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["programs"][0]["verified_insns"], 1234);
        assert_eq!(json["features"][0]["feature"], "xdp_link");
        assert_eq!(json["profile"]["parts"][1]["part"], "breakers");
    }
}
