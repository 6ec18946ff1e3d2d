//! The pinned maps of one attachment, opened by path, with typed reads of
//! what the kernel counts and the few writes that are not a rule set
//! (`apply`) or a control record (`control`): the agent record, key
//! sampling and the heartbeat.

use super::pins::AttachId;
use crate::{profile::StatsSettings, system::clock::monotonic_ns};
use anyhow::{bail, Context, Result};
use aya::maps::{lpm_trie::Key, Array, LpmTrie, Map, MapData, PerCpuArray};
use flowctl_common::{
    map_names as names,
    stats::{self, StatsSum},
    tables, AgentRecord, ControlRecord, EgressTarget, GlobalRecord, RuleBitmap, RuleConfig,
    RuleCounters, StatsBucket, TrieData, MAX_RULES, MAX_SRC_CLASSES, OPEN_BUCKETS, OPEN_BUCKET_NS,
    PORT_INDICES, PORT_NONE, PROTO_INDICES,
};
use std::path::Path;

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
    pub debt: Array<MapData, flowctl_common::debt::DebtSet>,
    /// The pool of flood sketches (written by the agent's flood loop).
    pub sketches: Array<MapData, u64>,
    pub stats: PerCpuArray<MapData, StatsBucket>,
    pub agent: Array<MapData, AgentRecord>,
    /// BBR rules' open-connection rings (see `OPEN_BUCKETS`).
    pub open: Array<MapData, u64>,
    /// KLimiter's egress targets and their per-CPU counters.
    pub egress_targets: Array<MapData, EgressTarget>,
    pub egress_counts: PerCpuArray<MapData, u64>,
    /// Warm-up rules' buckets (`flowctl_common::warm`), per record.
    pub warm: Array<MapData, flowctl_common::warm::WarmBucket>,
    /// The egress shaper's table, its aggregate buckets and its counters.
    pub shapers: Array<MapData, flowctl_common::shaper::ShaperConfig>,
    pub shaper_next: Array<MapData, u64>,
    pub shaper_counts: PerCpuArray<MapData, flowctl_common::shaper::ShaperCounters>,
    /// Isolated rules' own tables; `None` in a data plane an older build
    /// loaded, which has no such array (an apply with isolated rules then
    /// says to re-attach).
    pub rule_tables: Option<super::own_tables::RuleTables>,
    /// What this process last wrote into each slot of the source trie, so
    /// an apply writes only what changed (a list of a million that gains
    /// one address costs one insert); `None` when not known (another
    /// process wrote it, or a write failed): the slot is read back.
    pub trie_written: [Option<Vec<tables::TrieEntry>>; 2],
    /// The classes last written into each slot, so equal bitmaps keep
    /// their index (`tables::compile_keeping`) and a list's entries do not
    /// all change when a new class sorts before theirs.
    pub classes_written: [Option<Vec<RuleBitmap>>; 2],
    /// This process is the attachment's agent: a long write keeps its
    /// heartbeat fresh (an agent-less apply must not claim an agent).
    pub agent_heartbeat: bool,
}

/// Where a warm-up rule's ramp stands (`Maps::warm_up`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarmUpNow {
    /// Share of the rule's rate it admits now: `1/cold_factor` cold, 1 warm.
    pub share: f64,
    pub cold_factor: u8,
    pub warm_up_ns: u64,
}

/// A pinned map of the attachment whose pin directory is `dir`.
pub(super) fn open_pinned(dir: &Path, name: &str) -> Result<MapData> {
    MapData::from_pin(dir.join(name))
        .with_context(|| format!("opening pinned map {}", dir.join(name).display()))
}

impl Maps {
    pub fn open(id: &AttachId) -> Result<Self> {
        let d = id.pin_dir();
        Ok(Self {
            global: Array::try_from(Map::Array(open_pinned(&d, names::GLOBAL)?))?,
            rules: Array::try_from(Map::Array(open_pinned(&d, names::RULES)?))?,
            proto: Array::try_from(Map::Array(open_pinned(&d, names::PROTO_BITS)?))?,
            port: Array::try_from(Map::Array(open_pinned(&d, names::PORT_BITS)?))?,
            rule_sets: Array::try_from(Map::Array(open_pinned(&d, names::RULE_SETS)?))?,
            trie: LpmTrie::try_from(Map::LpmTrie(open_pinned(&d, names::SRC_TRIE)?))?,
            classes: Array::try_from(Map::Array(open_pinned(&d, names::SRC_CLASSES)?))?,
            counters: PerCpuArray::try_from(Map::PerCpuArray(open_pinned(&d, names::COUNTERS)?))?,
            control: Array::try_from(Map::Array(open_pinned(&d, names::CONTROL)?))?,
            debt: Array::try_from(Map::Array(open_pinned(&d, names::DEBT)?))?,
            sketches: Array::try_from(Map::Array(open_pinned(&d, names::SKETCHES)?))?,
            stats: PerCpuArray::try_from(Map::PerCpuArray(open_pinned(&d, names::STATS)?))?,
            agent: Array::try_from(Map::Array(open_pinned(&d, names::AGENT)?))?,
            open: Array::try_from(Map::Array(open_pinned(&d, names::OPEN)?))?,
            egress_targets: Array::try_from(Map::Array(open_pinned(&d, names::EGRESS_TARGETS)?))?,
            egress_counts: PerCpuArray::try_from(Map::PerCpuArray(open_pinned(
                &d,
                names::EGRESS_COUNTS,
            )?))?,
            warm: Array::try_from(Map::Array(open_pinned(&d, names::WARM)?))?,
            shapers: Array::try_from(Map::Array(open_pinned(&d, names::SHAPERS)?))?,
            shaper_next: Array::try_from(Map::Array(open_pinned(&d, names::SHAPER_NEXT)?))?,
            shaper_counts: PerCpuArray::try_from(Map::PerCpuArray(open_pinned(
                &d,
                names::SHAPER_COUNTS,
            )?))?,
            rule_tables: super::own_tables::RuleTables::open(id).ok(),
            trie_written: [None, None],
            classes_written: [None, None],
            agent_heartbeat: false,
        })
    }

