//! The pinned XDP data plane: load (or adopt), attach, detach, write a rule
//! set into the inactive slot and flip, read counters.

pub mod object;
pub mod pins;
pub mod state;

use crate::{
    dataplane::{
        object::xdp_object,
        pins::AttachId,
        state::{AttachState, RuleState},
    },
    profile::{RuleSet, Settings},
    system::clock::monotonic_ns,
};
use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{lpm_trie::Key, Array, LpmTrie, Map, MapData, PerCpuArray, PerCpuValues},
    programs::{links::FdLink, links::PinnedLink, ProgramError, Xdp, XdpMode},
    Ebpf, EbpfLoader,
};
use flowctl_common::{
    control_flags, globals, map_names as names,
    stats::{self, StatsSum},
    tables, AgentRecord, ControlRecord, GlobalRecord, KeySample, RuleBitmap, RuleConfig,
    RuleCounters, StatsBucket, TrieData, COUNTER_RECORDS, DEBT_SLOTS_PER_RULE, LAYOUT_VERSION,
    MAX_RULES, MAX_RULE_RECORDS, MAX_SRC_CLASSES, OPEN_BUCKETS, OPEN_BUCKET_NS, PORT_INDICES,
    PROTO_INDICES, RULE_SETS, XDP_PROGRAM, XDP_PROGRAM_FRAGS,
};
use std::{fs, path::Path};

/// The consumer side of the key-sampling ring buffer (`top --keys`). A ring
/// buffer has one consumer position, so only one process should drain it:
/// the agent when it runs, else `top --keys` itself.
pub struct KeySamples {
    ring: aya::maps::RingBuf<MapData>,
}

impl KeySamples {
    pub fn open(id: &AttachId) -> Result<Self> {
        let ring =
            aya::maps::RingBuf::try_from(Map::RingBuf(open(&id.pin_dir(), names::KEY_SAMPLES)?))?;
        Ok(Self { ring })
    }

    /// Takes up to `max` samples the kernel has written.
    pub fn drain(&mut self, max: usize) -> Vec<KeySample> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some(item) = self.ring.next() else { break };
            if item.len() >= size_of::<KeySample>() {
                // The record is written by the kernel as a KeySample; read it
                // unaligned, as the ring gives no alignment guarantee to Rust.
                out.push(unsafe { core::ptr::read_unaligned(item.as_ptr() as *const KeySample) });
            }
        }
        out
    }
}

