//! Throwaway labs: two network namespaces joined by a veth pair, with
//! addresses only they use. Removed on drop, also when a test panics. And
//! what the tests do to a lab: commands in a namespace, more namespaces and
//! veth pairs, another client address, a pass-through XDP program.

use std::process::Command;

pub fn sh(args: &[&str]) -> String {
    let out =
        Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// [`sh`] in namespace `ns` (`ip netns exec NS ARGS`).
pub fn sh_ns(ns: &str, args: &[&str]) -> String {
    let mut full = vec!["ip", "netns", "exec", ns];
    full.extend_from_slice(args);
    sh(&full)
}

/// A `nstat` counter of namespace `ns` (absolute, since the namespace
/// began); 0 when it never counted.
pub fn nstat(ns: &str, name: &str) -> u64 {
    let out = sh_ns(ns, &["nstat", "-az", name]);
    out.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.split_whitespace().next()))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Joins two namespaces with a veth pair; each end, (namespace, device,
/// address/prefix), gets its address and is set up.
pub fn veth_pair(ends: [(&str, &str, &str); 2]) {
    let [(ns_a, dev_a, _), (ns_b, dev_b, _)] = ends;
    sh(&[
        "ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns",
        ns_b,
    ]);
    for (ns, dev, addr) in ends {
        sh(&["ip", "-n", ns, "addr", "add", addr, "dev", dev]);
        sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
    }
}

/// A network namespace (`ip netns add`), deleted on drop.
pub struct Netns(pub String);

impl Netns {
    pub fn new(name: &str) -> Self {
        sh(&["ip", "netns", "add", name]);
        Self(name.to_string())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Attaches the bench object's pass-through XDP program (`bench_pass`) to
/// `dev` in the calling thread's namespace, in native mode; it stays until
/// the returned object is dropped. On a veth it makes the peer of a flowctl
/// attachment run its NAPI (XDP_TX replies reach it only then), or stands
/// for someone else's program.
pub fn attach_pass_xdp(dev: &str) -> aya::Ebpf {
    let mut ebpf = aya::EbpfLoader::new().load(flowctl_bench::bench_object()).unwrap();
    let prog: &mut aya::programs::Xdp = ebpf.program_mut("bench_pass").unwrap().try_into().unwrap();
    prog.load().unwrap();
    prog.attach(dev, aya::programs::XdpMode::Driver).unwrap();
    ebpf
}

pub struct Lab {
    /// Namespace of the protected side (where flowctl attaches).
    pub ns_srv: String,
    /// Namespace of the clients.
    pub ns_cli: String,
    pub veth_srv: String,
    pub veth_cli: String,
    pub ip_srv: String,
    pub ip_cli: String,
}

impl Lab {
    /// `subnet` picks 10.201.<subnet>.0/24 so concurrent labs never overlap.
    pub fn new(tag: &str, subnet: u8) -> Self {
        let id = crate::unique(tag);
        assert!(
            id.len() + 2 <= 15,
            "lab tag `{tag}` too long: interface names are at most 15 bytes"
        );
        let lab = Self {
            ns_srv: format!("{id}s"),
            ns_cli: format!("{id}c"),
            veth_srv: format!("{id}vs"),
            veth_cli: format!("{id}vc"),
            ip_srv: format!("10.201.{subnet}.1"),
            ip_cli: format!("10.201.{subnet}.2"),
        };
        sh(&["ip", "netns", "add", &lab.ns_srv]);
        sh(&["ip", "netns", "add", &lab.ns_cli]);
        veth_pair([
            (&lab.ns_srv, &lab.veth_srv, &format!("{}/24", lab.ip_srv)),
            (&lab.ns_cli, &lab.veth_cli, &format!("{}/24", lab.ip_cli)),
        ]);
        for ns in [&lab.ns_srv, &lab.ns_cli] {
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        lab
    }

    /// A KLimiter profile whose baseline is the TC egress counter on the
    /// server's veth (UDP to the client, port 9000), cutting rule `low`
    /// (UDP port 7800): the tests of the egress program's attach and
    /// removal share it.
    pub fn egress_klimiter_profile(&self) -> String {
        format!(
            "[settings]\nkey_table_entries = 16384\nsource_cache_entries = 16384\n\
[klimiter]\nsample_period = \"200ms\"\ncontrol_period = \"1s\"\n\
[[rule]]\nname = \"low\"\nproto = \"udp\"\ndport = 7800\nrate = \"1000000/s\"\nadmission = \"packet\"\npriority = 0.0\n\
[[baseline]]\nname = \"downstream\"\nthreshold = 1200\nentries = [\"low\"]\n\
source = {{ kind = \"egress\", iface = \"{}\", dst = \"{}/32\", dport = 9000, proto = \"udp\" }}\n",
            self.veth_srv, self.ip_cli
        )
    }

    /// A metrics address of this lab's own for an agent it starts: the
    /// agents serve their metrics in the namespace they were started in
    /// (the tests'), so concurrent labs' agents need ports of their own;
    /// the port follows the lab's subnet, unique among running labs.
    pub fn metrics_addr(&self) -> String {
        let subnet: u16 = self.ip_srv.split('.').nth(2).and_then(|s| s.parse().ok()).unwrap_or(0);
        format!("127.0.0.1:{}", 19_000 + subnet)
    }

    /// Gives the client side another address of the lab's /24.
    pub fn add_client_address(&self, ip: &str) {
        sh(&["ip", "-n", &self.ns_cli, "addr", "add", &format!("{ip}/24"), "dev", &self.veth_cli]);
    }

    /// Gives the protected side another address of the lab's /24.
    pub fn add_server_address(&self, ip: &str) {
        sh(&["ip", "-n", &self.ns_srv, "addr", "add", &format!("{ip}/24"), "dev", &self.veth_srv]);
    }

    /// Runs `f` on a thread that has entered namespace `ns`.
    pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let ns = ns.to_string();
        std::thread::spawn(move || {
            flowctl::system::netns::enter_netns(&ns).expect("enter netns");
            f()
        })
        .join()
        .expect("netns thread panicked")
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns_srv]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.ns_cli]).status();
    }
}

