//! Header parsing, to the contract of docs/classification.md. Every read
//! goes through one bounds check ([`ptr_at`]), which also keeps offsets
//! inside the parse window so the verifier can bound them.
//!
//! [`parse`] fills a [`PacketMeta`] and says which class the frame is in as
//! far as its headers decide: IP (to be matched), not IP, malformed or
//! evasive. Lengths come from the IP headers (the packet's end), never from
//! what follows them: a stack trims padding, so ports read out of padding
//! would classify bytes the stack never delivers.
//!
//! The parser is three global functions, `flowctl_parse` (Ethernet and VLAN
//! tags), `flowctl_parse_ip` and `flowctl_parse_l4`, that leave the headers
//! in this CPU's `FLOWCTL_PACKET` entry for the rest of the program
//! (docs/design.md, "Verifier budget"). [`rst_reply`] is the reverse: it
//! rewrites a parsed SYN, in place, into the RST that answers it.

use crate::maps::FLOWCTL_PACKET;
use aya_ebpf::{bindings::xdp_md, programs::XdpContext};
use flowctl_common::{
    frag, unparsed, PacketMeta, MAX_IPV6_EXT_HEADERS, MAX_VLAN_TAGS, PARSE_WINDOW,
};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, ip::Ipv6Hdr, tcp::TcpHdr, udp::UdpHdr};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const VLAN_LEN: usize = 4;

const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_DSTOPTS: u8 = 60;

/// What the headers say about a frame (see docs/classification.md).
pub mod class {
    /// IP: match it (the meta says how far the parser got).
    pub const IP: u32 = 0;
    /// Not IP (ARP, LLDP, ...): always passes.
    pub const NOT_IP: u32 = 1;
    /// What the stack drops itself: the profile's malformed verdict.
    pub const MALFORMED: u32 = 2;
    /// Tiny or overlapping fragments, a first IPv6 fragment without its
    /// chain, too many VLAN tags: always dropped.
    pub const EVASIVE: u32 = 3;
}

#[inline(always)]
fn ptr_at<T>(ctx: &XdpContext, off: usize) -> Result<*const T, ()> {
    let start = ctx.data();
    let end = ctx.data_end();
    if off > PARSE_WINDOW - size_of::<T>() || start + off + size_of::<T>() > end {
        return Err(());
    }
    Ok((start + off) as *const T)
}

/// Bytes of a header, read through the pointer that was bounds-checked: the
/// verifier tracks the range on that pointer, and reading through a separately
/// computed one (which LLVM may do when each field has its own check) fails.
#[inline(always)]
pub(crate) fn bytes<const N: usize>(ctx: &XdpContext, off: usize) -> Result<[u8; N], ()> {
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

/// Parses the frame into this CPU's `FLOWCTL_PACKET` entry (`len`: the
/// frame's bytes on the wire, all buffers) and returns its [`class`].
/// XDP runs one packet at a time per CPU (NAPI, softirq), so the entry is
/// this packet's until the program returns.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_parse(ctx: *mut xdp_md, len: u64) -> u32 {
    let Some(slot) = FLOWCTL_PACKET.get_ptr_mut(0) else { return class::MALFORMED };
    parse(&XdpContext::new(ctx), len as usize, unsafe { &mut *slot })
}

/// The IP layer of `flowctl_parse` (see [`parse`]).
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_parse_ip(ctx: *mut xdp_md, off: u64, len: u64, ipv6: u64) -> u32 {
    let Some(slot) = FLOWCTL_PACKET.get_ptr_mut(0) else { return class::MALFORMED };
    parse_ip(&XdpContext::new(ctx), off as usize, len as usize, ipv6 != 0, unsafe { &mut *slot })
}

/// The L4 header of `flowctl_parse` (see [`parse`]), at `off` in a
/// packet that ends at `end`.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_parse_l4(ctx: *mut xdp_md, off: u64, end: u64) -> u32 {
    let Some(slot) = FLOWCTL_PACKET.get_ptr_mut(0) else { return class::MALFORMED };
    parse_l4(&XdpContext::new(ctx), off as usize, end as usize, unsafe { &mut *slot })
}

