//! Loading the embedded XDP object: its maps pinned under the attachment
//! (adopted when pinned already) with the profile's table sizes, and the
//! one XDP entry point this kernel runs (`XdpVariant`).

use super::{object::xdp_object, pins::AttachId};
use crate::profile::Settings;
use anyhow::{anyhow, bail, Context, Result};
use aya::{
    programs::{ProgramError, Xdp},
    Ebpf, EbpfLoader,
};
use flowctl_common::{
    globals, map_names as names, XDP_PROGRAM, XDP_PROGRAM_FRAGS, XDP_PROGRAM_MULTIPROG,
};
use std::fs;

/// Which of the object's two XDP entry points to load. They are the same
/// program; `Frags` is built into section `xdp.frags`, so aya loads it with
/// BPF_F_XDP_HAS_FRAGS (multi-buffer: jumbo frames reach it, and it parses
/// what is in the first buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpVariant {
    Frags,
    Single,
    /// The extension of a libxdp dispatcher's slot (`multiprog::join`
    /// loads it, once the dispatcher it extends exists).
    Multiprog,
}

impl XdpVariant {
    pub fn program(self) -> &'static str {
        match self {
            XdpVariant::Frags => XDP_PROGRAM_FRAGS,
            XdpVariant::Single => XDP_PROGRAM,
            XdpVariant::Multiprog => XDP_PROGRAM_MULTIPROG,
        }
    }

    /// What `load` chooses: multi-buffer wherever the kernel has it (5.18+).
    /// The choice depends only on the running kernel, so an agent that
    /// adopts a pinned link (pins do not outlive a reboot) always re-points
    /// it at the same variant: the kernel refuses to replace a frags program
    /// with a single-buffer one on an interface whose MTU needs frags.
    pub fn for_kernel() -> Self {
        if crate::kernel::features::get().has(crate::kernel::features::Feature::XdpFrags) {
            XdpVariant::Frags
        } else {
            XdpVariant::Single
        }
    }
}

/// The XDP program `load` loaded into `ebpf` (only the chosen one is loaded,
/// so the one with a file descriptor is it): attach, adoption and the test
/// harness all ask here.
pub fn loaded_xdp(ebpf: &Ebpf) -> Result<&'static str> {
    for v in [XdpVariant::Frags, XdpVariant::Single] {
        if let Some(p) = ebpf.program(v.program()) {
            let x: &Xdp = p.try_into()?;
            if x.fd().is_ok() {
                return Ok(v.program());
            }
        }
    }
    bail!("no XDP program of the object is loaded")
}

/// Loads the XDP object with its maps pinned under `id`'s pin dir (adopting
/// maps already pinned there) and the table sizes of `settings`; the XDP
/// program is the variant this kernel supports (`XdpVariant::for_kernel`).
pub fn load(id: &AttachId, settings: &Settings) -> Result<Ebpf> {
    load_variant(id, settings, XdpVariant::for_kernel())
}

/// `load` with the XDP variant chosen by the caller (the benchmark tail-calls
/// into the program from a single-buffer one, and the kernel refuses tail
/// calls between frags and single-buffer programs).
pub fn load_variant(id: &AttachId, settings: &Settings, variant: XdpVariant) -> Result<Ebpf> {
    let dir = id.pin_dir();
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let stats_records = settings.stats.records();
    // aya-log's load-time level: 0 prunes every kernel event.
    let kernel_log_level: u8 = if settings.kernel_events { aya_log::Level::Debug as u8 } else { 0 };
    let fast_parse = settings.fast_parse as u8;
    // A BTF-defined map carries no pinning attribute here: pinned by name.
    let rule_tables = dir.join(names::RULE_TABLES);
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(&dir)
        .map_pin_path(names::RULE_TABLES, rule_tables.as_path())
        .map_max_entries(names::SRC_CACHE, settings.source_cache_entries)
        .map_max_entries(names::KEYS, settings.key_table_entries)
        .map_max_entries(names::QUOTAS, settings.quota_table_entries)
        .map_max_entries(names::CONNS, settings.connection_table_entries)
        .map_max_entries(names::GLOBAL_KEYS, settings.global_key_entries)
        .map_max_entries(names::STATS, settings.stats.records() * settings.stats.buckets)
        .override_global(globals::STATS_LEVEL, &settings.stats.level, true)
        .override_global(globals::STATS_BUCKET_NS, &settings.stats.bucket_ns, true)
        .override_global(globals::STATS_BUCKETS, &settings.stats.buckets, true)
        .override_global(globals::STATS_RECORDS, &stats_records, true)
        .override_global(aya_log::LEVEL, &kernel_log_level, true)
        .override_global(globals::FAST_PARSE, &fast_parse, true)
        .load(xdp_object())
        .map_err(|e| anyhow!("loading the XDP object: {e} (is this process root or does it hold CAP_BPF and CAP_NET_ADMIN?)"))?;
    if variant == XdpVariant::Multiprog {
        return Ok(ebpf);
    }
    let prog: &mut Xdp =
        ebpf.program_mut(variant.program()).context("program missing from object")?.try_into()?;
    if let Err(e) = prog.load() {
        return Err(load_error(e));
    }
    Ok(ebpf)
}

/// Turns a program load failure into a message with the verifier log's tail.
pub fn load_error(e: ProgramError) -> anyhow::Error {
    match e {
        ProgramError::LoadError { io_error, verifier_log } => {
            let log = verifier_log.to_string();
            let tail: Vec<&str> =
                log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
            anyhow!(
                "the kernel verifier rejected the XDP program ({io_error}); last lines of its log:\n{}",
                tail.join("\n")
            )
        }
        other => anyhow!("loading the XDP program: {other}"),
    }
}
