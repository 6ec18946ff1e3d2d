//! The structure-aware generator: seeded (same seed, same frames and
//! profiles), building frames header by header with the lengths, offsets
//! and counts the contract's boundaries are made of, then lying about some
//! of them and cutting some frames anywhere.

use super::reference::{RefProfile, WINDOW};
use flowctl_common::tables::{Cidr, Source};
use std::net::IpAddr;

/// SplitMix64: small, fast, and good enough to pick layouts.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    /// A generator for stream `k` of `seed` (a profile round, its frames).
    pub fn derive(seed: u64, k: u64) -> Self {
        let mut r = Self::new(
            seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        );
        r.next_u64();
        r
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in lo..=hi.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    pub fn u8(&mut self) -> u8 {
        self.next_u64() as u8
    }
    pub fn u16(&mut self) -> u16 {
        self.next_u64() as u16
    }
    /// An index picked by weight.
    pub fn weighted(&mut self, w: &[u32]) -> usize {
        let total: u32 = w.iter().sum();
        let mut x = (self.next_u64() % total as u64) as u32;
        for (i, &wi) in w.iter().enumerate() {
            if x < wi {
                return i;
            }
            x -= wi;
        }
        w.len() - 1
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    pub fn bytes_in(&mut self, lo: u64, hi: u64) -> Vec<u8> {
        let n = self.range(lo, hi) as usize;
        self.bytes(n)
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.u8()).collect()
    }
}

const V4_PREFIXES: &[&str] =
    &["10.0.0.0/8", "10.1.2.0/24", "192.168.7.7/32", "0.0.0.0/0", "172.16.0.0/12", "10.1.0.0/16"];
const V6_PREFIXES: &[&str] =
    &["fd00::/8", "fd00:1::/32", "2001:db8::1/128", "::/0", "2001:db8::/48", "fd00:1:2::/64"];
/// Destination prefixes rules may name: around the frames' usual
/// destination (10.99.0.1, fd99::1), so both sides of each are hit.
const DST_V4_PREFIXES: &[&str] = &["10.99.0.0/16", "10.99.0.1/32", "0.0.0.0/0", "10.98.0.0/15"];
const DST_V6_PREFIXES: &[&str] = &["fd99::/16", "fd99::1/128", "::/0", "fd98::/15"];
const PORTS: &[&str] = &[
    "53",
    "80",
    "443",
    "8080",
    "0",
    "65535",
    "\"8000-8100\"",
    "\"1-1024\"",
    "\"0-65535\"",
    "\"53-54\"",
];

/// Inline `[[list]]`s for a profile (none, one or two, of 1 to 6 prefixes
/// of both families and both sides' neighbourhoods, overlapping each
/// other and the rules' own prefixes), with the names rules may use.
fn lists(rng: &mut Rng) -> (String, Vec<&'static str>) {
    let n = rng.weighted(&[60, 25, 15]);
    let names = ["l0", "l1"];
    let mut t = String::new();
    for name in &names[..n] {
        let entries: Vec<String> = (0..rng.range(1, 6))
            .map(|_| {
                let pool = rng.pick(&[V4_PREFIXES, V6_PREFIXES, DST_V4_PREFIXES, DST_V6_PREFIXES]);
                format!("\"{}\"", rng.pick(pool))
            })
            .collect();
        t += &format!("\n[[list]]\nname = \"{name}\"\nentries = [{}]\n", entries.join(", "));
    }
    (t, names[..n].to_vec())
}