/// Counts the entries of a pinned hash map without reading it element by
/// element: BPF_MAP_LOOKUP_BATCH (kernel 5.6+) returns whole buckets, a few
/// thousand entries per system call (aya 0.14 has no batch operations, so
/// this is the raw syscall). A snapshot: entries the kernel adds or evicts
/// meanwhile may or may not be counted.
pub fn count_entries(id: &AttachId, name: &str, key_size: usize, value_size: usize) -> Result<u64> {
    use std::os::fd::{AsFd, AsRawFd};
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
    let map = open(&id.pin_dir(), name)?;
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

/// The pinned maps of one attachment, opened by path.
pub struct Maps {
    pub global: Array<MapData, GlobalRecord>,
    pub rules: Array<MapData, RuleConfig>,
    pub proto: Array<MapData, RuleBitmap>,
    pub port: Array<MapData, RuleBitmap>,
    pub rule_sets: Array<MapData, RuleBitmap>,
    pub trie: LpmTrie<MapData, TrieData, u32>,
    pub classes: Array<MapData, RuleBitmap>,
    pub counters: PerCpuArray<MapData, RuleCounters>,
    pub control: Array<MapData, ControlRecord>,
    pub debt: Array<MapData, u64>,
    pub stats: PerCpuArray<MapData, StatsBucket>,
    pub agent: Array<MapData, AgentRecord>,
    /// BBR rules' open-connection rings (see `OPEN_BUCKETS`).
    pub open: Array<MapData, u64>,
    /// KLimiter's egress targets and their per-CPU counters.
    pub egress_targets: Array<MapData, flowctl_common::EgressTarget>,
    pub egress_counts: PerCpuArray<MapData, u64>,
}

fn open(dir: &Path, name: &str) -> Result<MapData> {
    MapData::from_pin(dir.join(name))
        .with_context(|| format!("opening pinned map {}", dir.join(name).display()))
}

impl Maps {
    pub fn open(id: &AttachId) -> Result<Self> {
        let d = id.pin_dir();
        Ok(Self {
            global: Array::try_from(Map::Array(open(&d, names::GLOBAL)?))?,
            rules: Array::try_from(Map::Array(open(&d, names::RULES)?))?,
            proto: Array::try_from(Map::Array(open(&d, names::PROTO_BITS)?))?,
            port: Array::try_from(Map::Array(open(&d, names::PORT_BITS)?))?,
            rule_sets: Array::try_from(Map::Array(open(&d, names::RULE_SETS)?))?,
            trie: LpmTrie::try_from(Map::LpmTrie(open(&d, names::SRC_TRIE)?))?,
            classes: Array::try_from(Map::Array(open(&d, names::SRC_CLASSES)?))?,
            counters: PerCpuArray::try_from(Map::PerCpuArray(open(&d, names::COUNTERS)?))?,
            control: Array::try_from(Map::Array(open(&d, names::CONTROL)?))?,
            debt: Array::try_from(Map::Array(open(&d, names::DEBT)?))?,
            stats: PerCpuArray::try_from(Map::PerCpuArray(open(&d, names::STATS)?))?,
            agent: Array::try_from(Map::Array(open(&d, names::AGENT)?))?,
            open: Array::try_from(Map::Array(open(&d, names::OPEN)?))?,
            egress_targets: Array::try_from(Map::Array(open(&d, names::EGRESS_TARGETS)?))?,
            egress_counts: PerCpuArray::try_from(Map::PerCpuArray(open(
                &d,
                names::EGRESS_COUNTS,
            )?))?,
        })
    }

    pub fn global(&self) -> Result<GlobalRecord> {
        Ok(self.global.get(&0, 0)?)
    }

    /// Established, not yet completed connections of a BBR rule: the open
    /// ring's counts over the epochs within `idle_timeout_ns` of `now_ns`.
    pub fn in_flight(&self, record: u32, idle_timeout_ns: u64, now_ns: u64) -> Result<u64> {
        let cur = now_ns / OPEN_BUCKET_NS;
        let span = (idle_timeout_ns / OPEN_BUCKET_NS).clamp(1, OPEN_BUCKETS as u64 - 1);
        let mut n = 0u64;
        for e in cur.saturating_sub(span - 1)..=cur {
            let w = self
                .open
                .get(&(record * OPEN_BUCKETS as u32 + (e % OPEN_BUCKETS as u64) as u32), 0)?;
            let (epoch, count) = flowctl_common::window::unpack(w);
            if epoch == e as u32 {
                // A count is a u32 that completions may have taken below the
                // establishments they match (a CPU race): never below zero.
                n += (count as i32).max(0) as u64;
            }
        }
        Ok(n)
    }

    /// What the agent last published (see `AgentRecord`).
    pub fn agent_record(&self) -> Result<AgentRecord> {
        Ok(self.agent.get(&0, 0)?)
    }

    pub fn set_agent_record(&mut self, r: &AgentRecord) -> Result<()> {
        self.agent.set(0, *r, 0)?;
        Ok(())
    }

    /// The active slot's configuration of rule `index` (profile order).
    pub fn active_rule(&self, index: usize) -> Result<RuleConfig> {
        let slot = self.global()?.active_slot & 1;
        Ok(self.rules.get(&(slot * MAX_RULES as u32 + index as u32), 0)?)
    }

    /// Turns key sampling for `top --keys` on (about one in `every` matched
    /// packets) or off (0).
    pub fn set_key_sampling(&mut self, every: u32) -> Result<()> {
        let mut g = self.global()?;
        g.key_sample_every = every;
        self.global.set(0, g, 0)?;
        Ok(())
    }

    /// Sum of a record's per-CPU counters.
    pub fn counters(&self, record: u32) -> Result<RuleCounters> {
        let mut total = RuleCounters::default();
        for c in self.counters.get(&record, 0)?.iter() {
            total.add(c);
        }
        Ok(total)
    }

    /// A record's statistics over the last `span` complete buckets before
    /// `now_ns` (CLOCK_MONOTONIC), summed over CPUs. Reads only those
    /// buckets, one lookup each; the kernel's writers never wait on it.
    pub fn stats_span(
        &self,
        record: u32,
        shape: &crate::profile::StatsSettings,
        now_ns: u64,
        span: u32,
    ) -> Result<StatsSum> {
        self.stats_epochs(
            record,
            shape,
            stats::complete_span(now_ns, shape.bucket_ns, shape.buckets, span),
        )
    }

    /// A record's statistics over the last `span` complete buckets (at
    /// least one, at most what the ring holds) and the seconds they cover,
    /// for rates.
    pub fn stats_rate_window(
        &self,
        record: u32,
        shape: &crate::profile::StatsSettings,
        now_ns: u64,
        span: u32,
    ) -> Result<(StatsSum, f64)> {
        let span = span.min(shape.buckets.saturating_sub(1)).max(1);
        let sum = self.stats_span(record, shape, now_ns, span)?;
        Ok((sum, span as f64 * shape.bucket_ns as f64 / 1e9))
    }

    /// A record's statistics over the given bucket epochs, summed over CPUs.
    pub fn stats_epochs(
        &self,
        record: u32,
        shape: &crate::profile::StatsSettings,
        epochs: std::ops::Range<u64>,
    ) -> Result<StatsSum> {
        let mut sum = StatsSum::default();
        for e in epochs {
            let idx = stats::index(record, e, shape.buckets);
            for b in self.stats.get(&idx, 0)?.iter() {
                if b.epoch == e {
                    sum.add(b);
                }
            }
        }
        Ok(sum)
    }

    /// The rule index the kernel would pick, read from the kernel's own active
    /// tables with the kernel's matcher.
    pub fn classify(
        &self,
        src: &std::net::IpAddr,
        proto: u8,
        dport: Option<u16>,
    ) -> Result<Option<u32>> {
        let slot = (self.global()?.active_slot & 1) as u8;
        let key = Key::new(8 + 128, tables::trie_data(slot, src));
        let src_bits = match self.trie.get(&key, 0) {
            Ok(class) => self.classes.get(&(slot as u32 * MAX_SRC_CLASSES as u32 + class), 0)?,
            Err(_) => RuleBitmap::EMPTY,
        };
        let pb = self.proto.get(&(slot as u32 * PROTO_INDICES as u32 + proto as u32), 0)?;
        let port = dport.map(u32::from).unwrap_or(flowctl_common::PORT_NONE);
        let portb = self.port.get(&(slot as u32 * PORT_INDICES as u32 + port), 0)?;
        Ok(flowctl_common::matcher::first_match(&src_bits, &pb, &portb))
    }
}

/// Assigns counter records and bucket-state ids for `set`, keeping a rule's
/// record while its name is unchanged and its state id while its match and
/// limits are unchanged (so its buckets survive the reload).
pub fn plan_states(old: &[RuleState], next_state_id: &mut u32, set: &RuleSet) -> Vec<RuleState> {
    let mut used_records: Vec<u32> = Vec::new();
    let mut used_states: Vec<u32> = Vec::new();
    let mut out: Vec<RuleState> = Vec::new();
    for r in &set.rules {
        let fp = r.state_fingerprint();
        let record = old.iter().find(|o| o.name == r.name).map(|o| o.record);
        let state = old
            .iter()
            .find(|o| o.fingerprint == fp && o.name == r.name && !used_states.contains(&o.state_id))
            .or_else(|| {
                old.iter().find(|o| o.fingerprint == fp && !used_states.contains(&o.state_id))
            })
            .map(|o| o.state_id);
        let state_id = state.unwrap_or_else(|| {
            *next_state_id += 1;
            *next_state_id
        });
        used_states.push(state_id);
        out.push(RuleState {
            name: r.name.clone(),
            fingerprint: fp,
            state_id,
            record: record.unwrap_or(u32::MAX),
        });
        if let Some(rec) = record {
            used_records.push(rec);
        }
    }
    // New names take records that neither the old nor the new set uses, so
    // old and new rules never share counters during the flip.
    let old_records: Vec<u32> = old.iter().map(|o| o.record).collect();
    let mut free = (0..MAX_RULE_RECORDS as u32)
        .filter(|r| !used_records.contains(r) && !old_records.contains(r));
    for s in out.iter_mut() {
        if s.record == u32::MAX {
            s.record = free.next().expect("2*MAX_RULES records cover old and new sets");
        }
    }
    out
}

/// Writes `set` into the inactive slot, then flips the active slot and bumps
/// the generation. The kernel sees either the old or the new rule set, never a
/// mix. Returns the new rule states.
pub fn apply(maps: &mut Maps, state: &mut AttachState, set: &RuleSet) -> Result<()> {
    let mut next = state.next_state_id;
    let planned = plan_states(&state.rules, &mut next, set);
    let mut g = maps.global()?;
    let slot = (g.active_slot & 1) ^ 1;
    if g.layout_version != 0 && g.layout_version != LAYOUT_VERSION {
        bail!("pinned layout version {} is not {LAYOUT_VERSION}", g.layout_version);
    }

    for (i, (r, s)) in set.rules.iter().zip(&planned).enumerate() {
        let cfg = RuleConfig {
            interval_fp: r.interval_fp,
            burst_ns: r.burst_ns,
            state_id: s.state_id,
            record: s.record,
            action: r.action,
            unit: r.unit,
            key_kind: r.key_kind,
            prefix_v4: r.prefix_v4,
            prefix_v6: r.prefix_v6,
            has_ports: r.spec.ports.is_some() as u8,
            has_bucket: (r.interval_fp != 0) as u8,
            bbr: r.bbr.as_ref().map(|b| b.kernel_flags()).unwrap_or(0),
            at: slot * MAX_RULES as u32 + i as u32,
            quota_bucket_ns: r.quota_bucket_ns,
            quota_limit: r.quota_limit,
            quota_buckets: r.quota_buckets,
        };
        maps.rules.set(slot * MAX_RULES as u32 + i as u32, cfg, 0)?;
    }
    let specs: Vec<_> = set.rules.iter().map(|r| r.spec.clone()).collect();
    let t = tables::compile(&specs, slot as u8);
    for (i, b) in t.proto.iter().enumerate() {
        maps.proto.set(slot * PROTO_INDICES as u32 + i as u32, b, 0)?;
    }
    for (i, b) in t.port.iter().enumerate() {
        maps.port.set(slot * PORT_INDICES as u32 + i as u32, b, 0)?;
    }
    for (i, b) in t.sets.iter().enumerate() {
        maps.rule_sets.set(slot * RULE_SETS as u32 + i as u32, b, 0)?;
    }
    // Replace this slot's trie entries.
    let stale: Vec<Key<TrieData>> = maps
        .trie
        .keys()
        .filter_map(|k| k.ok())
        .filter(|k| k.data()[0] >> 1 == slot as u8)
        .collect();
    for k in &stale {
        let _ = maps.trie.remove(k);
    }
    // Classes first, so no trie entry ever names a class not yet written.
    for (i, b) in t.classes.iter().enumerate() {
        maps.classes.set(slot * MAX_SRC_CLASSES as u32 + i as u32, b, 0)?;
    }
    for e in &t.trie {
        maps.trie.insert(&Key::new(e.prefix_len, e.data), e.class, 0)?;
    }
    // Records new to this set start from zero.
    let ncpu = aya::util::nr_cpus().map_err(|(_, e)| anyhow!("counting CPUs: {e}"))?;
    for s in &planned {
        if !state.rules.iter().any(|o| o.record == s.record) {
            let zeros = PerCpuValues::try_from(vec![RuleCounters::default(); ncpu])?;
            maps.counters.set(s.record, zeros, 0)?;
            maps.control.set(s.record, ControlRecord::default(), 0)?;
            // Debts of the rule that used this record before are not this rule's.
            let base = s.record * DEBT_SLOTS_PER_RULE as u32;
            for i in 0..DEBT_SLOTS_PER_RULE as u32 {
                if maps.debt.get(&(base + i), 0)? != 0 {
                    maps.debt.set(base + i, 0, 0)?;
                }
            }
            // Nor its statistics or open connections.
            let buckets = state.stats.buckets;
            for i in 0..buckets {
                let idx = s.record * buckets + i;
                if maps.stats.get(&idx, 0)?.iter().any(|b| b.epoch != 0) {
                    maps.stats.set(
                        idx,
                        PerCpuValues::try_from(vec![StatsBucket::default(); ncpu])?,
                        0,
                    )?;
                }
            }
            for i in 0..OPEN_BUCKETS as u32 {
                let idx = s.record * OPEN_BUCKETS as u32 + i;
                if maps.open.get(&idx, 0)? != 0 {
                    maps.open.set(idx, 0, 0)?;
                }
            }
        }
    }
    // Fixed admission ratios from the profile (none: all pass). KLimiter's
    // entries keep the ratio the agent last set: a reload during an
    // overload must not open the gates.
    for (i, (r, s)) in set.rules.iter().zip(&planned).enumerate() {
        if set.baselines.iter().any(|b| b.entries.contains(&i)) {
            continue;
        }
        let mut c = maps.control.get(&s.record, 0)?;
        if c.set_admission(r.admission_ppm, r.admission_per_flow) {
            maps.control.set(s.record, c, 0)?;
        }
    }
    // Rules without BBR (any more) leave nothing of it in their control record.
    for (r, s) in set.rules.iter().zip(&planned) {
        if r.bbr.is_none() {
            let mut c = maps.control.get(&s.record, 0)?;
            if c.flags & control_flags::BBR_ACTIVE != 0 {
                c.flags &= !control_flags::BBR_ACTIVE;
                c.bbr_max_inflight = 0;
                c.bbr_overloaded = 0;
                c.bbr_inflight = 0;
                c.bbr_max_pass = 0;
                c.bbr_min_rt_ms = 0;
                c.version = c.version.wrapping_add(1);
                maps.control.set(s.record, c, 0)?;
            }
        }
    }
    // The flip.
    g.layout_version = LAYOUT_VERSION;
    g.active_slot = slot;
    g.generation += 1;
    g.malformed_verdict = set.settings.malformed_verdict;
    g.fragment_verdict = set.settings.fragment_verdict;
    g.grace_ns = set.settings.grace_ns;
    if g.hash_seed == 0 {
        g.hash_seed = random_u64();
    }
    maps.global.set(0, g, 0)?;
    state.rules = planned;
    state.next_state_id = next;
    Ok(())
}

pub fn heartbeat(maps: &mut Maps) -> Result<()> {
    let mut g = maps.global()?;
    g.heartbeat_ns = monotonic_ns();
    maps.global.set(0, g, 0)?;
    Ok(())
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if let Ok(mut f) = fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut b);
    }
    u64::from_ne_bytes(b) | 1
}

