//! What a profile costs in kernel memory: the preallocated tables and the
//! statistics rings its settings size, checked against `memory_budget`, and
//! how sizes are printed.

use super::{
    error::{Ctx, ProfileError, Span},
    model::{Settings, StatsSettings},
};
use flowctl_common::{BucketKey, QuotaRing, SrcEntry, SrcKey, StatsBucket, COUNTER_RECORDS};

/// Kernel bytes per preallocated LRU hash element: the element header
/// (hash node, LRU node, hash; ~60 bytes on 6.x) plus key and value rounded to
/// 8, plus one 8-byte bucket head. Calibrated against the memlock the kernel
/// reports in fdinfo (docs/design.md, `cargo xtask bench` prints both).
pub fn lru_bytes_per_entry(key: usize, value: usize) -> u64 {
    (60 + key.next_multiple_of(8) + value.next_multiple_of(8) + 8) as u64
}

/// Fixed kernel memory of the classification tables and counters (bytes).
pub fn fixed_table_bytes() -> u64 {
    use flowctl_common::*;
    let arrays = SLOTS * (PROTO_INDICES + PORT_INDICES + MAX_SRC_CLASSES) * size_of::<RuleBitmap>()
        + SLOTS * MAX_RULES * size_of::<RuleConfig>()
        + MAX_RULE_RECORDS * size_of::<ControlRecord>()
        + DEBT_SLOTS * size_of::<u64>()
        + MAX_RULE_RECORDS * OPEN_BUCKETS * size_of::<u64>()
        + HOT_KEY_RING_BYTES as usize;
    let grants = MAX_GRANTS as u64 * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<u64>());
    let bookings =
        BOOKING_ENTRIES as u64 * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<u64>());
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let counters = COUNTER_RECORDS * size_of::<RuleCounters>() * ncpu;
    (arrays + counters) as u64 + grants + bookings
}

impl StatsSettings {
    /// Kernel bytes of the rings: per CPU, every counter record's ring.
    pub fn kernel_bytes(&self) -> u64 {
        let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as u64;
        COUNTER_RECORDS as u64 * self.buckets as u64 * size_of::<StatsBucket>() as u64 * ncpu
    }
}

impl Settings {
    /// Preallocated kernel memory of a data plane with these table sizes.
    pub fn kernel_memory_bytes(&self) -> u64 {
        let cache = self.source_cache_entries as u64
            * lru_bytes_per_entry(size_of::<SrcKey>(), size_of::<SrcEntry>());
        let keys = self.key_table_entries as u64
            * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<u64>());
        let quotas = self.quota_table_entries as u64
            * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<QuotaRing>());
        let conns = self.connection_table_entries as u64
            * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<flowctl_common::ConnEntry>());
        let global = self.global_key_entries as u64
            * lru_bytes_per_entry(
                size_of::<BucketKey>(),
                size_of::<flowctl_common::GlobalBucket>(),
            );
        cache + keys + quotas + conns + global + fixed_table_bytes() + self.stats.kernel_bytes()
    }
}

/// The tables must fit `memory_budget`; `span` is where to point
/// (`super::settings::budget_span`).
pub fn check_budget(cx: &Ctx, settings: &Settings, span: Span) -> Result<(), ProfileError> {
    let need = settings.kernel_memory_bytes();
    if need > settings.memory_budget {
        return Err(cx.err(
            span,
            format!(
                "the tables need {} of kernel memory, over the budget of {} (lower key_table_entries/source_cache_entries or raise settings.memory_budget)",
                human_bytes(need),
                human_bytes(settings.memory_budget)
            ),
        ));
    }
    Ok(())
}

/// A size for people: KiB, MiB or GiB with one decimal.
pub fn human_bytes(n: u64) -> String {
    if n >= 1 << 30 {
        format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64)
    } else if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", n as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use crate::profile::{parse, tests::err};

    #[test]
    fn memory_budget_rejects_big_tables() {
        let e = err("[settings]\nkey_table_entries = 67108864\nmemory_budget = \"256MiB\"\n[[rule]]\nname = \"a\"\nrate = \"1/s\"");
        assert!(e.to_string().contains("over the budget"), "{e}");
        assert_eq!((e.line, e.col), (2, 21), "points at key_table_entries");
        let ok = parse("p", "[[rule]]\nname = \"a\"\nrate = \"1/s\"").unwrap();
        // Default tables: two 1M-entry LRU hashes, the quota and connection
        // tables and the statistics rings: about 300 MB on 2 CPUs.
        let mem = ok.settings.kernel_memory_bytes();
        assert!(mem > 200 << 20 && mem < 350 << 20, "{mem}");
    }
}