/// A random profile: 1 to 8 rules on ports, ranges, prefixes, lists
/// (on either side) and protocols, every action, both `malformed` and
/// `fragments` verdicts. Rates are huge so that no packet is ever refused.
pub fn profile(rng: &mut Rng) -> String {
    let mut t = String::from("[settings]\nkey_table_entries = 4096\nsource_cache_entries = 4096\nquota_table_entries = 1024\nconnection_table_entries = 1024\n");
    if rng.chance(0.5) {
        t += "malformed = \"drop\"\n";
    }
    if rng.chance(0.5) {
        t += "fragments = \"drop\"\n";
    }
    let (list_text, list_names) = lists(rng);
    // A list named on a side (a third of the rules when there are lists).
    let a_list = |rng: &mut Rng| {
        (!list_names.is_empty() && rng.chance(0.33))
            .then(|| format!("\"@{}\"", rng.pick(&list_names)))
    };
    let n = rng.range(1, 8);
    for i in 0..n {
        t += &format!("\n[[rule]]\nname = \"r{i}\"\n");
        let proto = match rng.weighted(&[30, 30, 8, 8, 16, 8]) {
            0 => Some("\"tcp\""),
            1 => Some("\"udp\""),
            2 => Some("\"icmp\""),
            3 => Some("\"icmpv6\""),
            4 => None,
            _ => Some(rng.pick(&["50", "47", "132", "44", "60", "59"])),
        };
        if let Some(p) = proto {
            t += &format!("proto = {p}\n");
            if (p == "\"tcp\"" || p == "\"udp\"") && rng.chance(0.65) {
                t += &format!("dport = {}\n", rng.pick(PORTS));
            }
        }
        let family = match rng.weighted(&[40, 30, 30]) {
            _ if let Some(l) = a_list(rng) => {
                t += &format!("src = {l}\n");
                None
            }
            0 => None,
            1 => {
                t += &format!("src = \"{}\"\n", rng.pick(V4_PREFIXES));
                Some(4)
            }
            _ => {
                t += &format!("src = \"{}\"\n", rng.pick(V6_PREFIXES));
                Some(6)
            }
        };
        // A destination on a quarter of the rules, of the source's family
        // (the profile refuses a rule that could never match).
        if rng.chance(0.25) {
            if let Some(l) = a_list(rng) {
                t += &format!("dst = {l}\n");
            } else {
                let v6 = family.map_or_else(|| rng.chance(0.5), |f| f == 6);
                let pick = if v6 { DST_V6_PREFIXES } else { DST_V4_PREFIXES };
                t += &format!("dst = \"{}\"\n", rng.pick(pick));
            }
        }
        // Every key kind: unparsed packets and later fragments are keyed
        // without their ports.
        let key = rng.pick(&["rule", "rule", "src", "src_prefix", "dport", "src_dport", "5tuple"]);
        match rng.weighted(&[55, 20, 25]) {
            0 => t += &format!("action = \"drop\"\nrate = \"1000000000/s\"\nkey = \"{key}\"\n"),
            1 => t += "action = \"pass\"\n",
            _ => t += &format!("action = \"dry-run\"\nrate = \"1000000000/s\"\nkey = \"{key}\"\n"),
        }
    }
    t + &list_text
}

/// What frames aim at: the profile's prefixes and ports (and neighbours).
pub struct Targets {
    src: Prefixes,
    dst: Prefixes,
    ports: Vec<u16>,
    protos: Vec<u8>,
    /// Longest frame to make: [`MAX_FRAME`] for the single-buffer program;
    /// more for the multi-buffer one (frames spread over several buffers).
    pub max_frame: usize,
}

impl Targets {
    pub fn of(p: &RefProfile) -> Self {
        let (mut src, mut dst) = (Prefixes::default(), Prefixes::default());
        let (mut ports, mut protos) = (vec![53u16, 80, 443], vec![]);
        for r in &p.rules {
            src.add(&r.src);
            dst.add(&r.dst);
            if let Some((lo, hi)) = r.ports {
                ports.extend([lo, hi, lo.wrapping_sub(1), hi.wrapping_add(1), lo + (hi - lo) / 2]);
            }
            if let Some(pr) = r.proto {
                protos.push(pr);
            }
        }
        Self { src, dst, ports, protos, max_frame: MAX_FRAME }
    }
}

/// The prefixes of one side that frames aim at.
#[derive(Default)]
struct Prefixes {
    v4: Vec<(u32, u8)>,
    v6: Vec<(u128, u8)>,
}

impl Prefixes {
    fn add(&mut self, side: &Option<Source>) {
        let prefixes: &[Cidr] = match side {
            None => &[],
            Some(Source::Prefix(c)) => std::slice::from_ref(c),
            // Aim at a list's first prefixes (a long list would crowd
            // out every other target).
            Some(Source::List(l)) => &l.prefixes[..l.prefixes.len().min(16)],
        };
        for c in prefixes {
            match c.addr {
                IpAddr::V4(a) => self.v4.push((u32::from(a), c.len)),
                IpAddr::V6(a) => self.v6.push((u128::from(a), c.len)),
            }
        }
    }

