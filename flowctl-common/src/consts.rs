//! Constants shared by kernel and user space: the one source of truth for map
//! names, capacities, indices and the pin layout.

/// Rules per profile. Rule sets are matched as 256-bit bitmaps, so the match
/// cost does not depend on how many rules there are.
pub const MAX_RULES: usize = 256;
/// 64-bit words in a rule bitmap.
pub const BITMAP_WORDS: usize = MAX_RULES / 64;
/// Rule tables are double-buffered: `apply` fills the inactive slot, then flips
/// `GlobalRecord::active_slot`, so the kernel never sees half a profile.
pub const SLOTS: usize = 2;
/// Per-rule counter/control records. A rule keeps its record across `apply`
/// while its name is unchanged, and old and new rules coexist during a flip.
pub const MAX_RULE_RECORDS: usize = MAX_RULES * SLOTS;
/// Counter record for traffic that matched no rule (non-IP, malformed, ...).
pub const GLOBAL_COUNTER_INDEX: u32 = MAX_RULE_RECORDS as u32;
pub const COUNTER_RECORDS: usize = MAX_RULE_RECORDS + 1;
/// Control records: one per rule record, and the global record's (its
/// flood flag, `control_flags::FLOOD`).
pub const CONTROL_RECORDS: usize = MAX_RULE_RECORDS + 1;
/// Rules a profile may hold unless `[settings] max_rules` says more (up to
/// `MAX_RULES`). The per-CPU statistics rings are sized for
/// `2 * max_rules + 1` records at load: at 128 rules the default profile's
/// rings take 2.7 MiB per CPU instead of 5.5 MiB at 256, which is what lets
/// the defaults fit a 128-CPU host in the default 1 GiB budget.
pub const DEFAULT_MAX_RULES: u32 = 128;

/// Port index used for packets without a destination port (ICMP, other
/// protocols, non-first fragments): only rules without a port constraint match it.
pub const PORT_NONE: u32 = 65536;
pub const PORT_INDICES: usize = 65537;
pub const PROTO_INDICES: usize = 256;
/// Bitmaps of rules by property per slot in `FLOWCTL_RULE_SETS`.
pub const RULE_SETS: usize = 2;
/// Indices into a slot's `FLOWCTL_RULE_SETS` entries.
pub mod rule_set {
    /// Rules with action `drop` (they limit).
    pub const ENFORCING: usize = 0;
    /// Rules without a protocol constraint.
    pub const ANY_PROTO: usize = 1;
}
/// Limits a rule may add to its own `rate` (`[[rule.limit]]`): a packet
/// must pass all of them (docs/design.md, "Nested limits").
pub const MAX_NESTED_LIMITS: usize = 3;
/// Entries of `FLOWCTL_RULES`: each slot's rules at `slot * MAX_RULES + i`,
/// then the nested limits of every rule at `nested_limit_at`.
pub const RULE_CONFIGS: usize = MAX_RULES * SLOTS * (1 + MAX_NESTED_LIMITS);

/// Bucket-state ids a rule's state takes (`RuleConfig::state_id`): its
/// own, then one per nested limit (`nested_state_id`), so no two limits'
/// buckets share a key.
pub const STATE_IDS_PER_RULE: u32 = 1 + MAX_NESTED_LIMITS as u32;

/// The state id of nested limit `i` (from 0) of a rule of state `state_id`.
#[inline(always)]
pub const fn nested_state_id(state_id: u32, i: u32) -> u32 {
    state_id + 1 + i
}

/// Where in `FLOWCTL_RULES` nested limit `i` (from 0) of the rule at
/// `rule_at` lives.
#[inline(always)]
pub const fn nested_limit_at(rule_at: u32, i: u32) -> u32 {
    (MAX_RULES * SLOTS) as u32 + rule_at * MAX_NESTED_LIMITS as u32 + i
}