/// The common layout, parsed inline by the entry point: an untagged
/// Ethernet frame carrying IPv4 without options and not a fragment, or
/// IPv6 without extension headers, then a TCP header with a valid data
/// offset or a UDP header; the Ethernet, IP and first 20 L4 bytes in the
/// frame's first buffer, the L4 header within the IP header's length and
/// the packet within the frame. Returns true when it filled this CPU's
/// `FLOWCTL_PACKET` entry, exactly as [`parse`] would have (class
/// [`class::IP`]); false, having written nothing, for every other frame,
/// which [`flowctl_parse`] then parses in full.
///
/// Why: the parser's global functions cost this layout two calls (IPv6
/// three), and on a host with return thunks each `ret` costs several ns
/// (docs/benchmarks.md, 1k and 1p). Which frames qualify is decided by the
/// header fields alone, so a frame an attacker shapes differently
/// (options, extension headers, tags, fragments, lying lengths) takes the
/// full parser and meets the same rules; the fuzzer holds both paths
/// against the reference (`tests/src/fuzz`, half its profiles each way).
#[inline(always)]
pub fn fast(ctx: &XdpContext, len: u64) -> bool {
    let Ok(eth) = ptr_at::<[u8; EthHdr::LEN]>(ctx, 0) else { return false };
    // SAFETY: the frame's first 14 bytes, checked against its end.
    let ether_type = be16(unsafe { &*eth }, 12);
    if ether_type == ETH_P_IP {
        fast_ipv4(ctx, len)
    } else if ether_type == ETH_P_IPV6 {
        fast_ipv6(ctx, len)
    } else {
        false
    }
}

#[inline(always)]
fn fast_ipv4(ctx: &XdpContext, len: u64) -> bool {
    const L3: usize = EthHdr::LEN;
    const L4: usize = L3 + Ipv4Hdr::LEN;
    let Ok(p) = ptr_at::<[u8; L4 + TcpHdr::LEN]>(ctx, 0) else { return false };
    // SAFETY: `p` is the frame's first 54 bytes, checked against its end;
    // every index below is a constant inside them.
    let h = unsafe { &*p };
    if h[L3] != 0x45 || be16(h, L3 + 6) & 0x3fff != 0 {
        return false;
    }
    let proto = h[L3 + 9];
    let Some(need) = fast_l4_len(h, proto, L4) else { return false };
    let total = be16(h, L3 + 2) as u64;
    if total < (Ipv4Hdr::LEN + need) as u64 || L3 as u64 + total > len {
        return false;
    }
    let Some(meta) = fast_meta(h, len, 4, proto, L4) else { return false };
    meta.src[0] = be32(h, L3 + 12);
    meta.dst[0] = be32(h, L3 + 16);
    true
}

#[inline(always)]
fn fast_ipv6(ctx: &XdpContext, len: u64) -> bool {
    const L3: usize = EthHdr::LEN;
    const L4: usize = L3 + Ipv6Hdr::LEN;
    let Ok(p) = ptr_at::<[u8; L4 + TcpHdr::LEN]>(ctx, 0) else { return false };
    // SAFETY: `p` is the frame's first 74 bytes, checked against its end;
    // every index below is a constant inside them.
    let h = unsafe { &*p };
    if h[L3] >> 4 != 6 {
        return false;
    }
    let proto = h[L3 + 6];
    let Some(need) = fast_l4_len(h, proto, L4) else { return false };
    // The payload length covers the L4 header and ends within the frame
    // (0, a jumbogram's, only with hop-by-hop first, which is not this
    // layout: too short here, so the full parser decides).
    let payload = be16(h, L3 + 4) as u64;
    if payload < need as u64 || L4 as u64 + payload > len {
        return false;
    }
    let Some(meta) = fast_meta(h, len, 6, proto, L4) else { return false };
    let mut i = 0;
    while i < 4 {
        meta.src[i] = be32(h, L3 + 8 + i * 4);
        meta.dst[i] = be32(h, L3 + 24 + i * 4);
        i += 1;
    }
    true
}

/// The L4 header's minimal length for the inline parse: TCP with a data
/// offset of at least 5 words (the full parser calls less malformed) and
/// UDP; None for anything else.
#[inline(always)]
fn fast_l4_len(h: &[u8], proto: u8, l4: usize) -> Option<usize> {
    match proto {
        IPPROTO_TCP if h[l4 + 12] >> 4 >= 5 => Some(TcpHdr::LEN),
        IPPROTO_UDP => Some(UdpHdr::LEN),
        _ => None,
    }
}

