//! Header parsing. Every read goes through one bounds check ([`ptr_at`]);
//! offsets are kept below `MAX_HDR_OFF` so the verifier can bound them.
//!
//! Verdicts: `Ok(None)` for frames that are not IP (they always pass),
//! `Err(())` for truncated or malformed headers (the malformed verdict),
//! `Ok(Some(meta))` otherwise. Non-first fragments have no L4 header: their
//! ports stay 0 and `frag` says so.

use aya_ebpf::programs::XdpContext;
use flowctl_common::{frag, PacketMeta, MAX_IPV6_EXT_HEADERS};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, ip::Ipv6Hdr, tcp::TcpHdr, udp::UdpHdr};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const VLAN_LEN: usize = 4;
/// Headers end before this offset, or the packet counts as malformed.
const MAX_HDR_OFF: usize = 1024;

const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;

#[inline(always)]
fn ptr_at<T>(ctx: &XdpContext, off: usize) -> Result<*const T, ()> {
    let start = ctx.data();
    let end = ctx.data_end();
    if off > MAX_HDR_OFF || start + off + core::mem::size_of::<T>() > end {
        return Err(());
    }
    Ok((start + off) as *const T)
}

/// Bytes of a header, read through the pointer that was bounds-checked: the
/// verifier tracks the range on that pointer, and reading through a separately
/// computed one (which LLVM may do when each field has its own check) fails.
#[inline(always)]
fn bytes<const N: usize>(ctx: &XdpContext, off: usize) -> Result<[u8; N], ()> {
    let p = ptr_at::<[u8; N]>(ctx, off)?;
    Ok(unsafe { core::ptr::read_unaligned(p) })
}

#[inline(always)]
fn be16(b: &[u8], i: usize) -> u16 {
    u16::from_be_bytes([b[i], b[i + 1]])
}

#[inline(always)]
fn be32(b: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Option<PacketMeta>, ()> {
    let mut meta = PacketMeta { len: (ctx.data_end() - ctx.data()) as u32, ..PacketMeta::default() };
    let mut off = EthHdr::LEN;
    let eth = bytes::<{ EthHdr::LEN }>(ctx, 0)?;
    let mut ether_type = be16(&eth, 12);
    // Up to two VLAN tags (802.1ad outer, 802.1Q inner, or two 802.1Q).
    if ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        let tag = bytes::<VLAN_LEN>(ctx, off)?;
        ether_type = be16(&tag, 2);
        off += VLAN_LEN;
        if ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
            let tag = bytes::<VLAN_LEN>(ctx, off)?;
            ether_type = be16(&tag, 2);
            off += VLAN_LEN;
        }
    }
    meta.l3_off = off as u16;
    match ether_type {
        ETH_P_IP => parse_ipv4(ctx, off, &mut meta)?,
        ETH_P_IPV6 => parse_ipv6(ctx, off, &mut meta)?,
        _ => return Ok(None),
    }
    Ok(Some(meta))
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, off: usize, meta: &mut PacketMeta) -> Result<(), ()> {
    let h = bytes::<{ Ipv4Hdr::LEN }>(ctx, off)?;
    let vihl = h[0];
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if vihl >> 4 != 4 || ihl < Ipv4Hdr::LEN {
        return Err(());
    }
    // The whole header, options included, must be present.
    ptr_at::<u8>(ctx, off + ihl - 1)?;
    let frags = be16(&h, 6);
    let offset = frags & 0x1fff;
    let more = frags & 0x2000 != 0;
    meta.family = 4;
    meta.proto = h[9];
    meta.src[0] = be32(&h, 12);
    meta.dst[0] = be32(&h, 16);
    meta.frag = if offset != 0 {
        frag::LATER
    } else if more {
        frag::FIRST
    } else {
        frag::NONE
    };
    if meta.frag == frag::LATER {
        return Ok(());
    }
    parse_l4(ctx, off + ihl, meta)
}

