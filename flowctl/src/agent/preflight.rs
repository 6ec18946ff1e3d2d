//! Every check a profile passes before anything is touched, in one place.
//!
//! `profile::load` has validated the file by itself (syntax, values, and what
//! one section says about another) and rejects it whole with file:line. What
//! is checked here is the profile against what is to run it: the privileges
//! of this process, this kernel's features, the host's cgroups and CPU
//! source, and the data plane already attached (its pinned layout and table
//! sizes, and the statistics shape the program was loaded with). `attach`,
//! the agent's `apply` and an agent-less `apply` all come through here, so a
//! profile that passes one passes all three, and one that fails changes
//! nothing.

use crate::{
    agent::breakers::{self, BreakerAgent, CgroupPoint},
    controllers::cpu::CpuSignal,
    dataplane::{self, pins::AttachId, state::AttachState},
    profile::{self, RuleSet},
};
use anyhow::{anyhow, bail, Context, Result};
use flowctl_common::{map_names, LAYOUT_VERSION};
use std::path::Path;

/// Root, or the capabilities the kernel will ask for. The kernel checks them
/// anyway; this catches the common case early, with the fix.
pub fn require_root() -> Result<()> {
    let mut caps = String::new();
    if let Ok(s) = std::fs::read_to_string("/proc/self/status") {
        caps = s.lines().find(|l| l.starts_with("CapEff:")).unwrap_or("").to_string();
    }
    let eff = u64::from_str_radix(caps.trim_start_matches("CapEff:").trim(), 16).unwrap_or(0);
    const CAP_NET_ADMIN: u64 = 1 << 12;
    const CAP_SYS_ADMIN: u64 = 1 << 21;
    const CAP_BPF: u64 = 1 << 39;
    if eff & CAP_NET_ADMIN == 0 || eff & (CAP_BPF | CAP_SYS_ADMIN) == 0 {
        bail!("flowctl needs root, or the capabilities CAP_BPF (or CAP_SYS_ADMIN) and CAP_NET_ADMIN: run it with sudo");
    }
    Ok(())
}

/// Rejects a profile whose parts need a kernel feature this kernel lacks
/// (`kernel::features::REQUIREMENTS`), naming the feature and the release
/// that has it.
pub fn kernel(set: &RuleSet, path: &Path) -> Result<()> {
    crate::kernel::features::check_profile(set).map_err(|e| anyhow!("{}: {e:#}", path.display()))
}

/// What `attach IFACE` starts from, once every check has passed.
pub struct Interface {
    pub set: RuleSet,
    /// Where the profile's breakers attach (`None`: it has none).
    pub breakers: Option<CgroupPoint>,
    pub cpu: CpuSignal,
}

/// `attach IFACE --profile F [--cgroup PATH]`.
pub fn interface(profile: &Path, iface: &str, cgroup: Option<&Path>) -> Result<Interface> {
    let set = profile::load(profile)?;
    if set.rules.is_empty() && set.shapers.is_empty() {
        bail!(
            "{}: the profile has no [[rule]] and no [[shaper]] for {iface}; for breakers only: `flowctl attach --cgroup PATH --profile {}` (no interface)",
            profile.display(),
            profile.display()
        );
    }
    require_root()?;
    kernel(&set, profile)?;
    let breakers = if !set.breakers.is_empty() {
        let point = CgroupPoint::resolve(cgroup)?;
        breakers::check(&point, &set, profile)?;
        Some(point)
    } else if cgroup.is_some() {
        bail!("{}: --cgroup given, but the profile has no [[breaker]]", profile.display());
    } else {
        None
    };
    let cpu = CpuSignal::new(set.settings.cpu_source.clone())
        .with_context(|| format!("{}: the cpu source", profile.display()))?;
    Ok(Interface { set, breakers, cpu })
}

/// `attach --cgroup PATH --profile F`: breakers only, no interface.
pub fn cgroup(
    profile: &Path,
    cgroup: Option<&Path>,
    netns: Option<&str>,
) -> Result<(RuleSet, CgroupPoint)> {
    let set = cgroup_profile(profile)?;
    if netns.is_some() {
        bail!("--netns names the namespace of an interface; breakers attach to a cgroup and see connects from every namespace");
    }
    require_root()?;
    kernel(&set, profile)?;
    let point = CgroupPoint::resolve(cgroup)?;
    breakers::check(&point, &set, profile)?;
    Ok((set, point))
}

/// A profile for a breakers-only agent: breakers and no rules.
fn cgroup_profile(profile: &Path) -> Result<RuleSet> {
    let set = profile::load(profile)?;
    if !set.rules.is_empty() {
        bail!(
            "{}: the profile has {} [[rule]]s, which need an interface: `flowctl attach IFACE --profile {}` (add --cgroup PATH for where its breakers attach)",
            profile.display(),
            set.rules.len(),
            profile.display()
        );
    }
    if set.breakers.is_empty() {
        bail!("{}: the profile has no [[breaker]]", profile.display());
    }
    Ok(set)
}

