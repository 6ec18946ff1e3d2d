//! `#[repr(C)]` map keys and values. Byte order: addresses and ports are kept
//! in host order in every key and record (the kernel converts once when it
//! parses), except the LPM trie key, whose data the kernel requires in network
//! order. Every layout is checked at compile time at the bottom of this file.

use crate::consts::{BITMAP_WORDS, MAX_NESTED_LIMITS, MAX_RULES};

/// What a rule does with traffic it matches.
pub mod action {
    /// Enforce the limit: refused packets are dropped.
    pub const DROP: u8 = 0;
    /// Exempt trusted traffic: counted, never limited.
    pub const PASS: u8 = 1;
    /// Evaluate the limit and count would-drops, but pass everything.
    pub const DRY_RUN: u8 = 2;
}

/// `interval_fp` of a `block` rule (a bucket that never holds a token)
/// and of a global rule's `default_share = "none"`: no rate has it (the
/// slowest, one per `MAX` window, is far below). The decision refuses a
/// local rule with it before any lookup.
pub const BLOCK_INTERVAL_FP: u64 = u64::MAX;

/// What one token stands for.
pub mod unit {
    pub const PACKETS: u8 = 0;
    pub const BYTES: u8 = 1;
    /// New TCP connections: SYN without ACK. Other packets of the rule pass.
    pub const CONNECTIONS: u8 = 2;
}

/// How a rule splits traffic into buckets.
pub mod key_kind {
    /// One bucket for the whole rule.
    pub const RULE: u8 = 0;
    pub const SRC: u8 = 1;
    /// Source prefix; `RuleConfig::prefix_v4` / `prefix_v6` give the lengths.
    pub const SRC_PREFIX: u8 = 2;
    pub const DPORT: u8 = 3;
    pub const SRC_DPORT: u8 = 4;
    pub const FIVE_TUPLE: u8 = 5;
}

/// Where a rule's buckets live (`RuleConfig::bucket_table`).
pub mod bucket_table {
    /// No token bucket (a quota-only rule).
    pub const NONE: u8 = 0;
    /// The shared tables: the source's cache entry for a source-keyed
    /// rule that owns it, else `FLOWCTL_KEYS`.
    pub const SHARED: u8 = 1;
    /// The rule's own LRU hash (`isolate = true`), at its counter record in
    /// `FLOWCTL_RULE_TABLES`: no other rule's keys can evict its buckets.
    pub const OWN: u8 = 2;
}

/// Why a packet was dropped (or would have been, in dry-run). Index into the
/// per-reason counter arrays; a new reason takes the next index before `COUNT`.
pub mod reason {
    /// The token bucket had no token.
    pub const RATE: usize = 0;
    /// Truncated or malformed headers, with `malformed_verdict = drop`.
    pub const MALFORMED: usize = 1;
    /// A non-first fragment that only port-constrained rules could match, with
    /// `fragment_verdict = drop`.
    pub const FRAGMENT: usize = 2;
    /// The bucket's compare-and-swap lost `CAS_RETRIES` times in a row.
    pub const CONTENDED: usize = 3;
    /// The admission stage left the new flow out (its ratio, fixed or
    /// KLimiter's, is below 1).
    pub const ADMISSION: usize = 4;
    /// The BBR stage refused a SYN: connections in flight at the limit
    /// while the CPU is over its threshold.
    pub const BBR: usize = 5;
    /// The rule's sliding-window quota is used up.
    pub const QUOTA: usize = 6;
    /// Layouts RFCs say to discard because they hide or rewrite the L4
    /// header (tiny and overlapping fragments, a first IPv6 fragment
    /// without its header chain, VLAN stacks deeper than parsed): always
    /// dropped (docs/classification.md).
    pub const EVASIVE: usize = 7;
    pub const COUNT: usize = 8;
    pub const NAMES: [&str; COUNT] =
        ["rate", "malformed", "fragment", "contended", "admission", "bbr", "quota", "evasive"];
}

/// Fragment position of a packet.
pub mod frag {
    pub const NONE: u8 = 0;
    pub const FIRST: u8 = 1;
    pub const LATER: u8 = 2;
}

/// How much of a packet's L4 the parser reached (`PacketMeta::unparsed`).
pub mod unparsed {
    /// Parsed to its L4 header (or a later fragment, which has none).
    pub const NO: u8 = 0;
    /// The L4 header lies beyond what the parser walks; the protocol is known.
    pub const PORTS: u8 = 1;
    /// The extension header chain goes on past what the parser walks: the
    /// protocol is unknown too.
    pub const PROTO: u8 = 2;
}

/// A set of rule indices (bit i = rule i of the active slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RuleBitmap {
    pub words: [u64; BITMAP_WORDS],
}

