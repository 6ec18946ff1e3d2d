//! flowctl as one component of a libxdp dispatcher (`attach --multiprog`),
//! so it shares an interface with xdp-filter, xdp-loader's programs and
//! anything else libxdp loads (docs/coexistence.md).
//!
//! libxdp runs several XDP programs on one interface through a dispatcher:
//! an XDP program whose slot functions (`prog0` .. `prog9`) each components
//! replaces as an extension (`freplace`), called in order of run priority,
//! each verdict either ending the chain or going on to the next component
//! (its chain-call actions). This distribution's libxdp (1.3, on libbpf
//! 1.1) cannot load aya's objects, so flowctl does what libxdp does, with
//! libxdp's own dispatcher object, following its protocol
//! (xdp-tools, lib/libxdp/protocol.org): under the lock on the bpffs
//! directory `xdp`, build a new dispatcher holding every component (the
//! ones there, by their pins, and flowctl's), pin each component's
//! program and link in `xdp/dispatch-IFINDEX-DISPATCHERID/`, swap the
//! interface's program only if it is still the old dispatcher, then remove
//! the old dispatcher's pins. Every swap is one atomic replace: packets
//! meet the old chain or the new one, never none, and flowctl's own
//! component is replaced the same way when an agent restarts.

use super::pins::AttachId;
use crate::kernel::xdp::{self as netlink, XdpMode};
use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Array, Map, MapData},
    programs::{links::FdLink, Extension, ProgramFd, Xdp},
    Ebpf, EbpfLoader,
};
use flowctl_common::XDP_PROGRAM_MULTIPROG;
use std::{
    fs,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
};

/// libxdp's directory on bpffs: its lock and the dispatchers' pins.
const LIBXDP_DIR: &str = "/sys/fs/bpf/xdp";
/// The dispatcher's slots (`MAX_DISPATCHER_ACTIONS`).
pub const MAX_COMPONENTS: usize = 10;
/// The config's magic and the dispatcher version this code writes and reads
/// (xdp-tools headers/xdp/prog_dispatcher.h: `XDP_DISPATCHER_MAGIC`,
/// `XDP_DISPATCHER_VERSION` 2 since libxdp 1.3).
const DISPATCHER_MAGIC: u8 = 236;
const DISPATCHER_VERSION: u8 = 2;
/// The dispatcher program's name in its object and in the kernel.
const DISPATCHER_PROGRAM: &str = "xdp_dispatcher";
/// libxdp's default run priority (`XDP_DEFAULT_RUN_PRIO`); lower runs first.
pub const DEFAULT_RUN_PRIO: u32 = 50;
/// Chain on `XDP_PASS` only: a packet flowctl passes goes on to the next
/// component; one it drops (or answers with a RST) does not. Bit 31 is
/// the verdict of an empty slot (`XDP_DISPATCHER_RETVAL`), which libxdp
/// always chains on.
const CHAIN_ON_PASS: u32 = 1 << 2 | 1 << 31;
/// The pin, in flowctl's own pin directory, of flowctl's component program:
/// how a later agent or `detach` knows which slot is flowctl's.
pub const COMPONENT_PIN: &str = "multiprog";

/// The dispatcher's read-only config (`struct xdp_dispatcher_config`), the
/// value of its `.rodata` map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct DispatcherConfig {
    magic: u8,
    dispatcher_version: u8,
    num_progs_enabled: u8,
    is_xdp_frags: u8,
    chain_call_actions: [u32; MAX_COMPONENTS],
    run_prios: [u32; MAX_COMPONENTS],
    program_flags: [u32; MAX_COMPONENTS],
}

// SAFETY: plain integers, no padding (4 + 3 x 40 bytes).
unsafe impl aya::Pod for DispatcherConfig {}

/// One component of a dispatcher, as `status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Component {
    pub slot: usize,
    pub prog_id: u32,
    pub name: String,
    pub run_prio: u32,
    /// Which verdicts go on to the next component (`XDP_PASS`, ...).
    pub chain_on: Vec<String>,
    /// flowctl's own component on this interface.
    pub flowctl: bool,
}

