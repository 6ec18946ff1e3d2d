//! The key-sampling ring (`FLOWCTL_KEY_SAMPLES`): the kernel writes a
//! matched packet's key about once in `GlobalRecord::key_sample_every`
//! packets while someone asks (`Maps::set_key_sampling`); this is the
//! reader behind `top --keys` and the agent's heavy-hitter table.

use super::{maps::open_pinned, pins::AttachId};
use anyhow::Result;
use aya::maps::{Map, MapData, RingBuf};
use flowctl_common::{map_names as names, KeySample};

/// The consumer side of the key-sampling ring buffer (`top --keys`). A ring
/// buffer has one consumer position, so only one process should drain it:
/// the agent when it runs, else `top --keys` itself.
pub struct KeySamples {
    ring: RingBuf<MapData>,
}

impl KeySamples {
    pub fn open(id: &AttachId) -> Result<Self> {
        let ring =
            RingBuf::try_from(Map::RingBuf(open_pinned(&id.pin_dir(), names::KEY_SAMPLES)?))?;
        Ok(Self { ring })
    }

    /// Takes up to `max` samples the kernel has written.
    pub fn drain(&mut self, max: usize) -> Vec<KeySample> {
        drain_ring(&mut self.ring, max)
    }
}

/// Takes up to `max` records of type `T` the kernel wrote into `ring`.
pub(super) fn drain_ring<T: Copy>(ring: &mut RingBuf<MapData>, max: usize) -> Vec<T> {
    let mut out = Vec::new();
    while out.len() < max {
        let Some(item) = ring.next() else { break };
        if item.len() >= size_of::<T>() {
            // The kernel wrote a T; read it unaligned, as the ring gives no
            // alignment guarantee to Rust.
            out.push(unsafe { core::ptr::read_unaligned(item.as_ptr() as *const T) });
        }
    }
    out
}
