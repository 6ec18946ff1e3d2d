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

use super::{mode::Mode, pins::AttachId};
use crate::kernel::xdp::{self as netlink, XdpMode};
use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Array, Map, MapData},
    programs::{links::FdLink, Extension, ProgramFd, ProgramInfo, Xdp},
    Ebpf, EbpfLoader,
};
use flowctl_common::{map_names, XDP_PROGRAM_MULTIPROG};
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
/// how a later agent or `detach` knows the data plane is a component.
/// Which slot is flowctl's is told by the maps its program uses (this
/// attachment's pinned maps), so a crash between the swap and this pin's
/// update cannot make flowctl's own slot look like someone else's.
pub const COMPONENT_PIN: &str = "multiprog";
/// The new component program's pin while its dispatcher is swapped in
/// (renamed over `COMPONENT_PIN` once it runs; bpffs refuses names with a
/// dot).
const COMPONENT_PIN_NEW: &str = "multiprog-new";
/// How often a swap that lost a race with libxdp (which locks only around
/// its pins, not its own swap, and retries as often) is planned again.
const SWAP_TRIES: u32 = 10;
/// The kernel's name of flowctl's component (program names are cut at 15
/// bytes), which orders it among components of equal priority as libxdp
/// orders them: by priority, then name.
fn component_name() -> &'static str {
    &XDP_PROGRAM_MULTIPROG[..XDP_PROGRAM_MULTIPROG.len().min(15)]
}

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

fn program_info(id: u32) -> Result<ProgramInfo> {
    for p in aya::programs::loaded_programs() {
        let p = p.context("listing the kernel's BPF programs")?;
        if p.id() == id {
            return Ok(p);
        }
    }
    bail!("BPF program {id} is gone")
}

fn current(ifindex: u32) -> Result<Current> {
    let (id, mode) = match netlink::attached(ifindex).context("asking which XDP program runs")? {
        None => return Ok(Current::Nothing),
        Some(netlink::Attached::One(id, mode)) => (id, mode),
        Some(netlink::Attached::Several { native, generic, offloaded }) => {
            let ids: Vec<String> =
                [("native", native), ("generic", generic), ("offloaded", offloaded)]
                    .iter()
                    .filter(|(_, id)| *id != 0)
                    .map(|(mode, id)| format!("{mode} program {id}"))
                    .collect();
            bail!(
                "this interface runs XDP programs in several modes at once ({}: an offloaded program beside a native or generic one); a libxdp dispatcher runs in one mode, so flowctl cannot tell which chain to join: remove the one not wanted (`ip link set dev IFACE xdpoffload off`, or `xdpdrv off`) and attach again",
                ids.join(", ")
            );
        }
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
            "the XDP dispatcher on this interface (program {id}) has version {} (magic {}); flowctl joins version {DISPATCHER_VERSION} only (libxdp 1.3 to 1.5)",
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
fn dispatcher_config(info: &ProgramInfo) -> Result<DispatcherConfig> {
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

/// The kernel's record of a pinned program (its id, name and maps).
fn pinned_info(path: &Path) -> Option<ProgramInfo> {
    ProgramInfo::from_pin(path).ok()
}

fn name_of(info: &ProgramInfo) -> Option<String> {
    info.name_as_str().map(str::to_string)
}

/// What tells flowctl's component of an attachment: its program uses the
/// attachment's pinned global record, or is the one pinned as flowctl's
/// (after `--replace` the old component's maps are no longer pinned).
struct Own {
    map: Option<u32>,
    progs: Vec<u32>,
}

impl Own {
    fn of(id: &AttachId) -> Self {
        let map = MapData::from_pin(id.pin_dir().join(map_names::GLOBAL))
            .ok()
            .and_then(|m| m.info().ok().map(|i| i.id()));
        let progs = [COMPONENT_PIN, COMPONENT_PIN_NEW]
            .iter()
            .filter_map(|f| pinned_info(&id.pin_dir().join(f)).map(|i| i.id()))
            .collect();
        Self { map, progs }
    }

    /// Whether the component program `info` is flowctl's.
    fn is(&self, info: &ProgramInfo) -> bool {
        self.progs.contains(&info.id())
            || self
                .map
                .is_some_and(|m| info.map_ids().ok().flatten().is_some_and(|ids| ids.contains(&m)))
    }
}

/// Whether the interface is gone (its namespace or device deleted).
fn interface_gone(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.raw_os_error() == Some(libc::ENODEV))
    })
}