impl RuleBitmap {
    pub const EMPTY: Self = Self { words: [0; BITMAP_WORDS] };
    pub const FULL: Self = Self { words: [u64::MAX; BITMAP_WORDS] };

    pub fn set(&mut self, rule: usize) {
        if rule < MAX_RULES {
            self.words[rule / 64] |= 1u64 << (rule % 64);
        }
    }

    pub fn contains(&self, rule: usize) -> bool {
        rule < MAX_RULES && self.words[rule / 64] & (1u64 << (rule % 64)) != 0
    }

    /// The rules of either.
    pub fn union(&self, o: &Self) -> Self {
        let mut words = self.words;
        let mut i = 0;
        while i < BITMAP_WORDS {
            words[i] |= o.words[i];
            i += 1;
        }
        Self { words }
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }
}

/// One rule of one slot, as the kernel needs it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleConfig {
    /// GCRA emission interval: nanoseconds per unit, fixed point with
    /// `gcra::FRAC_BITS` fractional bits.
    pub interval_fp: u64,
    /// Bucket depth in nanoseconds: burst * interval.
    pub burst_ns: u64,
    /// Identity of the rule's bucket state. Kept by `apply` while the rule's
    /// match key and limits are unchanged, so its buckets survive a reload.
    pub state_id: u32,
    /// Index of the rule's counter and control records.
    pub record: u32,
    pub action: u8,
    pub unit: u8,
    pub key_kind: u8,
    pub prefix_v4: u8,
    pub prefix_v6: u8,
    /// 1 when the rule constrains the destination port.
    pub has_ports: u8,
    /// Whether the rule has a token bucket and where its keys' buckets
    /// live (`bucket_table::*`).
    pub bucket_table: u8,
    /// `bbr_flags::*`: the BBR stage and connection tracking.
    pub bbr: u8,
    /// This rule's own index in the rules array (slot * MAX_RULES + index).
    pub at: u32,
    /// 1: a global rule (docs/fleet.md): its keys' buckets live in
    /// `FLOWCTL_GLOBAL_KEYS` and run at the rate of this host's lease; a
    /// key without one runs at `interval_fp` and `burst_ns`, the rule's
    /// default share (refusing everything with `default_share = "none"`).
    pub global: u8,
    /// 1: a SYN the bucket refuses books the next token for its
    /// retransmission (`booking`, docs/algorithms.md 1.7); the rule's
    /// bucket then runs in `flowctl_book_decide`.
    pub book_syns: u8,
    /// On a rule: how many nested limits it has (0 to `MAX_NESTED_LIMITS`),
    /// at `nested_limit_at(at, 0..nested)`. On a nested limit: 0.
    pub nested: u8,
    /// Warm-up (`warm`, docs/algorithms.md 1.8): the cold factor `c`, 0
    /// for a rule without a ramp. A rule with one keeps its aggregate
    /// bucket in `FLOWCTL_WARM` and runs it beside the decision, as nested
    /// limits do.
    pub cold_factor: u8,
    /// Quota bucket length L in ns (0: no quota).
    pub quota_bucket_ns: u64,
    /// Quota: at most this many units per window.
    pub quota_limit: u32,
    /// Quota buckets K (the window is K * L).
    pub quota_buckets: u32,
    /// Warm-up: `W`, ns (with `cold_factor`).
    pub warm_up_ns: u64,
}

/// Global record (array index 0): agent heartbeat, generation, verdict policy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalRecord {
    pub layout_version: u32,
    /// Which rule slot (0 or 1) the kernel matches against.
    pub active_slot: u32,
    /// Bumped by every apply; per-source cache entries of an older generation
    /// are reclassified on their next packet.
    pub generation: u64,
    /// Random per load; keys flow hashes so clients cannot pick admitted tuples.
    pub hash_seed: u64,
    /// CLOCK_MONOTONIC ns of the agent's last heartbeat (0: never).
    pub heartbeat_ns: u64,
    /// After this long without a heartbeat, adaptive stages fail open.
    pub grace_ns: u64,
    /// XDP verdict for truncated or malformed packets.
    pub malformed_verdict: u32,
    /// XDP verdict for non-first fragments that only port rules could match.
    pub fragment_verdict: u32,
    /// Send about one in this many matched packets' keys to the sampling
    /// ring for `top --keys` (0: off). Set by the agent while someone asks.
    pub key_sample_every: u32,
    /// Bit s set: the rules of slot s name destinations, so the kernel
    /// looks the packet's destination up in the trie too (bit 2 of its tag
    /// byte). Written before the flip to s; the slot's other tables too.
    pub dst_slots: u32,
}

