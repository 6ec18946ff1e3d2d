//! Writing a rule set: `plan_states` keeps each rule's counter record and
//! bucket state across reloads, `apply` writes the set into the inactive
//! slot of every per-slot table and flips `GlobalRecord::active_slot`, so
//! the kernel sees the old rule set or the new one, never a mix.

use super::{
    maps::Maps,
    own_tables::OwnTable,
    state::{AttachState, ListState, RuleState},
};
use crate::{profile::RuleSet, system::clock::monotonic_ns};
use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{lpm_trie::Key, Array, MapData, PerCpuValues},
    Pod,
};
use flowctl_common::{
    bucket_table, nested_limit_at, nested_state_id,
    tables::{self, Source},
    RuleConfig, RuleCounters, StatsBucket, TrieData, DEBT_SETS_PER_RULE, LAYOUT_VERSION, MAX_RULES,
    MAX_SRC_CLASSES, OPEN_BUCKETS, PORT_INDICES, PROTO_INDICES, RULE_SETS, STATE_IDS_PER_RULE,
};
use std::{collections::HashSet, fs, ops::Range};

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
        // A new state takes a block of ids: its own and its nested limits'.
        let state_id = state.unwrap_or_else(|| {
            let id = *next_state_id + 1;
            *next_state_id += STATE_IDS_PER_RULE;
            id
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
    // old and new rules never share counters during the flip; below
    // 2 * max_rules, the records the statistics rings were sized for
    // (`stats::ring_record`).
    let old_records: Vec<u32> = old.iter().map(|o| o.record).collect();
    let records = 2 * set.settings.stats.max_rules;
    let mut free = (0..records).filter(|r| !used_records.contains(r) && !old_records.contains(r));
    for s in out.iter_mut() {
        if s.record == u32::MAX {
            s.record = free.next().expect("2*max_rules records cover old and new sets");
        }
    }
    out
}

/// Writes `set` into the inactive slot, then flips the active slot and bumps
/// the generation. The kernel sees either the old or the new rule set, never a
/// mix. The new rule states replace `state.rules`.
pub fn apply(maps: &mut Maps, state: &mut AttachState, set: &RuleSet) -> Result<()> {
    let mut next = state.next_state_id;
    let planned = plan_states(&state.rules, &mut next, set);
    let mut g = maps.global()?;
    let slot = (g.active_slot & 1) ^ 1;
    if g.layout_version != 0 && g.layout_version != LAYOUT_VERSION {
        bail!("pinned layout version {} is not {LAYOUT_VERSION}", g.layout_version);
    }
    // Before anything is written: without a random seed nothing is applied.
    if g.hash_seed == 0 {
        g.hash_seed = random_seed()?;
    }

    let configs: Vec<RuleConfig> = set
        .rules
        .iter()
        .zip(&planned)
        .enumerate()
        .map(|(i, (r, s))| RuleConfig {
            // A global rule's kernel bucket is its default share (a lease
            // replaces it per key); without one, a bucket that refuses all.
            interval_fp: match &r.global {
                None => r.interval_fp,
                Some(g) => {
                    g.share.as_ref().map_or(flowctl_common::BLOCK_INTERVAL_FP, |d| d.interval_fp)
                }
            },
            burst_ns: match &r.global {
                None => r.burst_ns,
                Some(g) => g
                    .share
                    .as_ref()
                    .map_or(0, |d| crate::profile::depth_ns(r.unit, d.interval_fp, d.burst)),
            },
            state_id: s.state_id,
            record: s.record,
            action: r.action,
            unit: r.unit,
            key_kind: r.key_kind,
            prefix_v4: r.prefix_v4,
            prefix_v6: r.prefix_v6,
            has_ports: r.spec.ports.is_some() as u8,
            bucket_table: match (r.interval_fp, r.own_table) {
                (0, _) => bucket_table::NONE,
                (_, Some(_)) => bucket_table::OWN,
                (_, None) => bucket_table::SHARED,
            },
            bbr: r.bbr.as_ref().map(|b| b.kernel_flags()).unwrap_or(0),
            at: slot * MAX_RULES as u32 + i as u32,
            global: r.global.is_some() as u8,
            book_syns: r.book_retransmits as u8,
            nested: r.limits.len() as u8,
            cold_factor: r.warm_up.map_or(0, |w| w.cold_factor),
            quota_bucket_ns: r.quota_bucket_ns,
            // A global rule's quota here is its default share's, like its
            // bucket (a lease's quota share replaces it per key).
            quota_limit: match &r.global {
                None => r.quota_limit,
                Some(g) => g.share.as_ref().map_or(0, |d| d.quota),
            },
            quota_buckets: r.quota_buckets,
            warm_up_ns: r.warm_up.map_or(0, |w| w.warm_ns),
        })
        .collect();
    write_slot(&mut maps.rules, slot, MAX_RULES, &configs)?;
    // Nested limits before the flip, like everything the slot's rules name.
    for (r, c) in set.rules.iter().zip(&configs) {
        for (i, l) in r.limits.iter().enumerate() {
            let limit = RuleConfig {
                interval_fp: l.interval_fp,
                burst_ns: l.burst_ns,
                key_kind: l.key_kind,
                prefix_v4: l.prefix_v4,
                prefix_v6: l.prefix_v6,
                bucket_table: bucket_table::SHARED,
                at: nested_limit_at(c.at, i as u32),
                state_id: nested_state_id(c.state_id, i as u32),
                nested: 0,
                cold_factor: 0,
                warm_up_ns: 0,
                bbr: 0,
                quota_bucket_ns: 0,
                quota_limit: 0,
                quota_buckets: 0,
                ..*c
            };
            maps.rules.set(limit.at, limit, 0)?;
        }
    }
    let specs: Vec<_> = set.rules.iter().map(|r| r.spec.clone()).collect();
    let previous = maps.classes_written[slot as usize].take();
    let t = tables::compile_keeping(&specs, slot as u8, previous.as_deref().unwrap_or(&[]))?;
    write_slot(&mut maps.proto, slot, PROTO_INDICES, &t.proto)?;
    write_slot(&mut maps.port, slot, PORT_INDICES, &t.port)?;
    write_slot(&mut maps.rule_sets, slot, RULE_SETS, &t.sets)?;
    write_slot(&mut maps.classes, slot, MAX_SRC_CLASSES, &t.classes)?;
    maps.classes_written[slot as usize] = Some(t.classes.clone());
    write_trie(maps, slot as u8, t.trie)?;
    // Whether the slot's packets need a destination lookup: set before
    // the flip (nothing reads this slot's bit until then), on the record
    // as it is now.
    let mut pre = maps.global()?;
    let bit = 1u32 << slot;
    let dst_slots = if t.has_dst { pre.dst_slots | bit } else { pre.dst_slots & !bit };
    if dst_slots != pre.dst_slots {
        pre.dst_slots = dst_slots;
        maps.global.set(0, pre, 0)?;
    }
    let ncpu = aya::util::nr_cpus().map_err(|(_, e)| anyhow!("counting CPUs: {e}"))?;
    let now = monotonic_ns();
    for (i, (r, s)) in set.rules.iter().zip(&planned).enumerate() {
        let new = !state.rules.iter().any(|o| o.record == s.record);
        if new {
            clear_record(maps, s.record, state.stats.buckets, ncpu)?;
        }
        // KLimiter's entries keep the ratio the agent last set: a reload
        // during an overload must not open the gates.
        let klimiter = set.baselines.iter().any(|b| b.entries.contains(&i));
        maps.update_control(s.record, now, |c| {
            if new {
                c.reset();
            }
            if !klimiter {
                // Fixed admission ratios from the profile (none: all pass).
                c.set_admission(r.admission_ppm, r.admission_per_flow);
            }
            if r.bbr.is_none() {
                // Rules without BBR (any more) leave nothing of it.
                c.clear_bbr();
            }
        })?;
    }
    // Isolated rules' tables, before the flip: the new slot's rules find
    // theirs from their first packet.
    let own: Vec<OwnTable> = set
        .rules
        .iter()
        .zip(&planned)
        .filter_map(|(r, s)| r.own_table.map(|entries| OwnTable { record: s.record, entries }))
        .collect();
    let installed = match (&mut maps.rule_tables, own.is_empty()) {
        (Some(t), _) => t.prepare(&own)?,
        (None, true) => Vec::new(),
        (None, false) => bail!("this attachment's data plane has no table array for isolated rules (it was loaded by an older flowctl): `flowctl attach --replace` loads one that has"),
    };
    // The flip, on the record as it is now: the agent's heartbeat may have
    // moved during a long write (`write_trie`).
    let hash_seed = g.hash_seed;
    let flip = |maps: &mut Maps| -> Result<()> {
        let mut g = maps.global()?;
        g.hash_seed = hash_seed;
        g.layout_version = LAYOUT_VERSION;
        g.active_slot = slot;
        g.generation += 1;
        g.malformed_verdict = set.settings.malformed_verdict;
        g.fragment_verdict = set.settings.fragment_verdict;
        g.grace_ns = set.settings.grace_ns;
        maps.global.set(0, g, 0)?;
        Ok(())
    };
    let old_records: Vec<u32> = state.rules.iter().map(|r| r.record).collect();
    if let Err(e) = flip(maps) {
        // Not applied: the tables made for records no live rule has go.
        if let Some(t) = &mut maps.rule_tables {
            let unused = installed.into_iter().filter(|r| !old_records.contains(r));
            let _ = t.retire(unused, &[]);
        }
        return Err(e);
    }
    // The old slot's isolated rules lose their tables once nothing reads
    // their slot; a packet that still does is admitted and counted.
    if let Some(t) = &mut maps.rule_tables {
        let candidates = old_records.iter().chain(planned.iter().map(|s| &s.record)).copied();
        t.retire(candidates, &own)?;
    }
    state.rules = planned;
    state.next_state_id = next;
    state.lists = list_states(set);
    Ok(())
}

/// The lists of `set` as `status` shows them.
fn list_states(set: &RuleSet) -> Vec<ListState> {
    set.lists
        .iter()
        .map(|l| ListState {
            name: l.prefixes.name.clone(),
            prefixes: l.prefixes.prefixes.len() as u64,
            file: l.from.as_ref().map(|f| f.display().to_string()),
            rules: set
                .rules
                .iter()
                .filter(
                    |r| matches!(&r.spec.src, Some(Source::List(x)) if x.name == l.prefixes.name),
                )
                .map(|r| r.name.clone())
                .collect(),
        })
        .collect()
}

/// Makes `slot`'s trie entries `entries` (sorted, as `tables::compile`
/// leaves them). Against what this process last wrote there, only the
/// difference is written; otherwise the slot is read back from the
/// kernel and rewritten. Removals go first, so the trie never holds more
/// than the live slot and the new one; the slot is not live, so the order
/// does not matter to packets. Any failure leaves the memo unknown, so
/// the next apply reads the slot back.
fn write_trie(maps: &mut Maps, slot: u8, entries: Vec<tables::TrieEntry>) -> Result<()> {
    let t0 = std::time::Instant::now();
    let key = |e: &tables::TrieEntry| (e.data, e.prefix_len);
    let (removes, writes): (Vec<(u32, TrieData)>, Vec<&tables::TrieEntry>) =
        match maps.trie_written[slot as usize].take() {
            Some(old) if old.is_sorted_by_key(key) && entries.is_sorted_by_key(key) => {
                trie_diff(&old, &entries)
            }
            _ => {
                let mut stale: HashSet<(u32, TrieData)> = HashSet::new();
                for k in maps.trie.keys() {
                    let k = k.context("reading the source trie back")?;
                    if flowctl_common::trie_slot(k.data()[0]) == slot {
                        stale.insert((k.prefix_len(), k.data()));
                    }
                }
                for e in &entries {
                    stale.remove(&(e.prefix_len, e.data));
                }
                (stale.into_iter().collect(), entries.iter().collect())
            }
        };
    let t1 = t0.elapsed();
    for (i, (len, data)) in removes.iter().enumerate() {
        match maps.trie.remove(&Key::new(*len, *data)) {
            Ok(()) => {}
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(anyhow!("removing a stale source trie entry: {e}")),
        }
        keep_alive(maps, i)?;
    }
    let t2 = t0.elapsed();
    for (i, e) in writes.iter().enumerate() {
        maps.trie.insert(&Key::new(e.prefix_len, e.data), e.class, 0).map_err(|err| {
            let enomem = matches!(&err, aya::maps::MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::ENOMEM));
            anyhow!(
                "writing the source trie ({} entries): {err}{}",
                entries.len(),
                if enomem { "; the kernel is out of memory for it (a smaller list, or more memory)" } else { "" }
            )
        })?;
        keep_alive(maps, i)?;
    }
    tracing::debug!(
        diff = ?t1, remove = ?(t2 - t1), write = ?(t0.elapsed() - t2),
        "source trie of slot {slot}: {} entries, {} removed, {} written",
        entries.len(), removes.len(), writes.len()
    );
    maps.trie_written[slot as usize] = Some(entries);
    Ok(())
}