/// The pinned link outlived its interface (the namespace or device was
/// deleted, and the numbers were reused): its pins are stale.
#[derive(Debug, thiserror::Error)]
#[error("the pinned XDP link is severed: its interface is gone")]
pub struct SeveredLink;

/// How `attach` should treat the interface's XDP mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Native (driver) mode, falling back to generic with a warning.
    Auto,
    Native,
    /// Generic (skb) mode.
    Skb,
}

/// Which of the object's two XDP entry points to load. They are the same
/// program; `Frags` is built into section `xdp.frags`, so aya loads it with
/// BPF_F_XDP_HAS_FRAGS (multi-buffer: jumbo frames reach it, and it parses
/// what is in the first buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpVariant {
    Frags,
    Single,
}

impl XdpVariant {
    pub fn program(self) -> &'static str {
        match self {
            XdpVariant::Frags => XDP_PROGRAM_FRAGS,
            XdpVariant::Single => XDP_PROGRAM,
        }
    }

    /// What `load` chooses: multi-buffer wherever the kernel has it (5.18+).
    /// The choice depends only on the running kernel, so an agent that
    /// adopts a pinned link (pins do not outlive a reboot) always re-points
    /// it at the same variant: the kernel refuses to replace a frags program
    /// with a single-buffer one on an interface whose MTU needs frags.
    pub fn for_kernel() -> Self {
        if crate::kernel::features::get().has(crate::kernel::features::Feature::XdpFrags) {
            XdpVariant::Frags
        } else {
            XdpVariant::Single
        }
    }
}