/// Per-rule control record written by the agent's control loops (admission
/// ratio, BBR) and read by the XDP program's admission and BBR stages. All
/// zero means all pass.
///
/// User space changes it only through `ControlRecord::update` (in flowctl,
/// `Maps::update_control`), which owns the version and the stamp; the
/// kernel itself only counts into `bbr_admitted`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlRecord {
    /// Bumped on every change by user space (`ControlRecord::update`).
    pub version: u32,
    /// `control_flags::*`.
    pub flags: u32,
    /// Admitted share of new flows in parts per million, when
    /// `ADMISSION_ACTIVE` is set.
    pub admission_ppm: u32,
    /// BBR: the limit on connections in flight (u32::MAX: no limit yet).
    pub bbr_max_inflight: u32,
    /// BBR: 1 while the in-flight test is on (CPU over threshold or cooling
    /// down).
    pub bbr_overloaded: u32,
    /// BBR: established connections not yet completed, as the agent last
    /// summed them from the open-connection ring.
    pub bbr_inflight: u32,
    /// CLOCK_MONOTONIC ns of the last change.
    pub updated_ns: u64,
    /// BBR, for display: the window's most completions in one bucket and its
    /// smallest mean round trip (ms; 0: no data).
    pub bbr_max_pass: u32,
    pub bbr_min_rt_ms: u32,
    /// BBR: SYNs the kernel admitted since the agent's last write minus the
    /// tracked connections that completed since, as a wrapping i32 (the
    /// agent writes 0). Added to `bbr_inflight`, it keeps the stage close to
    /// exact between the agent's 100 ms ticks: without it, a burst of SYNs
    /// within one tick would all be admitted.
    pub bbr_admitted: u32,
    /// The flood sketch lent to this rule, as its index in the pool plus
    /// one (0: none): keys without a bucket are decided by it and get no
    /// bucket (`stages::sketch`; the agent's `flood` loop lends it).
    pub sketch: u32,
}

impl ControlRecord {
    /// The one way user space changes a control record: `edit` sets what
    /// its writer decides through `ControlEdit`'s setters, and when the
    /// record differs afterwards the version is bumped and `updated_ns`
    /// stamped with `now_ns`, once. Returns whether it changed, that is
    /// whether it needs writing back.
    pub fn update(&mut self, now_ns: u64, edit: impl FnOnce(&mut ControlEdit<'_>)) -> bool {
        let before = *self;
        edit(&mut ControlEdit(self));
        let changed = *self != before;
        if changed {
            self.version = before.version.wrapping_add(1);
            self.updated_ns = now_ns;
        }
        changed
    }

    /// The share of new flows the kernel admits under this record (1.0 when
    /// no ratio is active).
    pub fn admission_ratio(&self) -> f64 {
        if self.flags & control_flags::ADMISSION_ACTIVE != 0 {
            self.admission_ppm.min(1_000_000) as f64 / 1e6
        } else {
            1.0
        }
    }
}

/// A control record open for change inside `ControlRecord::update`: each
/// setter keeps a stage's flag and its fields consistent, and none touches
/// the version or the stamp (`update` does, once).
pub struct ControlEdit<'a>(&'a mut ControlRecord);