    /// Shaper `i`'s counters, summed over the CPUs.
    pub fn shaper_counters(&self, i: u32) -> Result<flowctl_common::shaper::ShaperCounters> {
        let mut t = flowctl_common::shaper::ShaperCounters::default();
        for c in self.shaper_counts.get(&i, 0)?.iter() {
            t.offered_pkts += c.offered_pkts;
            t.offered_bytes += c.offered_bytes;
            t.delayed_pkts += c.delayed_pkts;
            t.delay_ns += c.delay_ns;
            t.horizon_drops += c.horizon_drops;
            t.horizon_drop_bytes += c.horizon_drop_bytes;
            t.table_full += c.table_full;
        }
        Ok(t)
    }

    /// How far ahead of now aggregate shaper `i` has booked departures (its
    /// queue's time depth), ns.
    pub fn shaper_backlog_ns(&self, i: u32) -> Result<u64> {
        Ok(self.shaper_next.get(&i, 0)?.saturating_sub(monotonic_ns()))
    }

    /// The ramp of the active slot's rule `index` (profile order), whose
    /// record is `record`, when it has one: the share of its rate its
    /// bucket admits at this instant. A bucket its state has not claimed
    /// yet is cold.
    pub fn warm_up(&self, index: usize, record: u32) -> Result<Option<WarmUpNow>> {
        let rule = self.active_rule(index)?;
        if rule.cold_factor == 0 {
            return Ok(None);
        }
        let ramp = flowctl_common::warm::Ramp {
            warm_ns: rule.warm_up_ns,
            cold_factor: rule.cold_factor as u64,
        };
        let b = self.warm.get(&record, 0)?;
        let (tat, stored) = if b.state_id == rule.state_id { (b.tat, b.stored_ns) } else { (0, 0) };
        let ppm = ramp.rate_ppm(tat, stored, monotonic_ns());
        Ok(Some(WarmUpNow {
            share: ppm as f64 / 1e6,
            cold_factor: rule.cold_factor,
            warm_up_ns: rule.warm_up_ns,
        }))
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

    /// The first `count` rules of the active slot, the slot read once.
    pub fn active_rules(&self, count: usize) -> Result<Vec<RuleConfig>> {
        let slot = self.global()?.active_slot & 1;
        (0..count.min(MAX_RULES))
            .map(|i| Ok(self.rules.get(&(slot * MAX_RULES as u32 + i as u32), 0)?))
            .collect()
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
        shape: &StatsSettings,
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
        shape: &StatsSettings,
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
        shape: &StatsSettings,
        epochs: std::ops::Range<u64>,
    ) -> Result<StatsSum> {
        let mut sum = StatsSum::default();
        for e in epochs {
            let idx = stats::index(stats::ring_record(record, shape.records()), e, shape.buckets);
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
        dst: Option<&std::net::IpAddr>,
        proto: u8,
        dport: Option<u16>,
    ) -> Result<Option<u32>> {
        let g = self.global()?;
        let slot = (g.active_slot & 1) as u8;
        let src_bits = self.class_of(tables::Direction::Src, slot, src)?;
        let dst_bits = if (g.dst_slots >> slot) & 1 != 0 {
            let Some(dst) = dst else {
                bail!("the active profile has rules that match on `dst`: give the packet's destination with --dst");
            };
            self.class_of(tables::Direction::Dst, slot, dst)?
        } else {
            src_bits
        };
        let addrs = flowctl_common::matcher::AddrSets { src: &src_bits, dst: &dst_bits };
        let pb = self.proto.get(&(slot as u32 * PROTO_INDICES as u32 + proto as u32), 0)?;
        let port = dport.map(u32::from).unwrap_or(PORT_NONE);
        let portb = self.port.get(&(slot as u32 * PORT_INDICES as u32 + port), 0)?;
        Ok(flowctl_common::matcher::first_match(addrs, &pb, &portb))
    }

    /// The rule bitmap of `addr` on one side, as the kernel's trie lookup
    /// finds it.
    fn class_of(
        &self,
        dir: tables::Direction,
        slot: u8,
        addr: &std::net::IpAddr,
    ) -> Result<RuleBitmap> {
        let key = Key::new(flowctl_common::TRIE_KEY_BITS, tables::trie_data_for(dir, slot, addr));
        Ok(match self.trie.get(&key, 0) {
            Ok(class) => self.classes.get(&(slot as u32 * MAX_SRC_CLASSES as u32 + class), 0)?,
            Err(_) => RuleBitmap::EMPTY,
        })
    }
}

pub fn heartbeat(maps: &mut Maps) -> Result<()> {
    let mut g = maps.global()?;
    g.heartbeat_ns = monotonic_ns();
    maps.global.set(0, g, 0)?;
    Ok(())
}
