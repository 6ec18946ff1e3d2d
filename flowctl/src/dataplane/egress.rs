//! The TC egress programs' attachments: KLimiter's counter, its targets
//! (`FLOWCTL_EGRESS_TARGETS`) on the interfaces they name, and the
//! shaper of `[[shaper]]` tables (`FLOWCTL_SHAPERS`) on the attachment's
//! own interface with the `fq` root qdisc it needs. Each is a TCX link
//! or, without TCX, a netlink filter on a `clsact` qdisc that is recorded
//! and cleaned up; an `fq` flowctl installed is recorded and removed the
//! same way.

use super::{load::load_error, maps::Maps, pins::AttachId};
use crate::profile::RuleSet;
use anyhow::{bail, Context, Result};
use aya::Ebpf;
use std::fs;

/// The TC egress counter's attachments, one per interface. With TCX (6.6+)
/// each is a bpf_link owned here, gone with the process. Without TCX, a
/// netlink `cls_bpf` filter on the interface's `clsact` qdisc, which flowctl
/// adds when absent. Dropping this detaches every filter and then removes
/// each qdisc flowctl added, unless filters of someone else are on it
/// still: nothing is left behind, and a `clsact` that was there before is
/// left alone. A netlink filter outlives a SIGKILLed agent, so each is
/// recorded (priority and handle) in the attachment's run directory, and
/// the next agent of the attachment removes exactly those first.
#[derive(Default)]
pub struct Egress {
    attached: Vec<EgressAttach>,
    /// Where the netlink filters are recorded (None: not recorded).
    record: Option<std::path::PathBuf>,
    /// The `fq` root qdisc flowctl installed for the shaper, recorded
    /// beside the filters (`shaper-fq.json`).
    fq: Option<FqRecord>,
}

/// An `fq` root qdisc flowctl installed for the shaper: removed when the
/// shaper goes, by this agent or, after a kill, the next one or `detach`.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct FqRecord {
    iface: String,
    ifindex: u32,
}

struct EgressAttach {
    /// `EGRESS_PROGRAM` or `SHAPER_PROGRAM`.
    program: &'static str,
    iface: String,
    ifindex: u32,
    link: Option<aya::programs::tc::SchedClassifierLink>,
    /// A netlink filter's priority and handle (None: a TCX link).
    netlink: Option<(u16, u32)>,
    created_clsact: bool,
}

/// A netlink filter as recorded for the next agent.
#[derive(serde::Serialize, serde::Deserialize)]
struct NetlinkRecord {
    #[serde(default = "counter_program")]
    program: String,
    iface: String,
    ifindex: u32,
    priority: u16,
    handle: u32,
    created_clsact: bool,
}

fn counter_program() -> String {
    flowctl_common::EGRESS_PROGRAM.to_string()
}

impl Egress {
    /// The egress attachments of the agent of `id`, after removing the
    /// netlink filters (and qdiscs) a killed predecessor left (the caller
    /// holds the attachment's agent lock, so that agent is gone).
    pub fn for_attachment(id: &AttachId) -> Self {
        let record = id.run_dir().join("egress-netlink.json");
        if let Ok(text) = fs::read_to_string(&record) {
            let stale: Vec<NetlinkRecord> = serde_json::from_str(&text).unwrap_or_default();
            for r in stale {
                if crate::system::netns::ifindex(&r.iface).ok() != Some(r.ifindex) {
                    continue; // the interface is gone, and its filters with it
                }
                tracing::info!("removing the egress filter a previous agent left on {}", r.iface);
                if let Ok(link) = aya::programs::tc::SchedClassifierLink::attached(
                    &r.iface,
                    aya::programs::TcAttachType::Egress,
                    r.priority,
                    aya::programs::tc::TcHandle::from(r.handle),
                    None,
                ) {
                    drop(link); // detaches
                }
                if r.created_clsact {
                    remove_clsact_if_unused(&r.iface, r.ifindex);
                }
            }
            let _ = fs::remove_file(&record);
        }
        let fq_record = id.run_dir().join("shaper-fq.json");
        if let Ok(text) = fs::read_to_string(&fq_record) {
            if let Ok(r) = serde_json::from_str::<FqRecord>(&text) {
                if crate::system::netns::ifindex(&r.iface).ok() == Some(r.ifindex) {
                    tracing::info!(
                        "removing the fq qdisc a previous agent installed on {}",
                        r.iface
                    );
                    remove_fq(&r);
                }
            }
            let _ = fs::remove_file(&fq_record);
        }
        Self { attached: Vec::new(), record: Some(record), fq: None }
    }