impl ControlEdit<'_> {
    /// The admission stage: `Some(ppm)` admits that share of new flows,
    /// `None` switches the stage off; `per_flow` hashes the 5-tuple.
    pub fn set_admission(&mut self, ppm: Option<u32>, per_flow: bool) {
        let c = &mut *self.0;
        match ppm {
            Some(ppm) => {
                c.flags |= control_flags::ADMISSION_ACTIVE;
                c.admission_ppm = ppm;
            }
            None => {
                c.flags &= !control_flags::ADMISSION_ACTIVE;
                c.admission_ppm = 0;
            }
        }
        if per_flow {
            c.flags |= control_flags::ADMISSION_PER_FLOW;
        } else {
            c.flags &= !control_flags::ADMISSION_PER_FLOW;
        }
    }

    /// The BBR stage on, with BBR's latest decision (saturated to the
    /// record's 32-bit fields). `bbr_admitted` restarts from zero: the
    /// connections the kernel admitted since the last decision are in
    /// `in_flight` once established, and the kernel counts new ones from
    /// here.
    pub fn set_bbr(&mut self, b: &BbrControl) {
        let sat = |v: u64| v.min(u32::MAX as u64) as u32;
        let c = &mut *self.0;
        c.flags |= control_flags::BBR_ACTIVE;
        c.bbr_max_inflight = b.max_in_flight.map(sat).unwrap_or(u32::MAX);
        c.bbr_overloaded = b.overloaded as u32;
        c.bbr_inflight = sat(b.in_flight);
        c.bbr_max_pass = sat(b.max_pass);
        c.bbr_min_rt_ms = sat(b.min_rt_ms);
        c.bbr_admitted = 0;
    }

    /// The BBR stage off, with nothing of it left in the record.
    pub fn clear_bbr(&mut self) {
        let c = &mut *self.0;
        c.flags &= !control_flags::BBR_ACTIVE;
        c.bbr_max_inflight = 0;
        c.bbr_overloaded = 0;
        c.bbr_inflight = 0;
        c.bbr_max_pass = 0;
        c.bbr_min_rt_ms = 0;
        c.bbr_admitted = 0;
    }

    /// The flood sketch: `Some(i)` lends the pool's sketch `i` to the rule
    /// (deciding), `None` takes it back.
    pub fn set_sketch(&mut self, sketch: Option<u32>) {
        self.0.sketch = sketch.map(|i| i + 1).unwrap_or(0);
        self.0.flags &= !control_flags::SKETCH_DRAINING;
    }

    /// The rule's sketch keeps only setting where new buckets start
    /// (`control_flags::SKETCH_DRAINING`).
    pub fn drain_sketch(&mut self) {
        if self.0.sketch != 0 {
            self.0.flags |= control_flags::SKETCH_DRAINING;
        }
    }

    /// The global record's flood flag (`control_flags::FLOOD`).
    pub fn set_flood(&mut self, on: bool) {
        if on {
            self.0.flags |= control_flags::FLOOD;
        } else {
            self.0.flags &= !control_flags::FLOOD;
        }
    }

    /// Every stage off, every field a stage reads zero (all pass): a record
    /// taken over by a new rule. The version goes on counting.
    pub fn reset(&mut self) {
        let c = &mut *self.0;
        *c = ControlRecord { version: c.version, updated_ns: c.updated_ns, ..Default::default() };
    }
}

/// What BBR's loop decided for a rule at one tick, as `ControlEdit::set_bbr`
/// writes it into the rule's control record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BbrControl {
    /// The window's most completions in one bucket.
    pub max_pass: u64,
    /// The window's smallest mean round trip (ms; 0: no data).
    pub min_rt_ms: u64,
    /// The limit on connections in flight (None: no limit yet).
    pub max_in_flight: Option<u64>,
    /// Established connections not yet completed.
    pub in_flight: u64,
    /// The in-flight test is on (CPU over threshold or cooling down).
    pub overloaded: bool,
}

pub mod bbr_flags {
    /// The rule tracks its TCP connections and runs the BBR stage.
    pub const ON: u8 = 1;
    /// Refused SYNs are answered with a TCP RST (XDP_TX) instead of dropped.
    pub const RESET: u8 = 2;
}

pub mod control_flags {
    pub const ADMISSION_ACTIVE: u32 = 1;
    pub const BBR_ACTIVE: u32 = 2;
    /// Hash the 5-tuple (with the per-load seed) for admission, so a flow is
    /// wholly in or out.
    pub const ADMISSION_PER_FLOW: u32 = 4;
    /// In the global record's control record (`GLOBAL_COUNTER_INDEX`)
    /// only: some rule is flooded, so new sources are classified without
    /// a cache entry (a flood of new sources would evict the cached ones,
    /// and with them the buckets source-keyed rules keep there).
    pub const FLOOD: u32 = 8;
    /// The rule's flood is over and its sketch is being taken back: new
    /// buckets still start no earlier than its estimate, but it decides
    /// nothing (for one burst, after which every estimate is in the past).
    pub const SKETCH_DRAINING: u32 = 16;
}

/// What only the agent computes, for readers in other processes (`top`,
/// metrics): pinned so it outlives any one reader, stamped so a stopped
/// agent's numbers are shown as "agent not running", never as current.
/// The XDP program never touches it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgentRecord {
    /// CLOCK_MONOTONIC ns of the last write (0: never).
    pub updated_ns: u64,
    /// CPU signal EMA in per-mille (`NO_CPU_SIGNAL`: none yet).
    pub cpu_permille: u32,
    /// `cpu_source::*` of the signal.
    pub cpu_source: u32,
    /// Entries the last walk found in the key table, source cache and quota
    /// table, and when it ran (CLOCK_MONOTONIC ns; 0: never).
    pub keys_walked: u64,
    pub sources_walked: u64,
    pub quotas_walked: u64,
    pub walked_ns: u64,
    /// The kernel's key-table and source-cache insert counts at that walk.
    pub key_inserts_at_walk: u64,
    pub source_inserts_at_walk: u64,
}

pub const NO_CPU_SIGNAL: u32 = u32::MAX;