#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, off: usize, meta: &mut PacketMeta) -> Result<(), ()> {
    let h = bytes::<{ Ipv6Hdr::LEN }>(ctx, off)?;
    if h[0] >> 4 != 6 {
        return Err(());
    }
    meta.family = 6;
    let mut i = 0;
    while i < 4 {
        meta.src[i] = be32(&h, 8 + i * 4);
        meta.dst[i] = be32(&h, 24 + i * 4);
        i += 1;
    }
    let mut next = h[6];
    let mut off = off + Ipv6Hdr::LEN;
    // Walk extension headers, bounded.
    let mut n = 0;
    while n < MAX_IPV6_EXT_HEADERS {
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                let e = bytes::<2>(ctx, off)?;
                next = e[0];
                off += (e[1] as usize + 1) * 8;
            }
            IPPROTO_AH => {
                // AH length is in 4-byte units, minus 2.
                let e = bytes::<2>(ctx, off)?;
                next = e[0];
                off += (e[1] as usize + 2) * 4;
            }
            IPPROTO_FRAGMENT => {
                let e = bytes::<8>(ctx, off)?;
                let nh = e[0];
                let fo = be16(&e, 2);
                let offset = fo >> 3;
                let more = fo & 1 != 0;
                next = nh;
                off += 8;
                if offset != 0 {
                    meta.frag = frag::LATER;
                } else if more {
                    meta.frag = frag::FIRST;
                }
            }
            _ => break,
        }
        if off > MAX_HDR_OFF {
            return Err(());
        }
        n += 1;
    }
    if n == MAX_IPV6_EXT_HEADERS {
        // More extension headers than we walk: malformed by policy.
        return Err(());
    }
    meta.proto = next;
    if meta.frag == frag::LATER {
        return Ok(());
    }
    parse_l4(ctx, off, meta)
}

#[inline(always)]
fn parse_l4(ctx: &XdpContext, off: usize, meta: &mut PacketMeta) -> Result<(), ()> {
    meta.l4_off = off as u16;
    match meta.proto {
        IPPROTO_TCP => {
            let t = bytes::<{ TcpHdr::LEN }>(ctx, off)?;
            meta.sport = be16(&t, 0);
            meta.dport = be16(&t, 2);
            if ((t[12] >> 4) as usize) * 4 < TcpHdr::LEN {
                return Err(());
            }
            meta.tcp_flags = t[13];
        }
        IPPROTO_UDP => {
            let u = bytes::<{ UdpHdr::LEN }>(ctx, off)?;
            meta.sport = be16(&u, 0);
            meta.dport = be16(&u, 2);
        }
        1 | 58 => {
            // ICMP / ICMPv6: type and code must be present.
            ptr_at::<[u8; 4]>(ctx, off)?;
        }
        _ => {}
    }
    Ok(())
}