/// A network namespace for a store the agents share (etcd, Redis), with a
/// veth link to each lab's protected namespace (where its agent runs), so
/// one agent's link can go down alone. The links go with the namespace.
pub struct StoreNet {
    pub ns: Netns,
    /// The second octet of the links' addresses (10.NET.subnet.0/24).
    net: u8,
    /// (lab namespace, the lab's end of its link).
    links: Vec<(String, String)>,
}

impl StoreNet {
    pub fn new(tag: &str, net: u8) -> Self {
        let ns = Netns::new(&crate::unique(tag));
        sh(&["ip", "-n", &ns.0, "link", "set", "lo", "up"]);
        Self { ns, net, links: Vec::new() }
    }

    /// A link from `lab` on 10.NET.`subnet`.0/24; returns the store's
    /// address on it, `10.NET.SUBNET.1`.
    pub fn link(&mut self, lab: &Lab, subnet: u8) -> String {
        let id = crate::unique("fs");
        let (theirs, ours) = (format!("{id}a"), format!("{id}e"));
        let net = self.net;
        veth_pair([
            (&lab.ns_srv, &theirs, &format!("10.{net}.{subnet}.2/24")),
            (&self.ns.0, &ours, &format!("10.{net}.{subnet}.1/24")),
        ]);
        self.links.push((lab.ns_srv.clone(), theirs));
        format!("10.{net}.{subnet}.1")
    }

    /// Takes `lab`'s link down (`false`) or up again.
    pub fn set_link(&self, lab: &Lab, up: bool) {
        let (ns, dev) =
            self.links.iter().find(|(ns, _)| *ns == lab.ns_srv).expect("a link to this lab");
        sh(&["ip", "-n", ns, "link", "set", dev, if up { "up" } else { "down" }]);
    }
}

impl Drop for StoreNet {
    fn drop(&mut self) {
        // A link goes with either namespace; deleted here in case the labs
        // outlive this (quietly: a lab dropped first took it along).
        for (ns, dev) in &self.links {
            let _ = Command::new("ip")
                .args(["-n", ns, "link", "del", dev])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// The MAC address of `dev` in namespace `ns`.
pub fn mac(ns: &str, dev: &str) -> [u8; 6] {
    let s = sh(&["ip", "netns", "exec", ns, "cat", &format!("/sys/class/net/{dev}/address")]);
    let b: Vec<u8> = s.trim().split(':').map(|h| u8::from_str_radix(h, 16).unwrap()).collect();
    b.try_into().unwrap()
}