/// The pins of an attachment about to be adopted: the layout this flowctl
/// reads, and tables of the sizes the profile asks for (a pinned map's size
/// is fixed; changing it means starting over with `--replace`).
pub fn pins(id: &AttachId, set: &RuleSet, iface: &str) -> Result<()> {
    // An older layout's is taken over before this (an upgrade); a newer
    // one's is a downgrade, done only when asked.
    if let Some((v, dir)) = dataplane::pins::other_layout_dirs(id).pop() {
        bail!(
            "{iface} is held by the kept data plane of a newer flowctl (layout v{v}, pins at {}); this flowctl (layout v{LAYOUT_VERSION}) cannot adopt its buckets. `flowctl attach {iface} --replace --profile ...` takes it over without a gap (its program enforces until this one replaces it on the same XDP link), starting with fresh buckets, counters and statistics; or go on with the newer flowctl",
            dir.display()
        );
    }
    if !id.pin_dir().exists() {
        return Ok(());
    }
    match dataplane::pinned_layout(id) {
        Some(v) if v == LAYOUT_VERSION || v == 0 => {}
        other => bail!(
            "pins at {} have layout version {:?}, not {LAYOUT_VERSION}; refusing to adopt them. Re-run with --replace to start over (this resets all bucket state)",
            id.pin_dir().display(),
            other
        ),
    }
    let s = &set.settings;
    for (name, want) in [
        (map_names::KEYS, s.key_table_entries),
        (map_names::SRC_CACHE, s.source_cache_entries),
        (map_names::QUOTAS, s.quota_table_entries),
        (map_names::CONNS, s.connection_table_entries),
    ] {
        if let Some(have) = dataplane::pinned_max_entries(id, name) {
            if have != want {
                bail!("the pinned {name} has {have} entries but the profile asks for {want}; table sizes can only change with --replace (which resets bucket state)");
            }
        }
    }
    Ok(())
}

/// A profile applied to a running data plane: the table sizes and the
/// statistics shape are fixed when the program loads.
pub fn attachment(state: &AttachState, set: &RuleSet) -> Result<()> {
    let s = &set.settings;
    if (
        s.key_table_entries,
        s.source_cache_entries,
        s.quota_table_entries,
        s.connection_table_entries,
    ) != (
        state.key_table_entries,
        state.source_cache_entries,
        state.quota_table_entries,
        state.connection_table_entries,
    ) {
        bail!("table sizes differ from the attached data plane's; they can only change by re-attaching with --replace (nothing was applied)");
    }
    if s.stats != state.stats {
        bail!(
            "the statistics settings ({} level, {} x {} ms, max_rules {}) differ from the attached data plane's ({} level, {} x {} ms, max_rules {}); they are fixed when the program loads and change only by re-attaching with --replace (nothing was applied)",
            s.stats.level_name(),
            s.stats.buckets,
            s.stats.bucket_ns / 1_000_000,
            s.stats.max_rules,
            state.stats.level_name(),
            state.stats.buckets,
            state.stats.bucket_ns / 1_000_000,
            state.stats.max_rules
        );
    }
    Ok(())
}

/// `apply IFACE F` with no agent running: the data plane was kept, and only
/// its rules can change (breakers live with an agent).
pub fn agentless_apply(set: &RuleSet, path: &Path, iface: &str) -> Result<()> {
    if !set.breakers.is_empty() {
        bail!("{}: the profile has breakers, which live with an agent, and no agent is running for {iface} (nothing was applied); start one with `flowctl attach {iface} --profile {}`", path.display(), path.display());
    }
    Ok(())
}

/// The breakers' part of an apply to an interface agent: what to do once
/// the rules are applied.
pub enum BreakerChange {
    None,
    Stop,
    Apply,
    Start(CgroupPoint),
}

/// What an apply to a running interface agent will do, once every check has
/// passed.
pub struct Apply {
    pub set: RuleSet,
    /// A new CPU source, already opened (`None`: unchanged).
    pub cpu: Option<CpuSignal>,
    pub breakers: BreakerChange,
}

/// The agent's `apply`: every check, before the first write. Errors end in
/// "(nothing was applied)" where the caller's message does not say so.
pub fn interface_apply(
    path: &Path,
    state: &AttachState,
    cpu: &CpuSignal,
    running: Option<&BreakerAgent>,
    cgroup: Option<&Path>,
) -> Result<Apply> {
    let set = profile::load(path)?;
    kernel(&set, path)?;
    let new_cpu = if &set.settings.cpu_source != cpu.source() {
        let c = CpuSignal::new(set.settings.cpu_source.clone()).map_err(|e| {
            anyhow!("{}: the cpu source: {e:#} (nothing was applied)", path.display())
        })?;
        Some(c)
    } else {
        None
    };
    if set.rules.is_empty() && set.shapers.is_empty() {
        bail!(
            "{}: the profile has no [[rule]] and no [[shaper]] for this interface (nothing was applied)",
            path.display()
        );
    }
    attachment(state, &set)?;
    let nothing = |e: anyhow::Error| anyhow!("{e:#} (nothing was applied)");
    let breakers = match (running, set.breakers.is_empty()) {
        (None, true) => BreakerChange::None,
        (Some(_), true) => BreakerChange::Stop,
        (Some(b), false) => {
            breakers::check(&b.point, &set, path).map_err(nothing)?;
            BreakerChange::Apply
        }
        (None, false) => {
            let point = CgroupPoint::resolve(cgroup).map_err(nothing)?;
            breakers::check(&point, &set, path).map_err(nothing)?;
            BreakerChange::Start(point)
        }
    };
    Ok(Apply { set, cpu: new_cpu, breakers })
}

/// The `apply` of a breakers-only agent (`BreakerAgent::apply` then checks
/// the breakers' cgroups before it writes).
pub fn cgroup_apply(path: &Path) -> Result<RuleSet> {
    let set = profile::load(path)?;
    kernel(&set, path)?;
    if !set.rules.is_empty() {
        bail!(
            "{}: the profile has [[rule]]s, but this agent has no interface (nothing was applied)",
            path.display()
        );
    }
    if set.breakers.is_empty() {
        bail!("{}: the profile has no [[breaker]]; stop the agent to detach the breakers (nothing was applied)", path.display());
    }
    Ok(set)
}
