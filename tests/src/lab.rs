//! Throwaway labs: two network namespaces joined by a veth pair, with
//! addresses only they use. Removed on drop, also when a test panics.

use std::process::Command;

pub fn sh(args: &[&str]) -> String {
    let out =
        Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
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
        sh(&[
            "ip",
            "link",
            "add",
            &lab.veth_srv,
            "netns",
            &lab.ns_srv,
            "type",
            "veth",
            "peer",
            "name",
            &lab.veth_cli,
            "netns",
            &lab.ns_cli,
        ]);
        for (ns, dev, ip) in
            [(&lab.ns_srv, &lab.veth_srv, &lab.ip_srv), (&lab.ns_cli, &lab.veth_cli, &lab.ip_cli)]
        {
            sh(&["ip", "-n", ns, "addr", "add", &format!("{ip}/24"), "dev", dev]);
            sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        lab
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
