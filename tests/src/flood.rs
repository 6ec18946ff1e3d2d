//! A SYN flood from many spoofed sources, and brand-new legitimate clients
//! beside it. The flood is crafted Ethernet/IPv4/TCP SYN frames written to
//! an AF_PACKET socket on the client namespace's veth, so it leaves only
//! through the lab's own link. Its sources are a range the test owns
//! ([`FLOOD_NET`]), which the protected namespace routes into a blackhole
//! ([`blackhole_replies`]): the server's SYN-ACKs to them go nowhere.

use crate::{
    lab::{mac, sh, sh_ns, Lab},
    packet::checksum,
    packet_socket::PacketSocket,
};
use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// The flood's sources: 172.16.0.0/12, 2^20 addresses, never routed out of
/// the test's namespaces.
pub const FLOOD_NET: (Ipv4Addr, u8) = (Ipv4Addr::new(172, 16, 0, 0), 12);

/// Routes the protected namespace's replies to [`FLOOD_NET`] into a
/// blackhole, and turns off its reverse-path filter, so spoofed SYNs reach
/// the listening socket (as a real flood's would) and nothing answers them.
/// The route and settings go with the namespace.
pub fn blackhole_replies(lab: &Lab) {
    let net = format!("{}/{}", FLOOD_NET.0, FLOOD_NET.1);
    sh(&["ip", "-n", &lab.ns_srv, "route", "add", "blackhole", &net]);
    for conf in ["all", "default", lab.veth_srv.as_str()] {
        sh_ns(&lab.ns_srv, &["sysctl", "-qw", &format!("net.ipv4.conf.{conf}.rp_filter=0")]);
    }
}

/// What a flood sent.
#[derive(Debug)]
pub struct Sent {
    /// Frames the kernel took. A veth whose peer's queue is full drops the
    /// frame, and says so (ENOBUFS) only since Linux 6.16 (dc82a33); the
    /// caller subtracts the drops the sender was not told of
    /// ([`tx_dropped`] grows by both kinds, `refused_sends` counts the
    /// told ones).
    pub frames: u64,
    /// Frames refused even after retries.
    pub lost: u64,
    /// Send attempts the kernel refused (each also a veth drop).
    pub refused_sends: u64,
    pub secs: f64,
}

/// The `tx_dropped` counter of `dev` in namespace `ns`.
pub fn tx_dropped(ns: &str, dev: &str) -> u64 {
    let out = sh_ns(ns, &["ip", "-s", "-j", "link", "show", dev]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j output");
    v[0]["stats64"]["tx"]["dropped"].as_u64().unwrap_or_else(|| panic!("no tx dropped: {out}"))
}

/// Sends `passes` SYNs from each of `sources` addresses of [`FLOOD_NET`]
/// (pass by pass: every source once, then again) to `lab`'s server port
/// `dport` at about `pps` (below what the receiving side's XDP program
/// drains, so its queue seldom overflows), stopping early after `max_secs`;
/// `progress` counts the frames taken so far, for whoever waits on a pass.
pub fn syn_flood(
    lab: &Lab,
    dport: u16,
    (sources, passes, pps): (u32, u32, u64),
    max_secs: f64,
    progress: &'static AtomicU64,
) -> Sent {
    assert!(sources <= 1 << (32 - FLOOD_NET.1), "more sources than the flood's range");
    let src_mac = mac(&lab.ns_cli, &lab.veth_cli);
    let dst_mac = mac(&lab.ns_srv, &lab.veth_srv);
    let dst: Ipv4Addr = lab.ip_srv.parse().unwrap();
    let dev = lab.veth_cli.clone();
    Lab::in_ns(&lab.ns_cli, move || {
        let sock = PacketSocket::on(&dev);
        let base = u32::from(FLOOD_NET.0);
        let mut frame = syn_frame(src_mac, dst_mac, dst, dport);
        let start = Instant::now();
        let (mut frames, mut lost, mut refused_sends) = (0u64, 0u64, 0u64);
        'passes: for pass in 0..passes {
            for i in 0..sources {
                // Check the clock every 4096 frames: the bound in seconds.
                if i % 256 == 0 {
                    let due = Duration::from_secs_f64((frames + lost) as f64 / pps as f64);
                    let elapsed = start.elapsed();
                    if elapsed.as_secs_f64() > max_secs {
                        break 'passes;
                    }
                    if let Some(ahead) = due.checked_sub(elapsed) {
                        std::thread::sleep(ahead);
                    }
                }
                set_source(&mut frame, base + i, (1024 + pass % 60000) as u16);
                let (taken, refused) = sock.send_waiting(&frame);
                refused_sends += refused;
                if taken {
                    frames += 1;
                    if frames % 1024 == 0 {
                        progress.store(frames, Ordering::Relaxed);
                    }
                } else {
                    lost += 1;
                }
            }
        }
        progress.store(frames, Ordering::Relaxed);
        Sent { frames, lost, refused_sends, secs: start.elapsed().as_secs_f64() }
    })
}