/// Whether a swap failed because the interface's program changed since it
/// was read (libxdp swapped meanwhile): plan again.
fn lost_race(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::EBUSY))
}

/// The components of the interface's dispatcher, in run order; empty when
/// no dispatcher runs there.
pub fn chain(id: &AttachId) -> Result<Vec<Component>> {
    let Current::Dispatcher(d) = current(id.ifindex)? else { return Ok(Vec::new()) };
    let own = Own::of(id);
    Ok((0..d.config.num_progs_enabled as usize)
        .map(|slot| {
            let info = pinned_info(&prog_pin(&d.pin_dir, slot));
            let prog_id = info.as_ref().map_or(0, |i| i.id());
            let name = info.as_ref().and_then(name_of).unwrap_or_else(|| "?".into());
            Component {
                slot,
                prog_id,
                name,
                run_prio: d.config.run_prios[slot],
                chain_on: action_names(d.config.chain_call_actions[slot]),
                flowctl: info.as_ref().is_some_and(|i| own.is(i)),
            }
        })
        .collect())
}

/// Whether flowctl's data plane on `id` runs as a dispatcher component.
pub fn is_component(id: &AttachId) -> bool {
    let dir = id.pin_dir();
    dir.join(COMPONENT_PIN).exists() || dir.join(COMPONENT_PIN_NEW).exists()
}

/// A component of the new dispatcher: one already there (its pins), or
/// flowctl's.
enum Slot {
    Kept { prog: PathBuf, name: String, run_prio: u32, chain: u32, flags: u32 },
    Flowctl { run_prio: u32 },
}

impl Slot {
    /// libxdp's run order: priority, then the program's name.
    fn order(&self) -> (u32, &str) {
        match self {
            Slot::Kept { run_prio, name, .. } => (*run_prio, name),
            Slot::Flowctl { run_prio } => (*run_prio, component_name()),
        }
    }

    fn run_prio(&self) -> u32 {
        self.order().0
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
        .map_err(|e| anyhow!("loading libxdp's dispatcher object: {e} (flowctl writes the version-{DISPATCHER_VERSION} config of libxdp 1.3 to 1.5; a newer libxdp's dispatcher takes another)"))?;
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

impl Dispatcher {
    /// Its components as slots of the next dispatcher, except flowctl's
    /// (`own`); and whether flowctl's was among them.
    fn kept_slots(&self, own: &Own, iface: &str) -> Result<(Vec<Slot>, bool)> {
        let (mut slots, mut found) = (Vec::new(), false);
        for slot in 0..self.config.num_progs_enabled as usize {
            let prog = prog_pin(&self.pin_dir, slot);
            if !prog.exists() {
                bail!("the dispatcher on {iface} has no pin for its slot {slot} ({}): it was not loaded by libxdp's protocol, so flowctl will not rebuild it", prog.display());
            }
            let info = pinned_info(&prog);
            if info.as_ref().is_some_and(|i| own.is(i)) {
                found = true;
                continue;
            }
            let name = info.as_ref().and_then(name_of).unwrap_or_default();
            slots.push(Slot::Kept {
                prog,
                name,
                run_prio: self.config.run_prios[slot],
                chain: self.config.chain_call_actions[slot],
                flags: self.config.program_flags[slot],
            });
        }
        Ok((slots, found))
    }

    /// A descriptor of the running dispatcher: the expected program of the
    /// swap that replaces it.
    fn fd(&self) -> Result<ProgramFd> {
        Ok(program_info(self.prog_id)?.fd()?)
    }
}

/// A dispatcher loaded with its components linked and pinned, not yet on
/// the interface.
struct Built {
    /// Owns the dispatcher until the interface holds it.
    _object: Ebpf,
    fd: ProgramFd,
    dir: PathBuf,
}

/// Loads a dispatcher for `slots`, links every component to its slot (a
/// kept one by its pin; flowctl's, the object's extension program, loaded
/// against the first dispatcher it is built for and re-linked after) and
/// pins them. On failure its pins are gone.
fn build(ifindex: u32, slots: &[Slot], flowctl: Option<&mut Ebpf>) -> Result<Built> {
    let object = load_dispatcher(slots)?;
    let (target, new_id) = dispatcher_fd(&object)?;
    let dir = dispatch_dir(ifindex, new_id);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut flowctl = flowctl;
    let linked = (|| -> Result<()> {
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
                    let ext: &mut Extension = flowctl
                        .as_deref_mut()
                        .context("no flowctl program to link")?
                        .program_mut(XDP_PROGRAM_MULTIPROG)
                        .context("the object has no multiprog program")?
                        .try_into()?;
                    let link = if ext.fd().is_ok() {
                        ext.attach_to_program(&target, &func)?
                    } else {
                        ext.load(target.try_clone()?, &func).map_err(extension_error)?;
                        ext.attach()?
                    };
                    let link: FdLink = ext.take_link(link)?.into();
                    pin_component(&dir, i, link, ext)?;
                }
            }
        }
        Ok(())
    })();
    match linked {
        Ok(()) => Ok(Built { _object: object, fd: target, dir }),
        Err(e) => {
            remove_pins(&dir);
            Err(e)
        }
    }
}

