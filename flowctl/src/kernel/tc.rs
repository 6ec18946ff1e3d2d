//! The two rtnetlink requests the TC fallback needs and aya 0.14 lacks:
//! deleting the `clsact` qdisc flowctl added, and counting the filters left
//! on it (so a qdisc another flowctl agent's filter still uses stays).

use std::io;

const RTM_DELQDISC: u16 = 37;
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
        use std::os::fd::AsRawFd;
        let mut msg = Vec::new();
        let hdr = NlMsgHdr { ty, flags, seq: 1, ..Default::default() };
        msg.extend_from_slice(bytes(&hdr));
        msg.extend_from_slice(bytes(&tc));
        if let Some(k) = kind {
            let alen = 4 + k.len();
            msg.extend_from_slice(&(alen as u16).to_ne_bytes());
            msg.extend_from_slice(&TCA_KIND.to_ne_bytes());
            msg.extend_from_slice(k);
            msg.resize(msg.len().next_multiple_of(4), 0);
        }
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
        use std::os::fd::AsRawFd;
        let mut buf = vec![0u8; 64 * 1024];
        let mut n_counted = 0;
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
                    NLMSG_DONE => return Ok(n_counted),
                    NLMSG_ERROR => {
                        let at = off + size_of::<NlMsgHdr>();
                        let err = i32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
                        return if err == 0 {
                            Ok(n_counted)
                        } else {
                            Err(io::Error::from_raw_os_error(-err))
                        };
                    }
                    t if t == count => n_counted += 1,
                    _ => {}
                }
                off += (hdr.len as usize).next_multiple_of(4);
            }
        }
    }
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