/// What runs on an interface, as far as the dispatcher protocol cares.
enum Current {
    Nothing,
    Dispatcher(Dispatcher),
    Other { id: u32, name: String },
}

struct Dispatcher {
    prog_id: u32,
    mode: XdpMode,
    config: DispatcherConfig,
    pin_dir: PathBuf,
}

/// The lock libxdp takes for every change of a dispatcher: an exclusive
/// `flock` on its bpffs directory, held until dropped.
struct LibxdpLock {
    _held: fs::File,
}

impl LibxdpLock {
    fn take() -> Result<Self> {
        fs::create_dir_all(LIBXDP_DIR).with_context(|| format!("creating {LIBXDP_DIR}"))?;
        let f = fs::File::open(LIBXDP_DIR).with_context(|| format!("opening {LIBXDP_DIR}"))?;
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            bail!("locking {LIBXDP_DIR}: {}", std::io::Error::last_os_error());
        }
        Ok(Self { _held: f })
    }
}

fn dispatch_dir(ifindex: u32, prog_id: u32) -> PathBuf {
    Path::new(LIBXDP_DIR).join(format!("dispatch-{ifindex}-{prog_id}"))
}

fn prog_pin(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("prog{slot}-prog"))
}

fn link_pin(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("prog{slot}-link"))
}

fn program_info(id: u32) -> Result<aya::programs::ProgramInfo> {
    for p in aya::programs::loaded_programs() {
        let p = p.context("listing the kernel's BPF programs")?;
        if p.id() == id {
            return Ok(p);
        }
    }
    bail!("BPF program {id} is gone")
}

fn current(ifindex: u32) -> Result<Current> {
    let Some((id, mode)) = netlink::attached(ifindex).context("asking which XDP program runs")?
    else {
        return Ok(Current::Nothing);
    };
    let info = program_info(id)?;
    let name = info.name_as_str().unwrap_or("?").to_string();
    if name != DISPATCHER_PROGRAM {
        return Ok(Current::Other { id, name });
    }
    let config = dispatcher_config(&info)
        .with_context(|| format!("reading the config of dispatcher {id}"))?;
    if config.magic != DISPATCHER_MAGIC || config.dispatcher_version != DISPATCHER_VERSION {
        bail!(
            "the XDP dispatcher on this interface (program {id}) has version {} (magic {}); flowctl joins version {DISPATCHER_VERSION} only (libxdp 1.3 and later)",
            config.dispatcher_version,
            config.magic
        );
    }
    Ok(Current::Dispatcher(Dispatcher {
        prog_id: id,
        mode,
        config,
        pin_dir: dispatch_dir(ifindex, id),
    }))
}

/// The dispatcher's config: the value of its one `.rodata` map.
fn dispatcher_config(info: &aya::programs::ProgramInfo) -> Result<DispatcherConfig> {
    let ids = info.map_ids()?.unwrap_or_default();
    for id in ids {
        let Ok(data) = MapData::from_id(id) else { continue };
        let Ok(array) = Array::<MapData, DispatcherConfig>::try_from(Map::Array(data)) else {
            continue;
        };
        if let Ok(c) = array.get(&0, 0) {
            return Ok(c);
        }
    }
    bail!("no config map of the dispatcher's size")
}

fn action_names(bits: u32) -> Vec<String> {
    ["XDP_ABORTED", "XDP_DROP", "XDP_PASS", "XDP_TX", "XDP_REDIRECT"]
        .iter()
        .enumerate()
        .filter(|(i, _)| bits & (1 << i) != 0)
        .map(|(_, n)| n.to_string())
        .collect()
}

/// The program id behind a pinned program.
fn pinned_prog_id(path: &Path) -> Option<u32> {
    aya::programs::ProgramInfo::from_pin(path).ok().map(|i| i.id())
}

/// flowctl's component program on `id`'s interface, by its pin.
fn own_component_id(id: &AttachId) -> Option<u32> {
    pinned_prog_id(&id.pin_dir().join(COMPONENT_PIN))
}