    /// The interfaces the counter is attached to.
    pub fn ifaces(&self) -> Vec<&str> {
        self.attached
            .iter()
            .filter(|a| a.program == flowctl_common::EGRESS_PROGRAM)
            .map(|a| a.iface.as_str())
            .collect()
    }

    /// Whether the shaper is attached (to the attachment's interface).
    pub fn shaping(&self) -> bool {
        self.attached.iter().any(|a| a.program == flowctl_common::SHAPER_PROGRAM)
    }

    fn fq_record_path(&self) -> Option<std::path::PathBuf> {
        self.record.as_ref().map(|r| r.with_file_name("shaper-fq.json"))
    }

    fn save_fq(&self) {
        let Some(path) = self.fq_record_path() else { return };
        match &self.fq {
            None => {
                let _ = fs::remove_file(&path);
            }
            Some(r) => {
                if let Err(e) = serde_json::to_string(r)
                    .map_err(anyhow::Error::from)
                    .and_then(|t| Ok(fs::write(&path, t)?))
                {
                    tracing::warn!("recording the fq qdisc at {}: {e}", path.display());
                }
            }
        }
    }

    /// Detaches the shaper and removes the fq it installed.
    fn stop_shaping(&mut self) {
        let (shaper, rest): (Vec<_>, Vec<_>) =
            self.attached.drain(..).partition(|a| a.program == flowctl_common::SHAPER_PROGRAM);
        self.attached = rest;
        for a in shaper {
            a.release();
        }
        if let Some(r) = self.fq.take() {
            remove_fq(&r);
        }
        self.save();
        self.save_fq();
    }

    fn save(&self) {
        let Some(path) = &self.record else { return };
        let recs: Vec<NetlinkRecord> = self
            .attached
            .iter()
            .filter_map(|a| {
                a.netlink.map(|(priority, handle)| NetlinkRecord {
                    program: a.program.to_string(),
                    iface: a.iface.clone(),
                    ifindex: a.ifindex,
                    priority,
                    handle,
                    created_clsact: a.created_clsact,
                })
            })
            .collect();
        if recs.is_empty() {
            let _ = fs::remove_file(path);
        } else if let Ok(text) = serde_json::to_string(&recs) {
            if let Err(e) = fs::write(path, text) {
                tracing::warn!("recording the egress filters at {}: {e}", path.display());
            }
        }
    }

    /// Detaches everything now (what dropping does).
    pub fn release(&mut self) {
        for a in self.attached.drain(..) {
            a.release();
        }
        if let Some(r) = self.fq.take() {
            remove_fq(&r);
        }
        self.save();
        self.save_fq();
    }
}

impl EgressAttach {
    fn release(mut self) {
        drop(self.link.take());
        if self.created_clsact {
            remove_clsact_if_unused(&self.iface, self.ifindex);
        }
    }
}

/// Removes the fq root qdisc flowctl installed, if it is still the root
/// (an operator may have replaced it since: theirs stays).
fn remove_fq(r: &FqRecord) {
    match crate::kernel::tc::root_qdisc(r.ifindex) {
        Ok(Some(q)) if q.kind == "fq" => {
            if let Err(e) = crate::kernel::tc::del_root_qdisc(r.ifindex) {
                tracing::warn!("removing the fq qdisc flowctl installed on {}: {e}", r.iface);
            }
        }
        Ok(_) => tracing::info!("the root qdisc of {} is no longer flowctl's fq: left", r.iface),
        Err(e) => tracing::warn!("reading the root qdisc of {}: {e}; left", r.iface),
    }
}

/// Removes the `clsact` qdisc flowctl added to `iface` unless filters (of
/// another agent, or anyone) are still on it.
fn remove_clsact_if_unused(iface: &str, ifindex: u32) {
    match crate::kernel::tc::clsact_filters(ifindex) {
        Ok(0) => {
            if let Err(e) = crate::kernel::tc::del_clsact(ifindex) {
                tracing::warn!("removing the clsact qdisc flowctl added to {iface}: {e}");
            }
        }
        Ok(n) => tracing::info!("leaving the clsact qdisc on {iface}: {n} other filters use it"),
        Err(e) => tracing::warn!("listing the filters on {iface}: {e}; leaving its clsact qdisc"),
    }
}

