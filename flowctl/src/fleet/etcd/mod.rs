//! Profiles from etcd (docs/fleet.md, "Profiles from etcd").
