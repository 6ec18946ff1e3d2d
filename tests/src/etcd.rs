//! A real etcd for the fleet tests (docs/fleet.md): Debian's `etcd` in a
//! network namespace of its own, on [`Server`], with a veth link to each
//! agent's lab (so one agent's link can go down alone), and `etcdctl` and
//! `flowctl` run inside that namespace. Everything is removed on drop: the
//! server (killed by PID), its data, the links and the namespace.

use crate::{
    lab::{Lab, StoreNet},
    server::Server,
};
pub use crate::{pki::Pki, tempfile::TempDir};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

pub const PORT: u16 = 2379;

pub struct Etcd {
    /// The certificates when it serves TLS (and asks clients for theirs).
    tls: Option<PathBuf>,
    /// The server, then (after [`restart`](Self::restart)) its successor
    /// on the same data; the first is kept killed so its data stays.
    servers: Vec<Server>,
    /// Its namespace and the labs' links to it.
    pub net: StoreNet,
}

impl Etcd {
    /// etcd in a new namespace, listening on every address it has there,
    /// with progress notifications every second (etcd 3.4's default is 10
    /// minutes; the server flag shortens it).
    pub fn start(tag: &str) -> Self {
        Self::start_with(tag, None)
    }

    /// The same over TLS, with client certificates required: `pki`'s
    /// server certificate and CA.
    pub fn start_tls(tag: &str, pki: &Pki) -> Self {
        Self::start_with(tag, Some(pki.dir().to_path_buf()))
    }

    fn start_with(tag: &str, tls: Option<PathBuf>) -> Self {
        let mut e = Self { tls, servers: Vec::new(), net: StoreNet::new(tag, 203) };
        e.servers.push(e.launch(None));
        e
    }

    fn launch(&self, data: Option<&Path>) -> Server {
        let data = data.map(|d| d.display().to_string()).unwrap_or_else(|| "{dir}/data".into());
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut args: Vec<String> = [
            "--name",
            "e",
            "--data-dir",
            &data,
            "--listen-client-urls",
            &format!("{scheme}://0.0.0.0:{PORT}"),
            "--advertise-client-urls",
            &format!("{scheme}://127.0.0.1:{PORT}"),
            "--listen-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-cluster",
            "e=http://127.0.0.1:2380",
            "--experimental-watch-progress-notify-interval",
            "1s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(d) = &self.tls {
            let f = |n: &str| d.join(n).display().to_string();
            args.extend([
                "--cert-file".into(),
                f("server.crt"),
                "--key-file".into(),
                f("server.key"),
                "--trusted-ca-file".into(),
                f("ca.crt"),
                "--client-cert-auth".into(),
            ]);
        }
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (ns, tls) = (self.net.ns.0.clone(), self.tls.clone());
        Server::start(
            "etcd",
            Some(&self.net.ns.0),
            "etcd",
            &args,
            move |_| ctl_in(&ns, tls.as_deref(), &["endpoint", "health"]).status.success(),
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
        format!("{}:{PORT}", self.net.link(lab, subnet))
    }

    /// Takes `lab`'s link to etcd down (`false`) or up again.
    pub fn set_link(&self, lab: &Lab, up: bool) {
        self.net.set_link(lab, up);
    }

    /// `etcdctl ARGS` against the server, in its namespace.
    pub fn ctl(&self, args: &[&str]) -> Output {
        ctl_in(&self.net.ns.0, self.tls.as_deref(), args)
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
            .args(["netns", "exec", &self.net.ns.0])
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

fn ctl_in(ns: &str, tls: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, "etcdctl"]);
    match tls {
        Some(d) => {
            cmd.arg(format!("--endpoints=https://127.0.0.1:{PORT}"));
            for (flag, file) in
                [("--cacert", "ca.crt"), ("--cert", "client.crt"), ("--key", "client.key")]
            {
                cmd.arg(format!("{flag}={}", d.join(file).display()));
            }
        }
        None => {
            cmd.arg(format!("--endpoints=127.0.0.1:{PORT}"));
        }
    }
    cmd.args(args).output().expect("run etcdctl")
}

impl Drop for Etcd {
    fn drop(&mut self) {
        // Servers are killed (their directories removed) by their own drop,
        // before the namespace and its links go.
        self.servers.clear();
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
