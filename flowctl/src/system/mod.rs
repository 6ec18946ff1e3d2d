//! Operating-system plumbing the other wings share: cgroup mounts, network
//! namespaces and interfaces, file locks, the monotonic clock, logging, the
//! service manager.
pub mod cgroup;
pub mod clock;
pub mod lock;
pub mod log;
pub mod netns;
pub mod notify;
