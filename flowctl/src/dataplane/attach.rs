//! Attaching the loaded XDP program to an interface through a pinned
//! bpf_link (or re-pointing the pinned link of an adopted data plane),
//! detaching it with every pin, and the error text of both.

use super::{
    load::loaded_xdp,
    mode::Mode,
    pins::{run_file, AttachId},
};
use anyhow::{anyhow, Context, Result};
use aya::{
    programs::{links::FdLink, links::PinnedLink, ProgramError, Xdp, XdpMode},
    Ebpf,
};
use flowctl_common::XDP_PROGRAM_FRAGS;
use std::fs;

/// The pinned link outlived its interface (the namespace or device was
/// deleted, and the numbers were reused): its pins are stale.
#[derive(Debug, thiserror::Error)]
#[error("the pinned XDP link is severed: its interface is gone")]
pub struct SeveredLink;

/// Attaches (or, when `link` is pinned already, re-points the pinned link at
/// the freshly loaded program) and returns the mode in use.
pub fn attach(ebpf: &mut Ebpf, id: &AttachId, iface: &str, mode: Mode) -> Result<String> {
    let link_path = id.pin_dir().join("link");
    let name = loaded_xdp(ebpf)?;
    let frags = name == XDP_PROGRAM_FRAGS;
    let prog: &mut Xdp = ebpf.program_mut(name).context("program missing")?.try_into()?;
    if link_path.exists() {
        let pinned = PinnedLink::from_pin(&link_path).context("opening the pinned XDP link")?;
        let fd_link: FdLink = pinned.into();
        let xdp_link = aya::programs::xdp::XdpLink::try_from(fd_link)?;
        let link_id = match prog.attach_to_link(xdp_link) {
            Ok(l) => l,
            Err(ProgramError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOLINK) =>
            {
                return Err(SeveredLink.into());
            }
            Err(e) => return Err(anyhow!("re-pointing the pinned XDP link at {name}: {e}")),
        };
        // Closing this fd leaves the link pinned and attached; holding it
        // would keep the program on the interface after a `detach`
        // unpinned it, until this process exits.
        drop(prog.take_link(link_id)?);
        return Ok("adopted".into());
    }
    let try_mode = |prog: &mut Xdp, m: XdpMode| prog.attach_to_if_index(id.ifindex, m);
    let (link_id, used) = match mode {
        Mode::Skb => {
            (try_mode(prog, XdpMode::Skb).map_err(|e| attach_error(e, iface, frags))?, "generic")
        }
        Mode::Native => {
            (try_mode(prog, XdpMode::Driver).map_err(|e| attach_error(e, iface, frags))?, "native")
        }
        Mode::Auto => match try_mode(prog, XdpMode::Driver) {
            Ok(l) => (l, "native"),
            Err(e) if is_busy(&e) => return Err(attach_error(e, iface, frags)),
            Err(e) => {
                tracing::warn!("native XDP is not available on {iface} ({}); FALLING BACK TO GENERIC (skb) MODE, which is slower", describe(&e));
                crate::system::log::warning(format_args!("native XDP is not available on {iface}; using generic (skb) mode, which is slower"));
                (
                    try_mode(prog, XdpMode::Skb).map_err(|e| attach_error(e, iface, frags))?,
                    "generic",
                )
            }
        },
    };
    let link = prog.take_link(link_id)?;
    let fd_link = FdLink::try_from(link).map_err(|e| {
        anyhow!(
            "this kernel attached XDP without bpf_link ({e}); flowctl needs bpf_link (Linux 5.9+)"
        )
    })?;
    fd_link
        .pin(&link_path)
        .with_context(|| format!("pinning the XDP link at {}", link_path.display()))?;
    Ok(used.into())
}

/// Unpins an XDP link (when pinned there): with its last pin and fd gone,
/// the kernel detaches it.
fn unpin_link(path: &std::path::Path) -> Result<()> {
    if path.exists() {
        let pinned = PinnedLink::from_pin(path).context("opening the pinned XDP link")?;
        drop(pinned.unpin().context("unpinning the XDP link")?);
    }
    Ok(())
}

/// What a takeover of another layout's data plane (or `--replace`) starts
/// afresh, said in the status line: the new program's maps are new.
pub const RESET_ON_TAKEOVER: &str = "every bucket and remembered debt, quota window, warm-up ramp (its rules start cold), BBR's tracked connections, SYN booking, counter and statistics ring start afresh, and global rules' leases are asked for again";

