//! The rtnetlink requests aya 0.14 lacks: deleting the `clsact` qdisc
//! flowctl added and counting the filters left on it (so a qdisc another
//! flowctl agent's filter still uses stays), for the TC fallback; and the
//! root qdisc the egress shaper needs: reading what is there, installing
//! `fq` with its horizon, and removing it again.

use std::io;

const RTM_NEWQDISC: u16 = 36;
const RTM_DELQDISC: u16 = 37;
const RTM_GETQDISC: u16 = 38;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_REPLACE: u16 = 0x100;
const TCA_OPTIONS: u16 = 2;
const TC_H_ROOT: u32 = 0xffff_ffff;
// fq's options (include/uapi/linux/pkt_sched.h, enum TCA_FQ_*).
const TCA_FQ_PLIMIT: u16 = 1;
const TCA_FQ_FLOW_PLIMIT: u16 = 2;
const TCA_FQ_HORIZON: u16 = 14;
const TCA_FQ_HORIZON_DROP: u16 = 15;
const RTM_NEWTFILTER: u16 = 44;
const RTM_GETTFILTER: u16 = 46;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const TCA_KIND: u16 = 1;
const TC_H_CLSACT: u32 = 0xffff_fff1;
const TC_H_MIN_INGRESS: u32 = 0xfff2;
const TC_H_MIN_EGRESS: u32 = 0xfff3;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NlMsgHdr {
    len: u32,
    ty: u16,
    flags: u16,
    seq: u32,
    pid: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TcMsg {
    family: u8,
    pad1: u8,
    pad2: u16,
    ifindex: i32,
    handle: u32,
    parent: u32,
    info: u32,
}

struct Socket(std::os::fd::OwnedFd);

impl Socket {
    fn open() -> io::Result<Self> {
        use std::os::fd::FromRawFd;
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    fn send(&self, ty: u16, flags: u16, tc: TcMsg, kind: Option<&[u8]>) -> io::Result<()> {
        let attrs = kind.map(|k| attr(TCA_KIND, k)).unwrap_or_default();
        self.send_attrs(ty, flags, tc, &attrs)
    }

    fn send_attrs(&self, ty: u16, flags: u16, tc: TcMsg, attrs: &[u8]) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut msg = Vec::new();
        let hdr = NlMsgHdr { ty, flags, seq: 1, ..Default::default() };
        msg.extend_from_slice(bytes(&hdr));
        msg.extend_from_slice(bytes(&tc));
        msg.extend_from_slice(attrs);
        let len = msg.len() as u32;
        msg[..4].copy_from_slice(&len.to_ne_bytes());
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        let rc = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                msg.as_ptr() as *const libc::c_void,
                msg.len(),
                0,
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads replies until the ack (or, for a dump, NLMSG_DONE); returns
    /// how many messages of type `count` came.
    fn replies(&self, count: u16) -> io::Result<usize> {
        let mut n = 0;
        self.each_reply(count, |_| n += 1)?;
        Ok(n)
    }

    /// Reads replies until the ack (or NLMSG_DONE), handing the payload
    /// (after the netlink header) of each message of type `ty` to `f`.
    fn each_reply(&self, ty: u16, mut f: impl FnMut(&[u8])) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = unsafe {
                libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0)
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut off = 0usize;
            let n = n as usize;
            while off + size_of::<NlMsgHdr>() <= n {
                let hdr: NlMsgHdr =
                    unsafe { std::ptr::read_unaligned(buf[off..].as_ptr() as *const NlMsgHdr) };
                if (hdr.len as usize) < size_of::<NlMsgHdr>() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "short netlink message",
                    ));
                }
                match hdr.ty {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let at = off + size_of::<NlMsgHdr>();
                        let err = i32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
                        return if err == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-err))
                        };
                    }
                    t if t == ty => {
                        let end = (off + hdr.len as usize).min(n);
                        f(&buf[off + size_of::<NlMsgHdr>()..end]);
                    }
                    _ => {}
                }
                off += (hdr.len as usize).next_multiple_of(4);
            }
        }
    }
}

/// One netlink attribute: length, type, payload, padded to 4 bytes.
fn attr(ty: u16, payload: &[u8]) -> Vec<u8> {
    let mut a = Vec::with_capacity(4 + payload.len() + 3);
    a.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    a.extend_from_slice(&ty.to_ne_bytes());
    a.extend_from_slice(payload);
    a.resize(a.len().next_multiple_of(4), 0);
    a
}

fn bytes<T>(v: &T) -> &[u8] {
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, size_of::<T>()) }
}

/// Removes the `clsact` qdisc of `ifindex` (and with it every filter on it).
pub fn del_clsact(ifindex: u32) -> io::Result<()> {
    let s = Socket::open()?;
    let tc = TcMsg {
        ifindex: ifindex as i32,
        handle: 0xffff_0000,
        parent: TC_H_CLSACT,
        ..Default::default()
    };
    s.send(RTM_DELQDISC, NLM_F_REQUEST | NLM_F_ACK, tc, Some(b"clsact\0"))?;
    s.replies(0).map(|_| ())
}

