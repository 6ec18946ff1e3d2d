//! A Redis the test starts itself: `redis-server --save '' --appendonly no`
//! inside a network namespace the test creates, listening only on a unix
//! socket in the server's own directory (no TCP port: nothing else on the
//! machine can reach it), stopped by its PID and its directory removed when
//! dropped; and a current-thread tokio runtime to drive flowctl's client.

use flowctl::fleet::global::store::{Store, StoreConfig};
use flowctl_tests::{lab::Netns, pki::Pki, redis::EPHEMERAL, server::Server, unique};
use std::{path::PathBuf, process::Command, time::Duration};

pub struct Redis {
    // Dropped in this order: the server (killed by PID, its directory
    // removed), then its namespace.
    pub server: Server,
    _ns: Netns,
    pub socket: PathBuf,
    /// The default user's password, if any.
    pub password: Option<String>,
}

impl Redis {
    /// `extra`: more server arguments (`--requirepass`, `--user`).
    pub fn start(password: Option<&str>, extra: &[&str]) -> Self {
        let ns = Netns::new(&unique("flowctl-redis-"));
        let mut args =
            vec!["--port", "0", "--unixsocket", "{dir}/redis.sock", "--unixsocketperm", "700"];
        args.extend(EPHEMERAL);
        if let Some(p) = password {
            args.extend(["--requirepass", p]);
        }
        args.extend_from_slice(extra);
        let server = Server::start(
            "redis",
            Some(&ns.0),
            "redis-server",
            &args,
            |s| {
                let sock = s.dir().join("redis.sock");
                sock.exists()
                    && cli_at(&sock, None, &["PING"])
                        .is_some_and(|o| o.contains("PONG") || o.contains("NOAUTH"))
            },
            Duration::from_secs(10),
        );
        let socket = server.dir().join("redis.sock");
        Self { server, _ns: ns, socket, password: password.map(String::from) }
    }

    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket.display())
    }

    /// A client config with the default user's password and a deadline
    /// that a busy machine still meets.
    pub fn config(&self) -> StoreConfig {
        let mut cfg = StoreConfig::new(&self.url());
        cfg.password = self.password.clone();
        cfg.prefix = unique("flowctl-test-");
        cfg.timeout = Duration::from_secs(2);
        cfg
    }

    pub fn store(&self) -> Store {
        Store::new(self.config()).expect("store config")
    }

    /// `redis-cli` against this server (as the default user).
    pub fn cli(&self, args: &[&str]) -> String {
        cli_at(&self.socket, self.password.as_deref(), args).unwrap_or_else(|| {
            panic!("redis-cli {args:?} failed; server log:\n{}", self.server.log())
        })
    }
}

fn cli_at(socket: &std::path::Path, password: Option<&str>, args: &[&str]) -> Option<String> {
    let mut cmd = Command::new("redis-cli");
    cmd.arg("-s").arg(socket).arg("--no-auth-warning");
    if let Some(p) = password {
        cmd.args(["-a", p]);
    }
    let out = cmd.args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A runtime for one test's async calls.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// Redis with TLS only, on 127.0.0.1:PORT inside its own namespace, with a
/// password, asking every client for a certificate the test CA signed
/// (`tls-auth-clients yes`: mutual TLS).
pub struct TlsRedis {
    // Killed (by PID) before its namespace goes.
    _server: Server,
    pub ns: Netns,
    pub port: u16,
}

impl TlsRedis {
    pub fn start(pki: &Pki, password: &str) -> Self {
        let ns = Netns::new(&unique("flowctl-redis-tls-"));
        flowctl_tests::lab::sh(&["ip", "-n", &ns.0, "link", "set", "lo", "up"]);
        let port = 6390;
        let (cert, key, ca) = (pki.file("server.crt"), pki.file("server.key"), pki.file("ca.crt"));
        let (client_crt, client_key) = (pki.file("client.crt"), pki.file("client.key"));
        let port_s = port.to_string();
        let args = [
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--tls-port",
            &port_s,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            "yes",
            "--requirepass",
            password,
        ]
        .into_iter()
        .chain(EPHEMERAL)
        .collect::<Vec<_>>();
        let ns_name = ns.0.clone();
        let server = Server::start(
            "redis-tls",
            Some(&ns.0),
            "redis-server",
            &args,
            |_| {
                let out = Command::new("ip")
                    .args(["netns", "exec", &ns_name, "redis-cli", "--tls", "--cacert", &ca])
                    .args(["--cert", &client_crt, "--key", &client_key])
                    .args([
                        "-h",
                        "127.0.0.1",
                        "-p",
                        &port_s,
                        "-a",
                        password,
                        "--no-auth-warning",
                        "PING",
                    ])
                    .output();
                out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("PONG"))
            },
            Duration::from_secs(10),
        );
        Self { _server: server, ns, port }
    }
}