/// The attach flags of `mode` for a new dispatcher (None: native, else
/// generic).
fn mode_flags(mode: Mode) -> Option<u32> {
    match mode {
        Mode::Skb => Some(netlink::XDP_FLAGS_SKB_MODE),
        Mode::Native => Some(netlink::XDP_FLAGS_DRV_MODE),
        Mode::Auto => None,
    }
}

/// Puts flowctl's component (the object's extension program, loaded here)
/// into the interface's dispatcher, or a new one, in place of flowctl's
/// earlier component if there is one; returns the mode the dispatcher
/// runs in. A single XDP program that is not a dispatcher is never
/// replaced. A swap that loses a race with libxdp is planned again.
pub fn join(
    ebpf: &mut Ebpf,
    id: &AttachId,
    iface: &str,
    mode: Mode,
    run_prio: u32,
) -> Result<String> {
    let _lock = LibxdpLock::take()?;
    let own = Own::of(id);
    let dir = id.pin_dir();
    let mut tries = 0;
    loop {
        tries += 1;
        let (old, mut slots) = match current(id.ifindex)? {
            Current::Other { id: pid, name } => bail!(
                "{iface} runs XDP program {pid} ({name}), which is not a libxdp dispatcher; flowctl --multiprog joins only a dispatcher. Load that program through libxdp (`xdp-loader load {iface} FILE`) or remove it (`ip link set dev {iface} xdp off`)"
            ),
            Current::Nothing => (None, Vec::new()),
            Current::Dispatcher(d) => {
                if let Some(want) = mode_flags(mode) {
                    if want != d.mode.flags() {
                        bail!(
                            "the XDP dispatcher on {iface} runs in {} mode; its components share it, so attach with --mode {} (or auto)",
                            d.mode.name(),
                            if d.mode == XdpMode::Generic { "skb" } else { "native" }
                        );
                    }
                }
                let (slots, _) = d.kept_slots(&own, iface)?;
                (Some(d), slots)
            }
        };
        let ours = Slot::Flowctl { run_prio };
        let at = slots.iter().position(|s| s.order() > ours.order()).unwrap_or(slots.len());
        slots.insert(at, ours);
        if slots.len() > MAX_COMPONENTS {
            bail!("the dispatcher on {iface} has all its {MAX_COMPONENTS} slots taken");
        }
        let old_fd = old.as_ref().map(Dispatcher::fd).transpose()?;
        let built = build(id.ifindex, &slots, Some(&mut *ebpf))?;
        // The new program is pinned as flowctl's before it runs, so a crash
        // after the swap still finds the data plane a component.
        let new_pin = dir.join(COMPONENT_PIN_NEW);
        let _ = fs::remove_file(&new_pin);
        let ext: &mut Extension =
            ebpf.program_mut(XDP_PROGRAM_MULTIPROG).context("multiprog program")?.try_into()?;
        if let Err(e) = ext.pin(&new_pin) {
            remove_pins(&built.dir);
            return Err(anyhow!("pinning {}: {e}", new_pin.display()));
        }
        let swap = |flags: u32| {
            netlink::replace(
                id.ifindex,
                Some(built.fd.as_fd()),
                old_fd.as_ref().map(|f| f.as_fd()),
                flags,
            )
            .map(|_| flags)
        };
        let used = match (&old, mode_flags(mode)) {
            (Some(d), _) => swap(d.mode.flags()),
            (None, Some(f)) => swap(f),
            (None, None) => swap(netlink::XDP_FLAGS_DRV_MODE).or_else(|e| {
                if lost_race(&e) {
                    return Err(e);
                }
                tracing::warn!("native XDP is not available on {iface} ({e}); the dispatcher goes on in generic (skb) mode, which is slower");
                crate::system::log::warning(format_args!("native XDP is not available on {iface}; using generic (skb) mode, which is slower"));
                swap(netlink::XDP_FLAGS_SKB_MODE)
            }),
        };
        match used {
            Ok(f) => {
                if let Some(d) = old {
                    remove_pins(&d.pin_dir);
                }
                fs::rename(&new_pin, dir.join(COMPONENT_PIN)).with_context(|| {
                    format!("renaming {} over {COMPONENT_PIN}", new_pin.display())
                })?;
                return Ok(
                    if f == netlink::XDP_FLAGS_SKB_MODE { "generic" } else { "native" }.into()
                );
            }
            Err(e) => {
                remove_pins(&built.dir);
                let _ = fs::remove_file(&new_pin);
                if lost_race(&e) && tries < SWAP_TRIES {
                    std::thread::sleep(std::time::Duration::from_millis(20 * tries as u64));
                    continue;
                }
                return Err(anyhow!("putting the new XDP dispatcher on {iface}: {e} (the interface's program kept changing, or the mode is not available)"));
            }
        }
    }
}