/// What the legitimate clients saw.
#[derive(Debug, Default)]
pub struct Clients {
    pub attempts: u32,
    /// Established within `FIRST_SYN` (before the first retransmission):
    /// the first SYN was admitted.
    pub first_syn: u32,
    /// Established at all, within the connect timeout.
    pub established: u32,
}

/// A first SYN answered within this got in before the kernel's first
/// retransmission (1 s initial RTO, RFC 6298).
pub const FIRST_SYN: Duration = Duration::from_millis(900);

/// One connect from each of `addrs` (addresses of the client namespace,
/// new to the rule) to the server's `port`, `gap` apart, with a 3.5 s
/// connect timeout (the first retransmission fits).
pub fn clients_from(lab: &Lab, addrs: Vec<String>, port: u16, gap: Duration) -> Clients {
    let target: SocketAddr = format!("{}:{port}", lab.ip_srv).parse().unwrap();
    Lab::in_ns(&lab.ns_cli, move || {
        let mut c = Clients::default();
        for a in addrs {
            c.attempts += 1;
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                .expect("socket");
            let local: SocketAddr = format!("{a}:0").parse().unwrap();
            s.bind(&local.into()).expect("bind a client address");
            let t = Instant::now();
            if s.connect_timeout(&target.into(), Duration::from_millis(3500)).is_ok() {
                c.established += 1;
                if t.elapsed() < FIRST_SYN {
                    c.first_syn += 1;
                }
            }
            drop(s);
            std::thread::sleep(gap);
        }
        c
    })
}

/// Offsets in the frame `syn_frame` builds.
const IP: usize = 14;
const TCP: usize = IP + 20;
const FRAME_LEN: usize = TCP + 20;

fn syn_frame(src_mac: [u8; 6], dst_mac: [u8; 6], dst: Ipv4Addr, dport: u16) -> [u8; FRAME_LEN] {
    let mut f = [0u8; FRAME_LEN];
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&src_mac);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    f[IP] = 0x45;
    f[IP + 2..IP + 4].copy_from_slice(&40u16.to_be_bytes());
    f[IP + 8] = 64;
    f[IP + 9] = 6;
    f[IP + 16..IP + 20].copy_from_slice(&dst.octets());
    f[TCP + 2..TCP + 4].copy_from_slice(&dport.to_be_bytes());
    f[TCP + 4..TCP + 8].copy_from_slice(&0x1000_0000u32.to_be_bytes());
    f[TCP + 12] = 5 << 4;
    f[TCP + 13] = 0x02; // SYN
    f[TCP + 14..TCP + 16].copy_from_slice(&64240u16.to_be_bytes());
    f
}

/// Writes the source address and port into the frame, with both checksums.
fn set_source(f: &mut [u8; FRAME_LEN], src: u32, sport: u16) {
    f[IP + 12..IP + 16].copy_from_slice(&src.to_be_bytes());
    f[IP + 10..IP + 12].fill(0);
    let c = checksum(&[&f[IP..TCP]]);
    f[IP + 10..IP + 12].copy_from_slice(&c.to_be_bytes());
    f[TCP..TCP + 2].copy_from_slice(&sport.to_be_bytes());
    f[TCP + 16..TCP + 18].fill(0);
    // The pseudo header: addresses, protocol, TCP length.
    let c = checksum(&[&f[IP + 12..IP + 20], &[0, 6, 0, 20], &f[TCP..FRAME_LEN]]);
    f[TCP + 16..TCP + 18].copy_from_slice(&c.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify() {
        let mut f = syn_frame([2; 6], [4; 6], Ipv4Addr::new(10, 201, 1, 1), 80);
        set_source(&mut f, u32::from(Ipv4Addr::new(172, 16, 3, 4)), 1234);
        assert_eq!(checksum(&[&f[IP..TCP]]), 0, "IPv4 header");
        let pseudo = [&f[IP + 12..IP + 20], &[0, 6, 0, 20], &f[TCP..FRAME_LEN]];
        assert_eq!(checksum(&pseudo), 0, "TCP");
    }
}
