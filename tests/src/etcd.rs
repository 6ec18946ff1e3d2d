//! A real etcd for the fleet tests (docs/fleet.md): Debian's `etcd` in a
//! network namespace of its own, on [`Server`], with a veth link to each
//! agent's lab (so one agent's link can go down alone), and `etcdctl` and
//! `flowctl` run inside that namespace. Everything is removed on drop: the
//! server (killed by PID), its data, the links and the namespace.

use crate::{
    lab::{sh, veth_pair, Lab, Netns},
    server::Server,
};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

pub const PORT: u16 = 2379;

pub struct Etcd {
    /// The server, then (after [`restart`](Self::restart)) its successor
    /// on the same data; the first is kept killed so its data stays.
    servers: Vec<Server>,
    pub ns: Netns,
    /// (lab namespace, the lab's end of its link).
    links: Vec<(String, String)>,
}

impl Etcd {
    /// etcd in a new namespace, listening on every address it has there,
    /// with progress notifications every second (etcd 3.4's default is 10
    /// minutes; the server flag shortens it).
    pub fn start(tag: &str) -> Self {
        let ns = Netns::new(&crate::unique(tag));
        sh(&["ip", "-n", &ns.0, "link", "set", "lo", "up"]);
        let mut e = Self { servers: Vec::new(), ns, links: Vec::new() };
        e.servers.push(e.launch(None));
        e
    }

    fn launch(&self, data: Option<&Path>) -> Server {
        let data = data.map(|d| d.display().to_string()).unwrap_or_else(|| "{dir}/data".into());
        let ns = self.ns.0.clone();
        Server::start(
            "etcd",
            Some(&self.ns.0),
            "etcd",
            &[
                "--name",
                "e",
                "--data-dir",
                &data,
                "--listen-client-urls",
                &format!("http://0.0.0.0:{PORT}"),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{PORT}"),
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "e=http://127.0.0.1:2380",
                "--experimental-watch-progress-notify-interval",
                "1s",
            ],
            move |_| ctl_in(&ns, &["endpoint", "health"]).status.success(),
            Duration::from_secs(20),
        )
    }

    /// The data of the first server (a restart reuses it).
    fn data(&self) -> PathBuf {
        self.servers[0].dir().join("data")
    }

    /// Kills the running server (SIGKILL by PID): etcd is gone.
    pub fn kill(&mut self) {
        self.servers.last_mut().expect("started").kill();
    }

    /// A new server on the same data.
    pub fn restart(&mut self) {
        let s = self.launch(Some(&self.data()));
        self.servers.push(s);
    }

    /// A veth link from `lab`'s protected namespace (where its agent runs)
    /// to etcd's, on 10.203.`subnet`.0/24; returns the endpoint the agent
    /// uses, `10.203.SUBNET.1:2379`.
    pub fn link(&mut self, lab: &Lab, subnet: u8) -> String {
        let id = crate::unique("fe");
        let (theirs, ours) = (format!("{id}a"), format!("{id}e"));
        veth_pair([
            (&lab.ns_srv, &theirs, &format!("10.203.{subnet}.2/24")),
            (&self.ns.0, &ours, &format!("10.203.{subnet}.1/24")),
        ]);
        self.links.push((lab.ns_srv.clone(), theirs));
        format!("10.203.{subnet}.1:{PORT}")
    }

    /// Takes `lab`'s link to etcd down (`false`) or up again.
    pub fn set_link(&self, lab: &Lab, up: bool) {
        let (ns, dev) =
            self.links.iter().find(|(ns, _)| *ns == lab.ns_srv).expect("a link to this lab");
        sh(&["ip", "-n", ns, "link", "set", dev, if up { "up" } else { "down" }]);
    }

    /// `etcdctl ARGS` against the server, in its namespace.
    pub fn ctl(&self, args: &[&str]) -> Output {
        ctl_in(&self.ns.0, args)
    }

    /// `etcdctl ARGS`, which must succeed; its stdout.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(out.status.success(), "etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// The store's current revision.
    pub fn revision(&self) -> i64 {
        let out = self.ctl_ok(&["endpoint", "status", "-w", "json"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("endpoint status json");
        v[0]["Status"]["header"]["revision"].as_i64().expect("revision")
    }

    /// `flowctl ARGS` in etcd's namespace (publish, status --fleet), with
    /// etcd at 127.0.0.1.
    pub fn flowctl(&self, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.ns.0])
            .arg(crate::cli::bin())
            .args(args)
            .output()
            .expect("run flowctl")
    }

    /// `etcd://127.0.0.1:2379/PREFIX`, for the commands run in etcd's namespace.
    pub fn local_url(prefix: &str) -> String {
        format!("etcd://127.0.0.1:{PORT}{prefix}")
    }
}

fn ctl_in(ns: &str, args: &[&str]) -> Output {
    Command::new("ip")
        .args(["netns", "exec", ns, "etcdctl", "--endpoints", &format!("127.0.0.1:{PORT}")])
        .args(args)
        .output()
        .expect("run etcdctl")
}

impl Drop for Etcd {
    fn drop(&mut self) {
        // A link goes with either namespace; deleted here in case the
        // labs outlive this (quietly: a lab dropped first took it along).
        // Servers are killed (their directories removed) by their own drop,
        // before the namespace.
        for (ns, dev) in &self.links {
            let _ = Command::new("ip")
                .args(["-n", ns, "link", "del", dev])
                .stderr(std::process::Stdio::null())
                .status();
        }
        self.servers.clear();
    }
}

/// A directory of the test's own (the agents' disk copies), removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let p = std::env::temp_dir().join(crate::unique(prefix));
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Polls `ok` every 20 ms for at most `within`; the time it took, or a
/// panic naming `what`.
pub fn wait_for(what: &str, within: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        if ok() {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