impl Drop for Egress {
    fn drop(&mut self) {
        self.release();
    }
}

/// Writes KLimiter's egress targets (slot order = the profile's egress
/// baselines) and attaches the TC egress counter to each interface they
/// name that it is not on yet. The attachments live as long as `egress`
/// (the agent); without an agent nothing needs the counts.
pub fn set_egress(
    ebpf: &mut Ebpf,
    maps: &mut Maps,
    set: &RuleSet,
    egress: &mut Egress,
) -> Result<()> {
    use crate::profile::klimiter::LevelSource;
    let mut slot = 0u32;
    let mut ifaces = Vec::new();
    for b in &set.baselines {
        if let LevelSource::Egress { iface, target, .. } = &b.source {
            maps.egress_targets.set(slot, *target, 0)?;
            slot += 1;
            if !ifaces.contains(iface) {
                ifaces.push(iface.clone());
            }
        }
    }
    for s in slot..flowctl_common::MAX_EGRESS_TARGETS as u32 {
        maps.egress_targets.set(s, flowctl_common::EgressTarget::default(), 0)?;
    }
    let have = egress.ifaces().iter().map(|s| s.to_string()).collect::<Vec<_>>();
    if ifaces.iter().all(|i| have.contains(i)) {
        return Ok(());
    }
    let prog = loaded_classifier(ebpf, flowctl_common::EGRESS_PROGRAM)?;
    let tcx = crate::kernel::features::get().has(crate::kernel::features::Feature::Tcx);
    for i in ifaces {
        if have.contains(&i) {
            continue;
        }
        let a = attach_egress(prog, flowctl_common::EGRESS_PROGRAM, &i, tcx)?;
        egress.attached.push(a);
        egress.save();
    }
    Ok(())
}

/// The object's TC program `name`, loaded on first use.
fn loaded_classifier<'a>(
    ebpf: &'a mut Ebpf,
    name: &str,
) -> Result<&'a mut aya::programs::SchedClassifier> {
    let prog: &mut aya::programs::SchedClassifier = ebpf
        .program_mut(name)
        .with_context(|| format!("{name} missing from the object"))?
        .try_into()?;
    if prog.fd().is_err() {
        prog.load().map_err(load_error)?;
    }
    Ok(prog)
}

/// Attaches the egress counter to `iface`: a TCX link where the kernel has
/// TCX, else a netlink filter on the `clsact` qdisc (added when absent).
fn attach_egress(
    prog: &mut aya::programs::SchedClassifier,
    program: &'static str,
    iface: &str,
    tcx: bool,
) -> Result<EgressAttach> {
    use aya::programs::{
        tc::{self, NlOptions, TcAttachOptions},
        LinkOrder, TcAttachType,
    };
    let hint = "(does the interface exist in this network namespace?)";
    let ifindex = crate::system::netns::ifindex(iface)?;
    let mut created_clsact = false;
    let options = if tcx {
        TcAttachOptions::TcxOrder(LinkOrder::default())
    } else {
        match tc::qdisc_add_clsact(iface) {
            Ok(()) => created_clsact = true,
            Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => bail!("adding a clsact qdisc to {iface} for {program} (no TCX on this kernel): {e} {hint}"),
        }
        TcAttachOptions::Netlink(NlOptions::default())
    };
    let attached = prog
        .attach_with_options(iface, TcAttachType::Egress, options)
        .and_then(|id| prog.take_link(id));
    match attached {
        Ok(link) => {
            let netlink =
                if tcx { None } else { Some((link.priority()?, u32::from(link.handle()?))) };
            Ok(EgressAttach {
                program,
                iface: iface.to_string(),
                ifindex,
                link: Some(link),
                netlink,
                created_clsact,
            })
        }
        Err(e) => {
            if created_clsact {
                let _ = crate::kernel::tc::del_clsact(ifindex);
            }
            let how = if tcx { "TCX link" } else { "netlink filter on clsact" };
            bail!("attaching {program} to {iface} ({how}): {e} {hint}")
        }
    }
}