/// Removes flowctl's component pins (its marker and a pending new one).
fn remove_own_pins(id: &AttachId) {
    for f in [COMPONENT_PIN, COMPONENT_PIN_NEW] {
        let _ = fs::remove_file(id.pin_dir().join(f));
    }
}

/// The pins libxdp's protocol left for a dispatcher of `ifindex` that holds
/// flowctl's component, once the interface is gone (nothing runs them).
fn remove_stale_dispatch_dirs(ifindex: u32, own: &Own) {
    let prefix = format!("dispatch-{ifindex}-");
    let Ok(entries) = fs::read_dir(LIBXDP_DIR) else { return };
    for e in entries.flatten() {
        let dir = e.path();
        if !e.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        if (0..MAX_COMPONENTS)
            .any(|slot| pinned_info(&prog_pin(&dir, slot)).is_some_and(|i| own.is(&i)))
        {
            remove_pins(&dir);
        }
    }
}

/// Takes flowctl's component out of the interface's dispatcher (a new one
/// without it, or no program when it was the only one) and removes its
/// pins. False when flowctl had no component there. An error (other than
/// the interface being gone) keeps the pins, so `detach` can be retried.
pub fn leave(id: &AttachId) -> Result<bool> {
    if !is_component(id) {
        return Ok(false);
    }
    let own = Own::of(id);
    let _lock = LibxdpLock::take()?;
    let mut tries = 0;
    loop {
        tries += 1;
        let d = match current(id.ifindex) {
            Ok(Current::Dispatcher(d)) => d,
            Ok(_) => {
                remove_own_pins(id);
                return Ok(false);
            }
            Err(e) if interface_gone(&e) => {
                remove_stale_dispatch_dirs(id.ifindex, &own);
                remove_own_pins(id);
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let (slots, found) = d.kept_slots(&own, "the interface")?;
        if !found {
            remove_own_pins(id);
            return Ok(false);
        }
        let old_fd = d.fd()?;
        let swapped = if slots.is_empty() {
            netlink::replace(id.ifindex, None, Some(old_fd.as_fd()), d.mode.flags()).map(|_| None)
        } else {
            let built = build(id.ifindex, &slots, None)?;
            match netlink::replace(
                id.ifindex,
                Some(built.fd.as_fd()),
                Some(old_fd.as_fd()),
                d.mode.flags(),
            ) {
                Ok(()) => Ok(Some(built)),
                Err(e) => {
                    remove_pins(&built.dir);
                    Err(e)
                }
            }
        };
        match swapped {
            Ok(_) => {
                remove_pins(&d.pin_dir);
                remove_own_pins(id);
                return Ok(true);
            }
            Err(e) if lost_race(&e) && tries < SWAP_TRIES => {
                std::thread::sleep(std::time::Duration::from_millis(20 * tries as u64));
            }
            Err(e) => {
                return Err(anyhow!("taking flowctl out of the interface's XDP dispatcher: {e}"))
            }
        }
    }
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
