//! The fleet: what the hosts of one service share through stores
//! (docs/fleet.md). `etcd` keeps the profile they all enforce; `global`
//! keeps the limits that hold across all of them (leases in Redis).

pub mod etcd;
pub mod global;