/// The XDP program `load` loaded into `ebpf` (only the chosen one is loaded,
/// so the one with a file descriptor is it): attach, adoption and the test
/// harness all ask here.
pub fn loaded_xdp(ebpf: &Ebpf) -> Result<&'static str> {
    for v in [XdpVariant::Frags, XdpVariant::Single] {
        if let Some(p) = ebpf.program(v.program()) {
            let x: &Xdp = p.try_into()?;
            if x.fd().is_ok() {
                return Ok(v.program());
            }
        }
    }
    bail!("no XDP program of the object is loaded")
}

/// Loads the XDP object with its maps pinned under `id`'s pin dir (adopting
/// maps already pinned there) and the table sizes of `settings`; the XDP
/// program is the variant this kernel supports (`XdpVariant::for_kernel`).
pub fn load(id: &AttachId, settings: &Settings) -> Result<Ebpf> {
    load_variant(id, settings, XdpVariant::for_kernel())
}

/// `load` with the XDP variant chosen by the caller (the benchmark tail-calls
/// into the program from a single-buffer one, and the kernel refuses tail
/// calls between frags and single-buffer programs).
pub fn load_variant(id: &AttachId, settings: &Settings, variant: XdpVariant) -> Result<Ebpf> {
    let dir = id.pin_dir();
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(&dir)
        .map_max_entries(names::SRC_CACHE, settings.source_cache_entries)
        .map_max_entries(names::KEYS, settings.key_table_entries)
        .map_max_entries(names::QUOTAS, settings.quota_table_entries)
        .map_max_entries(names::CONNS, settings.connection_table_entries)
        .map_max_entries(names::STATS, COUNTER_RECORDS as u32 * settings.stats.buckets)
        .override_global(globals::STATS_LEVEL, &settings.stats.level, true)
        .override_global(globals::STATS_BUCKET_NS, &settings.stats.bucket_ns, true)
        .override_global(globals::STATS_BUCKETS, &settings.stats.buckets, true)
        .load(xdp_object())
        .map_err(|e| anyhow!("loading the XDP object: {e} (is this process root or does it hold CAP_BPF and CAP_NET_ADMIN?)"))?;
    let prog: &mut Xdp =
        ebpf.program_mut(variant.program()).context("program missing from object")?.try_into()?;
    if let Err(e) = prog.load() {
        return Err(load_error(e));
    }
    Ok(ebpf)
}

