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

/// Adds the big-endian 16-bit words of `b` to a one's-complement sum.
#[inline(always)]
fn sum_words<const N: usize>(b: &[u8; N], mut sum: u32) -> u32 {
    let mut i = 0;
    while i + 1 < N {
        sum += be16(b, i) as u32;
        i += 2;
    }
    sum
}

/// Rewrites a TCP SYN, in place, into the RST|ACK a closed port answers
/// with (RFC 9293 3.10.7.1: SEQ 0, ACK = the SYN's SEQ + 1): MACs, addresses
/// and ports swapped, TTL/hop limit 64, TCP header cut to 20 bytes (the
/// caller trims the frame), checksums recomputed. IPv4 options and IPv6
/// extension headers are not handled (Err: the caller drops).
///
/// The IP and TCP headers are read and written through one bounds-checked
/// pointer: the offsets come from `FLOWCTL_PACKET`, so the verifier knows
/// them only as bounded numbers, and a second pointer computed from the
/// other offset would carry no checked range of its own.
#[inline(always)]
pub fn rst_reply(ctx: &XdpContext, meta: &PacketMeta) -> Result<(), ()> {
    let l3 = meta.l3_off as usize;
    let l4 = meta.l4_off as usize;
    let eth = ptr_at::<[u8; 12]>(ctx, 0)? as *mut [u8; 12];
    let mut e = unsafe { core::ptr::read_unaligned(eth) };
    let mut i = 0;
    while i < 6 {
        e.swap(i, i + 6);
        i += 1;
    }
    if meta.family == 4 {
        if l4 != l3 + 20 {
            // Options would need the checksum over a variable length; rare
            // on SYNs, and a drop is still a refusal.
            return Err(());
        }
        let p = ptr_at::<[u8; 40]>(ctx, l3)? as *mut [u8; 40];
        let mut h = unsafe { core::ptr::read_unaligned(p) };
        if h[0] != 0x45 {
            return Err(());
        }
        let mut k = 0;
        while k < 4 {
            h.swap(12 + k, 16 + k);
            k += 1;
        }
        let total = (20u16 + 20).to_be_bytes();
        h[2] = total[0];
        h[3] = total[1];
        h[4] = 0;
        h[5] = 0;
        h[6] = 0x40; // don't fragment
        h[7] = 0;
        h[8] = 64;
        h[10] = 0;
        h[11] = 0;
        let mut ip = [0u8; 20];
        let mut k = 0;
        while k < 20 {
            ip[k] = h[k];
            k += 1;
        }
        let c = fold(sum_words(&ip, 0)).to_be_bytes();
        h[10] = c[0];
        h[11] = c[1];
        // Pseudo header: addresses (as now swapped), protocol, TCP length.
        let mut a = [0u8; 8];
        let mut k = 0;
        while k < 8 {
            a[k] = h[12 + k];
            k += 1;
        }
        rst_tcp(&mut h, 20, sum_words(&a, 6 + 20));
        unsafe { core::ptr::write_unaligned(p, h) };
    } else {
        if l4 != l3 + 40 {
            return Err(());
        }
        let p = ptr_at::<[u8; 60]>(ctx, l3)? as *mut [u8; 60];
        let mut h = unsafe { core::ptr::read_unaligned(p) };
        let mut k = 0;
        while k < 16 {
            h.swap(8 + k, 24 + k);
            k += 1;
        }
        h[4] = 0;
        h[5] = 20;
        h[7] = 64;
        let mut a = [0u8; 32];
        let mut k = 0;
        while k < 32 {
            a[k] = h[8 + k];
            k += 1;
        }
        rst_tcp(&mut h, 40, sum_words(&a, 6 + 20));
        unsafe { core::ptr::write_unaligned(p, h) };
    }
    unsafe { core::ptr::write_unaligned(eth, e) };
    Ok(())
}

/// Replaces the SYN's TCP header at `at` in `h` by the RST|ACK's, with its
/// checksum over `pseudo` (the pseudo header's sum).
#[inline(always)]
fn rst_tcp<const N: usize>(h: &mut [u8; N], at: usize, pseudo: u32) {
    let ack = be32(h, at + 4).wrapping_add(1).to_be_bytes();
    let mut r = [0u8; 20];
    r[0] = h[at + 2];
    r[1] = h[at + 3];
    r[2] = h[at];
    r[3] = h[at + 1];
    r[8] = ack[0];
    r[9] = ack[1];
    r[10] = ack[2];
    r[11] = ack[3];
    r[12] = 5 << 4;
    r[13] = 0x14; // RST | ACK
    let c = fold(sum_words(&r, pseudo)).to_be_bytes();
    r[16] = c[0];
    r[17] = c[1];
    let mut k = 0;
    while k < 20 {
        h[at + k] = r[k];
        k += 1;
    }
}
