//! What a profile costs in kernel memory: the preallocated tables and the
//! statistics rings its settings size, checked against `memory_budget`, and
//! how sizes are printed.

use super::{
    error::{Ctx, ProfileError, Span},
    model::{Settings, StatsSettings},
};
use flowctl_common::{BucketKey, QuotaRing, SrcEntry, SrcKey, StatsBucket};

/// Kernel bytes per preallocated LRU hash element: the element header
/// (hash node, LRU node, hash; ~60 bytes on 6.x) plus key and value rounded to
/// 8, plus one 8-byte bucket head. Calibrated against the memlock the kernel
/// reports in fdinfo (docs/design.md, `cargo xtask bench` prints both).
pub fn lru_bytes_per_entry(key: usize, value: usize) -> u64 {
    (60 + key.next_multiple_of(8) + value.next_multiple_of(8) + 8) as u64
}

/// The CPUs per-CPU maps are sized for: the kernel's possible CPUs
/// (`/sys/devices/system/cpu/possible`, which may be more than are online
/// or available to this process), else the CPUs this process may use.
pub fn host_cpus() -> u64 {
    aya::util::nr_cpus().map(|n| n as u64).unwrap_or_else(|_| {
        std::thread::available_parallelism().map(|n| n.get() as u64).unwrap_or(1)
    })
}

/// aya-log-ebpf 0.2's ring for the kernel events (`AYA_LOGS`,
/// `RingBuf::with_byte_size(1 << 17)`): in every loaded XDP object, written
/// only when the events are on.
const KERNEL_LOG_RING_BYTES: usize = 1 << 17;
/// The kernel events' per-CPU maps (flowctl-ebpf/src/events.rs), created at
/// every load: one `EventSlot` (three timestamps and a 64-byte frame) and a
/// `u64` per counter record (`FLOWCTL_EVENT_SEEN`).
const KERNEL_EVENT_BYTES_PER_CPU: usize = 3 * 8 + 64 + 8 * flowctl_common::COUNTER_RECORDS;

/// Fixed kernel memory of the classification tables and counters (bytes)
/// on this host.
pub fn fixed_table_bytes() -> u64 {
    fixed_table_bytes_on(host_cpus())
}

/// The same on a host with `cpus` possible CPUs.
pub fn fixed_table_bytes_on(cpus: u64) -> u64 {
    use flowctl_common::*;
    let arrays = SLOTS * (PROTO_INDICES + PORT_INDICES + MAX_SRC_CLASSES) * size_of::<RuleBitmap>()
        + RULE_CONFIGS * size_of::<RuleConfig>()
        + CONTROL_RECORDS * size_of::<ControlRecord>()
        + DEBT_SETS * size_of::<debt::DebtSet>()
        + (sketch::SKETCH_POOL * sketch::SKETCH_CELLS) as usize * size_of::<u64>()
        + MAX_RULE_RECORDS * size_of::<warm::WarmBucket>()
        + MAX_RULE_RECORDS * OPEN_BUCKETS * size_of::<u64>()
        + HOT_KEY_RING_BYTES as usize
        + KERNEL_LOG_RING_BYTES
        + grant::LEASE_FILTER_WORDS as usize * size_of::<u64>();
    let grants =
        MAX_GRANTS as u64 * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<GrantValue>());
    let bookings =
        BOOKING_ENTRIES as u64 * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<u64>());
    // The egress shaper's: its table and aggregate buckets, its flow
    // table, its per-CPU counters.
    let shaper = (shaper::MAX_SHAPERS * (size_of::<shaper::ShaperConfig>() + size_of::<u64>()))
        as u64
        + shaper::SHAPER_FLOW_ENTRIES as u64
            * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<u64>())
        + (shaper::SHAPER_COUNTERS * size_of::<shaper::ShaperCounters>()) as u64 * cpus;
    let counters = (COUNTER_RECORDS * (size_of::<RuleCounters>() + size_of::<ReportWindow>())
        + KERNEL_EVENT_BYTES_PER_CPU) as u64
        * cpus;
    arrays as u64 + counters + grants + bookings + shaper
}

impl StatsSettings {
    /// Kernel bytes of the rings on a host with `cpus` CPUs: per CPU,
    /// a ring per record (`records`).
    pub fn kernel_bytes_on(&self, cpus: u64) -> u64 {
        self.records() as u64 * self.buckets as u64 * size_of::<StatsBucket>() as u64 * cpus
    }
}

impl Settings {
    /// Preallocated kernel memory of a data plane with these table sizes
    /// on this host.
    pub fn kernel_memory_bytes(&self) -> u64 {
        self.kernel_memory_bytes_on(host_cpus())
    }

    /// The same on a host with `cpus` possible CPUs: the per-CPU maps (the
    /// counters and the statistics rings) grow with them, the rest not.
    pub fn kernel_memory_bytes_on(&self, cpus: u64) -> u64 {
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
        let own = self.own_table_entries * own_table_bytes(1);
        cache
            + list_trie_bytes(self.list_prefixes)
            + own
            + keys
            + quotas
            + conns
            + global
            + fixed_table_bytes_on(cpus)
            + self.stats.kernel_bytes_on(cpus)
    }
}

/// Kernel bytes of an isolated rule's own table of `entries` keys
/// (`isolate`, `table_entries`): an LRU hash of the key table's shape.
pub fn own_table_bytes(entries: u32) -> u64 {
    entries as u64 * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<u64>())
}