/// What to remove from a slot holding `old` and what to write so that it
/// holds `new` (both sorted by key data and prefix length).
fn trie_diff<'a>(
    old: &[tables::TrieEntry],
    new: &'a [tables::TrieEntry],
) -> (Vec<(u32, TrieData)>, Vec<&'a tables::TrieEntry>) {
    use std::cmp::Ordering;
    let key = |e: &tables::TrieEntry| (e.data, e.prefix_len);
    let (mut removes, mut writes) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        let ord = match (old.get(i), new.get(j)) {
            (Some(o), Some(n)) => key(o).cmp(&key(n)),
            (Some(_), None) => Ordering::Less,
            _ => Ordering::Greater,
        };
        match ord {
            Ordering::Less => {
                removes.push((old[i].prefix_len, old[i].data));
                i += 1;
            }
            Ordering::Greater => {
                writes.push(&new[j]);
                j += 1;
            }
            Ordering::Equal => {
                if old[i].class != new[j].class {
                    writes.push(&new[j]);
                }
                i += 1;
                j += 1;
            }
        }
    }
    (removes, writes)
}

/// During a long trie write by the agent: its heartbeat every 64k
/// entries, so the kernel's adaptive stages do not take it for gone
/// (`GlobalRecord::grace_ns`) while a list of millions is written.
fn keep_alive(maps: &mut Maps, i: usize) -> Result<()> {
    if maps.agent_heartbeat && i % 65_536 == 65_535 {
        super::maps::heartbeat(maps)?;
    }
    Ok(())
}