/// Writes `[[shaper]]` tables into `FLOWCTL_SHAPERS` in profile order and
/// clears the slots after them (the program stops at the first clear one).
/// Entry by entry: a packet sent meanwhile may meet the old and the new
/// tables mixed, for that one packet.
pub fn write_shapers(maps: &mut Maps, shapers: &[crate::profile::shaper::Shaper]) -> Result<()> {
    use flowctl_common::shaper::{ShaperConfig, MAX_SHAPERS};
    for (i, s) in shapers.iter().enumerate() {
        maps.shapers.set(i as u32, s.config, 0)?;
    }
    for i in shapers.len()..MAX_SHAPERS {
        maps.shapers.set(i as u32, ShaperConfig::default(), 0)?;
    }
    Ok(())
}

/// Writes the profile's `[[shaper]]` tables (`write_shapers`) and, when
/// there are any, attaches the shaper to
/// `iface`'s egress with an `fq` root qdisc: fq already at the root is
/// used as it is; a default root qdisc (`noqueue`, `pfifo_fast`, `mq`,
/// the kernel's own) is replaced, and comes back when the shaper goes; a
/// root qdisc an operator configured (`htb`, `tbf`, ...) is refused, as is
/// a kernel without fq. No shapers: the shaper and its fq go. The
/// attachment lives as long as `egress` (the agent).
pub fn set_shapers(
    ebpf: &mut Ebpf,
    maps: &mut Maps,
    set: &RuleSet,
    egress: &mut Egress,
    iface: &str,
) -> Result<()> {
    write_shapers(maps, &set.shapers)?;
    if set.shapers.is_empty() {
        if egress.shaping() || egress.fq.is_some() {
            egress.stop_shaping();
        }
        return Ok(());
    }
    let ifindex = crate::system::netns::ifindex(iface)?;
    let horizon_ns = set.shapers.iter().map(|s| s.config.horizon_ns).max().unwrap_or(0);
    // fq's own horizon past the shaper's: the shaper drops first, and
    // counts what it drops.
    let fq_horizon_us = ((horizon_ns + 1_000_000_000) / 1000).min(u32::MAX as u64) as u32;
    if egress.shaping() {
        // A new profile's horizons: flowctl's fq follows them (changed in
        // place, its queue kept); an fq someone else installed is theirs.
        if egress.fq.is_some() {
            crate::kernel::tc::add_root_fq(ifindex, fq_horizon_us, 10_000).with_context(|| {
                format!("changing the fq qdisc on {iface} for the new horizons")
            })?;
        }
        return Ok(());
    }
    let root = crate::kernel::tc::root_qdisc(ifindex)
        .with_context(|| format!("reading the root qdisc of {iface}"))?;
    match root {
        Some(q) if q.kind == "fq" => {
            tracing::info!("{iface} has an fq root qdisc already: the shaper uses it as it is");
        }
        Some(q) if !q.is_default() => bail!(
            "{iface} has a root qdisc `{}` (handle {:x}:) that someone configured; the [[shaper]] tables need fq at the root and flowctl does not replace another's qdisc: remove it (`tc qdisc del dev {iface} root`) or drop the shapers",
            q.kind,
            q.handle >> 16
        ),
        _ => match crate::kernel::tc::add_root_fq(ifindex, fq_horizon_us, 10_000) {
            Ok(()) => {
                egress.fq = Some(FqRecord { iface: iface.to_string(), ifindex });
                egress.save_fq();
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => bail!(
                "the [[shaper]] tables need the fq qdisc on {iface} to hold packets until their departure time, and this kernel has none (sch_fq, CONFIG_NET_SCH_FQ): load it with `modprobe sch_fq`, or run a kernel that has it (Debian's 6.1 and 6.12 build it as a module)"
            ),
            Err(e) => bail!("installing the fq qdisc on {iface} for the [[shaper]] tables: {e}"),
        },
    }
    let prog = loaded_classifier(ebpf, flowctl_common::SHAPER_PROGRAM)?;
    let tcx = crate::kernel::features::get().has(crate::kernel::features::Feature::Tcx);
    match attach_egress(prog, flowctl_common::SHAPER_PROGRAM, iface, tcx) {
        Ok(a) => {
            egress.attached.push(a);
            egress.save();
            Ok(())
        }
        Err(e) => {
            egress.stop_shaping();
            Err(e)
        }
    }
}