/// Per-CPU counters of one rule (or of unmatched traffic, at
/// `GLOBAL_COUNTER_INDEX`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleCounters {
    pub offered_pkts: u64,
    pub offered_bytes: u64,
    pub passed_pkts: u64,
    pub passed_bytes: u64,
    pub would_drop_pkts: u64,
    pub would_drop_bytes: u64,
    /// Key-table inserts the kernel refused (table full of non-evictable state).
    pub insert_failures: u64,
    /// Buckets this rule created in the key table (with the agent's walks,
    /// the occupancy estimate between walks).
    pub key_inserts: u64,
    /// Sources added to the per-source cache. Global only.
    pub source_inserts: u64,
    /// Packets that were not IP (ARP, LLDP, ...): always passed. Global only.
    pub non_ip_pkts: u64,
    /// Truncated or malformed packets, whatever their verdict. Global only.
    pub malformed_pkts: u64,
    /// Non-first fragments that only port rules could match, whatever their
    /// verdict. Global only.
    pub fragment_pkts: u64,
    /// Packets whose L4 header lies beyond what the parser walks, matched
    /// against every rule that could apply (docs/classification.md).
    /// Global only.
    pub unparsed_pkts: u64,
    /// Refused SYNs that booked a token for their retransmission (counted
    /// as `rate` drops too).
    pub booked_syns: u64,
    /// Retransmitted SYNs admitted on their booking (counted as passed
    /// too, and charged nothing more).
    pub redeemed_syns: u64,
    /// Source-cache entries this rule claimed for its buckets: with
    /// `key_inserts`, the buckets it created (the agent's flood signal).
    pub source_claims: u64,
    /// Packets of keys without a bucket that the rule's flood sketch
    /// decided (admitted or refused).
    pub sketched_pkts: u64,
    /// Packets refused by each nested limit (counted as `rate` drops, or
    /// would-drops, too); the rule's own rate refused the rest.
    pub limit_refusals: [u64; MAX_NESTED_LIMITS],
    pub dropped_pkts: [u64; reason::COUNT],
    pub dropped_bytes: [u64; reason::COUNT],
}

impl RuleCounters {
    pub fn add(&mut self, o: &Self) {
        self.offered_pkts += o.offered_pkts;
        self.offered_bytes += o.offered_bytes;
        self.passed_pkts += o.passed_pkts;
        self.passed_bytes += o.passed_bytes;
        self.would_drop_pkts += o.would_drop_pkts;
        self.would_drop_bytes += o.would_drop_bytes;
        self.insert_failures += o.insert_failures;
        self.key_inserts += o.key_inserts;
        self.source_inserts += o.source_inserts;
        self.non_ip_pkts += o.non_ip_pkts;
        self.malformed_pkts += o.malformed_pkts;
        self.fragment_pkts += o.fragment_pkts;
        self.unparsed_pkts += o.unparsed_pkts;
        self.booked_syns += o.booked_syns;
        self.redeemed_syns += o.redeemed_syns;
        self.source_claims += o.source_claims;
        self.sketched_pkts += o.sketched_pkts;
        for i in 0..MAX_NESTED_LIMITS {
            self.limit_refusals[i] += o.limit_refusals[i];
        }
        for i in 0..reason::COUNT {
            self.dropped_pkts[i] += o.dropped_pkts[i];
            self.dropped_bytes[i] += o.dropped_bytes[i];
        }
    }

    pub fn dropped_total(&self) -> u64 {
        self.dropped_pkts.iter().sum()
    }
}

/// Key of the per-source cache: the source address alone, IPv4 as an
/// IPv4-mapped IPv6 address (`::ffff:a.b.c.d`), four host-order words.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SrcKey {
    pub addr: [u32; 4],
}

impl SrcKey {
    #[inline(always)]
    pub fn of(meta: &PacketMeta) -> Self {
        Self::from_src(meta.family, &meta.src)
    }

    /// The key of a source of `family` (4: `src[0]` alone) in the words
    /// `PacketMeta` and `BucketKey` hold it.
    #[inline(always)]
    pub fn from_src(family: u8, src: &[u32; 4]) -> Self {
        if family == 4 {
            Self { addr: [0, 0, 0xffff, src[0]] }
        } else {
            Self { addr: *src }
        }
    }
}

