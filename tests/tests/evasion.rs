//! Issue 13's layouts end to end: crafted frames sent with a packet socket
//! through a veth pair into a namespace whose stack really delivers them.
//! Each layout first reaches its socket without flowctl (so the stack does
//! deliver it and the test means something), then, with the real binary
//! attached and the rule drained, must not: the tiny-fragment SYN (RFC
//! 1858), an IPv6 datagram behind exactly eight extension headers, and one
//! behind a 2 KiB destination-options header on a jumbo-MTU link.

use flowctl_tests::{
    agent::Agent,
    cli::{agent_ready, attachment},
    lab::{mac, sh, Lab},
    need::in_vm,
    packet::checksum,
    tempfile::TempFile,
};
use std::{
    net::UdpSocket,
    time::{Duration, Instant},
};

const SRV6: [u8; 16] = [0xfd, 0x13, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const CLI6: [u8; 16] = [0xfd, 0x13, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
/// Copies of each layout sent per phase.
const COPIES: usize = 5;

/// The agent on the lab's protected side, once ready (SIGINT on drop: it
/// detaches).
fn attach(lab: &Lab, profile: &TempFile) -> Agent {
    let up_within = Duration::from_secs(if in_vm() { 180 } else { 20 });
    let cmd = Agent::attach(lab, profile.path(), &[]);
    Agent::spawn(cmd, up_within, Duration::from_secs(3), || agent_ready(&lab.veth_srv))
}

struct Frames {
    eth: Vec<u8>,
    eth6: Vec<u8>,
    src4: [u8; 4],
    dst4: [u8; 4],
}

impl Frames {
    fn new(dst: [u8; 6], src: [u8; 6], src4: [u8; 4], dst4: [u8; 4]) -> Self {
        let mut eth = dst.to_vec();
        eth.extend_from_slice(&src);
        let mut eth6 = eth.clone();
        eth.extend_from_slice(&[0x08, 0x00]);
        eth6.extend_from_slice(&[0x86, 0xdd]);
        Self { eth, eth6, src4, dst4 }
    }

    /// A 20-byte TCP SYN header from `sport` to `dport`, checksummed.
    fn syn(&self, sport: u16, dport: u16) -> Vec<u8> {
        let mut tcp = vec![0u8; 20];
        tcp[0..2].copy_from_slice(&sport.to_be_bytes());
        tcp[2..4].copy_from_slice(&dport.to_be_bytes());
        tcp[4..8].copy_from_slice(&0x1357_9bdfu32.to_be_bytes());
        tcp[12] = 5 << 4;
        tcp[13] = 0x02;
        tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
        let pseudo = [&self.src4[..], &self.dst4[..], &[0, 6, 0, 20]].concat();
        let c = checksum(&[&pseudo, &tcp]);
        tcp[16..18].copy_from_slice(&c.to_be_bytes());
        tcp
    }

    /// An IPv4 frame carrying `payload` of protocol `proto`, with flags and
    /// fragment offset `fo` and identification `id`.
    fn ipv4(&self, proto: u8, payload: &[u8], fo: u16, id: u16) -> Vec<u8> {
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, proto, 0, 0];
        ip[2..4].copy_from_slice(&(20 + payload.len() as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&id.to_be_bytes());
        ip[6..8].copy_from_slice(&fo.to_be_bytes());
        ip.extend_from_slice(&self.src4);
        ip.extend_from_slice(&self.dst4);
        let c = checksum(&[&ip]);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        [&self.eth[..], &ip, payload].concat()
    }

    /// A SYN split after 8 bytes of its TCP header (RFC 1858's tiny
    /// fragment): the first fragment (MF) carries the ports and sequence
    /// number, the second (offset 1) the flags.
    fn tiny_fragment_syn(&self, sport: u16, dport: u16) -> [Vec<u8>; 2] {
        let tcp = self.syn(sport, dport);
        [self.ipv4(6, &tcp[..8], 0x2000, sport), self.ipv4(6, &tcp[8..], 1, sport)]
    }

    /// A UDP datagram to [SRV6]:`dport` behind extension headers `ext`
    /// (each: next-header number, bytes; chained in order).
    fn udp6_behind(&self, ext: &[(u8, Vec<u8>)], dport: u16) -> Vec<u8> {
        let payload = b"flowctl evasion test";
        let mut udp = vec![0u8; 8];
        udp[0..2].copy_from_slice(&4053u16.to_be_bytes());
        udp[2..4].copy_from_slice(&dport.to_be_bytes());
        udp[4..6].copy_from_slice(&(8 + payload.len() as u16).to_be_bytes());
        udp.extend_from_slice(payload);
        let pseudo =
            [&CLI6[..], &SRV6[..], &(udp.len() as u32).to_be_bytes(), &[0, 0, 0, 17]].concat();
        let c = checksum(&[&pseudo, &udp]);
        udp[6..8].copy_from_slice(&c.to_be_bytes());
        let mut chain = Vec::new();
        for (i, (_, b)) in ext.iter().enumerate() {
            let mut b = b.clone();
            b[0] = ext.get(i + 1).map(|e| e.0).unwrap_or(17);
            chain.extend_from_slice(&b);
        }
        let mut ip = vec![0x60, 0, 0, 0];
        ip.extend_from_slice(&((chain.len() + udp.len()) as u16).to_be_bytes());
        ip.push(ext.first().map(|e| e.0).unwrap_or(17));
        ip.push(64);
        ip.extend_from_slice(&CLI6);
        ip.extend_from_slice(&SRV6);
        [&self.eth6[..], &ip, &chain, &udp].concat()
    }
}

/// An options header (hop-by-hop 0 or destination options 60) of 8 bytes.
fn small_opts(kind: u8) -> (u8, Vec<u8>) {
    (kind, vec![0, 0, 1, 4, 0, 0, 0, 0])
}

/// A 2048-byte destination-options header of eight options of an unknown
/// type whose action is "skip" (high bits 00), as Linux delivers (up to
/// net.ipv6.max_dst_opts_number = 8; it refuses padding runs over 7 bytes).
fn long_dstopts() -> (u8, Vec<u8>) {
    let mut b = vec![0u8, 255];
    for i in 0..8 {
        let len = if i < 7 { 255 } else { 2046 - 7 * 257 - 2 };
        b.push(0x1e);
        b.push(len as u8);
        b.extend(std::iter::repeat_n(0u8, len));
    }
    assert_eq!(b.len(), 2048);
    (60, b)
}

/// Sends frames out of `dev` with a packet socket (run inside its namespace).
fn send(dev: &str, frames: &[Vec<u8>]) {
    let sock = flowctl_tests::packet_socket::PacketSocket::on(dev);
    for f in frames {
        sock.send(f);
    }
}

/// Datagrams that reached `sock` within a short, bounded wait.
fn drain(sock: &UdpSocket) -> usize {
    let mut n = 0;
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_millis(if in_vm() { 3000 } else { 500 });
    while Instant::now() < deadline {
        match sock.recv(&mut buf) {
            Ok(_) => n += 1,
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    n
}

/// SYNs to port 53 the server's stack took in (after reassembly), from the
/// nftables counter at input.
fn syns_in(ns: &str) -> u64 {
    let out = sh(&["ip", "netns", "exec", ns, "nft", "list", "chain", "inet", "flowctl_ev", "in"]);
    let at = out.find("packets ").expect("nft counter");
    out[at + 8..].split_whitespace().next().unwrap().parse().unwrap()
}

/// One phase: every layout `COPIES` times; returns (SYNs at input, datagrams
/// behind 8 headers, datagrams behind the long header).
fn phase(
    lab: &Lab,
    f: &Frames,
    sock8: &UdpSocket,
    sock_long: &UdpSocket,
    round: u16,
) -> (u64, usize, usize) {
    let syns_before = syns_in(&lab.ns_srv);
    let mut frames = Vec::new();
    for i in 0..COPIES as u16 {
        frames.extend(f.tiny_fragment_syn(40000 + round * 100 + i, 53));
    }
    let eight: Vec<_> =
        std::iter::once(small_opts(0)).chain((0..7).map(|_| small_opts(60))).collect();
    frames.extend((0..COPIES).map(|_| f.udp6_behind(&eight, 53)));
    frames.extend((0..COPIES).map(|_| f.udp6_behind(&[long_dstopts()], 5353)));
    let dev = lab.veth_cli.clone();
    Lab::in_ns(&lab.ns_cli, move || send(&dev, &frames));
    let (d8, dl) = (drain(sock8), drain(sock_long));
    (syns_in(&lab.ns_srv) - syns_before, d8, dl)
}

fn crafted_layouts_do_not_reach_the_socket_behind_a_drained_rule() {
    let lab = Lab::new("fev", 235);
    for (ns, dev, ip) in
        [(&lab.ns_srv, &lab.veth_srv, "fd13::1/64"), (&lab.ns_cli, &lab.veth_cli, "fd13::2/64")]
    {
        sh(&["ip", "-n", ns, "link", "set", dev, "mtu", "9000"]);
        sh(&["ip", "-n", ns, "-6", "addr", "add", ip, "dev", dev, "nodad"]);
    }
    sh(&["ip", "netns", "exec", &lab.ns_srv, "nft", "add table inet flowctl_ev; add chain inet flowctl_ev in { type filter hook input priority 0 ; } ; add rule inet flowctl_ev in tcp dport 53 tcp flags syn counter"]);
    let ip4 = |s: &str| s.parse::<std::net::Ipv4Addr>().unwrap().octets();
    let f = Frames::new(
        mac(&lab.ns_srv, &lab.veth_srv),
        mac(&lab.ns_cli, &lab.veth_cli),
        ip4(&lab.ip_cli),
        ip4(&lab.ip_srv),
    );
    let (sock8, sock_long) = Lab::in_ns(&lab.ns_srv, || {
        let a = UdpSocket::bind("[::]:53").unwrap();
        let b = UdpSocket::bind("[::]:5353").unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    });

    // Without flowctl, the stack delivers every layout.
    let (syns, d8, dl) = phase(&lab, &f, &sock8, &sock_long, 0);
    println!("without flowctl: {syns} reassembled SYNs, {d8} datagrams behind 8 headers, {dl} behind a 2 KiB header");
    assert_eq!((syns, d8, dl), (COPIES as u64, COPIES, COPIES), "the stack delivers these layouts");

    // With flowctl and every rule drained (one token, refilled hourly),
    // behind a pass rule on another port.
    let profile = TempFile::profile(
        "[[rule]]\nname = \"ssh\"\nproto = \"tcp\"\ndport = 22\naction = \"pass\"\n\n\
         [[rule]]\nname = \"dns-tcp\"\nproto = \"tcp\"\ndport = 53\nunit = \"connections\"\nrate = \"1/h\"\nburst = 1\nkey = \"rule\"\n\n\
         [[rule]]\nname = \"dns\"\nproto = \"udp\"\ndport = \"53-5353\"\nrate = \"1/h\"\nburst = 1\nkey = \"rule\"\n",
    );
    let agent = attach(&lab, &profile);
    // Spend each rule's one token with a plain packet.
    let (plain_syn, plain_udp) = (f.ipv4(6, &f.syn(39999, 53), 0, 1), f.udp6_behind(&[], 53));
    let dev = lab.veth_cli.clone();
    Lab::in_ns(&lab.ns_cli, move || send(&dev, &[plain_syn, plain_udp]));
    assert_eq!(drain(&sock8), 1, "the plain datagram took the dns rule's token");
    let (syns, d8, dl) = phase(&lab, &f, &sock8, &sock_long, 1);
    println!("with flowctl: {syns} reassembled SYNs, {d8} datagrams behind 8 headers, {dl} behind a 2 KiB header");
    assert_eq!(syns, 0, "tiny-fragment SYNs reached TCP");
    assert_eq!(d8, 0, "datagrams behind exactly 8 extension headers reached the socket");
    assert_eq!(dl, 0, "datagrams behind a 2 KiB options header reached the socket");
    let a = attachment(&lab.veth_srv).expect("the attachment in status");
    let g = &a["unmatched"];
    println!("unmatched: {g}");
    assert_eq!(
        g["dropped_by_reason"]["evasive"],
        2 * COPIES,
        "both fragments of each tiny-fragment SYN dropped as evasive"
    );
    assert_eq!(g["unparsed_pkts"], COPIES, "the long-header datagrams matched as unparsed");
    drop(agent);
}

fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        crafted_layouts_do_not_reach_the_socket_behind_a_drained_rule: [Root, Command("nft")],
    ]);
}