/// Distinct source classes per slot: one per distinct set of rules a
/// source can match by its address (at most one per trie entry). The LPM
/// trie maps a source to its class; the class's rule bitmap lives in
/// `SRC_CLASSES`, so the per-source cache stores a 4-byte class instead of
/// a 32-byte bitmap. Rules with plain prefixes make at most `MAX_RULES + 2`;
/// lists of many prefixes mostly repeat a few (`tables::compile`).
pub const MAX_SRC_CLASSES: usize = 4096;
/// Prefixes all `[[list]]`s of a profile may hold together: the trie keeps
/// two slots of them during an apply (docs/lists.md).
pub const MAX_LIST_PREFIXES: usize = 1 << 22;
/// Entries of `FLOWCTL_SRC_TRIE`: per slot, the rules' prefixes, the two
/// default routes and the lists' prefixes. An LPM trie is never
/// preallocated: memory follows what is inserted.
pub const SRC_TRIE_ENTRIES: usize = SLOTS * (MAX_RULES + 2 + MAX_LIST_PREFIXES);
/// Trie value meaning "no class" (only before the first apply).
pub const NO_CLASS: u32 = u32::MAX;

/// Remembered debts of refused buckets live in `FLOWCTL_DEBT`, a region of
/// tagged sets per rule record (`debt::DEBT_SETS_PER_RULE`): see `debt`.
pub use crate::debt::{DEBT_SETS, DEBT_SETS_PER_RULE};

/// Default and hard limits of the key tables (entries).
pub const DEFAULT_TABLE_ENTRIES: u32 = 1 << 20;
/// Default entries of an isolated rule's own bucket table
/// (`isolate = true`), and its bounds.
pub const DEFAULT_OWN_TABLE_ENTRIES: u32 = 1 << 16;
pub const MIN_OWN_TABLE_ENTRIES: u32 = 1 << 10;
pub const MAX_OWN_TABLE_ENTRIES: u32 = 1 << 24;
/// Default entries of the quota table (one window ring per key).
pub const DEFAULT_QUOTA_ENTRIES: u32 = 1 << 16;
/// Most buckets a quota window may have (K); the ring holds K + 1 slots.
pub const MAX_QUOTA_BUCKETS: usize = 16;
pub const QUOTA_RING_SLOTS: usize = MAX_QUOTA_BUCKETS + 1;

/// Statistics rings: default bucket width and count (100 ms x 100 = 10 s,
/// the span BBR's window and the in-flight idle timeout need), and limits.
pub const DEFAULT_STATS_BUCKET_NS: u64 = 100_000_000;
pub const DEFAULT_STATS_BUCKETS: u32 = 100;
pub const MAX_STATS_BUCKETS: u32 = 1000;

/// Open-connection ring of BBR rules: connections established per epoch of
/// `OPEN_BUCKET_NS`, minus those that completed; a rule's in-flight count is
/// the sum over the epochs within its idle timeout, so a connection counts
/// for at most the timeout after its handshake (a lost FIN or an evicted
/// entry cannot make the count drift; a longer-lived connection stops
/// counting too, since the ring sees only opens and completions).
pub const OPEN_BUCKET_NS: u64 = 1_000_000_000;
pub const OPEN_BUCKETS: usize = 64;
/// Default entries of the connection table (BBR rules' tracked connections).
pub const DEFAULT_CONN_ENTRIES: u32 = 1 << 18;

/// Downstream endpoints the TC egress program counts (KLimiter baselines).
pub const MAX_EGRESS_TARGETS: usize = 16;
/// Per target, two per-CPU counters: packets, and new TCP connections (SYN).
pub const EGRESS_COUNTERS_PER_TARGET: usize = 2;

/// Default entries of the global rules' key table (`FLOWCTL_GLOBAL_KEYS`),
/// and most leased keys (`FLOWCTL_GRANTS`) an agent holds at once.
pub const DEFAULT_GLOBAL_KEY_ENTRIES: u32 = 1 << 16;
pub const MAX_GRANTS: u32 = 1 << 16;
/// Refused SYNs' bookings (`FLOWCTL_BOOKINGS`, flow -> slot) held at once,
/// over every rule with `book_retransmits`. A rule of rate r holds at most
/// about r * (`booking::HORIZON_NS` + `booking::LIFETIME_NS`) of them;
/// an evicted booking loses its token (never admits more).
pub const BOOKING_ENTRIES: u32 = 1 << 16;
/// Bytes of the hot-key ring buffer (52-byte reports, at most 10 per key
/// per second: `grant::HOT_EVERY_NS`).
pub const HOT_KEY_RING_BYTES: u32 = 1 << 18;

