//! Isolated rules' own bucket tables (`isolate = true`): one LRU hash per
//! rule, of the rule's `table_entries`, at the rule's counter record in
//! the pinned array of maps `FLOWCTL_RULE_TABLES` (docs/design.md, "Where
//! bucket state lives"). The array holds the only reference a table needs:
//! it outlives agents with the pins, and goes with them at `detach`.
//!
//! `apply` calls [`prepare`] before its flip, so every rule of the new
//! slot finds its table, and [`retire`] after it, so the old slot's rules
//! keep theirs while they may still be read. A packet of a retired rule
//! that meets no table is admitted without a bucket and counted
//! as a failed insert (`flowctl_own_admit`).

use super::maps::open_pinned;
use super::pins::AttachId;
use anyhow::{anyhow, Context, Result};
use aya::maps::{ArrayOfMaps, MapData, MapError};
use aya_obj::generated::{bpf_attr, bpf_cmd, bpf_map_type};
use flowctl_common::{map_names as names, BucketKey};
use std::os::fd::{AsFd, AsRawFd};

/// One isolated rule's table as the rule set wants it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnTable {
    pub record: u32,
    pub entries: u32,
}

/// The array of maps, opened from its pin.
pub struct RuleTables {
    outer: ArrayOfMaps<MapData, MapData>,
    /// The same map again, for what aya's `ArrayOfMaps` does not wrap
    /// (deleting an element).
    raw: MapData,
}

impl RuleTables {
    pub fn open(id: &AttachId) -> Result<Self> {
        let dir = id.pin_dir();
        let outer = ArrayOfMaps::try_from(aya::maps::Map::ArrayOfMaps(open_pinned(
            &dir,
            names::RULE_TABLES,
        )?))
        .context("opening the isolated rules' table array")?;
        Ok(Self { outer, raw: open_pinned(&dir, names::RULE_TABLES)? })
    }

    /// The table at `record`, if one is set.
    pub fn get(&self, record: u32) -> Result<Option<MapData>> {
        match self.outer.get(&record, 0) {
            Ok(m) => Ok(Some(m)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(anyhow!("reading the isolated rules' table at record {record}: {e}")),
        }
    }

    /// Entries of the table at `record` (None: no table there).
    pub fn entries(&self, record: u32) -> Result<Option<u32>> {
        Ok(match self.get(record)? {
            Some(m) => Some(m.info().context("reading an isolated rule's table")?.max_entries()),
            None => None,
        })
    }

    /// Makes sure every rule of `wanted` has a table of its size: a table
    /// of another size (the rule's `table_entries` changed, and with it
    /// its state) is replaced by an empty one; a table of the right size
    /// is kept, with its buckets. Returns the records it installed a table
    /// at.
    ///
    /// Every new table is made before any is installed, so an apply that
    /// fails for memory changes no table a live rule uses. A table
    /// replaced for a new size serves the live slot's rule of the same
    /// record until the flip: its keys start afresh a moment early, as
    /// they do at the flip (a new size is a new state).
    pub fn prepare(&mut self, wanted: &[OwnTable]) -> Result<Vec<u32>> {
        let mut made = Vec::new();
        for w in wanted {
            if self.entries(w.record)? != Some(w.entries) {
                made.push((w.record, create(w)?));
            }
        }
        let mut installed = Vec::new();
        for (record, table) in made {
            self.outer.set(record, &table, 0).map_err(|e| {
                anyhow!("installing the own table of the rule at record {record}: {e}")
            })?;
            installed.push(record);
        }
        Ok(installed)
    }

    /// Drops the table at each of `records` that `wanted` does not name.
    /// The callers name the records that can hold one (the old and the new
    /// rule set's): a lookup of each of the array's 512 slots made every
    /// apply in a TCG guest a second slower, a syscall each.
    pub fn retire(
        &mut self,
        records: impl IntoIterator<Item = u32>,
        wanted: &[OwnTable],
    ) -> Result<()> {
        for record in records {
            if wanted.iter().any(|w| w.record == record) || self.get(record)?.is_none() {
                continue;
            }
            delete(&self.raw, record)
                .with_context(|| format!("dropping the own table of record {record}"))?;
        }
        Ok(())
    }
}

/// A new, empty table for `w`: the inner maps' shape (`flowctl-ebpf`'s
/// `FLOWCTL_RULE_TABLES` template: an LRU hash of `BucketKey` to a TAT) with
/// the rule's size. Preallocated, as the shared tables are.
fn create(w: &OwnTable) -> Result<MapData> {
    let obj = aya_obj::Map::new_from_params(
        bpf_map_type::BPF_MAP_TYPE_LRU_HASH as u32,
        size_of::<BucketKey>() as u32,
        size_of::<u64>() as u32,
        w.entries,
        0,
    );
    MapData::create(obj, &format!("flowctl_own{}", w.record), None).map_err(|e| {
        let enomem = matches!(&e, MapError::CreateError { io_error, .. } if io_error.raw_os_error() == Some(libc::ENOMEM));
        anyhow!(
            "creating the own table of the rule at record {} ({} entries): {e}{}",
            w.record,
            w.entries,
            if enomem { "; the kernel is out of memory for it (a smaller table_entries)" } else { "" }
        )
    })
}

/// `BPF_MAP_DELETE_ELEM` of `index` in an array of maps (the kernel drops
/// its reference to the inner map; a program still holding the map from a
/// lookup keeps it until it returns: RCU).
fn delete(map: &MapData, index: u32) -> std::io::Result<()> {
    // SAFETY: bpf_attr is a plain C union; all-zero is "no options".
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    {
        // SAFETY: writing plain integers into the element member.
        let e = unsafe { &mut attr.__bindgen_anon_2 };
        e.map_fd = map.fd().as_fd().as_raw_fd() as u32;
        e.key = &index as *const u32 as u64;
    }
    // SAFETY: the kernel reads the 4-byte key, which outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_MAP_DELETE_ELEM as libc::c_long,
            &mut attr as *mut bpf_attr,
            size_of::<bpf_attr>() as libc::c_long,
        )
    };
    match rc {
        0.. => Ok(()),
        _ => match std::io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            e => Err(e),
        },
    }
}
