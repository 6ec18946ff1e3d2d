//! The XDP requests over rtnetlink that aya 0.14 does not make: which
//! program an interface runs (and in which mode), and setting one in place
//! of an expected other (`XDP_FLAGS_REPLACE`), which is how libxdp swaps
//! one dispatcher for the next without a moment of no program
//! (include/uapi/linux/if_link.h, `IFLA_XDP_*`).

use super::rtnl::{attr, each_attr, Socket, NLM_F_ACK, NLM_F_REQUEST};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const RTM_SETLINK: u16 = 19;
const IFLA_XDP: u16 = 43;
const NLA_F_NESTED: u16 = 0x8000;
const IFLA_XDP_FD: u16 = 1;
const IFLA_XDP_ATTACHED: u16 = 2;
const IFLA_XDP_FLAGS: u16 = 3;
const IFLA_XDP_PROG_ID: u16 = 4;
const IFLA_XDP_DRV_PROG_ID: u16 = 5;
const IFLA_XDP_SKB_PROG_ID: u16 = 6;
const IFLA_XDP_HW_PROG_ID: u16 = 7;
const IFLA_XDP_EXPECTED_FD: u16 = 8;
const XDP_ATTACHED_DRV: u8 = 1;
const XDP_ATTACHED_SKB: u8 = 2;
const XDP_ATTACHED_HW: u8 = 3;
const XDP_ATTACHED_MULTI: u8 = 4;
pub const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
pub const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
const XDP_FLAGS_REPLACE: u32 = 1 << 4;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IfInfoMsg {
    family: u8,
    pad: u8,
    ty: u16,
    index: i32,
    flags: u32,
    change: u32,
}

/// The mode a program runs in on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpMode {
    Native,
    Generic,
    Offloaded,
}

impl XdpMode {
    /// The attach flag that addresses this mode's program.
    pub fn flags(self) -> u32 {
        match self {
            XdpMode::Generic => XDP_FLAGS_SKB_MODE,
            _ => XDP_FLAGS_DRV_MODE,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            XdpMode::Native => "native",
            XdpMode::Generic => "generic",
            XdpMode::Offloaded => "offloaded",
        }
    }
}

/// What runs on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// One program, in one mode.
    One(u32, XdpMode),
    /// Programs in more than one mode at once (`XDP_ATTACHED_MULTI`: the
    /// kernel then gives no single program id, only one per mode).
    Several { native: u32, generic: u32, offloaded: u32 },
}

/// What `ifindex` runs; `None` when it runs no program.
pub fn attached(ifindex: u32) -> io::Result<Option<Attached>> {
    let s = Socket::open()?;
    let head = IfInfoMsg { index: ifindex as i32, ..Default::default() };
    // With an ack to end the replies (a plain get has no NLMSG_DONE).
    s.request(RTM_GETLINK, NLM_F_REQUEST | NLM_F_ACK, &head, &[])?;
    let mut found = None;
    s.each_reply(RTM_NEWLINK, |m| {
        let Some(attrs) = m.get(size_of::<IfInfoMsg>()..) else { return };
        each_attr(attrs, |ty, payload| {
            if ty != IFLA_XDP {
                return;
            }
            let (mut mode, mut id, mut per_mode) = (0u8, 0u32, [0u32; 3]);
            let u32_of = |v: &[u8]| u32::from_ne_bytes(v[..4].try_into().expect("4 bytes"));
            each_attr(payload, |t, v| match t {
                IFLA_XDP_ATTACHED if !v.is_empty() => mode = v[0],
                IFLA_XDP_PROG_ID if v.len() >= 4 => id = u32_of(v),
                IFLA_XDP_DRV_PROG_ID if v.len() >= 4 => per_mode[0] = u32_of(v),
                IFLA_XDP_SKB_PROG_ID if v.len() >= 4 => per_mode[1] = u32_of(v),
                IFLA_XDP_HW_PROG_ID if v.len() >= 4 => per_mode[2] = u32_of(v),
                _ => {}
            });
            found = Some(match mode {
                XDP_ATTACHED_DRV => Attached::One(id, XdpMode::Native),
                XDP_ATTACHED_SKB => Attached::One(id, XdpMode::Generic),
                XDP_ATTACHED_HW => Attached::One(id, XdpMode::Offloaded),
                XDP_ATTACHED_MULTI => {
                    let [native, generic, offloaded] = per_mode;
                    Attached::Several { native, generic, offloaded }
                }
                _ => return,
            });
        });
    })?;
    Ok(found)
}

/// Sets `prog` (None: removes the program) on `ifindex` in the mode of
/// `flags`, if the interface still runs `expected` (None: if it runs no
/// program). EEXIST or EBUSY: someone else's program is there now.
pub fn replace(
    ifindex: u32,
    prog: Option<BorrowedFd<'_>>,
    expected: Option<BorrowedFd<'_>>,
    flags: u32,
) -> io::Result<()> {
    const XDP_FLAGS_UPDATE_IF_NOEXIST: u32 = 1;
    let s = Socket::open()?;
    let head = IfInfoMsg { index: ifindex as i32, ..Default::default() };
    let fd: i32 = prog.map(|p| p.as_raw_fd()).unwrap_or(-1);
    let mut nest = attr(IFLA_XDP_FD, &fd.to_ne_bytes());
    let flags = match expected {
        Some(old) => {
            nest.extend(attr(IFLA_XDP_EXPECTED_FD, &old.as_raw_fd().to_ne_bytes()));
            flags | XDP_FLAGS_REPLACE
        }
        None => flags | XDP_FLAGS_UPDATE_IF_NOEXIST,
    };
    nest.extend(attr(IFLA_XDP_FLAGS, &flags.to_ne_bytes()));
    s.request(
        RTM_SETLINK,
        NLM_F_REQUEST | NLM_F_ACK,
        &head,
        &attr(IFLA_XDP | NLA_F_NESTED, &nest),
    )?;
    s.replies(0).map(|_| ())
}