/// Folds a 32-bit one's-complement sum into the 16-bit checksum.
#[inline(always)]
fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// Rewrites a TCP SYN, in place, into the RST|ACK a closed port answers
/// with (RFC 9293 3.10.7.1: SEQ 0, ACK = the SYN's SEQ + 1): MACs, addresses
/// and ports swapped, TTL/hop limit 64, TCP header cut to 20 bytes (the
/// caller trims the frame), checksums recomputed. IPv4 options and IPv6
/// extension headers are not handled (Err: the caller drops).
///
/// The IP and TCP headers are rewritten through one bounds-checked pointer:
/// the offsets come from `FLOWCTL_PACKET`, so the verifier knows them only
/// as bounded numbers, and a second pointer computed from the other offset
/// would carry no checked range of its own. The work is done in 16- and
/// 32-bit words in the packet itself: byte-wise, LLVM held every byte in a
/// register and spilled them, which cost the connection function ~400 bytes
/// of stack that the 512-byte call-chain limit cannot spare. Checksums sum
/// words in the machine's byte order, which gives the same checksum bytes
/// (RFC 1071, 2(B)).
#[inline(always)]
pub fn rst_reply(ctx: &XdpContext, meta: &PacketMeta) -> Result<(), ()> {
    let l3 = meta.l3_off as usize;
    let l4 = meta.l4_off as usize;
    let eth = ptr_at::<[u8; 12]>(ctx, 0)? as *mut u8;
    // The pseudo header's protocol (6) and TCP length (20) words.
    let proto_len = (6u16.to_be() as u32) + (20u16.to_be() as u32);
    unsafe {
        if meta.family == 4 {
            if l4 != l3 + 20 {
                // Options would need the checksum over a variable length;
                // rare on SYNs, and a drop is still a refusal.
                return Err(());
            }
            let h = ptr_at::<[u8; 40]>(ctx, l3)? as *mut u8;
            if *h != 0x45 {
                return Err(());
            }
            swap32(h, 12, 16);
            wr16(h, 2, 40u16.to_be()); // total length
            wr16(h, 4, 0); // id
            wr16(h, 6, 0x4000u16.to_be()); // don't fragment
            *h.add(8) = 64; // TTL
            wr16(h, 10, 0);
            wr16(h, 10, fold(sum16(h, 0, 20, 0)));
            rst_tcp(h.add(20), sum16(h, 12, 20, proto_len));
        } else {
            if l4 != l3 + 40 {
                return Err(());
            }
            let h = ptr_at::<[u8; 60]>(ctx, l3)? as *mut u8;
            let mut k = 0;
            while k < 16 {
                swap32(h, 8 + k, 24 + k);
                k += 4;
            }
            wr16(h, 4, 20u16.to_be()); // payload length
            *h.add(7) = 64; // hop limit
            rst_tcp(h.add(40), sum16(h, 8, 40, proto_len));
        }
        swap32(eth, 0, 6);
        let (a, b) = (rd16(eth, 4), rd16(eth, 10));
        wr16(eth, 4, b);
        wr16(eth, 10, a);
    }
    Ok(())
}

#[inline(always)]
unsafe fn rd16(p: *const u8, at: usize) -> u16 {
    core::ptr::read_unaligned(p.add(at) as *const u16)
}

#[inline(always)]
unsafe fn wr16(p: *mut u8, at: usize, v: u16) {
    core::ptr::write_unaligned(p.add(at) as *mut u16, v)
}

#[inline(always)]
unsafe fn rd32(p: *const u8, at: usize) -> u32 {
    core::ptr::read_unaligned(p.add(at) as *const u32)
}

#[inline(always)]
unsafe fn wr32(p: *mut u8, at: usize, v: u32) {
    core::ptr::write_unaligned(p.add(at) as *mut u32, v)
}

/// Swaps the 4 bytes at `a` with the 4 at `b`.
#[inline(always)]
unsafe fn swap32(p: *mut u8, a: usize, b: usize) {
    let (x, y) = (rd32(p, a), rd32(p, b));
    wr32(p, a, y);
    wr32(p, b, x);
}

/// Adds the 16-bit words of `p[from..to]` (machine order) to a one's-complement sum.
#[inline(always)]
unsafe fn sum16(p: *const u8, from: usize, to: usize, mut sum: u32) -> u32 {
    let mut i = from;
    while i + 1 < to {
        sum += rd16(p, i) as u32;
        i += 2;
    }
    sum
}

/// Replaces the SYN's 20-byte TCP header at `t` by the RST|ACK's, with its
/// checksum over `pseudo` (the pseudo header's sum).
#[inline(always)]
unsafe fn rst_tcp(t: *mut u8, pseudo: u32) {
    let ack = u32::from_be(rd32(t, 4)).wrapping_add(1).to_be();
    let (sport, dport) = (rd16(t, 0), rd16(t, 2));
    wr16(t, 0, dport);
    wr16(t, 2, sport);
    wr32(t, 4, 0); // SEQ
    wr32(t, 8, ack);
    wr16(t, 12, u16::from_ne_bytes([5 << 4, 0x14])); // data offset 5; RST | ACK
    wr16(t, 14, 0); // window
    wr32(t, 16, 0); // checksum, urgent pointer
    wr16(t, 16, fold(sum16(t, 0, 20, pseudo)));
}
