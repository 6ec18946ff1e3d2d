//! A real Redis for the global rules' end-to-end tests (docs/fleet.md):
//! Debian's `redis-server` in a network namespace of its own
//! ([`StoreNet`]), without persistence, on [`Server`] (paused, resumed and
//! killed by PID), with a veth link to each agent's lab and `redis-cli`
//! run inside that namespace. Access is by ACL, as a careful operator runs
//! it: the agents log in as [`AGENT_USER`], whose password is in a file the
//! profile names (`redis_password_file`) and who may touch only the keys
//! under `flowctl:` and no dangerous command (FLUSHALL, CONFIG, ...); the
//! test's own `redis-cli` is the default user with [`ADMIN_PASSWORD`].
//! Everything goes on drop.

use crate::{
    lab::{Lab, StoreNet},
    server::Server,
};
use std::{path::PathBuf, process::Command, time::Duration};

pub const PORT: u16 = 6379;
/// The agents' ACL user and password (the password goes to them in a file).
pub const AGENT_USER: &str = "flowctl";
const AGENT_PASSWORD: &str = "agent-pw-e2e";
/// The default user's password: the test's `redis-cli` only.
const ADMIN_PASSWORD: &str = "admin-pw-e2e";
/// The agent user's rights: its own keys, and no command that could
/// wipe or reconfigure the store.
const AGENT_RIGHTS: [&str; 5] = ["on", "~flowctl:*", "resetchannels", "+@all", "-@dangerous"];

/// The server arguments every test's Redis shares: nothing persisted (no
/// RDB snapshots, no append-only file), its files in the server's own
/// directory ([`Server`]'s `{dir}`), removed with it.
pub const EPHEMERAL: [&str; 6] = ["--save", "", "--appendonly", "no", "--dir", "{dir}"];

pub struct Redis {
    pub server: Server,
    pub net: StoreNet,
}

/// How an agent reaches a [`Redis`]: the URL of one of its links and the
/// agent user's credentials, written as a profile's `[fleet]` keys by
/// [`fleet_keys`](Self::fleet_keys).
pub struct Access {
    pub url: String,
    pub password_file: PathBuf,
}

impl Access {
    /// `redis`, `redis_user` and `redis_password_file` for `[fleet]`.
    pub fn fleet_keys(&self) -> String {
        format!(
            "redis = \"{}\"\nredis_user = \"{AGENT_USER}\"\nredis_password_file = \"{}\"\n",
            self.url,
            self.password_file.display()
        )
    }
}

impl Redis {
    pub fn start(tag: &str) -> Self {
        let net = StoreNet::new(tag, 204);
        let ns = net.ns.0.clone();
        let port = PORT.to_string();
        let mut args = vec!["--port", &port, "--bind", "0.0.0.0", "--protected-mode", "no"];
        args.extend(EPHEMERAL);
        let agent_password = format!(">{AGENT_PASSWORD}");
        args.extend(["--requirepass", ADMIN_PASSWORD, "--user", AGENT_USER, &agent_password]);
        args.extend(AGENT_RIGHTS);
        let server = Server::start(
            "redis",
            Some(&net.ns.0),
            "redis-server",
            &args,
            move |_| cli_in(&ns, &["PING"]).trim() == "PONG",
            Duration::from_secs(10),
        );
        let password_file = server.dir().join("agent.password");
        std::fs::write(&password_file, format!("{AGENT_PASSWORD}\n")).expect("password file");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&password_file, std::fs::Permissions::from_mode(0o600))
            .expect("password file mode");
        Self { server, net }
    }

    /// A link from `lab`; returns how its agent reaches Redis over it.
    pub fn link(&mut self, lab: &Lab, subnet: u8) -> Access {
        let ip = self.net.link(lab, subnet);
        self.access(&format!("redis://{ip}:{PORT}"))
    }

    /// The agent user's access at `url` (an address the caller routes).
    pub fn access(&self, url: &str) -> Access {
        Access { url: url.to_string(), password_file: self.server.dir().join("agent.password") }
    }

    /// The ACL users of the clients connected now, one per connection
    /// (`CLIENT LIST`), without the connection that asks.
    pub fn client_users(&self) -> Vec<String> {
        self.cli(&["CLIENT", "LIST"])
            .lines()
            .filter(|l| !l.contains("cmd=client|list"))
            .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("user=")).map(String::from))
            .collect()
    }

    /// `redis-cli ARGS` in the server's namespace; its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        cli_in(&self.net.ns.0, args)
    }
}

fn cli_in(ns: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "redis-cli", "-p", &PORT.to_string()])
        .args(["--no-auth-warning", "-a", ADMIN_PASSWORD])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).to_string()
}
