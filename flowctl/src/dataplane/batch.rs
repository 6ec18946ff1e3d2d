//! Many entries of an array map in one system call: `BPF_MAP_UPDATE_BATCH`
//! (Linux 5.6, `generic_map_update_batch` in kernel/bpf/syscall.c), which
//! aya 0.14 does not wrap.
//!
//! Why: `apply` writes a slot of `FLOWCTL_PORT_BITS`, 65,537 bitmaps, on
//! every load, apply and adoption. One `BPF_MAP_UPDATE_ELEM` per entry made
//! that 65,860 system calls per apply: 0.5 s of system time on the host
//! and 9 s in a 6.1 guest under TCG (2026-12-07), where the
//! end-to-end tests apply several times each. The batch is one call; the
//! kernel copies the same entries with the same per-element semantics.
//!
//! A kernel that refuses the batch (a map type or kernel without it) gets
//! the entries one call each, as before: the result is the same.

use aya::maps::{Array, IterableMap, MapData};
use aya::Pod;
use aya_obj::generated::{bpf_attr, bpf_cmd};
use std::os::fd::{AsFd, AsRawFd};

/// Writes `values` into `map` at `first..first + values.len()`.
pub fn set_range<V: Pod>(
    map: &mut Array<MapData, V>,
    first: u32,
    values: &[V],
) -> Result<(), aya::maps::MapError> {
    if values.is_empty() {
        return Ok(());
    }
    let keys: Vec<u32> = (first..first + values.len() as u32).collect();
    if update_batch(map.map(), &keys, values).is_ok() {
        return Ok(());
    }
    for (k, v) in keys.iter().zip(values) {
        map.set(*k, v, 0)?;
    }
    Ok(())
}

/// One `BPF_MAP_UPDATE_BATCH` of `keys` and `values` (the map's key and
/// value sizes must be `size_of::<u32>()` and `size_of::<V>()`, as they are
/// for an `Array<_, V>` aya opened).
fn update_batch<V: Pod>(map: &MapData, keys: &[u32], values: &[V]) -> std::io::Result<()> {
    debug_assert_eq!(keys.len(), values.len());
    // SAFETY: bpf_attr is a plain C union; all-zero is its documented
    // "no options" state, and only the batch member is set below.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    {
        // SAFETY: writing plain integers into the union's batch member.
        let b = unsafe { &mut attr.batch };
        b.keys = keys.as_ptr() as u64;
        b.values = values.as_ptr() as u64;
        b.count = keys.len() as u32;
        b.map_fd = map.fd().as_fd().as_raw_fd() as u32;
    }
    // SAFETY: the kernel reads `count` keys and values from the two
    // slices, which outlive the call, and writes back only `attr.batch.count`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_MAP_UPDATE_BATCH as libc::c_long,
            &mut attr as *mut bpf_attr,
            size_of::<bpf_attr>() as libc::c_long,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: reading the integer the kernel wrote back.
    let done = unsafe { attr.batch.count } as usize;
    if done != keys.len() {
        return Err(std::io::Error::other(format!("batch wrote {done} of {}", keys.len())));
    }
    Ok(())
}
