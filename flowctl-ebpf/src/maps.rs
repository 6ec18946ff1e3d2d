//! Every map of the `flowctl-xdp` object, and its load-time constants, in
//! one place. The names are the interface: user space pins, opens and
//! fills the maps by these names (`flowctl_common::map_names`, and the
//! table in docs/design.md), and sets the constants by theirs before
//! loading. Renaming one here breaks the loader, and a pinned map of an
//! attachment made by the previous build.

use aya_ebpf::{
    btf_maps::{ArrayOfMaps, LruHashMap as BtfLruHashMap},
    macros::{btf_map, map},
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
    Global,
};
use flowctl_common::{
    sketch::{SKETCH_CELLS, SKETCH_POOL},
    stats,
    stats::StatsClock,
    AgentRecord, BucketKey, ConnEntry, ControlRecord, EgressTarget, GlobalBucket, GlobalRecord,
    GrantValue, PacketMeta, QuotaRing, ReportWindow, RuleBitmap, RuleConfig, RuleCounters,
    SrcEntry, SrcKey, StatsBucket, TrieData, BOOKING_ENTRIES, CONTROL_RECORDS, COUNTER_RECORDS,
    DEBT_SETS, DEFAULT_CONN_ENTRIES, DEFAULT_GLOBAL_KEY_ENTRIES, DEFAULT_QUOTA_ENTRIES,
    DEFAULT_STATS_BUCKETS, DEFAULT_STATS_BUCKET_NS, DEFAULT_TABLE_ENTRIES,
    EGRESS_COUNTERS_PER_TARGET, HOT_KEY_RING_BYTES, KEY_SAMPLE_RING_BYTES, MAX_EGRESS_TARGETS,
    MAX_GRANTS, MAX_NESTED_LIMITS, MAX_RULE_RECORDS, MAX_SRC_CLASSES, OPEN_BUCKETS, PORT_INDICES,
    PROTO_INDICES, RULE_CONFIGS, RULE_SETS, SLOTS, SRC_TRIE_ENTRIES,
};

// The profile, as the agent applied it: two slots of everything it reads
// per packet (`GlobalRecord::active_slot` says which is live).

#[map]
pub static FLOWCTL_GLOBAL: Array<GlobalRecord> = Array::pinned(1, 0);
#[map]
pub static FLOWCTL_RULES: Array<RuleConfig> = Array::pinned(RULE_CONFIGS as u32, 0);
#[map]
pub static FLOWCTL_PROTO_BITS: Array<RuleBitmap> = Array::pinned((PROTO_INDICES * SLOTS) as u32, 0);
#[map]
pub static FLOWCTL_PORT_BITS: Array<RuleBitmap> = Array::pinned((PORT_INDICES * SLOTS) as u32, 0);
/// Rules by property per slot (`rule_set::*`), for packets whose ports the
/// parser could not reach.
#[map]
pub static FLOWCTL_RULE_SETS: Array<RuleBitmap> = Array::pinned((RULE_SETS * SLOTS) as u32, 0);
#[map]
pub static FLOWCTL_SRC_TRIE: LpmTrie<TrieData, u32> = LpmTrie::pinned(SRC_TRIE_ENTRIES as u32, 0);
#[map]
pub static FLOWCTL_SRC_CLASSES: Array<RuleBitmap> =
    Array::pinned((MAX_SRC_CLASSES * SLOTS) as u32, 0);

// Per-key state of the stages.

/// The destination classes this CPU looked up last (direct-mapped by a
/// hash of the address), for profiles with `dst` rules: a host receives
/// at a handful of its own addresses, so nearly every packet finds its
/// destination here instead of walking the trie (docs/benchmarks.md 1j).
/// Not pinned: a new program starts with an empty memo, and an entry of
/// another generation is never used.
#[map]
pub static FLOWCTL_DST_MEMO: PerCpuArray<DstMemo> =
    PerCpuArray::with_max_entries(DST_MEMO_ENTRIES, 0);

/// One destination's class under one rule-set generation. `family` 0 (a
/// zeroed entry) matches no packet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DstMemo {
    pub generation: u32,
    pub class: u32,
    pub family: u32,
    pub addr: [u32; 4],
}

/// Entries of [`FLOWCTL_DST_MEMO`] per CPU (a power of two).
pub const DST_MEMO_ENTRIES: u32 = 16;

/// Sources' classes, and a source-keyed rule's bucket (see
/// `stages::bucket`).
#[map]
pub static FLOWCTL_SRC_CACHE: LruHashMap<SrcKey, SrcEntry> =
    LruHashMap::pinned(DEFAULT_TABLE_ENTRIES, 0);
