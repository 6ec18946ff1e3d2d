//! An AF_PACKET socket that writes whole Ethernet frames to one interface
//! of the current namespace: the crafted packets of the flood and evasion
//! tests leave only through the lab's own link.

use std::time::Duration;

/// A send-only AF_PACKET socket bound to one interface.
pub struct PacketSocket(libc::c_int);

impl PacketSocket {
    pub fn on(dev: &str) -> Self {
        let name = std::ffi::CString::new(dev).unwrap();
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert_ne!(ifindex, 0, "no interface {dev} here");
        // Protocol 0: send only. ETH_P_ALL would also queue a copy of every
        // frame the interface carries, the sender's own included, to this
        // socket, which never reads.
        let proto = 0u16;
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto as i32) };
        assert!(fd >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        let r = unsafe {
            libc::bind(
                fd,
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
        Self(fd)
    }

    /// One frame, which the kernel must take at once (a test that sends a
    /// handful of frames and counts each).
    pub fn send(&self, frame: &[u8]) {
        let n = unsafe { libc::send(self.0, frame.as_ptr().cast(), frame.len(), 0) };
        assert_eq!(n, frame.len() as isize, "send: {}", std::io::Error::last_os_error());
    }

    /// One frame of a flood: whether the kernel took it, and how many
    /// attempts it refused first. A full queue (ENOBUFS) is waited out, a
    /// little longer each time, up to about 1 ms.
    pub fn send_waiting(&self, frame: &[u8]) -> (bool, u64) {
        for attempt in 0..20u64 {
            let n = unsafe { libc::send(self.0, frame.as_ptr().cast(), frame.len(), 0) };
            if n == frame.len() as isize {
                return (true, attempt);
            }
            std::thread::sleep(Duration::from_micros(5 * (attempt + 1)));
        }
        (false, 20)
    }
}

impl Drop for PacketSocket {
    fn drop(&mut self) {
        unsafe { libc::close(self.0) };
    }
}
