//! Operating-system plumbing the other wings share: cgroup mounts, network
//! namespaces and interfaces, file locks, the monotonic clock.
pub mod cgroup;
pub mod clock;
pub mod lock;
pub mod netns;
