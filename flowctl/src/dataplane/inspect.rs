//! What a pinned data plane says about itself without opening `Maps`: its
//! layout version, a map's size and entry count, and the kernel memory its
//! maps lock (for `status`, the metrics, adoption checks and the
//! benchmarks).

use super::{maps::open_pinned, pins::AttachId};
use anyhow::{bail, Result};
use aya::maps::{Array, Map, MapData};
use flowctl_common::{map_names as names, GlobalRecord};
use std::{
    fs,
    os::fd::{AsFd, AsRawFd},
};

/// Counts the entries of a pinned hash map without reading it element by
/// element: BPF_MAP_LOOKUP_BATCH (kernel 5.6+) returns whole buckets, a few
/// thousand entries per system call (aya 0.14 has no batch operations, so
/// this is the raw syscall). A snapshot: entries the kernel adds or evicts
/// meanwhile may or may not be counted.
pub fn count_entries(id: &AttachId, name: &str, key_size: usize, value_size: usize) -> Result<u64> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    const CHUNK: usize = 4096;
    #[repr(C)]
    #[derive(Default)]
    struct BatchAttr {
        in_batch: u64,
        out_batch: u64,
        keys: u64,
        values: u64,
        count: u32,
        map_fd: u32,
        elem_flags: u64,
        flags: u64,
    }
    let map = open_pinned(&id.pin_dir(), name)?;
    let fd = map.fd().as_fd().as_raw_fd();
    let mut keys = vec![0u8; key_size * CHUNK];
    let mut values = vec![0u8; value_size.next_multiple_of(8) * CHUNK];
    // The hash map's batch token is a bucket index (4 bytes); room to spare.
    let (mut tok_in, mut tok_out) = ([0u8; 64], [0u8; 64]);
    let mut total = 0u64;
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { tok_in.as_ptr() as u64 },
            out_batch: tok_out.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &mut attr as *mut BatchAttr,
                size_of::<BatchAttr>(),
            )
        };
        let err = if rc < 0 { std::io::Error::last_os_error().raw_os_error() } else { None };
        match err {
            None => total += attr.count as u64,
            Some(libc::ENOENT) => return Ok(total + attr.count as u64),
            Some(e) => bail!("counting {name}: {}", std::io::Error::from_raw_os_error(e)),
        }
        tok_in = tok_out;
        first = false;
    }
}

/// Reads the layout version of pins under `id`, if any.
pub fn pinned_layout(id: &AttachId) -> Option<u32> {
    let m = MapData::from_pin(id.pin_dir().join(names::GLOBAL)).ok()?;
    let a: Array<MapData, GlobalRecord> = Array::try_from(Map::Array(m)).ok()?;
    a.get(&0, 0).ok().map(|g| g.layout_version)
}

/// Max entries of a pinned map, for checking a profile's table sizes against
/// an adopted data plane.
pub fn pinned_max_entries(id: &AttachId, name: &str) -> Option<u32> {
    let m = MapData::from_pin(id.pin_dir().join(name)).ok()?;
    m.info().ok().map(|i| i.max_entries())
}

/// Kernel memory the pinned maps lock, as fdinfo reports it.
pub fn pinned_memlock(id: &AttachId) -> u64 {
    names::ALL.iter().map(|n| map_memlock(id, n)).sum()
}

/// Kernel memory one pinned map locks (fdinfo `memlock`), 0 when absent.
pub fn map_memlock(id: &AttachId, name: &str) -> u64 {
    let Ok(m) = MapData::from_pin(id.pin_dir().join(name)) else { return 0 };
    let fd = m.fd().as_fd().as_raw_fd();
    fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("memlock:").map(|v| v.trim().parse::<u64>().unwrap_or(0))
            })
        })
        .unwrap_or(0)
}