/// How many filters (of any kind, from anyone) the `clsact` qdisc of
/// `ifindex` holds on its ingress and egress hooks.
pub fn clsact_filters(ifindex: u32) -> io::Result<usize> {
    let mut total = 0;
    for minor in [TC_H_MIN_INGRESS, TC_H_MIN_EGRESS] {
        let s = Socket::open()?;
        let tc = TcMsg {
            ifindex: ifindex as i32,
            parent: (TC_H_CLSACT & 0xffff_0000) | minor,
            ..Default::default()
        };
        s.send(RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP, tc, None)?;
        total += s.replies(RTM_NEWTFILTER)?;
    }
    Ok(total)
}

/// The root qdisc of an interface, as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootQdisc {
    pub kind: String,
    /// 0 for a qdisc the kernel attached by default (no handle given).
    pub handle: u32,
}

impl RootQdisc {
    /// One the kernel attached itself (the default qdisc, `noqueue` of a
    /// virtual device, `mq` of a multi-queue NIC), which replacing loses
    /// nothing an operator configured and deleting ours brings back.
    pub fn is_default(&self) -> bool {
        self.handle == 0
            || matches!(self.kind.as_str(), "noqueue" | "pfifo_fast" | "mq")
                && self.handle & 0xffff_0000 == 0x8000_0000
    }
}

/// The root qdisc of `ifindex` (None: none reported).
pub fn root_qdisc(ifindex: u32) -> io::Result<Option<RootQdisc>> {
    let s = Socket::open()?;
    let tc = TcMsg { ifindex: ifindex as i32, ..Default::default() };
    s.send(RTM_GETQDISC, NLM_F_REQUEST | NLM_F_DUMP, tc, None)?;
    let mut root = None;
    s.each_reply(RTM_NEWQDISC, |m| {
        if m.len() < size_of::<TcMsg>() {
            return;
        }
        let t: TcMsg = unsafe { std::ptr::read_unaligned(m.as_ptr() as *const TcMsg) };
        if t.ifindex as u32 != ifindex || t.parent != TC_H_ROOT {
            return;
        }
        let mut off = size_of::<TcMsg>();
        while off + 4 <= m.len() {
            let len = u16::from_ne_bytes([m[off], m[off + 1]]) as usize;
            let ty = u16::from_ne_bytes([m[off + 2], m[off + 3]]);
            if len < 4 || off + len > m.len() {
                break;
            }
            if ty == TCA_KIND {
                let kind = &m[off + 4..off + len];
                let kind = kind.split(|&b| b == 0).next().unwrap_or_default();
                root = Some(RootQdisc {
                    kind: String::from_utf8_lossy(kind).into_owned(),
                    handle: t.handle,
                });
            }
            off += len.next_multiple_of(4);
        }
    })?;
    Ok(root)
}

/// Installs `fq` as the root qdisc of `ifindex` (replacing a default
/// one), dropping what is stamped more than `horizon_us` ahead, with
/// room for `flow_plimit` packets per flow: the shaper's own horizon
/// governs how long packets wait, not fq's default of 100 per flow.
/// ENOENT: this kernel has no fq (sch_fq).
pub fn add_root_fq(ifindex: u32, horizon_us: u32, flow_plimit: u32) -> io::Result<()> {
    let s = Socket::open()?;
    let tc = TcMsg { ifindex: ifindex as i32, parent: TC_H_ROOT, ..Default::default() };
    let mut opts = Vec::new();
    opts.extend(attr(TCA_FQ_PLIMIT, &(flow_plimit.saturating_mul(4)).to_ne_bytes()));
    opts.extend(attr(TCA_FQ_FLOW_PLIMIT, &flow_plimit.to_ne_bytes()));
    opts.extend(attr(TCA_FQ_HORIZON, &horizon_us.to_ne_bytes()));
    opts.extend(attr(TCA_FQ_HORIZON_DROP, &[1u8]));
    let mut attrs = attr(TCA_KIND, b"fq\0");
    attrs.extend(attr(TCA_OPTIONS, &opts));
    s.send_attrs(
        RTM_NEWQDISC,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        tc,
        &attrs,
    )?;
    s.replies(0).map(|_| ())
}

/// Removes the root qdisc of `ifindex` (the kernel attaches its default
/// again).
pub fn del_root_qdisc(ifindex: u32) -> io::Result<()> {
    let s = Socket::open()?;
    let tc = TcMsg { ifindex: ifindex as i32, parent: TC_H_ROOT, ..Default::default() };
    s.send(RTM_DELQDISC, NLM_F_REQUEST | NLM_F_ACK, tc, None)?;
    s.replies(0).map(|_| ())
}
