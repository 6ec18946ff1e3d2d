//! Global rules' per-key state in the kernel (docs/fleet.md): the keys'
//! buckets (a source key's in its source-cache entry, `FLOWCTL_SRC_CACHE`,
//! any other in `FLOWCTL_GLOBAL_KEYS`; read for their offered counts), this
//! host's grants (`FLOWCTL_GRANTS`, the one writer of which is the agent's
//! lease loop, with the lease filter beside them: `lease_filter`) and the
//! hot-key reports (`FLOWCTL_HOT_KEYS`, one consumer).

use super::{lease_filter::LeaseFilter, maps::open_pinned, pins::AttachId, samples::drain_ring};
use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, Map, MapData, RingBuf};
use flowctl_common::{
    grant, map_names as names, window, BucketKey, GlobalBucket, GrantValue, HotKey, QuotaRing,
    SrcEntry, SrcKey,
};

pub struct GlobalKeys {
    sources: HashMap<MapData, SrcKey, SrcEntry>,
    buckets: HashMap<MapData, BucketKey, GlobalBucket>,
    grants: HashMap<MapData, BucketKey, GrantValue>,
    filter: LeaseFilter,
    quotas: HashMap<MapData, BucketKey, QuotaRing>,
    hot: RingBuf<MapData>,
}

impl GlobalKeys {
    pub fn open(id: &AttachId) -> Result<Self> {
        let d = id.pin_dir();
        let grants: HashMap<MapData, BucketKey, GrantValue> =
            HashMap::try_from(Map::HashMap(open_pinned(&d, names::GRANTS)?))?;
        let words = Array::try_from(Map::Array(open_pinned(&d, names::LEASE_FILTER)?))?;
        let granted: Vec<BucketKey> =
            grants.keys().collect::<Result<_, _>>().context("listing FLOWCTL_GRANTS")?;
        let filter = LeaseFilter::open(words, granted.into_iter())?;
        Ok(Self {
            sources: HashMap::try_from(Map::LruHashMap(open_pinned(&d, names::SRC_CACHE)?))?,
            buckets: HashMap::try_from(Map::LruHashMap(open_pinned(&d, names::GLOBAL_KEYS)?))?,
            grants,
            filter,
            quotas: HashMap::try_from(Map::LruHashMap(open_pinned(&d, names::QUOTAS)?))?,
            hot: RingBuf::try_from(Map::RingBuf(open_pinned(&d, names::HOT_KEYS)?))?,
        })
    }

    /// Up to `max` hot-key reports the kernel has written since.
    pub fn hot(&mut self, max: usize) -> Vec<HotKey> {
        drain_ring(&mut self.hot, max)
    }

    /// A key's bucket (`None`: the kernel has none, or evicted it): in the
    /// source's cache entry when the key's rule owns it (the kernel puts a
    /// source key's bucket there when it can), else in the key table.
    pub fn bucket(&self, key: &BucketKey) -> Option<GlobalBucket> {
        let in_source = source_of(key)
            .and_then(|src| self.sources.get(&src, 0).ok())
            .filter(|e| e.owner_state == key.state_id)
            .map(|e| e.bucket);
        in_source.or_else(|| self.buckets.get(key, 0).ok())
    }

    /// Grants `key` one unit per `interval_fp` with `burst_units` here, and
    /// `quota` units per window (a rule with a quota), until `expires_ns`
    /// (kernel clock), from the kernel's next re-read (within
    /// `grant::REFRESH_NS`). The bucket's TAT and the quota's window are
    /// left alone: the key keeps what it has spent.
    pub fn set_lease(
        &mut self,
        key: &BucketKey,
        interval_fp: u64,
        burst_units: u64,
        quota: u64,
        expires_ns: u64,
    ) -> Result<()> {
        let word = grant::encode(interval_fp, burst_units);
        let g = GrantValue { word, quota, expires_ns };
        // The filter's bit first: the kernel looks for a grant only where
        // the bit is set.
        self.filter.granting(key)?;
        self.grants.insert(key, g, 0).context("writing a grant into FLOWCTL_GRANTS")
    }

    /// [`set_lease`](Self::set_lease) without a quota or an end (tests and
    /// benchmarks of the kernel's stage).
    pub fn set_grant(&mut self, key: &BucketKey, interval_fp: u64, burst_units: u64) -> Result<()> {
        self.set_lease(key, interval_fp, burst_units, 0, u64::MAX)
    }

    /// The quota units `key` has admitted in its window (`w`) as of the
    /// kernel's clock now, counted as the kernel counts them, and the ns
    /// until all have left a window (`window::spent`); (0, 0) without a
    /// ring.
    pub fn quota_spent(&self, key: &BucketKey, w: &window::Window) -> (u64, u64) {
        let Ok(ring) = self.quotas.get(key, 0) else { return (0, 0) };
        window::spent(&ring.words, w, crate::system::clock::monotonic_ns())
    }

    /// Ends `key`'s lease here: back to the rule's default share.
    pub fn clear_grant(&mut self, key: &BucketKey) -> Result<()> {
        match self.grants.remove(key) {
            // Not there: nothing to end.
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
            Err(e) => return Err(e).context("removing a grant from FLOWCTL_GRANTS"),
        }
        // The bit last, once no grant needs it.
        self.filter.removed(key)
    }

    /// The grant stored for `key` (`None`: no lease).
    pub fn grant(&self, key: &BucketKey) -> Option<GrantValue> {
        self.grants.get(key, 0).ok()
    }
}

/// The source-cache key whose entry can hold `key`'s bucket: a source key's
/// (family and source set, nothing else; `keys::bucket_key`), as the kernel
/// spells the source (`SrcKey::of`). An entry's `owner_state` then says
/// whether it holds this rule's bucket.
fn source_of(key: &BucketKey) -> Option<SrcKey> {
    let only_src = key.proto == 0 && key.sport == 0 && key.dport == 0 && key.dst == [0; 4];
    (only_src && matches!(key.family, 4 | 6)).then(|| SrcKey::from_src(key.family, &key.src))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_key_maps_to_its_source_cache_key_and_nothing_else_does() {
        let v4 =
            BucketKey { state_id: 3, family: 4, src: [0x0a00_0001, 0, 0, 0], ..Default::default() };
        assert_eq!(source_of(&v4), Some(SrcKey { addr: [0, 0, 0xffff, 0x0a00_0001] }));
        let v6 = BucketKey { state_id: 3, family: 6, src: [1, 2, 3, 4], ..Default::default() };
        assert_eq!(source_of(&v6), Some(SrcKey { addr: [1, 2, 3, 4] }));
        // src_dport, 5-tuple, rule and dport keys never live in the cache.
        assert_eq!(source_of(&BucketKey { dport: 80, ..v4 }), None);
        assert_eq!(source_of(&BucketKey { proto: 6, dst: [9, 0, 0, 0], ..v4 }), None);
        assert_eq!(source_of(&BucketKey { state_id: 3, ..Default::default() }), None);
    }
}
