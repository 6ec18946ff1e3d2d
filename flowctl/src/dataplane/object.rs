//! The embedded XDP object.

/// The `flowctl-xdp` ELF object built by build.rs, 8-byte aligned as the ELF
/// parser needs.
pub fn xdp_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/flowctl-xdp"))
}

/// The `flowctl-breaker` object: cgroup connect hooks and sock_ops
/// outcome counting for circuit breakers.
pub fn breaker_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/flowctl-breaker"))
}