/// Writes `items` into `slot`'s part of a table that holds `per_slot`
/// entries for each slot.
fn write_slot<V: Pod>(
    map: &mut Array<MapData, V>,
    slot: u32,
    per_slot: usize,
    items: &[V],
) -> Result<()> {
    Ok(super::batch::set_range(map, slot * per_slot as u32, items)?)
}

/// A record new to the rule set starts from zero: its counters, and the
/// debts, statistics and open connections of the rule that used it before
/// (its control record is reset by the caller, through `update_control`).
fn clear_record(maps: &mut Maps, record: u32, stats_buckets: u32, ncpu: usize) -> Result<()> {
    let zeros = PerCpuValues::try_from(vec![RuleCounters::default(); ncpu])?;
    maps.counters.set(record, zeros, 0)?;
    let debts = record * DEBT_SETS_PER_RULE as u32;
    zero(&mut maps.debt, debts..debts + DEBT_SETS_PER_RULE as u32)?;
    for i in 0..stats_buckets {
        let idx = record * stats_buckets + i;
        if maps.stats.get(&idx, 0)?.iter().any(|b| b.epoch != 0) {
            maps.stats.set(idx, PerCpuValues::try_from(vec![StatsBucket::default(); ncpu])?, 0)?;
        }
    }
    let open = record * OPEN_BUCKETS as u32;
    zero(&mut maps.open, open..open + OPEN_BUCKETS as u32)
}

/// Zeroes the entries of `range` that are not zero already (a read is
/// cheaper than a write on a map the kernel is using).
fn zero<V: Pod + Default + PartialEq>(
    map: &mut Array<MapData, V>,
    range: Range<u32>,
) -> Result<()> {
    for i in range {
        if map.get(&i, 0)? != V::default() {
            map.set(i, V::default(), 0)?;
        }
    }
    Ok(())
}

/// The load's hash seed (never 0, which means "not set yet"). It keys the
/// admission stage's flow hash and the debt table's sets and tags, so a
/// sender who could predict it could aim packets: no fallback, an error.
fn random_seed() -> Result<u64> {
    use std::io::Read;
    let mut b = [0u8; 8];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| anyhow!("reading /dev/urandom for the hash seed: {e}; mount /dev (devtmpfs) in the agent's environment"))?;
    Ok(u64::from_ne_bytes(b) | 1)
}