/// `attach --replace`: everything of the attachment goes except its XDP
/// link, ours or one another flowctl version pinned (an upgrade over a
/// kept data plane). The old program stays on the link, enforcing with its
/// own maps, until `attach` re-points the link at the new program: no
/// packet passes unchecked in between. What goes is said: every bucket,
/// counter, statistic and quota window starts afresh. Returns the kept
/// link's mode as last recorded (`native`, `generic`; `adopted` when no
/// record says), or `None` when there was no link (nothing was attached).
pub fn replace_keeping_link(id: &AttachId) -> Result<Option<String>> {
    let recorded = super::state::AttachState::load(id).ok().flatten().map(|s| s.mode);
    let dir = id.pin_dir();
    let link_path = dir.join("link");
    // A dispatcher component's pin stays too: the next agent swaps its
    // component for the new one in one replace (`multiprog::join`).
    let mut kept = link_path.exists() || super::multiprog::is_component(id);
    if dir.exists() {
        for e in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let p = e?.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if p != link_path && !name.starts_with(super::multiprog::COMPONENT_PIN) {
                fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
            }
        }
    }
    for (version, old) in super::pins::other_layout_dirs(id) {
        let old_link = old.join("link");
        if old_link.exists() && !kept {
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let link: FdLink =
                PinnedLink::from_pin(&old_link).context("opening the older XDP link")?.into();
            drop(link.pin(&link_path).with_context(|| {
                format!("pinning the XDP link of layout v{version} at {}", link_path.display())
            })?);
            kept = true;
            crate::system::log::status(format_args!(
                "taking over the data plane of flowctl layout v{version} (pins at {}): its program enforces until this one replaces it on the same link; {RESET_ON_TAKEOVER}",
                old.display()
            ));
        } else {
            unpin_link(&old_link)?;
        }
        super::pins::remove_other_layout_dir(&old)?;
    }
    for f in [run_file::STATE, run_file::PROFILE, run_file::SYN_TOTALS] {
        let _ = fs::remove_file(id.run_dir().join(f));
    }
    Ok(kept.then(|| recorded.unwrap_or_else(|| "adopted".into())))
}

fn is_busy(e: &ProgramError) -> bool {
    let s = format!("{e:?}");
    s.contains("EBUSY")
        || s.contains("EEXIST")
        || s.contains("Device or resource busy")
        || s.contains("File exists")
}

/// The errno behind a failed attach, when the kernel gave one.
fn os_error(e: &ProgramError) -> Option<&std::io::Error> {
    match e {
        ProgramError::SyscallError(s) => Some(&s.io_error),
        _ => None,
    }
}

/// A program error with its errno (aya's Display leaves it out).
fn describe(e: &ProgramError) -> String {
    match os_error(e) {
        Some(io) => format!("{e}: {io}"),
        None => e.to_string(),
    }
}

fn attach_error(e: ProgramError, iface: &str, frags: bool) -> anyhow::Error {
    // veth (drivers/net/veth.c, veth_xdp_set) and other drivers refuse a
    // single-buffer program in native mode when the MTU does not fit one
    // page: ERANGE.
    let range = os_error(&e).and_then(|io| io.raw_os_error()) == Some(libc::ERANGE);
    if range && !frags {
        anyhow!(
            "attaching XDP to {iface}: {}: its MTU is too large for a single-buffer XDP program in native mode, and this kernel ({}) lacks multi-buffer XDP (xdp.frags, Linux 5.18+); lower the MTU or use --mode skb",
            describe(&e),
            crate::kernel::features::get().release
        )
    } else if is_busy(&e) {
        anyhow!(
            "{iface} already has another XDP program attached; flowctl will not replace it. Inspect it with `ip link show {iface}` and remove it with `ip link set dev {iface} xdp off` (or `bpftool net detach xdp dev {iface}`) if it is not needed"
        )
    } else {
        anyhow!("attaching XDP to {iface}: {}", describe(&e))
    }
}

/// Removes the link and every pin of an attachment, and the run files that
/// describe them. Idempotent: returns false when there was nothing to
/// remove. The run directory and its lock stay: whoever holds the lock
/// removes them (`pins::remove_run_dir`).
pub fn detach(id: &AttachId) -> Result<bool> {
    // Another flowctl version's kept data plane on this interface goes too.
    let mut detached = false;
    for (_, dir) in super::pins::other_layout_dirs(id) {
        unpin_link(&dir.join("link"))?;
        super::pins::remove_other_layout_dir(&dir)?;
        detached = true;
    }
    let dir = id.pin_dir();
    if !dir.exists() {
        if detached {
            for f in [run_file::STATE, run_file::PROFILE, run_file::SOCKET, run_file::SYN_TOTALS] {
                let _ = fs::remove_file(id.run_dir().join(f));
            }
            super::pins::prune_empty_roots();
        }
        return Ok(detached);
    }
    unpin_link(&dir.join("link"))?;
    super::multiprog::leave(id)?;
    fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    // What describes the pins goes with them; the lock stays (see above).
    for f in [run_file::STATE, run_file::PROFILE, run_file::SOCKET, run_file::SYN_TOTALS] {
        let _ = fs::remove_file(id.run_dir().join(f));
    }
    // The last attachment's pins gone: so is the pin root's layout.
    super::pins::prune_empty_roots();
    Ok(true)
}