/// Every other key's bucket (its TAT).
#[map]
pub static FLOWCTL_KEYS: LruHashMap<BucketKey, u64> = LruHashMap::pinned(DEFAULT_TABLE_ENTRIES, 0);
/// Isolated rules' own bucket tables (`bucket_table::OWN`), one LRU hash
/// per rule at its counter record: the agent creates each with the rule's
/// `table_entries` and drops it with the rule. The template's one entry is
/// only the inner maps' shape (a hash map's size may differ from it). A
/// BTF-defined map, as aya declares maps of maps; pinned by the loader
/// (`map_pin_path`), since BTF map definitions carry no pinning here.
#[btf_map]
pub static FLOWCTL_RULE_TABLES: ArrayOfMaps<BtfLruHashMap<BucketKey, u64, 1>, MAX_RULE_RECORDS> =
    ArrayOfMaps::new();
/// Quota window rings, one per key of every quota rule.
#[map]
pub static FLOWCTL_QUOTAS: LruHashMap<BucketKey, QuotaRing> =
    LruHashMap::pinned(DEFAULT_QUOTA_ENTRIES, 0);
/// A zeroed ring to insert from (144 bytes are too many for the stack).
#[map]
pub static FLOWCTL_ZERO_RING: PerCpuArray<QuotaRing> = PerCpuArray::with_max_entries(1, 0);
/// Global rules' keys (see `stages::global`), sized by the loader.
#[map]
pub static FLOWCTL_GLOBAL_KEYS: LruHashMap<BucketKey, GlobalBucket> =
    LruHashMap::pinned(DEFAULT_GLOBAL_KEY_ENTRIES, 0);
/// The global stage's working memory: the packet's key and a new bucket,
/// per CPU, not on the stack (6.1 counts that stage's frame with its
/// callers' against 512 bytes, docs/design.md "Verifier budget").
#[repr(C)]
pub struct GlobalScratch {
    pub key: BucketKey,
    pub _pad: u32,
    pub fresh: GlobalBucket,
}
#[map]
pub static FLOWCTL_GLOBAL_SCRATCH: PerCpuArray<GlobalScratch> = PerCpuArray::with_max_entries(1, 0);
/// The nested limits' stage's scratch, per CPU (`stages::nested`): the key
/// of the limit at hand, built here rather than on the stack (as the global
/// stage's is), and the TAT each limit's take wrote, which its give-back
/// needs. The isolated stage (`stages::isolated`) builds its key here too:
/// an isolated rule has no nested limits, so one packet never needs both.
/// Not pinned: it holds nothing past one packet.
#[repr(C)]
pub struct LimitScratch {
    pub key: BucketKey,
    pub _pad: u32,
    pub written: [u64; 1 + MAX_NESTED_LIMITS],
}
#[map]
pub static FLOWCTL_LIMIT_SCRATCH: PerCpuArray<LimitScratch> = PerCpuArray::with_max_entries(1, 0);
/// This host's grants for leased keys (`GrantValue`), written by the agent.
#[map]
pub static FLOWCTL_GRANTS: HashMap<BucketKey, GrantValue> = HashMap::pinned(MAX_GRANTS, 0);
/// Per rule record, per CPU: refused keys sent to be reported in the
/// current window (`stages::global::flowctl_take_report`). Not pinned: a reload
/// starting a fresh window costs nothing.
#[map]
pub static FLOWCTL_REPORT_WINDOWS: PerCpuArray<ReportWindow> =
    PerCpuArray::with_max_entries(COUNTER_RECORDS as u32, 0);
/// One bit per slot of keys that may hold a grant (`grant::filter_slot`),
/// written by the agent: a clear bit spares a key the grants lookup.
#[map]
pub static FLOWCTL_LEASE_FILTER: Array<u64> =
    Array::pinned(flowctl_common::grant::LEASE_FILTER_WORDS, 0);
/// Refused SYNs' bookings (`stages::booking`): flow -> slot (ns).
#[map]
pub static FLOWCTL_BOOKINGS: LruHashMap<BucketKey, u64> = LruHashMap::pinned(BOOKING_ENTRIES, 0);
/// Hot keys of global rules, for the agent (`HotKey`).
#[map]
pub static FLOWCTL_HOT_KEYS: RingBuf = RingBuf::pinned(HOT_KEY_RING_BYTES, 0);
/// Warm-up rules' aggregate buckets (`stages::warm`), one per rule record.
#[map]
pub static FLOWCTL_WARM: Array<flowctl_common::warm::WarmBucket> =
    Array::pinned(MAX_RULE_RECORDS as u32, 0);
/// Remembered debts of refused buckets: a region of tagged sets per rule
/// record (`flowctl_common::debt`).
#[map]
pub static FLOWCTL_DEBT: Array<flowctl_common::debt::DebtSet> = Array::pinned(DEBT_SETS as u32, 0);
/// The pool of flood sketches the agent lends to flooded rules, as one
/// flat array of TAT cells (`flowctl_common::sketch::cell_index`).
#[map]
pub static FLOWCTL_SKETCHES: Array<u64> = Array::pinned(SKETCH_POOL * SKETCH_CELLS, 0);

// What the agent's control loops set per rule record, and what they read.