/// Bytes of the key-sampling ring buffer (`top --keys`); a power of two
/// multiple of the page size, as the kernel requires.
pub const KEY_SAMPLE_RING_BYTES: u32 = 1 << 20;

/// Load-time constants of the XDP object (read-only data the verifier sees
/// as known, so code behind a switched-off constant is pruned).
pub mod globals {
    /// `stats::level::*`.
    pub const STATS_LEVEL: &str = "FLOWCTL_STATS_LEVEL";
    pub const STATS_BUCKET_NS: &str = "FLOWCTL_STATS_BUCKET_NS";
    pub const STATS_BUCKETS: &str = "FLOWCTL_STATS_BUCKETS";
    /// Rings in `FLOWCTL_STATS`: `2 * max_rules + 1` (`stats::ring_record`).
    pub const STATS_RECORDS: &str = "FLOWCTL_STATS_RECORDS";
    /// 1 (the default): the entry point parses the common layout itself
    /// (untagged Ethernet, IPv4 without options, unfragmented, TCP or UDP)
    /// and calls the parser's functions only for the rest. 0: every frame
    /// goes through the parser's functions, so the benchmark and the fuzzer
    /// can hold the two against each other.
    pub const FAST_PARSE: &str = "FLOWCTL_FAST_PARSE";
}

/// The log target of the XDP program's kernel events (aya-log records,
/// `flowctl-ebpf/src/events.rs`): the agent loads them on only when its log
/// shows this target at debug (`FLOWCTL_LOG=flowctl::kernel=debug`).
pub const KERNEL_EVENTS_TARGET: &str = "flowctl::kernel";

/// Bounded compare-and-swap retries on one key before the packet is dropped
/// with reason `contended` (see docs/design.md).
pub const CAS_RETRIES: u32 = 4;

/// IPv6 extension headers the parser walks; a ninth makes the packet
/// `unparsed` (docs/classification.md).
pub const MAX_IPV6_EXT_HEADERS: u32 = 8;
/// VLAN tags the parser walks; a fifth makes the frame `evasive`.
pub const MAX_VLAN_TAGS: u32 = 4;
/// Every header the parser reads ends within this many bytes of the frame's
/// start (the verifier needs a bound; docs/classification.md).
pub const PARSE_WINDOW: usize = 1024;

/// Version of the pinned layout (paths, map set, record layouts). A flowctl that
/// finds pins of another version refuses to adopt them.
pub const LAYOUT_VERSION: u32 = 14;
/// Root of everything flowctl pins on bpffs.
pub const PIN_ROOT: &str = "/sys/fs/bpf/flowctl";
/// Root of the agents' run-time files (lock, control socket, active profile).
pub const RUN_ROOT: &str = "/run/flowctl";