/// Per-source cache entry: the source's class (the LPM trie's answer) and the
/// bucket of the one source-keyed rule that owns the entry. The common case, a
/// source hitting one source-keyed rule, costs a single hash lookup, local or
/// global. A local owner uses only `bucket.tat`, which sits in the entry's
/// first 24 bytes beside the class, so its path touches what it touched when
/// the entry was 24 bytes; a global owner (docs/fleet.md) uses the whole
/// bucket, its cached grant and demand count included, so a leased hot key
/// needs no second table (docs/design.md, "Where bucket state lives").
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SrcEntry {
    /// Low 32 bits of the generation `class` was computed for.
    pub generation: u32,
    /// `state_id` of the source-keyed rule whose bucket `bucket` is (0: none).
    pub owner_state: u32,
    /// Index into the slot's `SRC_CLASSES` (`NO_CLASS`: none).
    pub class: u32,
    pub _pad: u32,
    /// The owner's bucket (8-byte aligned, for the compare-and-swap).
    pub bucket: GlobalBucket,
}

/// Key of the shared key table (buckets of every rule that the per-source
/// cache does not hold). `state_id` keeps rules apart, and a rule's nested
/// limits (each has its own: `STATE_IDS_PER_RULE`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BucketKey {
    pub state_id: u32,
    pub family: u8,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    pub _pad: u16,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}

/// A key of a global rule (`FLOWCTL_GLOBAL_KEYS`, key: `BucketKey`): its
/// bucket, its copy of this host's grant, and what the agent reads to size
/// the next lease.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalBucket {
    /// GCRA theoretical arrival time (ns), as in the key table; first, for
    /// the compare-and-swap's alignment.
    pub tat: u64,
    /// The grant word (`grant::encode`) as last read from `FLOWCTL_GRANTS`.
    pub grant: u64,
    /// When it was read (`grant::REFRESH_NS`).
    pub grant_read_ns: u64,
    /// When the lease read with `grant` ends (kernel clock, ns). With the
    /// three fields above, all a leased key's packet reads.
    pub grant_expires_ns: u64,
    /// Units offered by this key here since the bucket was made: the agent
    /// reads its growth as the key's demand.
    pub offered: u64,
    /// When the key was last reported hot (`grant::HOT_EVERY_NS`).
    pub hot_ns: u64,
    /// The quota share read with `grant` (units per window; meaningful
    /// while `grant` holds a lease and the rule has a quota).
    pub quota: u64,
}

/// One rule record's refused-key reports on one CPU in the current window
/// (`grant::REFUSED_REPORTS_PER_WINDOW`; per-CPU, so plain stores).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReportWindow {
    /// When the window began (ns).
    pub start_ns: u64,
    /// Refused keys handed to the full stage to be reported in it.
    pub used: u64,
}

/// This host's grant for one key of a global rule (`FLOWCTL_GRANTS`,
/// written whole by the agent): the rate and burst as one word
/// (`grant::encode`), and the key's quota share.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrantValue {
    pub word: u64,
    /// Quota units per window here (0 without a quota).
    pub quota: u64,
    /// When the lease ends here (kernel clock, ns: the agent's local
    /// expiry, which is before the store's). The kernel goes back to the
    /// default share then by itself, so a grant never outlives its lease,
    /// also when the agent died or stopped without clearing it.
    pub expires_ns: u64,
}

/// A hot key of a global rule, as the kernel reports it to the agent
/// (`FLOWCTL_HOT_KEYS`, a ring buffer): ask for a lease, or a larger one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HotKey {
    pub record: u32,
    /// `grant::hot::*`.
    pub why: u32,
    pub key: BucketKey,
}

/// A tracked TCP connection of a BBR rule (key: `BucketKey` with the 5-tuple
/// and `state_id` = the rule's record).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnEntry {
    /// When the first admitted SYN was seen (CLOCK_MONOTONIC ns).
    pub syn_ns: u64,
    /// Open-ring epoch the handshake completed in (valid when established).
    pub open_epoch: u32,
    /// `conn_state::*`.
    pub state: u32,
}

pub mod conn_state {
    pub const SYN_SEEN: u32 = 1;
    pub const ESTABLISHED: u32 = 2;
}

/// A downstream endpoint whose traffic the TC egress program counts (a
/// KLimiter `egress` baseline): destination prefix, protocol and port range.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EgressTarget {
    /// Host-order address words (IPv4 in word 0).
    pub addr: [u32; 4],
    pub prefix_len: u8,
    /// 4 or 6; 0: an unused slot.
    pub family: u8,
    /// 6, 17, or 0 for either.
    pub proto: u8,
    pub _pad: u8,
    pub port_lo: u16,
    pub port_hi: u16,
}

/// One key's quota window ring: K + 1 slots, each (epoch << 32 | count)
/// updated by compare-and-swap (see `window`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaRing {
    pub words: [u64; crate::QUOTA_RING_SLOTS],
    /// 1 + the epoch in which a refusal of this key was last written to the
    /// debt table (0: none), so a key held at its quota writes it once per
    /// bucket, not once per packet (`window::refused_until`).
    pub noted: u64,
}