/// The components of the interface's dispatcher, in run order; empty when
/// no dispatcher runs there.
pub fn chain(id: &AttachId) -> Result<Vec<Component>> {
    let Current::Dispatcher(d) = current(id.ifindex)? else { return Ok(Vec::new()) };
    let own = own_component_id(id);
    Ok((0..d.config.num_progs_enabled as usize)
        .map(|slot| {
            let prog_id = pinned_prog_id(&prog_pin(&d.pin_dir, slot)).unwrap_or(0);
            let name = program_info(prog_id)
                .ok()
                .and_then(|i| i.name_as_str().map(str::to_string))
                .unwrap_or_else(|| "?".into());
            Component {
                slot,
                prog_id,
                name,
                run_prio: d.config.run_prios[slot],
                chain_on: action_names(d.config.chain_call_actions[slot]),
                flowctl: Some(prog_id) == own && prog_id != 0,
            }
        })
        .collect())
}

/// Whether flowctl's data plane on `id` runs as a dispatcher component.
pub fn is_component(id: &AttachId) -> bool {
    id.pin_dir().join(COMPONENT_PIN).exists()
}

/// A component of the new dispatcher: one already there (its pins), or
/// flowctl's.
enum Slot {
    Kept { prog: PathBuf, run_prio: u32, chain: u32, flags: u32 },
    Flowctl { run_prio: u32 },
}

impl Slot {
    fn run_prio(&self) -> u32 {
        match self {
            Slot::Kept { run_prio, .. } | Slot::Flowctl { run_prio } => *run_prio,
        }
    }
}

/// libxdp's dispatcher object, installed with libxdp (Debian `libxdp1`).
fn dispatcher_object() -> Result<Vec<u8>> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("LIBXDP_OBJECT_PATH") {
        dirs.push(p.into());
    }
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu/bpf",
            "/usr/lib/aarch64-linux-gnu/bpf",
            "/usr/lib/bpf",
            "/usr/local/lib/bpf",
        ]
        .map(PathBuf::from),
    );
    for d in &dirs {
        let p = d.join("xdp-dispatcher.o");
        if let Ok(b) = fs::read(&p) {
            return Ok(b);
        }
    }
    bail!(
        "libxdp's dispatcher object (xdp-dispatcher.o) is not installed in {}; install libxdp (Debian: `apt install libxdp1 xdp-tools`) or set LIBXDP_OBJECT_PATH",
        dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

/// A new dispatcher running `slots` (in run order).
fn load_dispatcher(slots: &[Slot]) -> Result<Ebpf> {
    let mut config = DispatcherConfig {
        magic: DISPATCHER_MAGIC,
        dispatcher_version: DISPATCHER_VERSION,
        num_progs_enabled: slots.len() as u8,
        is_xdp_frags: 0,
        ..Default::default()
    };
    for (i, s) in slots.iter().enumerate() {
        config.run_prios[i] = s.run_prio();
        (config.chain_call_actions[i], config.program_flags[i]) = match s {
            Slot::Kept { chain, flags, .. } => (*chain, *flags),
            Slot::Flowctl { .. } => (CHAIN_ON_PASS, 0),
        };
    }
    let object = dispatcher_object()?;
    let mut ebpf = EbpfLoader::new()
        .override_global("conf", &config, true)
        .load(&object)
        .map_err(|e| anyhow!("loading libxdp's dispatcher object: {e}"))?;
    let prog: &mut Xdp = ebpf
        .program_mut(DISPATCHER_PROGRAM)
        .context("no xdp_dispatcher program in libxdp's dispatcher object")?
        .try_into()?;
    prog.load().map_err(super::load::load_error)?;
    Ok(ebpf)
}

/// The loaded dispatcher's fd (the target its components extend) and
/// program id (its pin directory's name).
fn dispatcher_fd(ebpf: &Ebpf) -> Result<(ProgramFd, u32)> {
    let prog: &Xdp = ebpf.program(DISPATCHER_PROGRAM).context("dispatcher missing")?.try_into()?;
    Ok((prog.fd()?.try_clone()?, prog.info()?.id()))
}

/// A refused extension load, with what to do about it: a kernel that
/// refuses extension programs outright (EPERM before the verifier runs, as
/// this project's host kernel does for libxdp's own check) cannot run a
/// dispatcher at all.
fn extension_error(e: aya::programs::ProgramError) -> anyhow::Error {
    if let aya::programs::ProgramError::LoadError { io_error, .. } = &e {
        if io_error.raw_os_error() == Some(libc::EPERM) {
            return anyhow!(
                "this kernel ({}) refuses extension (freplace) programs (EPERM), which a libxdp dispatcher's components are; libxdp falls back to a single program here too. Attach without --multiprog (flowctl then needs the interface to itself)",
                crate::kernel::features::get().release
            );
        }
    }
    super::load::load_error(e)
}

/// The function of the dispatcher a component replaces: with one
/// component, the whole dispatcher (its body is then that program, no
/// loop), else its slot, as libxdp links them.
fn slot_function(components: usize, slot: usize) -> String {
    if components == 1 {
        DISPATCHER_PROGRAM.to_string()
    } else {
        format!("prog{slot}")
    }
}

/// Pins a component's program and link in the new dispatcher's directory.
/// The link first, then the program, as libxdp pins them (its unpin
/// expects both).
fn pin_component(dir: &Path, slot: usize, link: FdLink, prog: &mut Extension) -> Result<()> {
    drop(
        link.pin(link_pin(dir, slot))
            .with_context(|| format!("pinning {}", link_pin(dir, slot).display()))?,
    );
    prog.pin(prog_pin(dir, slot))
        .with_context(|| format!("pinning {}", prog_pin(dir, slot).display()))?;
    Ok(())
}

/// Removes a dispatcher's pin directory (its links go with their last pin).
fn remove_pins(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let _ = fs::remove_file(e.path());
        }
    }
    let _ = fs::remove_dir(dir);
}