/// This CPU's `FLOWCTL_PACKET` entry with every field the inline parse
/// reads but the addresses (the caller's, by family) written, field for
/// field what [`parse`] writes for the same frame. Written in place: a
/// `PacketMeta` built first would take the entry point's frame 56 bytes
/// more, and the call chain has none to spare.
#[inline(always)]
fn fast_meta(
    h: &[u8],
    len: u64,
    family: u8,
    proto: u8,
    l4: usize,
) -> Option<&'static mut PacketMeta> {
    // SAFETY: this CPU's entry, this packet's until the program returns.
    let meta = unsafe { &mut *FLOWCTL_PACKET.get_ptr_mut(0)? };
    meta.src = [0; 4];
    meta.dst = [0; 4];
    meta.len = len as u32;
    meta.sport = be16(h, l4);
    meta.dport = be16(h, l4 + 2);
    meta.family = family;
    meta.proto = proto;
    meta.tcp_flags = if proto == IPPROTO_TCP { h[l4 + 13] } else { 0 };
    meta.frag = frag::NONE;
    meta.unparsed = unparsed::NO;
    meta.l3_off = EthHdr::LEN as u16;
    meta.l4_off = l4 as u16;
    Some(meta)
}

/// Parses the frame into `meta` (`len`: its bytes, all buffers) and returns
/// its [`class`].
#[inline(always)]
fn parse(ctx: &XdpContext, len: usize, meta: &mut PacketMeta) -> u32 {
    *meta = PacketMeta { len: len as u32, ..PacketMeta::default() };
    let Ok(eth) = bytes::<{ EthHdr::LEN }>(ctx, 0) else { return class::MALFORMED };
    let mut ether_type = be16(&eth, 12);
    let mut off = EthHdr::LEN;
    // VLAN tags (802.1ad and 802.1Q, in any order and number, as nested
    // VLAN devices deliver them): MAX_VLAN_TAGS, and a frame with more is
    // evasive (it could hide any IP packet from every rule).
    let mut tags = 0;
    while ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        if tags == MAX_VLAN_TAGS {
            return class::EVASIVE;
        }
        let Ok(tag) = bytes::<VLAN_LEN>(ctx, off) else { return class::MALFORMED };
        ether_type = be16(&tag, 2);
        off += VLAN_LEN;
        tags += 1;
    }
    meta.l3_off = off as u16;
    if ether_type != ETH_P_IP && ether_type != ETH_P_IPV6 {
        return class::NOT_IP;
    }
    // The IP layer and then L4 are global functions, each verified once
    // with unknown offsets: inline, every VLAN depth (a distinct constant
    // offset) and every exit of the IPv6 chain walk multiplied the
    // verifier's work on everything after it.
    flowctl_parse_ip(ctx.ctx, off as u64, len as u64, (ether_type == ETH_P_IPV6) as u64)
}

/// The IP header at `off` and what follows (`ipv6`: which version the
/// EtherType announced).
#[inline(always)]
fn parse_ip(ctx: &XdpContext, off: usize, len: usize, ipv6: bool, meta: &mut PacketMeta) -> u32 {
    if ipv6 {
        parse_ipv6(ctx, off, len, meta)
    } else {
        parse_ipv4(ctx, off, len, meta)
    }
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, off: usize, len: usize, meta: &mut PacketMeta) -> u32 {
    let Ok(h) = bytes::<{ Ipv4Hdr::LEN }>(ctx, off) else { return class::MALFORMED };
    let vihl = h[0];
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if vihl >> 4 != 4 || ihl < Ipv4Hdr::LEN {
        return class::MALFORMED;
    }
    // The whole header, options included, must be present.
    if ptr_at::<u8>(ctx, off + ihl - 1).is_err() {
        return class::MALFORMED;
    }
    let total = be16(&h, 2) as usize;
    if total < ihl || off + total > len {
        return class::MALFORMED;
    }
    let frags = be16(&h, 6);
    let offset = frags & 0x1fff;
    let more = frags & 0x2000 != 0;
    meta.family = 4;
    meta.proto = h[9];
    meta.src[0] = be32(&h, 12);
    meta.dst[0] = be32(&h, 16);
    if offset != 0 {
        meta.frag = frag::LATER;
        // Offsets 1 and 2 (8 and 16 bytes) overlap the first fragment's TCP
        // header and could rewrite its flags (RFC 1858 3.2, RFC 3128).
        if meta.proto == IPPROTO_TCP && offset <= 2 {
            return class::EVASIVE;
        }
        return class::IP;
    }
    if more {
        meta.frag = frag::FIRST;
    }
    // Inline: IPv4 reaches L4 from one place (IPv6's chain walk, from many,
    // calls the global function instead), and most traffic is IPv4.
    parse_l4(ctx, off + ihl, off + total, meta)
}