    fn v4(&self, rng: &mut Rng) -> [u8; 4] {
        if !self.v4.is_empty() && rng.chance(0.7) {
            let (a, len) = self.v4[rng.below(self.v4.len())];
            let host = if len == 32 { 0 } else { (rng.next_u64() as u32) >> len };
            let mut x = a | host;
            if len > 0 && rng.chance(0.15) {
                x ^= 1 << (32 - len); // just outside
            }
            return x.to_be_bytes();
        }
        (rng.next_u64() as u32).to_be_bytes()
    }

    fn v6(&self, rng: &mut Rng) -> [u8; 16] {
        if !self.v6.is_empty() && rng.chance(0.7) {
            let (a, len) = self.v6[rng.below(self.v6.len())];
            let r = (rng.next_u64() as u128) << 64 | rng.next_u64() as u128;
            let host = if len == 128 { 0 } else { r >> len };
            let mut x = a | host;
            if len > 0 && rng.chance(0.15) {
                x ^= 1 << (128 - len);
            }
            return x.to_be_bytes();
        }
        let r = (rng.next_u64() as u128) << 64 | rng.next_u64() as u128;
        (r & !(0xff << 120) | (0xfd << 120)).to_be_bytes()
    }
}

impl Targets {
    fn port(&self, rng: &mut Rng) -> u16 {
        if rng.chance(0.75) {
            rng.pick(&self.ports)
        } else {
            rng.u16()
        }
    }

    fn proto(&self, rng: &mut Rng, v6: bool) -> u8 {
        if !self.protos.is_empty() && rng.chance(0.25) {
            return rng.pick(&self.protos);
        }
        match rng.weighted(&[35, 35, 12, 3, 15]) {
            0 => 6,
            1 => 17,
            2 if v6 => 58,
            2 => 1,
            3 if v6 => 1,
            3 => 58,
            _ => {
                let x = rng.u8();
                rng.pick(&[47, 50, 132, 59, 0, 255, 143, 44, 60, x])
            }
        }
    }
}

/// Frames stay at most this long for the single-buffer program (one
/// buffer for BPF_PROG_TEST_RUN: 4096 less headroom and shared info).
pub const MAX_FRAME: usize = 3000;
/// For the multi-buffer program: a jumbo frame (MTU 9000).
pub const MAX_JUMBO_FRAME: usize = 9018;

fn payload_len(rng: &mut Rng, room: usize) -> usize {
    match rng.weighted(&[30, 50, 15, 5, if room > MAX_FRAME { 3 } else { 0 }]) {
        0 => 0,
        1 => rng.range(1, 64) as usize,
        2 => rng.range(64, 1400) as usize,
        3 => rng.range(1400, 2700) as usize,
        _ => rng.range(2700, room as u64) as usize,
    }
}

/// An L4 header (TCP with any data offset and flags, UDP, ICMP) and payload;
/// random bytes for other protocols.
fn l4(rng: &mut Rng, t: &Targets, proto: u8, room: usize) -> Vec<u8> {
    let pay = payload_len(rng, room).min(room.saturating_sub(60));
    let mut b = match proto {
        6 => {
            let doff: u8 = if rng.chance(0.7) { 5 } else { rng.range(0, 15) as u8 };
            let mut h = vec![0u8; 20.max(doff as usize * 4)];
            h[0..2].copy_from_slice(&rng.u16().to_be_bytes());
            h[2..4].copy_from_slice(&t.port(rng).to_be_bytes());
            h[4..12].copy_from_slice(&rng.bytes(8));
            h[12] = doff << 4 | (rng.u8() & 1);
            h[13] = rng.u8();
            for x in h.iter_mut().skip(20) {
                *x = {
                    let x = rng.u8();
                    rng.pick(&[1u8, 0, x])
                };
            }
            h
        }
        17 => {
            let mut h = vec![0u8; 8];
            h[0..2].copy_from_slice(&rng.u16().to_be_bytes());
            h[2..4].copy_from_slice(&t.port(rng).to_be_bytes());
            h[4..6].copy_from_slice(&((8 + pay) as u16).to_be_bytes());
            h
        }
        1 | 58 => vec![rng.pick(&[8u8, 0, 128, 129, 3, 1]), rng.u8() & 3, 0, 0, 0, 1, 0, 1],
        _ => rng.bytes_in(0, 40),
    };
    b.extend(rng.bytes(pay));
    b
}

