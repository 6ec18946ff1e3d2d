//! Profiles from etcd (docs/fleet.md, "Profiles from etcd"): an agent
//! attached with `--profile etcd://HOST:2379/PREFIX` reads the profile
//! from etcd, applies it through the same all-or-nothing path as `flowctl
//! apply`, keeps a last good copy on disk, watches for changes and reports
//! what it enforces; `flowctl publish` writes one; `flowctl status --fleet`
//! shows the rollout.
//!
//! - `url`: the address and the keys under the prefix;
//! - `version`: which profile is newest and complete, pure;
//! - `disk`: the last good copy;
//! - `access`: connecting (TLS, user and password) and what errors mean;
//! - `watch`: the task that reads, watches and reports;
//! - `follower`: the agent's side (the start, and what to apply next);
//! - `publish` and `rollout`: the two verbs' etcd parts.

pub mod access;
pub mod disk;
pub mod follower;
pub mod publish;
pub mod rollout;
pub mod url;
pub mod version;
pub mod watch;

pub use access::Access;
pub use follower::{Config, Follower};
pub use url::{is_etcd, EtcdUrl};