#[map]
pub static FLOWCTL_CONTROL: Array<ControlRecord> = Array::pinned(CONTROL_RECORDS as u32, 0);
/// Agent-computed state for other readers (user space only; see AgentRecord).
#[map]
pub static FLOWCTL_AGENT: Array<AgentRecord> = Array::pinned(1, 0);
/// Tracked TCP connections of BBR rules (key: 5-tuple, `state_id` = record).
#[map]
pub static FLOWCTL_CONNS: LruHashMap<BucketKey, ConnEntry> =
    LruHashMap::pinned(DEFAULT_CONN_ENTRIES, 0);
/// BBR rules' open-connection rings: per record, `OPEN_BUCKETS` words of
/// (epoch << 32 | established-and-not-completed), updated by compare-and-swap.
#[map]
pub static FLOWCTL_OPEN: Array<u64> = Array::pinned((MAX_RULE_RECORDS * OPEN_BUCKETS) as u32, 0);

// Counting (see `accounting`) and sampling (see `sampler`).

#[map]
pub static FLOWCTL_COUNTERS: PerCpuArray<RuleCounters> =
    PerCpuArray::pinned(COUNTER_RECORDS as u32, 0);
/// Per-rule statistics rings: `FLOWCTL_STATS_BUCKETS` entries per counter
/// record, sized by the loader (see `flowctl_common::stats`).
#[map]
pub static FLOWCTL_STATS: PerCpuArray<StatsBucket> =
    PerCpuArray::pinned(COUNTER_RECORDS as u32 * DEFAULT_STATS_BUCKETS, 0);
/// Each CPU's current statistics bucket (see `accounting::current_stats`).
#[map]
pub static FLOWCTL_STATS_CLOCK: PerCpuArray<StatsClock> = PerCpuArray::with_max_entries(1, 0);
/// Sampled keys for `top --keys`, read by the agent.
#[map]
pub static FLOWCTL_KEY_SAMPLES: RingBuf = RingBuf::pinned(KEY_SAMPLE_RING_BYTES, 0);

/// The packet in flight on this CPU, as `flowctl_parse` read it (see
/// `packet`).
#[map]
pub static FLOWCTL_PACKET: PerCpuArray<PacketMeta> = PerCpuArray::with_max_entries(1, 0);

// The TC egress counter's (`egress`, a separate program in this object).

#[map]
pub static FLOWCTL_EGRESS_TARGETS: Array<EgressTarget> =
    Array::pinned(MAX_EGRESS_TARGETS as u32, 0);
#[map]
pub static FLOWCTL_EGRESS_COUNTS: PerCpuArray<u64> =
    PerCpuArray::pinned((MAX_EGRESS_TARGETS * EGRESS_COUNTERS_PER_TARGET) as u32, 0);

// The TC egress shaper's (`shaper`, a separate program in this object).

#[map]
pub static FLOWCTL_SHAPERS: Array<flowctl_common::shaper::ShaperConfig> =
    Array::pinned(flowctl_common::shaper::MAX_SHAPERS as u32, 0);
/// Each aggregate shaper's bucket: the next free departure time (ns).
#[map]
pub static FLOWCTL_SHAPER_NEXT: Array<u64> =
    Array::pinned(flowctl_common::shaper::MAX_SHAPERS as u32, 0);
/// Per-flow shapers' buckets (key: the flow, `state_id` = shaper + 1).
#[map]
pub static FLOWCTL_SHAPER_FLOWS: LruHashMap<BucketKey, u64> =
    LruHashMap::pinned(flowctl_common::shaper::SHAPER_FLOW_ENTRIES, 0);
#[map]
pub static FLOWCTL_SHAPER_COUNTS: PerCpuArray<flowctl_common::shaper::ShaperCounters> =
    PerCpuArray::pinned(flowctl_common::shaper::SHAPER_COUNTERS as u32, 0);

// Load-time constants (set by the loader; the verifier prunes by them).

#[no_mangle]
pub static FLOWCTL_STATS_LEVEL: Global<u8> = Global::new(stats::level::FULL);
#[no_mangle]
pub static FLOWCTL_STATS_BUCKET_NS: Global<u64> = Global::new(DEFAULT_STATS_BUCKET_NS);
#[no_mangle]
pub static FLOWCTL_STATS_BUCKETS: Global<u32> = Global::new(DEFAULT_STATS_BUCKETS);
#[no_mangle]
pub static FLOWCTL_STATS_RECORDS: Global<u32> = Global::new(COUNTER_RECORDS as u32);
/// `flowctl_common::globals::FAST_PARSE`.
#[no_mangle]
pub static FLOWCTL_FAST_PARSE: Global<u8> = Global::new(1);

/// The headers `flowctl_parse` left for the packet in flight. XDP runs one
/// packet at a time per CPU (NAPI, softirq), so this CPU's entry is this
/// packet's until the program returns.
#[inline(always)]
pub fn packet() -> Option<&'static PacketMeta> {
    FLOWCTL_PACKET.get(0)
}
