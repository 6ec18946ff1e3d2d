//! A Redis the test starts itself: `redis-server --save '' --appendonly no`
//! inside a network namespace the test creates, listening only on a unix
//! socket in the server's own directory (no TCP port: nothing else on the
//! machine can reach it), stopped by its PID and its directory removed when
//! dropped; and a current-thread tokio runtime to drive flowctl's client.

use flowctl::fleet::global::store::{Store, StoreConfig};
use flowctl_tests::{lab::Netns, server::Server, unique};
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
        let mut args = vec![
            "--port",
            "0",
            "--unixsocket",
            "{dir}/redis.sock",
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            "{dir}",
        ];
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
