//! The rtnetlink socket the requests aya 0.14 lacks are sent on (`tc`'s
//! qdiscs and filters, `xdp`'s replace-if-unchanged and query): one request
//! per socket, its replies read until the ack or the end of a dump.

use std::io;

pub const NLM_F_REQUEST: u16 = 1;
pub const NLM_F_ACK: u16 = 4;
pub const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NlMsgHdr {
    len: u32,
    ty: u16,
    flags: u16,
    seq: u32,
    pid: u32,
}

pub struct Socket(std::os::fd::OwnedFd);

impl Socket {
    pub fn open() -> io::Result<Self> {
        use std::os::fd::FromRawFd;
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    /// Sends one request: the netlink header, the family's fixed header
    /// (`head`: a `tcmsg`, an `ifinfomsg`) and the attributes.
    pub fn request<H>(&self, ty: u16, flags: u16, head: &H, attrs: &[u8]) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut msg = Vec::new();
        let hdr = NlMsgHdr { ty, flags, seq: 1, ..Default::default() };
        msg.extend_from_slice(bytes(&hdr));
        msg.extend_from_slice(bytes(head));
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
    pub fn replies(&self, count: u16) -> io::Result<usize> {
        let mut n = 0;
        self.each_reply(count, |_| n += 1)?;
        Ok(n)
    }

    /// Reads replies until the ack (or NLMSG_DONE), handing the payload
    /// (after the netlink header) of each message of type `ty` to `f`.
    pub fn each_reply(&self, ty: u16, mut f: impl FnMut(&[u8])) -> io::Result<()> {
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

/// Walks the attributes in `buf`, handing each one's type (flags such as
/// NLA_F_NESTED cleared) and payload to `f`.
pub fn each_attr(buf: &[u8], mut f: impl FnMut(u16, &[u8])) {
    let mut off = 0;
    while off + 4 <= buf.len() {
        let len = u16::from_ne_bytes([buf[off], buf[off + 1]]) as usize;
        let ty = u16::from_ne_bytes([buf[off + 2], buf[off + 3]]) & 0x3fff;
        if len < 4 || off + len > buf.len() {
            break;
        }
        f(ty, &buf[off + 4..off + len]);
        off += len.next_multiple_of(4);
    }
}

/// One netlink attribute: length, type, payload, padded to 4 bytes.
pub fn attr(ty: u16, payload: &[u8]) -> Vec<u8> {
    let mut a = Vec::with_capacity(4 + payload.len() + 3);
    a.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    a.extend_from_slice(&ty.to_ne_bytes());
    a.extend_from_slice(payload);
    a.resize(a.len().next_multiple_of(4), 0);
    a
}

pub fn bytes<T>(v: &T) -> &[u8] {
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, size_of::<T>()) }
}