/// Turns a program load failure into a message with the verifier log's tail.
pub fn load_error(e: ProgramError) -> anyhow::Error {
    match e {
        ProgramError::LoadError { io_error, verifier_log } => {
            let log = verifier_log.to_string();
            let tail: Vec<&str> =
                log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
            anyhow!(
                "the kernel verifier rejected the XDP program ({io_error}); last lines of its log:\n{}",
                tail.join("\n")
            )
        }
        other => anyhow!("loading the XDP program: {other}"),
    }
}

/// The TC egress counter's attachments, one per interface. With TCX (6.6+)
/// each is a bpf_link owned here, gone with the process. Without TCX, a
/// netlink `cls_bpf` filter on the interface's `clsact` qdisc, which flowctl
/// adds when absent. Dropping this detaches every filter and then removes
/// each qdisc flowctl added, unless filters of someone else are on it
/// still: nothing is left behind, and a `clsact` that was there before is
/// left alone. A netlink filter outlives a SIGKILLed agent, so each is
/// recorded (priority and handle) in the attachment's run directory, and
/// the next agent of the attachment removes exactly those first.
#[derive(Default)]
pub struct Egress {
    attached: Vec<EgressAttach>,
    /// Where the netlink filters are recorded (None: not recorded).
    record: Option<std::path::PathBuf>,
}