/// Puts flowctl's component (the object's extension program, loaded here)
/// into the interface's dispatcher, or a new one, in place of flowctl's
/// earlier component if there is one; returns the mode the dispatcher
/// runs in. A single XDP program that is not a dispatcher is never
/// replaced.
pub fn join(
    ebpf: &mut Ebpf,
    id: &AttachId,
    iface: &str,
    mode: super::Mode,
    run_prio: u32,
) -> Result<String> {
    let _lock = LibxdpLock::take()?;
    let own = own_component_id(id);
    let cur = current(id.ifindex)?;
    let mut slots = Vec::new();
    let (old, mode_flags) = match &cur {
        Current::Other { id: pid, name } => bail!(
            "{iface} runs XDP program {pid} ({name}), which is not a libxdp dispatcher; flowctl --multiprog joins only a dispatcher. Load that program through libxdp (`xdp-loader load {iface} FILE`) or remove it (`ip link set dev {iface} xdp off`)"
        ),
        Current::Nothing => (None, None),
        Current::Dispatcher(d) => {
            for slot in 0..d.config.num_progs_enabled as usize {
                let prog = prog_pin(&d.pin_dir, slot);
                if own.is_some() && pinned_prog_id(&prog) == own {
                    continue;
                }
                if !prog.exists() {
                    bail!("the dispatcher on {iface} has no pin for its slot {slot} ({}): it was not loaded by libxdp's protocol, so flowctl will not rebuild it", prog.display());
                }
                slots.push(Slot::Kept {
                    prog,
                    run_prio: d.config.run_prios[slot],
                    chain: d.config.chain_call_actions[slot],
                    flags: d.config.program_flags[slot],
                });
            }
            (Some(d), Some(d.mode.flags()))
        }
    };
    // After the components of the same priority already there, as libxdp
    // orders equal priorities by load order.
    let at = slots.iter().position(|s| s.run_prio() > run_prio).unwrap_or(slots.len());
    slots.insert(at, Slot::Flowctl { run_prio });
    if slots.len() > MAX_COMPONENTS {
        bail!("the dispatcher on {iface} has all its {MAX_COMPONENTS} slots taken");
    }
    let dispatcher = load_dispatcher(&slots)?;
    let (target, new_id) = dispatcher_fd(&dispatcher)?;
    let dir = dispatch_dir(id.ifindex, new_id);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let built = (|| -> Result<()> {
        for (i, s) in slots.iter().enumerate() {
            let func = slot_function(slots.len(), i);
            match s {
                Slot::Kept { prog, .. } => {
                    let mut ext = Extension::from_pin(prog)
                        .with_context(|| format!("opening {}", prog.display()))?;
                    let link = ext.attach_to_program(&target, &func)?;
                    let link: FdLink = ext.take_link(link)?.into();
                    pin_component(&dir, i, link, &mut ext)?;
                }
                Slot::Flowctl { .. } => {
                    let ext: &mut Extension = ebpf
                        .program_mut(XDP_PROGRAM_MULTIPROG)
                        .context("the object has no multiprog program")?
                        .try_into()?;
                    ext.load(target.try_clone()?, &func).map_err(extension_error)?;
                    let link = ext.attach()?;
                    let link: FdLink = ext.take_link(link)?.into();
                    pin_component(&dir, i, link, ext)?;
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = built {
        remove_pins(&dir);
        return Err(e);
    }
    let old_fd = match old {
        Some(d) => Some(program_info(d.prog_id)?.fd()?),
        None => None,
    };
    let swap = |flags: u32| {
        netlink::replace(
            id.ifindex,
            Some(target.as_fd()),
            old_fd.as_ref().map(|f| f.as_fd()),
            flags,
        )
    };
    let used = match (mode_flags, mode) {
        (Some(f), _) => swap(f).map(|_| f),
        (None, super::Mode::Skb) => {
            swap(netlink::XDP_FLAGS_SKB_MODE).map(|_| netlink::XDP_FLAGS_SKB_MODE)
        }
        (None, super::Mode::Native) => {
            swap(netlink::XDP_FLAGS_DRV_MODE).map(|_| netlink::XDP_FLAGS_DRV_MODE)
        }
        (None, super::Mode::Auto) => swap(netlink::XDP_FLAGS_DRV_MODE)
            .map(|_| netlink::XDP_FLAGS_DRV_MODE)
            .or_else(|_| swap(netlink::XDP_FLAGS_SKB_MODE).map(|_| netlink::XDP_FLAGS_SKB_MODE)),
    };
    let used = match used {
        Ok(f) => f,
        Err(e) => {
            remove_pins(&dir);
            return Err(anyhow!("putting the new XDP dispatcher on {iface}: {e} (the interface's program changed meanwhile, or the mode is not available)"));
        }
    };
    if let Some(d) = old {
        remove_pins(&d.pin_dir);
    }
    // Which slot is flowctl's, for the next agent and `detach`.
    let own_pin = id.pin_dir().join(COMPONENT_PIN);
    let _ = fs::remove_file(&own_pin);
    let ext: &mut Extension =
        ebpf.program_mut(XDP_PROGRAM_MULTIPROG).context("multiprog program")?.try_into()?;
    ext.pin(&own_pin).with_context(|| format!("pinning {}", own_pin.display()))?;
    Ok(if used == netlink::XDP_FLAGS_SKB_MODE { "generic" } else { "native" }.into())
}

/// Takes flowctl's component out of the interface's dispatcher (a new one
/// without it, or no program when it was the only one) and removes its
/// pin. False when flowctl had no component there.
pub fn leave(id: &AttachId) -> Result<bool> {
    let own_pin = id.pin_dir().join(COMPONENT_PIN);
    let Some(own) = pinned_prog_id(&own_pin) else {
        let _ = fs::remove_file(&own_pin);
        return Ok(false);
    };
    let _lock = LibxdpLock::take()?;
    let Current::Dispatcher(d) = current(id.ifindex).unwrap_or(Current::Nothing) else {
        let _ = fs::remove_file(&own_pin);
        return Ok(false);
    };
    let mut slots = Vec::new();
    let mut found = false;
    for slot in 0..d.config.num_progs_enabled as usize {
        let prog = prog_pin(&d.pin_dir, slot);
        if pinned_prog_id(&prog) == Some(own) {
            found = true;
            continue;
        }
        slots.push(Slot::Kept {
            prog,
            run_prio: d.config.run_prios[slot],
            chain: d.config.chain_call_actions[slot],
            flags: d.config.program_flags[slot],
        });
    }
    let old_fd = program_info(d.prog_id)?.fd()?;
    if !found {
        let _ = fs::remove_file(&own_pin);
        return Ok(false);
    }
    if slots.is_empty() {
        netlink::replace(id.ifindex, None, Some(old_fd.as_fd()), d.mode.flags())
            .context("removing the XDP dispatcher")?;
        remove_pins(&d.pin_dir);
        let _ = fs::remove_file(&own_pin);
        return Ok(true);
    }
    let dispatcher = load_dispatcher(&slots)?;
    let (target, new_id) = dispatcher_fd(&dispatcher)?;
    let dir = dispatch_dir(id.ifindex, new_id);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let built = (|| -> Result<()> {
        for (i, s) in slots.iter().enumerate() {
            let Slot::Kept { prog, .. } = s else { continue };
            let mut ext =
                Extension::from_pin(prog).with_context(|| format!("opening {}", prog.display()))?;
            let link = ext.attach_to_program(&target, &slot_function(slots.len(), i))?;
            let link: FdLink = ext.take_link(link)?.into();
            pin_component(&dir, i, link, &mut ext)?;
        }
        netlink::replace(id.ifindex, Some(target.as_fd()), Some(old_fd.as_fd()), d.mode.flags())
            .context("putting the dispatcher without flowctl on the interface")?;
        Ok(())
    })();
    if let Err(e) = built {
        remove_pins(&dir);
        return Err(e);
    }
    remove_pins(&d.pin_dir);
    let _ = fs::remove_file(&own_pin);
    Ok(true)
}

/// Whether this start runs flowctl as a dispatcher component, and at which
/// run priority: as asked (`--multiprog`), or as the kept data plane it
/// adopts already runs (at its priority unless another is asked for). A
/// kept data plane on its own link cannot turn into a component in place.
pub fn choose(
    id: &AttachId,
    iface: &str,
    asked: Option<u32>,
    adopting: bool,
) -> Result<Option<u32>> {
    if adopting && is_component(id) {
        let running =
            chain(id).ok().and_then(|c| c.into_iter().find(|c| c.flowctl)).map(|c| c.run_prio);
        return Ok(asked.or(running).or(Some(DEFAULT_RUN_PRIO)));
    }
    if adopting && asked.is_some() {
        bail!(
            "the kept data plane on {iface} runs on its own XDP link, not in a dispatcher; `flowctl detach {iface}` first, then attach with --multiprog (or attach without it to adopt the kept one)"
        );
    }
    Ok(asked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_has_libxdps_layout() {
        // struct xdp_dispatcher_config: four bytes, then three arrays of
        // ten u32 (the dispatcher object's `conf` is 124 bytes).
        assert_eq!(size_of::<DispatcherConfig>(), 124);
        assert_eq!(std::mem::offset_of!(DispatcherConfig, chain_call_actions), 4);
        assert_eq!(std::mem::offset_of!(DispatcherConfig, run_prios), 44);
        assert_eq!(std::mem::offset_of!(DispatcherConfig, program_flags), 84);
    }

    #[test]
    fn flowctl_chains_on_pass_and_empty_slots() {
        assert_eq!(action_names(CHAIN_ON_PASS), ["XDP_PASS"]);
        assert_eq!(CHAIN_ON_PASS >> 31, 1, "an empty slot's verdict chains");
        assert_eq!(slot_function(1, 0), "xdp_dispatcher");
        assert_eq!(slot_function(2, 1), "prog1");
    }
}