/// Map names, as declared in flowctl-ebpf and looked up by the agent.
pub mod map_names {
    pub const GLOBAL: &str = "FLOWCTL_GLOBAL";
    pub const RULES: &str = "FLOWCTL_RULES";
    pub const PROTO_BITS: &str = "FLOWCTL_PROTO_BITS";
    pub const PORT_BITS: &str = "FLOWCTL_PORT_BITS";
    pub const RULE_SETS: &str = "FLOWCTL_RULE_SETS";
    pub const SRC_TRIE: &str = "FLOWCTL_SRC_TRIE";
    pub const SRC_CLASSES: &str = "FLOWCTL_SRC_CLASSES";
    pub const SRC_CACHE: &str = "FLOWCTL_SRC_CACHE";
    pub const KEYS: &str = "FLOWCTL_KEYS";
    /// Isolated rules' own bucket tables, an array of maps by counter record.
    pub const RULE_TABLES: &str = "FLOWCTL_RULE_TABLES";
    pub const COUNTERS: &str = "FLOWCTL_COUNTERS";
    pub const CONTROL: &str = "FLOWCTL_CONTROL";
    pub const DEBT: &str = "FLOWCTL_DEBT";
    pub const SKETCHES: &str = "FLOWCTL_SKETCHES";
    pub const QUOTAS: &str = "FLOWCTL_QUOTAS";
    pub const STATS: &str = "FLOWCTL_STATS";
    pub const KEY_SAMPLES: &str = "FLOWCTL_KEY_SAMPLES";
    pub const AGENT: &str = "FLOWCTL_AGENT";
    pub const CONNS: &str = "FLOWCTL_CONNS";
    pub const OPEN: &str = "FLOWCTL_OPEN";
    pub const EGRESS_TARGETS: &str = "FLOWCTL_EGRESS_TARGETS";
    pub const EGRESS_COUNTS: &str = "FLOWCTL_EGRESS_COUNTS";
    pub const GLOBAL_KEYS: &str = "FLOWCTL_GLOBAL_KEYS";
    pub const GRANTS: &str = "FLOWCTL_GRANTS";
    pub const LEASE_FILTER: &str = "FLOWCTL_LEASE_FILTER";
    pub const HOT_KEYS: &str = "FLOWCTL_HOT_KEYS";
    pub const BOOKINGS: &str = "FLOWCTL_BOOKINGS";
    pub const WARM: &str = "FLOWCTL_WARM";
    pub const SHAPERS: &str = "FLOWCTL_SHAPERS";
    pub const SHAPER_NEXT: &str = "FLOWCTL_SHAPER_NEXT";
    pub const SHAPER_FLOWS: &str = "FLOWCTL_SHAPER_FLOWS";
    pub const SHAPER_COUNTS: &str = "FLOWCTL_SHAPER_COUNTS";
    /// The circuit breakers' object (flowctl-ebpf/src/breaker_main.rs).
    pub const BREAKER_TARGETS: &str = "FLOWCTL_BREAKER_TARGETS";
    pub const BREAKER_CONTROL: &str = "FLOWCTL_BREAKER_CONTROL";
    pub const BREAKER_COUNTS: &str = "FLOWCTL_BREAKER_COUNTS";
    pub const BREAKER_DEADLINE: &str = "FLOWCTL_BREAKER_DEADLINE";
    /// Every map the XDP object declares, in the order `status` reports them.
    pub const ALL: [&str; 32] = [
        GLOBAL,
        RULES,
        PROTO_BITS,
        PORT_BITS,
        RULE_SETS,
        SRC_TRIE,
        SRC_CLASSES,
        SRC_CACHE,
        KEYS,
        RULE_TABLES,
        COUNTERS,
        CONTROL,
        DEBT,
        SKETCHES,
        QUOTAS,
        STATS,
        KEY_SAMPLES,
        AGENT,
        CONNS,
        OPEN,
        EGRESS_TARGETS,
        EGRESS_COUNTS,
        GLOBAL_KEYS,
        GRANTS,
        LEASE_FILTER,
        HOT_KEYS,
        BOOKINGS,
        WARM,
        SHAPERS,
        SHAPER_NEXT,
        SHAPER_FLOWS,
        SHAPER_COUNTS,
    ];
}

/// Program names in the XDP object.
pub const XDP_PROGRAM: &str = "flowctl_xdp";
/// The same XDP program declaring multi-buffer support (`xdp.frags`, Linux
/// 5.18+), for interfaces whose frames span several buffers (jumbo MTUs).
/// The loader loads one of the two; the kernel verifies only that one.
pub const XDP_PROGRAM_FRAGS: &str = "flowctl_xdp_frags";
/// The same XDP program as an extension (`freplace`) of a libxdp
/// dispatcher's slot, for `attach --multiprog` (single-buffer, as the
/// dispatchers libxdp builds for single-buffer components are).
pub const XDP_PROGRAM_MULTIPROG: &str = "flowctl_xdp_multiprog";
/// The TC egress counter of KLimiter's `egress` baselines.
pub const EGRESS_PROGRAM: &str = "flowctl_egress";
/// The TC egress shaper of `[[shaper]]` tables.
pub const SHAPER_PROGRAM: &str = "flowctl_shape";

/// XDP verdicts, as the kernel's `enum xdp_action` numbers them.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