/// True for the extension header types the parser walks.
#[inline(always)]
fn is_extension(next: u8) -> bool {
    matches!(
        next,
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_FRAGMENT | IPPROTO_AH | IPPROTO_DSTOPTS
    )
}

/// A header that does not end within the packet: malformed, or in a first
/// fragment, evasive (RFC 7112: the first fragment holds the whole chain).
#[inline(always)]
fn cut_short(meta: &PacketMeta) -> u32 {
    if meta.frag == frag::FIRST {
        class::EVASIVE
    } else {
        class::MALFORMED
    }
}

#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, off: usize, len: usize, meta: &mut PacketMeta) -> u32 {
    let Ok(h) = bytes::<{ Ipv6Hdr::LEN }>(ctx, off) else { return class::MALFORMED };
    if h[0] >> 4 != 6 {
        return class::MALFORMED;
    }
    let payload = be16(&h, 4) as usize;
    let mut next = h[6];
    // A zero payload length with hop-by-hop first is a jumbogram (RFC 2675):
    // the frame's end is the packet's.
    let end =
        if payload == 0 && next == IPPROTO_HOPOPTS { len } else { off + Ipv6Hdr::LEN + payload };
    if end > len {
        return class::MALFORMED;
    }
    meta.family = 6;
    let mut i = 0;
    while i < 4 {
        meta.src[i] = be32(&h, 8 + i * 4);
        meta.dst[i] = be32(&h, 24 + i * 4);
        i += 1;
    }
    let mut off = off + Ipv6Hdr::LEN;
    let mut n = 0;
    while n < MAX_IPV6_EXT_HEADERS && is_extension(next) {
        if next == IPPROTO_FRAGMENT {
            if off + 8 > end {
                return cut_short(meta);
            }
            let Ok(e) = bytes::<8>(ctx, off) else {
                return unparsed_at(meta, next, unparsed::PROTO);
            };
            let fo = be16(&e, 2);
            next = e[0];
            off += 8;
            if fo >> 3 != 0 {
                // A later fragment: what follows is the middle of the
                // datagram, not headers.
                meta.frag = frag::LATER;
                meta.proto = next;
                return class::IP;
            }
            if fo & 1 != 0 {
                meta.frag = frag::FIRST;
            }
        } else {
            if off + 2 > end {
                return cut_short(meta);
            }
            let Ok(e) = bytes::<2>(ctx, off) else {
                return unparsed_at(meta, next, unparsed::PROTO);
            };
            // AH counts its length in 4-byte units minus 2, the others in
            // 8-byte units minus 1.
            let hlen =
                if next == IPPROTO_AH { (e[1] as usize + 2) * 4 } else { (e[1] as usize + 1) * 8 };
            if off + hlen > end {
                return cut_short(meta);
            }
            next = e[0];
            off += hlen;
        }
        n += 1;
    }
    if is_extension(next) {
        // The chain goes on past what the parser walks.
        return unparsed_at(meta, next, unparsed::PROTO);
    }
    meta.proto = next;
    flowctl_parse_l4(ctx.ctx, off as u64, end as u64)
}

/// Marks a packet whose L4 the parser cannot reach (docs/classification.md,
/// "unparsed"): classified against every rule that could apply.
#[inline(always)]
fn unparsed_at(meta: &mut PacketMeta, next: u8, how: u8) -> u32 {
    meta.proto = next;
    meta.unparsed = how;
    class::IP
}