/// Kernel bytes per list prefix in one slot of the source trie: its node
/// (`struct lpm_trie_node`, 40 bytes, plus the 17-byte key data and the
/// 4-byte class) and the intermediate nodes a trie of many prefixes needs,
/// as slab allocations. Measured: 140 bytes per prefix (unreclaimable slab
/// grew by 139-141 MB per slot of a million /32s on 6.18, docs/lists.md).
const LIST_PREFIX_BYTES_PER_SLOT: u64 = 144;

/// Kernel bytes of the lists' trie entries: two slots of them (an apply
/// writes the new slot while the old one is live).
pub fn list_trie_bytes(prefixes: u64) -> u64 {
    2 * LIST_PREFIX_BYTES_PER_SLOT * prefixes
}

/// The tables must fit `memory_budget`; `span` is where to point
/// (`super::settings::budget_span`).
pub fn check_budget(cx: &Ctx, settings: &Settings, span: Span) -> Result<(), ProfileError> {
    let need = settings.kernel_memory_bytes();
    if need > settings.memory_budget {
        return Err(cx.err(
            span,
            format!(
                "the tables need {} of kernel memory, over the budget of {} (lower key_table_entries/source_cache_entries or isolated rules' table_entries, shorten the lists, or raise settings.memory_budget)",
                human_bytes(need),
                human_bytes(settings.memory_budget)
            ),
        ));
    }
    Ok(())
}

/// A size for people: KiB or MiB with one decimal, GiB with two (so a
/// figure just over a 1 GiB budget does not read as equal to it).
pub fn human_bytes(n: u64) -> String {
    if n >= 1 << 30 {
        format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64)
    } else if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", n as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use crate::profile::{parse, tests::err, Settings};

    #[test]
    fn memory_budget_rejects_big_tables() {
        let e = err("[settings]\nkey_table_entries = 67108864\nmemory_budget = \"256MiB\"\n[[rule]]\nname = \"a\"\nrate = \"1/s\"");
        assert!(e.to_string().contains("over the budget"), "{e}");
        assert_eq!((e.line, e.col), (2, 21), "points at key_table_entries");
        let ok = parse("p", "[[rule]]\nname = \"a\"\nrate = \"1/s\"").unwrap();
        // Default tables: two 1M-entry LRU hashes (the source cache's
        // 72-byte entries hold a global rule's bucket), the quota and
        // connection tables, the shaper's flow table, the flood sketches
        // (4 MiB) and the statistics rings: 387 MiB on 2 CPUs.
        let mem = ok.settings.kernel_memory_bytes_on(2);
        assert!(mem > 350 << 20 && mem < 400 << 20, "{mem}");
        // The per-CPU maps grow with the CPUs, the rest not: 2.9 MiB per
        // CPU, most of it the statistics rings (257 records for the
        // default 128 rules x 100 buckets x 112 bytes).
        let per_cpu = ok.settings.kernel_memory_bytes_on(3) - mem;
        assert_eq!(ok.settings.kernel_memory_bytes_on(128), mem + 126 * per_cpu);
        assert!(per_cpu > 2 << 20 && per_cpu < 3 << 20, "{per_cpu}");
        // The defaults fit a 128-CPU host in the default 1 GiB budget.
        let on_128 = ok.settings.kernel_memory_bytes_on(128);
        assert!(on_128 <= ok.settings.memory_budget, "{on_128}");
        assert_eq!(super::human_bytes(on_128), "752.5 MiB");
        // A list of a million prefixes: two slots of 144 bytes each, 275 MiB.
        let listed = Settings { list_prefixes: 1_000_000, ..ok.settings.clone() };
        assert_eq!(listed.kernel_memory_bytes_on(2) - mem, 288_000_000);
        // All 256 rules: rings for 513 records, 5.6 MiB per CPU: 1.08 GiB,
        // over the budget on 128 CPUs (as before max_rules existed).
        let all = parse("p", "[settings]\nmax_rules = 256\n[[rule]]\nname = \"a\"\nrate = \"1/s\"")
            .unwrap();
        let per_cpu_all =
            all.settings.kernel_memory_bytes_on(3) - all.settings.kernel_memory_bytes_on(2);
        assert!(per_cpu_all > 5 << 20 && per_cpu_all < 6 << 20, "{per_cpu_all}");
        assert_eq!(super::human_bytes(all.settings.kernel_memory_bytes_on(128)), "1.08 GiB");
    }

    #[test]
    fn max_rules_bounds_the_rules_with_line_and_reason() {
        let rules = |n: usize| {
            (0..n)
                .map(|i| format!("[[rule]]\nname = \"r{i}\"\nrate = \"1/s\"\n"))
                .collect::<String>()
        };
        assert_eq!(parse("p", &rules(128)).unwrap().rules.len(), 128);
        let e = err(&rules(129));
        assert!(
            e.to_string().contains("at most 128 (raise [settings] max_rules, up to 256"),
            "{e}"
        );
        assert_eq!(e.line, 1 + 3 * 128, "points at the 129th rule");
        let big = format!("[settings]\nmax_rules = 256\n{}", rules(256));
        assert_eq!(parse("p", &big).unwrap().rules.len(), 256);
        let e = err(&format!("[settings]\nmax_rules = 256\n{}", rules(257)));
        assert!(e.to_string().contains("too many rules: at most 256"), "{e}");
        let e = err("[settings]\nmax_rules = 257\n[[rule]]\nname = \"a\"\nrate = \"1/s\"");
        assert!(e.to_string().contains("max_rules 257 out of range: 1 to 256"), "{e}");
        assert_eq!((e.line, e.col), (2, 13));
        let small = parse("p", "[settings]\nmax_rules = 4\n[[rule]]\nname = \"a\"\nrate = \"1/s\"")
            .unwrap();
        assert_eq!(small.settings.stats.records(), 9);
    }
}