/// A first fragment's L4 bytes cut short: mostly inside the L4 header.
fn cut_tiny(rng: &mut Rng, b: &mut Vec<u8>) {
    let k = if rng.chance(0.7) {
        rng.range(0, 24) as usize
    } else {
        rng.range(0, b.len() as u64) as usize
    };
    b.truncate(k.min(b.len()));
}

/// A later fragment's offset: 1, 2, 3 often, anything else too.
fn later_offset(rng: &mut Rng) -> u16 {
    if rng.chance(0.5) {
        rng.range(1, 4) as u16
    } else {
        rng.range(1, 8191) as u16
    }
}

pub fn frame(rng: &mut Rng, t: &Targets) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1];
    let tags = rng.weighted(&[55, 12, 12, 8, 8, 3, 2]);
    for _ in 0..tags {
        f.extend(rng.pick(&[0x8100u16, 0x88a8]).to_be_bytes());
        f.extend(rng.u16().to_be_bytes());
    }
    match rng.weighted(&[45, 45, 10]) {
        0 => {
            f.extend(0x0800u16.to_be_bytes());
            let room = t.max_frame - f.len();
            f.extend(ipv4(rng, t, room));
        }
        1 => {
            f.extend(0x86ddu16.to_be_bytes());
            let room = t.max_frame - f.len();
            f.extend(ipv6(rng, t, room));
        }
        _ => {
            f.extend(
                {
                    let x = rng.u16();
                    rng.pick(&[0x0806u16, 0x88cc, 0x8847, 0x0801, 0x86dc, x])
                }
                .to_be_bytes(),
            );
            f.extend(rng.bytes_in(0, 60));
        }
    }
    if rng.chance(0.1) {
        f.extend(rng.bytes_in(1, 64)); // padding after the packet's end
    }
    if rng.chance(0.15) && f.len() > 15 {
        let cut = rng.range(14, f.len() as u64 - 1) as usize;
        f.truncate(cut);
    }
    f.truncate(t.max_frame);
    f
}

/// A length field: right, or a lie (shorter, longer, anything).
fn lie(rng: &mut Rng, right: usize) -> u16 {
    match rng.weighted(&[82, 8, 7, 3]) {
        0 => right as u16,
        1 => rng.range(0, right as u64) as u16,
        2 => (right + rng.range(1, 100) as usize).min(65535) as u16,
        _ => rng.u16(),
    }
}

fn ipv4(rng: &mut Rng, t: &Targets, room: usize) -> Vec<u8> {
    let ihl: usize = match rng.weighted(&[75, 20, 5]) {
        0 => 5,
        1 => rng.range(6, 15) as usize,
        _ => rng.range(0, 4) as usize,
    };
    let version = if rng.chance(0.97) { 4 } else { rng.range(0, 15) as u8 };
    let proto = t.proto(rng, false);
    let hlen = ihl.max(5) * 4;
    let mut h = vec![0u8; 20];
    h[0] = version << 4 | ihl as u8;
    h[1] = rng.u8();
    h[4..6].copy_from_slice(&rng.u16().to_be_bytes());
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&t.src.v4(rng));
    // The destination: the usual one, unless rules name destinations.
    let dst = if t.dst.v4.is_empty() { [10, 99, 0, 1] } else { t.dst.v4(rng) };
    h[16..20].copy_from_slice(&dst);
    for _ in 20..hlen {
        h.push({
            let x = rng.u8();
            rng.pick(&[1u8, 1, 0, x])
        });
    }
    let df = if rng.chance(0.3) { 0x4000 } else { 0 };
    let mut body = l4(rng, t, proto, room - hlen);
    let frag: u16 = match rng.weighted(&[68, 12, 20]) {
        0 => df,
        1 => {
            if rng.chance(0.6) {
                cut_tiny(rng, &mut body);
            }
            0x2000 // first fragment
        }
        _ => {
            let off = later_offset(rng);
            if rng.chance(0.5) {
                body = rng.bytes_in(0, 64);
            }
            off | if rng.chance(0.5) { 0x2000 } else { 0 }
        }
    };
    if rng.chance(0.01) {
        h[6] |= 0x80; // the reserved bit
    }
    let field = frag | u16::from_be_bytes([h[6] & 0x80, 0]);
    h[6..8].copy_from_slice(&field.to_be_bytes());
    let tl = lie(rng, hlen + body.len());
    h[2..4].copy_from_slice(&tl.to_be_bytes());
    h.extend(body);
    h
}