/// The L4 header at `off`, in a packet that ends at `end`.
#[inline(always)]
fn parse_l4(ctx: &XdpContext, off: usize, end: usize, meta: &mut PacketMeta) -> u32 {
    meta.l4_off = off as u16;
    let need = match meta.proto {
        IPPROTO_TCP => TcpHdr::LEN,
        IPPROTO_UDP => UdpHdr::LEN,
        IPPROTO_ICMP | IPPROTO_ICMPV6 => 4,
        _ => 0,
    };
    if off + need > end {
        // Not all there: a tiny first fragment (RFC 1858 3.1), or a
        // truncated packet the stack drops.
        return cut_short(meta);
    }
    match meta.proto {
        IPPROTO_TCP => {
            let Ok(t) = bytes::<{ TcpHdr::LEN }>(ctx, off) else {
                return unparsed_at(meta, IPPROTO_TCP, unparsed::PORTS);
            };
            if ((t[12] >> 4) as usize) * 4 < TcpHdr::LEN {
                return class::MALFORMED;
            }
            meta.sport = be16(&t, 0);
            meta.dport = be16(&t, 2);
            meta.tcp_flags = t[13];
        }
        IPPROTO_UDP => {
            let Ok(u) = bytes::<{ UdpHdr::LEN }>(ctx, off) else {
                return unparsed_at(meta, IPPROTO_UDP, unparsed::PORTS);
            };
            meta.sport = be16(&u, 0);
            meta.dport = be16(&u, 2);
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            // Nothing is read from it, but a header past the window is
            // unparsed like any other (docs/classification.md).
            if ptr_at::<[u8; 4]>(ctx, off).is_err() {
                return unparsed_at(meta, meta.proto, unparsed::PORTS);
            }
        }
        _ => {}
    }
    class::IP
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
    // SAFETY: `eth` is the frame's first 12 bytes (the MACs) and `h` the
    // 40 (IPv4) or 60 (IPv6) bytes of the IP and TCP headers at `l3`, each
    // checked against the packet's end by `ptr_at`; every access below is
    // inside one of them: IPv4 bytes 0-19 and TCP at 20-39, IPv6 bytes
    // 4-39 and TCP at 40-59, the MACs at 0-11.
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

/// The 16 bits at `p + at`, unaligned.
///
/// # Safety
///
/// `p + at .. p + at + 2` must be readable: inside a header `ptr_at` checked.
#[inline(always)]
unsafe fn rd16(p: *const u8, at: usize) -> u16 {
    // SAFETY: the caller's bounds; `read_unaligned` needs no alignment.
    unsafe { core::ptr::read_unaligned(p.add(at) as *const u16) }
}

/// Stores 16 bits at `p + at`, unaligned.
///
/// # Safety
///
/// `p + at .. p + at + 2` must be writable: inside a header `ptr_at` checked.
#[inline(always)]
unsafe fn wr16(p: *mut u8, at: usize, v: u16) {
    // SAFETY: the caller's bounds; `write_unaligned` needs no alignment.
    unsafe { core::ptr::write_unaligned(p.add(at) as *mut u16, v) }
}

/// The 32 bits at `p + at`, unaligned.
///
/// # Safety
///
/// `p + at .. p + at + 4` must be readable: inside a header `ptr_at` checked.
#[inline(always)]
unsafe fn rd32(p: *const u8, at: usize) -> u32 {
    // SAFETY: the caller's bounds; `read_unaligned` needs no alignment.
    unsafe { core::ptr::read_unaligned(p.add(at) as *const u32) }
}

/// Stores 32 bits at `p + at`, unaligned.
///
/// # Safety
///
/// `p + at .. p + at + 4` must be writable: inside a header `ptr_at` checked.
#[inline(always)]
unsafe fn wr32(p: *mut u8, at: usize, v: u32) {
    // SAFETY: the caller's bounds; `write_unaligned` needs no alignment.
    unsafe { core::ptr::write_unaligned(p.add(at) as *mut u32, v) }
}

/// Swaps the 4 bytes at `a` with the 4 at `b`.
///
/// # Safety
///
/// `p + a .. p + a + 4` and `p + b .. p + b + 4` must be readable and
/// writable.
#[inline(always)]
unsafe fn swap32(p: *mut u8, a: usize, b: usize) {
    // SAFETY: exactly the two ranges the caller vouches for.
    unsafe {
        let (x, y) = (rd32(p, a), rd32(p, b));
        wr32(p, a, y);
        wr32(p, b, x);
    }
}

/// Adds the 16-bit words of `p[from..to]` (machine order) to a one's-complement sum.
///
/// # Safety
///
/// `p + from .. p + to` must be readable.
#[inline(always)]
unsafe fn sum16(p: *const u8, from: usize, to: usize, mut sum: u32) -> u32 {
    let mut i = from;
    while i + 1 < to {
        // SAFETY: `i + 2 <= to`, so the word is inside the caller's range.
        sum += unsafe { rd16(p, i) } as u32;
        i += 2;
    }
    sum
}

/// Replaces the SYN's 20-byte TCP header at `t` by the RST|ACK's, with its
/// checksum over `pseudo` (the pseudo header's sum).
///
/// # Safety
///
/// `t .. t + 20` must be readable and writable.
#[inline(always)]
unsafe fn rst_tcp(t: *mut u8, pseudo: u32) {
    // SAFETY: every access is within bytes 0-19 of `t`, which the caller
    // vouches for.
    unsafe {
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
}
