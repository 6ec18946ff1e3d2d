//! A real Redis for the global rules' end-to-end tests (docs/fleet.md):
//! Debian's `redis-server` in a network namespace of its own
//! ([`StoreNet`]), without persistence, on [`Server`] (paused, resumed and
//! killed by PID), with a veth link to each agent's lab and `redis-cli`
//! run inside that namespace. Everything goes on drop.

use crate::{
    lab::{Lab, StoreNet},
    server::Server,
};
use std::{process::Command, time::Duration};

pub const PORT: u16 = 6379;

/// The server arguments every test's Redis shares: nothing persisted (no
/// RDB snapshots, no append-only file), its files in the server's own
/// directory ([`Server`]'s `{dir}`), removed with it.
pub const EPHEMERAL: [&str; 6] = ["--save", "", "--appendonly", "no", "--dir", "{dir}"];

pub struct Redis {
    pub server: Server,
    pub net: StoreNet,
}

impl Redis {
    pub fn start(tag: &str) -> Self {
        let net = StoreNet::new(tag, 204);
        let ns = net.ns.0.clone();
        let port = PORT.to_string();
        let mut args = vec!["--port", &port, "--bind", "0.0.0.0", "--protected-mode", "no"];
        args.extend(EPHEMERAL);
        let server = Server::start(
            "redis",
            Some(&net.ns.0),
            "redis-server",
            &args,
            move |_| cli_in(&ns, &["PING"]).trim() == "PONG",
            Duration::from_secs(10),
        );
        Self { server, net }
    }

    /// A link from `lab`; returns the URL its agent uses.
    pub fn link(&mut self, lab: &Lab, subnet: u8) -> String {
        format!("redis://{}:{PORT}", self.net.link(lab, subnet))
    }

    /// `redis-cli ARGS` in the server's namespace; its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        cli_in(&self.net.ns.0, args)
    }
}

fn cli_in(ns: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "redis-cli", "-p", &PORT.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).to_string()
}