struct EgressAttach {
    iface: String,
    ifindex: u32,
    link: Option<aya::programs::tc::SchedClassifierLink>,
    /// A netlink filter's priority and handle (None: a TCX link).
    netlink: Option<(u16, u32)>,
    created_clsact: bool,
}

/// A netlink filter as recorded for the next agent.
#[derive(serde::Serialize, serde::Deserialize)]
struct NetlinkRecord {
    iface: String,
    ifindex: u32,
    priority: u16,
    handle: u32,
    created_clsact: bool,
}

impl Egress {
    /// The egress attachments of the agent of `id`, after removing the
    /// netlink filters (and qdiscs) a killed predecessor left (the caller
    /// holds the attachment's agent lock, so that agent is gone).
    pub fn for_attachment(id: &AttachId) -> Self {
        let record = id.run_dir().join("egress-netlink.json");
        if let Ok(text) = fs::read_to_string(&record) {
            let stale: Vec<NetlinkRecord> = serde_json::from_str(&text).unwrap_or_default();
            for r in stale {
                if crate::system::netns::ifindex(&r.iface).ok() != Some(r.ifindex) {
                    continue; // the interface is gone, and its filters with it
                }
                tracing::info!("removing the egress filter a previous agent left on {}", r.iface);
                if let Ok(link) = aya::programs::tc::SchedClassifierLink::attached(
                    &r.iface,
                    aya::programs::TcAttachType::Egress,
                    r.priority,
                    aya::programs::tc::TcHandle::from(r.handle),
                    None,
                ) {
                    drop(link); // detaches
                }
                if r.created_clsact {
                    remove_clsact_if_unused(&r.iface, r.ifindex);
                }
            }
            let _ = fs::remove_file(&record);
        }
        Self { attached: Vec::new(), record: Some(record) }
    }

    /// The interfaces the counter is attached to.
    pub fn ifaces(&self) -> Vec<&str> {
        self.attached.iter().map(|a| a.iface.as_str()).collect()
    }

    fn save(&self) {
        let Some(path) = &self.record else { return };
        let recs: Vec<NetlinkRecord> = self
            .attached
            .iter()
            .filter_map(|a| {
                a.netlink.map(|(priority, handle)| NetlinkRecord {
                    iface: a.iface.clone(),
                    ifindex: a.ifindex,
                    priority,
                    handle,
                    created_clsact: a.created_clsact,
                })
            })
            .collect();
        if recs.is_empty() {
            let _ = fs::remove_file(path);
        } else if let Ok(text) = serde_json::to_string(&recs) {
            if let Err(e) = fs::write(path, text) {
                tracing::warn!("recording the egress filters at {}: {e}", path.display());
            }
        }
    }

    /// Detaches everything now (what dropping does).
    pub fn release(&mut self) {
        for mut a in self.attached.drain(..) {
            drop(a.link.take());
            if a.created_clsact {
                remove_clsact_if_unused(&a.iface, a.ifindex);
            }
        }
        self.save();
    }
}

/// Removes the `clsact` qdisc flowctl added to `iface` unless filters (of
/// another agent, or anyone) are still on it.
fn remove_clsact_if_unused(iface: &str, ifindex: u32) {
    match crate::kernel::tc::clsact_filters(ifindex) {
        Ok(0) => {
            if let Err(e) = crate::kernel::tc::del_clsact(ifindex) {
                tracing::warn!("removing the clsact qdisc flowctl added to {iface}: {e}");
            }
        }
        Ok(n) => tracing::info!("leaving the clsact qdisc on {iface}: {n} other filters use it"),
        Err(e) => tracing::warn!("listing the filters on {iface}: {e}; leaving its clsact qdisc"),
    }
}

