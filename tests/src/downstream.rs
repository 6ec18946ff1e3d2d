//! A downstream for the circuit breakers' tests: nftables in a lab's server
//! namespace counts the SYNs that reach it per port (before anything else
//! sees them) and drops them while black-holed. Healthy (a
//! [`TcpServer`](crate::traffic::TcpServer) accepts) and refusing (nothing
//! listens: RSTs) are up to the test.

use crate::{
    lab::{sh_ns, Lab},
    tempfile::TempFile,
};

pub struct Downstream {
    ns: String,
}

impl Downstream {
    /// Counters for `ports` in a new table `inet flowctl_test`.
    pub fn new(lab: &Lab, ports: &[u16]) -> Self {
        let mut rules = String::from("table inet flowctl_test {\n chain bh {\n }\n chain pre {\n  type filter hook prerouting priority -300;\n");
        for p in ports {
            rules += &format!("  tcp dport {p} tcp flags & (syn | ack) == syn counter\n");
        }
        rules += "  jump bh\n }\n}\n";
        let f = TempFile::new("flowctl-nft-", ".nft", &rules);
        sh_ns(&lab.ns_srv, &["nft", "-f", f.path()]);
        Self { ns: lab.ns_srv.clone() }
    }

    /// SYNs seen so far for `port`.
    pub fn syns(&self, port: u16) -> u64 {
        let text = sh_ns(&self.ns, &["nft", "list", "chain", "inet", "flowctl_test", "pre"]);
        let line =
            text.lines().find(|l| l.contains(&format!("dport {port} "))).expect("counter rule");
        let n = line.split("packets ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap();
        n.parse().unwrap()
    }

    /// Drops the SYNs to `port` (on), or none at all again (off).
    pub fn black_hole(&self, port: u16, on: bool) {
        if on {
            let port = port.to_string();
            sh_ns(
                &self.ns,
                &[
                    "nft",
                    "add",
                    "rule",
                    "inet",
                    "flowctl_test",
                    "bh",
                    "tcp",
                    "dport",
                    &port,
                    "drop",
                ],
            );
        } else {
            sh_ns(&self.ns, &["nft", "flush", "chain", "inet", "flowctl_test", "bh"]);
        }
    }
}