/// One sampled packet for `top --keys`, as the kernel writes it into the
/// sampling ring buffer: the rule's record, the packet's bucket key, its
/// length and whether it was dropped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeySample {
    pub record: u32,
    pub len: u32,
    /// 1 when the packet was dropped (or would have been, in dry-run).
    pub dropped: u32,
    pub key: BucketKey,
}

/// LPM trie key data: `[tag, address bytes in network order...]`, the tag
/// from [`trie_tag`] (`tables::trie_data_for` on the host). The prefix
/// length counts the 8 tag bits.
pub type TrieData = [u8; 17];
pub const TRIE_TAG_BITS: u32 = 8;
/// The prefix length of a whole address's key (a lookup): the tag and 128
/// address bits (an IPv4 address fills the first 32, the rest are zero).
pub const TRIE_KEY_BITS: u32 = TRIE_TAG_BITS + 128;

/// A trie key's tag byte: bit 0 IPv6, bit 1 the slot, bit 2 a destination
/// entry (sources and destinations share the trie).
#[inline(always)]
pub const fn trie_tag(dst: bool, slot: u8, v6: bool) -> u8 {
    (dst as u8) << 2 | (slot & 1) << 1 | v6 as u8
}

/// The slot a trie key's tag byte belongs to.
pub const fn trie_slot(tag: u8) -> u8 {
    (tag >> 1) & 1
}

/// What the parser extracted from a packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacketMeta {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    /// Bytes on the wire as XDP sees them (from the Ethernet header).
    pub len: u32,
    pub sport: u16,
    pub dport: u16,
    /// 4 or 6.
    pub family: u8,
    pub proto: u8,
    pub tcp_flags: u8,
    /// `frag::*`.
    pub frag: u8,
    /// `unparsed::*`: ports (and maybe the protocol) unknown.
    pub unparsed: u8,
    /// Offsets of the IP and L4 headers from the frame's start (for replies).
    pub l3_off: u16,
    pub l4_off: u16,
}

pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const ACK: u8 = 0x10;
}

macro_rules! assert_layout {
    ($t:ty, $size:expr, $align:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $size);
        const _: () = assert!(core::mem::align_of::<$t>() == $align);
    };
}
assert_layout!(RuleBitmap, 32, 8);
assert_layout!(RuleConfig, 64, 8);
assert_layout!(crate::warm::WarmBucket, 24, 8);
assert_layout!(crate::shaper::ShaperConfig, 40, 8);
assert_layout!(crate::shaper::ShaperCounters, 64, 8);
assert_layout!(QuotaRing, 8 * (crate::QUOTA_RING_SLOTS + 1), 8);
assert_layout!(GlobalRecord, 56, 8);
assert_layout!(crate::StatsBucket, 112, 8);
assert_layout!(KeySample, 56, 4);
assert_layout!(ControlRecord, 48, 8);
assert_layout!(ConnEntry, 16, 8);
assert_layout!(EgressTarget, 24, 4);
assert_layout!(RuleCounters, 288, 8);
assert_layout!(AgentRecord, 64, 8);
assert_layout!(SrcKey, 16, 4);
assert_layout!(SrcEntry, 72, 8);
assert_layout!(GlobalBucket, 56, 8);
assert_layout!(BucketKey, 44, 4);

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for RuleBitmap {}
    unsafe impl aya::Pod for RuleConfig {}
    unsafe impl aya::Pod for GlobalBucket {}
    unsafe impl aya::Pod for GrantValue {}
    unsafe impl aya::Pod for crate::debt::DebtSet {}
    unsafe impl aya::Pod for crate::warm::WarmBucket {}
    unsafe impl aya::Pod for crate::shaper::ShaperConfig {}
    unsafe impl aya::Pod for crate::shaper::ShaperCounters {}
    unsafe impl aya::Pod for HotKey {}
    unsafe impl aya::Pod for GlobalRecord {}
    unsafe impl aya::Pod for ControlRecord {}
    unsafe impl aya::Pod for RuleCounters {}
    unsafe impl aya::Pod for SrcKey {}
    unsafe impl aya::Pod for SrcEntry {}
    unsafe impl aya::Pod for BucketKey {}
    unsafe impl aya::Pod for QuotaRing {}
    unsafe impl aya::Pod for crate::StatsBucket {}
    unsafe impl aya::Pod for KeySample {}
    unsafe impl aya::Pod for AgentRecord {}
    unsafe impl aya::Pod for ConnEntry {}
    unsafe impl aya::Pod for EgressTarget {}
}

#[cfg(test)]
mod tests {
    use super::*;

    use control_flags::{ADMISSION_ACTIVE, ADMISSION_PER_FLOW, BBR_ACTIVE};