impl Drop for Egress {
    fn drop(&mut self) {
        self.release();
    }
}

/// Writes KLimiter's egress targets (slot order = the profile's egress
/// baselines) and attaches the TC egress counter to each interface they
/// name that it is not on yet. The attachments live as long as `egress`
/// (the agent); without an agent nothing needs the counts.
pub fn set_egress(
    ebpf: &mut Ebpf,
    maps: &mut Maps,
    set: &RuleSet,
    egress: &mut Egress,
) -> Result<()> {
    use crate::profile::klimiter::LevelSource;
    let mut slot = 0u32;
    let mut ifaces = Vec::new();
    for b in &set.baselines {
        if let LevelSource::Egress { iface, target, .. } = &b.source {
            maps.egress_targets.set(slot, *target, 0)?;
            slot += 1;
            if !ifaces.contains(iface) {
                ifaces.push(iface.clone());
            }
        }
    }
    for s in slot..flowctl_common::MAX_EGRESS_TARGETS as u32 {
        maps.egress_targets.set(s, flowctl_common::EgressTarget::default(), 0)?;
    }
    let have = egress.ifaces().iter().map(|s| s.to_string()).collect::<Vec<_>>();
    if ifaces.iter().all(|i| have.contains(i)) {
        return Ok(());
    }
    let prog: &mut aya::programs::SchedClassifier = ebpf
        .program_mut(flowctl_common::EGRESS_PROGRAM)
        .context("egress program missing from the object")?
        .try_into()?;
    if prog.fd().is_err() {
        prog.load().map_err(load_error)?;
    }
    let tcx = crate::kernel::features::get().has(crate::kernel::features::Feature::Tcx);
    for i in ifaces {
        if have.contains(&i) {
            continue;
        }
        let a = attach_egress(prog, &i, tcx)?;
        egress.attached.push(a);
        egress.save();
    }
    Ok(())
}

/// Attaches the egress counter to `iface`: a TCX link where the kernel has
/// TCX, else a netlink filter on the `clsact` qdisc (added when absent).
fn attach_egress(
    prog: &mut aya::programs::SchedClassifier,
    iface: &str,
    tcx: bool,
) -> Result<EgressAttach> {
    use aya::programs::{
        tc::{self, NlOptions, TcAttachOptions},
        LinkOrder, TcAttachType,
    };
    let hint = "(does the interface exist in this network namespace?)";
    let ifindex = crate::system::netns::ifindex(iface)?;
    let mut created_clsact = false;
    let options = if tcx {
        TcAttachOptions::TcxOrder(LinkOrder::default())
    } else {
        match tc::qdisc_add_clsact(iface) {
            Ok(()) => created_clsact = true,
            Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => bail!("adding a clsact qdisc to {iface} for the egress counter (no TCX on this kernel): {e} {hint}"),
        }
        TcAttachOptions::Netlink(NlOptions::default())
    };
    let attached = prog
        .attach_with_options(iface, TcAttachType::Egress, options)
        .and_then(|id| prog.take_link(id));
    match attached {
        Ok(link) => {
            let netlink =
                if tcx { None } else { Some((link.priority()?, u32::from(link.handle()?))) };
            Ok(EgressAttach {
                iface: iface.to_string(),
                ifindex,
                link: Some(link),
                netlink,
                created_clsact,
            })
        }
        Err(e) => {
            if created_clsact {
                let _ = crate::kernel::tc::del_clsact(ifindex);
            }
            let how = if tcx { "TCX link" } else { "netlink filter on clsact" };
            bail!("attaching the egress counter to {iface} ({how}): {e} {hint}")
        }
    }
}

