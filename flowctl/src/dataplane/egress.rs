//! KLimiter's TC egress counter: its targets (`FLOWCTL_EGRESS_TARGETS`)
//! and its attachments, a TCX link per interface or, without TCX, a
//! netlink filter on a `clsact` qdisc that is recorded and cleaned up.

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
}

struct EgressAttach {
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
    iface: String,
    ifindex: u32,
    priority: u16,
    handle: u32,
    created_clsact: bool,
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
        Self { attached: Vec::new(), record: Some(record) }
    }

    /// The interfaces the counter is attached to.
    pub fn ifaces(&self) -> Vec<&str> {
        self.attached.iter().map(|a| a.iface.as_str()).collect()
    }

    fn save(&self) {
        let Some(path) = &self.record else { return };
        let recs: Vec<NetlinkRecord> = self
            .attached
            .iter()
            .filter_map(|a| {
                a.netlink.map(|(priority, handle)| NetlinkRecord {
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
        for mut a in self.attached.drain(..) {
            drop(a.link.take());
            if a.created_clsact {
                remove_clsact_if_unused(&a.iface, a.ifindex);
            }
        }
        self.save();
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
    let prog: &mut aya::programs::SchedClassifier = ebpf
        .program_mut(flowctl_common::EGRESS_PROGRAM)
        .context("egress program missing from the object")?
        .try_into()?;
    if prog.fd().is_err() {
        prog.load().map_err(load_error)?;
    }
    let tcx = crate::kernel::features::get().has(crate::kernel::features::Feature::Tcx);
    for i in ifaces {
        if have.contains(&i) {
            continue;
        }
        let a = attach_egress(prog, &i, tcx)?;
        egress.attached.push(a);
        egress.save();
    }
    Ok(())
}

/// Attaches the egress counter to `iface`: a TCX link where the kernel has
/// TCX, else a netlink filter on the `clsact` qdisc (added when absent).
fn attach_egress(
    prog: &mut aya::programs::SchedClassifier,
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
            Err(e) => bail!("adding a clsact qdisc to {iface} for the egress counter (no TCX on this kernel): {e} {hint}"),
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
            bail!("attaching the egress counter to {iface} ({how}): {e} {hint}")
        }
    }
}