fn ext_len_field(rng: &mut Rng, big_ok: bool) -> u8 {
    match rng.weighted(&[60, 30, if big_ok { 10 } else { 0 }]) {
        0 => 0,
        1 => rng.range(1, 8) as u8,
        _ => rng.range(9, 255) as u8,
    }
}

fn ipv6(rng: &mut Rng, t: &Targets, room: usize) -> Vec<u8> {
    let mut h = vec![0u8; 40];
    let version = if rng.chance(0.97) { 6 } else { rng.range(0, 15) as u8 };
    h[0] = version << 4;
    h[7] = 64;
    h[8..24].copy_from_slice(&t.src.v6(rng));
    let dst = if t.dst.v6.is_empty() {
        [0xfd, 0x99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    } else {
        t.dst.v6(rng)
    };
    h[24..40].copy_from_slice(&dst);
    let n = match rng.weighted(&[28, 25, 15, 12, 8, 12]) {
        0 => 0,
        1 => rng.range(1, 3) as usize,
        2 => rng.range(4, 7) as usize,
        3 => 8,
        4 => 9,
        _ => rng.range(10, 12) as usize,
    };
    // Aim the L4 header at the window's edge now and then.
    let aim = rng.chance(0.06).then(|| rng.range(WINDOW as u64 - 40, WINDOW as u64 + 16) as usize);
    let mut types: Vec<u8> = (0..n).map(|_| rng.pick(&[0u8, 43, 44, 60, 60, 51])).collect();
    if n > 0 && rng.chance(0.4) {
        types[0] = 0;
    }
    // The aimed header is the last (the L4 header lands at the edge) or the
    // one before it (the last extension header does).
    let aimed = if n >= 2 && rng.chance(0.5) { n - 2 } else { n.saturating_sub(1) };
    if aim.is_some() && n > 0 {
        types[aimed] = 60;
    }
    let mut chain: Vec<Vec<u8>> = Vec::new();
    let mut used = 40usize;
    let mut first_frag = false;
    let mut later = false;
    for (i, &ty) in types.iter().enumerate() {
        let mut e = match ty {
            44 => {
                let (off, m) = match rng.weighted(&[35, 15, 50]) {
                    0 => (0, 1),
                    1 => (0, 0),
                    _ => (later_offset(rng), rng.below(2) as u16),
                };
                if off == 0 && m == 1 {
                    first_frag = true;
                }
                if off != 0 {
                    later = true;
                }
                let mut e = vec![0u8, 0];
                e.extend((off << 3 | m).to_be_bytes());
                e.extend(rng.bytes(4));
                e
            }
            51 => {
                let pl =
                    if rng.chance(0.7) { rng.range(1, 6) as u8 } else { rng.range(0, 40) as u8 };
                let mut e = vec![0u8, pl];
                e.extend(rng.bytes((pl as usize + 2) * 4 - 2));
                e
            }
            _ => {
                let mut len = ext_len_field(rng, used < 1200 && room > 2200);
                if let Some(target) = aim {
                    if i == aimed {
                        // The L3 start is what the frame holds so far.
                        let l3 = t.max_frame - room;
                        let want = target.saturating_sub(l3 + used) / 8;
                        len = want.clamp(1, 256).saturating_sub(1) as u8;
                    }
                }
                let mut e = vec![0u8, len];
                e.extend(rng.bytes((len as usize + 1) * 8 - 2));
                e
            }
        };
        if used + e.len() > room.saturating_sub(100) {
            e.truncate(8);
            e[1] = 0;
        }
        used += e.len();
        chain.push(e);
    }
    let last = if rng.chance(0.85) {
        t.proto(rng, true)
    } else {
        rng.pick(&[59u8, 50, 253, 143, 135, 139])
    };
    // Link the next-header fields.
    let mut nh_of: Vec<u8> = types.clone();
    nh_of.push(last);
    h[6] = nh_of[0];
    for (i, e) in chain.iter_mut().enumerate() {
        e[0] = nh_of[i + 1];
    }
    let mut body: Vec<u8> = chain.concat();
    let mut l4b = if later && rng.chance(0.5) {
        rng.bytes_in(0, 64)
    } else {
        l4(rng, t, last, room.saturating_sub(body.len() + 40))
    };
    if first_frag && rng.chance(0.4) {
        cut_tiny(rng, &mut l4b);
    }
    body.extend(l4b);
    if first_frag && rng.chance(0.15) {
        // cut inside the chain
        let k = rng.range(0, body.len() as u64) as usize;
        body.truncate(k);
    }
    let plen = if n > 0 && types[0] == 0 && rng.chance(0.08) { 0 } else { lie(rng, body.len()) };
    h[4..6].copy_from_slice(&plen.to_be_bytes());
    h.extend(body);
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz::reference::{classify, RefProfile};

    /// Same seed, same profiles and frames; every frame (and every cut of
    /// some) classifies without a panic, and fits one test-run buffer.
    #[test]
    fn seeded_and_total() {
        let make = |seed| {
            let mut r = Rng::derive(seed, 0);
            let text = profile(&mut r);
            let p = RefProfile::parse(&text).unwrap();
            let t = Targets::of(&p);
            let frames: Vec<Vec<u8>> = (0..3000).map(|_| frame(&mut r, &t)).collect();
            (text, p, frames)
        };
        let (a, p, fa) = make(5);
        let (b, _, fb) = make(5);
        assert_eq!(a, b);
        assert_eq!(fa, fb);
        for f in &fa {
            assert!(f.len() >= 14 && f.len() <= MAX_FRAME);
            classify(f, &p);
            for cut in (14..f.len()).step_by(7) {
                classify(&f[..cut], &p);
            }
        }
        let mut r = Rng::new(9);
        for _ in 0..20_000 {
            let n = r.range(0, 200) as usize;
            classify(&r.bytes(n), &p);
        }
    }
}

#[cfg(test)]
mod jumbo {
    use super::*;

    /// With the multi-buffer program's limit, some frames are longer than
    /// one test-run buffer (3520 bytes) and none longer than the limit.
    /// Every generated profile is accepted, and over a few hundred of them
    /// lists appear on both sides and destinations as prefixes.
    #[test]
    fn profiles_parse_and_use_lists_on_both_sides() {
        let (mut src_lists, mut dst_lists, mut dst_prefixes) = (0, 0, 0);
        for seed in 0..300 {
            let text = profile(&mut Rng::derive(seed, 0));
            let p = RefProfile::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            for r in &p.rules {
                src_lists += matches!(r.src, Some(Source::List(_))) as u32;
                dst_lists += matches!(r.dst, Some(Source::List(_))) as u32;
                dst_prefixes += matches!(r.dst, Some(Source::Prefix(_))) as u32;
            }
        }
        assert!(
            src_lists > 50 && dst_lists > 5 && dst_prefixes > 50,
            "{src_lists} {dst_lists} {dst_prefixes}"
        );
    }

    #[test]
    fn jumbo_frames_are_made() {
        let mut r = Rng::derive(3, 1);
        let p = RefProfile::parse(
            "[[rule]]\nname = \"a\"\nproto = \"udp\"\ndport = 53\naction = \"pass\"\n",
        )
        .unwrap();
        let mut t = Targets::of(&p);
        t.max_frame = MAX_JUMBO_FRAME;
        let lens: Vec<usize> = (0..20_000).map(|_| frame(&mut r, &t).len()).collect();
        let big = lens.iter().filter(|&&l| l > 3520).count();
        assert!(big > 100, "{big} frames over one buffer");
        assert!(lens.iter().all(|&l| l <= MAX_JUMBO_FRAME));
    }
}
