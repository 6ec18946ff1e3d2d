//! Crafted frames. Checksums are left zero: XDP sees frames before any
//! checksum validation, and the program never reads them.

pub const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
pub const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 2];

#[derive(Clone, Copy)]
pub enum L4 {
    Udp { sport: u16, dport: u16 },
    Tcp { sport: u16, dport: u16, flags: u8 },
    Icmp,
}

/// Ethernet header with `vlans` tags (outer first) and a final ethertype.
pub fn eth(vlans: &[u16], ether_type: u16) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&DST_MAC);
    f.extend_from_slice(&SRC_MAC);
    for (i, vid) in vlans.iter().enumerate() {
        let tpid: u16 = if i == 0 && vlans.len() == 2 { 0x88a8 } else { 0x8100 };
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&vid.to_be_bytes());
    }
    f.extend_from_slice(&ether_type.to_be_bytes());
    f
}

fn l4_bytes(l4: L4, payload: usize) -> (u8, Vec<u8>) {
    match l4 {
        L4::Udp { sport, dport } => {
            let mut b = Vec::new();
            b.extend_from_slice(&sport.to_be_bytes());
            b.extend_from_slice(&dport.to_be_bytes());
            b.extend_from_slice(&((8 + payload) as u16).to_be_bytes());
            b.extend_from_slice(&[0, 0]);
            b.resize(8 + payload, 0xab);
            (17, b)
        }
        L4::Tcp { sport, dport, flags } => {
            let mut b = vec![0u8; 20];
            b[0..2].copy_from_slice(&sport.to_be_bytes());
            b[2..4].copy_from_slice(&dport.to_be_bytes());
            b[12] = 5 << 4;
            b[13] = flags;
            b.resize(20 + payload, 0xab);
            (6, b)
        }
        L4::Icmp => {
            let mut b = vec![8u8, 0, 0, 0, 0, 1, 0, 1];
            b.resize(8 + payload, 0xab);
            (1, b)
        }
    }
}

/// IPv4 options to append (must be a multiple of 4 bytes).
pub struct V4 {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub options: Vec<u8>,
    /// (fragment offset in 8-byte units, more-fragments flag)
    pub frag: (u16, bool),
    pub vlans: Vec<u16>,
}

impl V4 {
    pub fn new(src: [u8; 4]) -> Self {
        Self { src, dst: [10, 99, 0, 1], options: Vec::new(), frag: (0, false), vlans: Vec::new() }
    }

    pub fn build(&self, l4: L4, payload: usize) -> Vec<u8> {
        let (proto, body) = l4_bytes(l4, payload);
        let mut f = eth(&self.vlans, 0x0800);
        let ihl = 20 + self.options.len();
        // Later fragments carry no L4 header: 8 bytes fewer.
        let body: &[u8] = if self.frag.0 == 0 { &body } else { &body[8..] };
        let tot = (ihl + body.len()) as u16;
        let fo = self.frag.0 | if self.frag.1 { 0x2000 } else { 0 };
        f.push(0x40 | (ihl / 4) as u8);
        f.push(0);
        f.extend_from_slice(&tot.to_be_bytes());
        f.extend_from_slice(&[0, 1]);
        f.extend_from_slice(&fo.to_be_bytes());
        f.push(64);
        f.push(proto);
        f.extend_from_slice(&[0, 0]);
        f.extend_from_slice(&self.src);
        f.extend_from_slice(&self.dst);
        f.extend_from_slice(&self.options);
        f.extend_from_slice(body);
        f
    }
}

/// An IPv6 extension header: (next-header number of this header, bytes).
pub fn ext_hopopts() -> (u8, Vec<u8>) {
    (0, vec![0, 0, 1, 4, 0, 0, 0, 0])
}
pub fn ext_dstopts() -> (u8, Vec<u8>) {
    (60, vec![0, 0, 1, 4, 0, 0, 0, 0])
}
pub fn ext_ah() -> (u8, Vec<u8>) {
    // Payload length 4 => (4 + 2) * 4 = 24 bytes.
    let mut b = vec![0u8; 24];
    b[1] = 4;
    (51, b)
}
pub fn ext_fragment(offset_units: u16, more: bool) -> (u8, Vec<u8>) {
    let fo = (offset_units << 3) | more as u16;
    let mut b = vec![0u8; 8];
    b[2..4].copy_from_slice(&fo.to_be_bytes());
    (44, b)
}

pub struct V6 {
    pub src: [u8; 16],
    /// fd00::1 unless set.
    pub dst: [u8; 16],
    pub ext: Vec<(u8, Vec<u8>)>,
    pub vlans: Vec<u16>,
}

impl V6 {
    pub fn new(src: [u8; 16]) -> Self {
        let mut dst = [0u8; 16];
        dst[0] = 0xfd;
        dst[15] = 1;
        Self { src, dst, ext: Vec::new(), vlans: Vec::new() }
    }

    pub fn build(&self, l4: L4, payload: usize) -> Vec<u8> {
        let (mut proto, body) = l4_bytes(l4, payload);
        if proto == 1 {
            proto = 58;
        }
        let later_fragment =
            self.ext.iter().any(|(n, b)| *n == 44 && u16::from_be_bytes([b[2], b[3]]) >> 3 != 0);
        let mut exts = Vec::new();
        // Chain: each header's first byte is the next header.
        for (i, (_, b)) in self.ext.iter().enumerate() {
            let mut b = b.clone();
            b[0] = self.ext.get(i + 1).map(|e| e.0).unwrap_or(proto);
            exts.extend_from_slice(&b);
        }
        let first = self.ext.first().map(|e| e.0).unwrap_or(proto);
        let body: &[u8] = if later_fragment { &body[8..] } else { &body };
        let mut f = eth(&self.vlans, 0x86dd);
        f.extend_from_slice(&[0x60, 0, 0, 0]);
        f.extend_from_slice(&((exts.len() + body.len()) as u16).to_be_bytes());
        f.push(first);
        f.push(64);
        f.extend_from_slice(&self.src);
        f.extend_from_slice(&self.dst);
        f.extend_from_slice(&exts);
        f.extend_from_slice(body);
        f
    }
}

pub fn arp() -> Vec<u8> {
    let mut f = eth(&[], 0x0806);
    f.resize(42, 0);
    f
}

/// The one's-complement checksum of `parts` (big-endian 16-bit words).
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for p in parts {
        for w in p.chunks(2) {
            sum += u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]) as u32;
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