    const BBR: BbrControl = BbrControl {
        max_pass: 40,
        min_rt_ms: 12,
        max_in_flight: Some(90),
        in_flight: 70,
        overloaded: true,
    };

    #[test]
    fn set_admission_reports_changes_and_bumps_the_version() {
        let mut c = ControlRecord::default();
        assert!(c.update(10, |e| e.set_admission(Some(250_000), true)));
        assert_eq!(
            (c.admission_ppm, c.flags, c.version, c.updated_ns),
            (250_000, ADMISSION_ACTIVE | ADMISSION_PER_FLOW, 1, 10)
        );
        assert!(!c.update(20, |e| e.set_admission(Some(250_000), true)), "the same is no change");
        assert_eq!((c.version, c.updated_ns), (1, 10), "no change, no bump, no stamp");
        assert!(c.update(30, |e| e.set_admission(Some(250_000), false)));
        assert_eq!((c.flags, c.version), (ADMISSION_ACTIVE, 2));
        assert!(c.update(40, |e| e.set_admission(None, false)));
        assert_eq!((c.admission_ppm, c.flags, c.admission_ratio()), (0, 0, 1.0));
        assert_eq!((c.version, c.updated_ns), (3, 40));
    }

    #[test]
    fn set_bbr_sets_the_flag_and_every_field() {
        let mut c = ControlRecord { bbr_admitted: 7, ..Default::default() };
        assert!(c.update(5, |e| e.set_bbr(&BBR)));
        assert_eq!(c.flags, BBR_ACTIVE);
        assert_eq!(
            (c.bbr_max_inflight, c.bbr_overloaded, c.bbr_inflight, c.bbr_max_pass, c.bbr_min_rt_ms),
            (90, 1, 70, 40, 12)
        );
        assert_eq!((c.bbr_admitted, c.version, c.updated_ns), (0, 1, 5));
        assert!(!c.update(6, |e| e.set_bbr(&BBR)), "the same decision is no change");
        assert_eq!((c.version, c.updated_ns), (1, 5));
        // The kernel counted admissions since: the same decision restarts them.
        c.bbr_admitted = 3;
        assert!(c.update(7, |e| e.set_bbr(&BBR)));
        assert_eq!((c.bbr_admitted, c.version, c.updated_ns), (0, 2, 7));
    }

    #[test]
    fn set_bbr_saturates_and_reads_no_limit_as_the_maximum() {
        let mut c = ControlRecord::default();
        let b = BbrControl { max_in_flight: None, in_flight: u64::MAX, overloaded: false, ..BBR };
        assert!(c.update(1, |e| e.set_bbr(&b)));
        assert_eq!((c.bbr_max_inflight, c.bbr_inflight, c.bbr_overloaded), (u32::MAX, u32::MAX, 0));
        let mut c = ControlRecord::default();
        let b = BbrControl { max_in_flight: Some(1 << 40), ..b };
        assert!(c.update(2, |e| e.set_bbr(&b)));
        assert_eq!(c.bbr_max_inflight, u32::MAX, "a limit beyond u32 is no limit either");
    }

    #[test]
    fn clear_bbr_leaves_nothing_of_it_and_keeps_admission() {
        let mut c = ControlRecord::default();
        assert!(c.update(1, |e| {
            e.set_admission(Some(500_000), true);
            e.set_bbr(&BBR);
        }));
        assert_eq!(c.version, 1, "one update, one bump");
        assert!(c.update(2, |e| e.clear_bbr()));
        let admission_only = ControlRecord {
            version: 2,
            flags: ADMISSION_ACTIVE | ADMISSION_PER_FLOW,
            admission_ppm: 500_000,
            updated_ns: 2,
            ..Default::default()
        };
        assert_eq!(c, admission_only);
        assert!(!c.update(3, |e| e.clear_bbr()), "nothing to clear is no change");
        assert_eq!(c.version, 2);
    }

    #[test]
    fn reset_zeroes_every_stage_and_the_version_goes_on() {
        let mut c = ControlRecord::default();
        assert!(!c.update(1, |e| e.reset()), "a zero record is reset already");
        assert_eq!(c, ControlRecord::default());
        c.update(2, |e| {
            e.set_admission(Some(1), false);
            e.set_bbr(&BBR);
        });
        assert!(c.update(3, |e| e.reset()));
        assert_eq!(c, ControlRecord { version: 2, updated_ns: 3, ..Default::default() });
        assert_eq!(c.admission_ratio(), 1.0);
    }

    #[test]
    fn the_version_wraps() {
        let mut c = ControlRecord { version: u32::MAX, ..Default::default() };
        assert!(c.update(1, |e| e.set_admission(Some(1), false)));
        assert_eq!(c.version, 0);
    }
}