/// Attaches (or, when `link` is pinned already, re-points the pinned link at
/// the freshly loaded program) and returns the mode in use.
pub fn attach(ebpf: &mut Ebpf, id: &AttachId, iface: &str, mode: Mode) -> Result<String> {
    let link_path = id.pin_dir().join("link");
    let name = loaded_xdp(ebpf)?;
    let frags = name == XDP_PROGRAM_FRAGS;
    let prog: &mut Xdp = ebpf.program_mut(name).context("program missing")?.try_into()?;
    if link_path.exists() {
        let pinned = PinnedLink::from_pin(&link_path).context("opening the pinned XDP link")?;
        let fd_link: FdLink = pinned.into();
        let xdp_link = aya::programs::xdp::XdpLink::try_from(fd_link)?;
        let link_id = match prog.attach_to_link(xdp_link) {
            Ok(l) => l,
            Err(ProgramError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOLINK) =>
            {
                return Err(SeveredLink.into());
            }
            Err(e) => return Err(anyhow!("re-pointing the pinned XDP link at {name}: {e}")),
        };
        let link = prog.take_link(link_id)?;
        std::mem::forget(link); // stays pinned
        return Ok("adopted".into());
    }
    let try_mode = |prog: &mut Xdp, m: XdpMode| prog.attach_to_if_index(id.ifindex, m);
    let (link_id, used) = match mode {
        Mode::Skb => {
            (try_mode(prog, XdpMode::Skb).map_err(|e| attach_error(e, iface, frags))?, "generic")
        }
        Mode::Native => {
            (try_mode(prog, XdpMode::Driver).map_err(|e| attach_error(e, iface, frags))?, "native")
        }
        Mode::Auto => match try_mode(prog, XdpMode::Driver) {
            Ok(l) => (l, "native"),
            Err(e) if is_busy(&e) => return Err(attach_error(e, iface, frags)),
            Err(e) => {
                tracing::warn!("native XDP is not available on {iface} ({}); FALLING BACK TO GENERIC (skb) MODE, which is slower", describe(&e));
                eprintln!("warning: native XDP is not available on {iface}; using generic (skb) mode, which is slower");
                (
                    try_mode(prog, XdpMode::Skb).map_err(|e| attach_error(e, iface, frags))?,
                    "generic",
                )
            }
        },
    };
    let link = prog.take_link(link_id)?;
    let fd_link = FdLink::try_from(link).map_err(|e| {
        anyhow!(
            "this kernel attached XDP without bpf_link ({e}); flowctl needs bpf_link (Linux 5.9+)"
        )
    })?;
    fd_link
        .pin(&link_path)
        .with_context(|| format!("pinning the XDP link at {}", link_path.display()))?;
    Ok(used.into())
}

fn is_busy(e: &ProgramError) -> bool {
    let s = format!("{e:?}");
    s.contains("EBUSY")
        || s.contains("EEXIST")
        || s.contains("Device or resource busy")
        || s.contains("File exists")
}

/// The errno behind a failed attach, when the kernel gave one.
fn os_error(e: &ProgramError) -> Option<&std::io::Error> {
    match e {
        ProgramError::SyscallError(s) => Some(&s.io_error),
        _ => None,
    }
}

/// A program error with its errno (aya's Display leaves it out).
fn describe(e: &ProgramError) -> String {
    match os_error(e) {
        Some(io) => format!("{e}: {io}"),
        None => e.to_string(),
    }
}

fn attach_error(e: ProgramError, iface: &str, frags: bool) -> anyhow::Error {
    // veth (drivers/net/veth.c, veth_xdp_set) and other drivers refuse a
    // single-buffer program in native mode when the MTU does not fit one
    // page: ERANGE.
    let range = os_error(&e).and_then(|io| io.raw_os_error()) == Some(libc::ERANGE);
    if range && !frags {
        anyhow!(
            "attaching XDP to {iface}: {}: its MTU is too large for a single-buffer XDP program in native mode, and this kernel ({}) lacks multi-buffer XDP (xdp.frags, Linux 5.18+); lower the MTU or use --mode skb",
            describe(&e),
            crate::kernel::features::get().release
        )
    } else if is_busy(&e) {
        anyhow!(
            "{iface} already has another XDP program attached; flowctl will not replace it. Inspect it with `ip link show {iface}` and remove it with `ip link set dev {iface} xdp off` (or `bpftool net detach xdp dev {iface}`) if it is not needed"
        )
    } else {
        anyhow!("attaching XDP to {iface}: {}", describe(&e))
    }
}

/// Removes the link and every pin of an attachment. Idempotent: returns false
/// when there was nothing to remove.
pub fn detach(id: &AttachId) -> Result<bool> {
    let dir = id.pin_dir();
    if !dir.exists() {
        let _ = fs::remove_dir_all(id.run_dir());
        return Ok(false);
    }
    let link_path = dir.join("link");
    if link_path.exists() {
        let pinned = PinnedLink::from_pin(&link_path).context("opening the pinned XDP link")?;
        let fd = pinned.unpin().context("unpinning the XDP link")?;
        drop(fd);
    }
    fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    // Keep the lock file (an agent may hold it); drop the rest.
    for f in ["state.json", "profile.toml", "agent.sock"] {
        let _ = fs::remove_file(id.run_dir().join(f));
    }
    Ok(true)
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
    use std::os::fd::{AsFd, AsRawFd};
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
