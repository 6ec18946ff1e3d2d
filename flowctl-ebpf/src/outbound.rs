//! The headers the TC egress programs read of a packet this host sends
//! (`egress`, the KLimiter counter, and `shaper`): family, addresses,
//! protocol and ports. Ethernet with IPv4 or IPv6; IPv6 extension headers
//! are not walked (the packet then has no ports), and an IPv4 later
//! fragment has none either.

use aya_ebpf::programs::TcContext;
use flowctl_common::tcp_flags;

pub struct Outbound {
    pub family: u8,
    pub proto: u8,
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    /// The ports were read (TCP or UDP, first fragment, no extension headers).
    pub has_ports: bool,
    /// A TCP SYN without ACK.
    pub syn: bool,
}

#[inline(always)]
fn bytes<const N: usize>(ctx: &TcContext, off: usize) -> Option<[u8; N]> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if off > 128 || start + off + N > end {
        return None;
    }
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const [u8; N]) })
}

#[inline(always)]
fn word(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The packet's headers, or None for what is not IP over Ethernet (or too
/// short to say).
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Option<Outbound> {
    let eth = bytes::<14>(ctx, 0)?;
    let ether_type = u16::from_be_bytes([eth[12], eth[13]]);
    let mut p = Outbound {
        family: 0,
        proto: 0,
        src: [0; 4],
        dst: [0; 4],
        sport: 0,
        dport: 0,
        has_ports: false,
        syn: false,
    };
    let (l4, ports_follow) = match ether_type {
        0x0800 => {
            let h = bytes::<20>(ctx, 14)?;
            let ihl = ((h[0] & 0x0f) as usize) * 4;
            p.family = 4;
            p.proto = h[9];
            p.src[0] = word(&h, 12);
            p.dst[0] = word(&h, 16);
            let later = u16::from_be_bytes([h[6], h[7]]) & 0x1fff != 0;
            (14 + ihl, !later && ihl >= 20)
        }
        0x86dd => {
            let h = bytes::<40>(ctx, 14)?;
            p.family = 6;
            p.proto = h[6];
            let mut i = 0;
            while i < 4 {
                p.src[i] = word(&h, 8 + i * 4);
                p.dst[i] = word(&h, 24 + i * 4);
                i += 1;
            }
            (14 + 40, true)
        }
        _ => return None,
    };
    if ports_follow && (p.proto == 6 || p.proto == 17) {
        if let Some(ports) = bytes::<4>(ctx, l4) {
            p.sport = u16::from_be_bytes([ports[0], ports[1]]);
            p.dport = u16::from_be_bytes([ports[2], ports[3]]);
            p.has_ports = true;
            // A UDP datagram may be shorter than a TCP header: read the
            // flags only for TCP.
            p.syn = p.proto == 6
                && bytes::<14>(ctx, l4)
                    .is_some_and(|t| t[13] & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN);
        }
    }
    Some(p)
}
