//! `flowctl check FILE`: validates a profile and says what it costs.

use crate::{
    cli::format::{breaker_text, limit_text},
    profile::{self, host_cpus, human_bytes},
};
use anyhow::Result;
use std::path::Path;

/// Validates `path` and prints what it holds and costs; with `cpus`, also
/// the cost on a host with that many CPUs. False when the profile fits
/// this host but not that one (over its budget there).
pub fn check(path: &Path, cpus: Option<u64>) -> Result<bool> {
    let set = profile::load(path)?;
    out!("{}: ok, {} rules, {} breakers", path.display(), set.rules.len(), set.breakers.len());
    let s = &set.settings;
    let here = host_cpus();
    let mut fits = true;
    if !set.rules.is_empty() {
        out!(
            "kernel memory: {} preallocated on this host's {here} CPUs (budget {}; key table {} entries, source cache {} entries)",
            human_bytes(s.kernel_memory_bytes_on(here)),
            human_bytes(s.memory_budget),
            s.key_table_entries,
            s.source_cache_entries
        );
        out!(
            "  {} of it per CPU (counters and statistics rings: {} buckets x {} rule records, for max_rules {})",
            human_bytes(s.kernel_memory_bytes_on(here + 1) - s.kernel_memory_bytes_on(here)),
            s.stats.buckets,
            s.stats.records(),
            s.stats.max_rules
        );
        if let Some(n) = cpus {
            let need = s.kernel_memory_bytes_on(n);
            fits = need <= s.memory_budget;
            out!(
                "on {n} CPUs: {} preallocated, {}",
                human_bytes(need),
                if fits {
                    format!("within the budget of {}", human_bytes(s.memory_budget))
                } else {
                    format!(
                        "over the budget of {}: refused there (raise settings.memory_budget, or lower max_rules, statistics_buckets or the table sizes)",
                        human_bytes(s.memory_budget)
                    )
                }
            );
        }
    }
    for r in &set.rules {
        out!("  {:<20} {:<40} {}", r.name, r.match_text(), limit_text(r));
        if let Some(entries) = r.own_table {
            out!(
                "  {:<20} isolated: its own table of {entries} keys, {} (in the memory above)",
                "",
                human_bytes(profile::own_table_bytes(entries))
            );
        }
    }
    for l in &set.lists {
        let n = l.prefixes.prefixes.len() as u64;
        out!(
            "  list {:<15} {n} prefixes from {} (up to {} of trie)",
            l.prefixes.name,
            l.file.as_ref().map_or("the profile".to_string(), |f| f.display().to_string()),
            human_bytes(profile::list_trie_bytes(n))
        );
    }
    for b in &set.breakers {
        out!("  breaker {:<12} {:<40} {}", b.name, b.target.to_string(), breaker_text(b));
    }
    flood_defence(&set)?;
    for advice in set.rules.iter().filter_map(|r| r.advice()) {
        out!("note: {advice}");
    }
    Ok(fits)
}

/// What the flood sketches hold for each rule that can be lent one
/// (agent/flood.rs; docs/design.md, "The flood sketch").
fn flood_defence(set: &profile::RuleSet) -> Result<()> {
    use crate::agent::flood;
    use flowctl_common::sketch::{SKETCH_CELLS, SKETCH_POOL};
    let eligible: Vec<_> = set.rules.iter().filter(|r| flood::eligible(r)).collect();
    if eligible.is_empty() {
        return Ok(());
    }
    let s = &set.settings;
    out!(
        "flood sketches: {SKETCH_POOL} of {} (in the memory above), lent to a rule that creates buckets faster than its tables turn over in {} s, while its flood stays under what a sketch holds (at most {}% of new keys' first packets refused):",
        human_bytes(SKETCH_CELLS as u64 * 8),
        flood::TURNOVER.as_secs(),
        flood::FALSE_REFUSAL_TARGET * 100.0
    );
    for r in eligible {
        out!(
            "  {:<20} over {:.0} new keys/s, up to {:.0} packets/s from keys without a bucket",
            r.name,
            flood::threshold_of(r, s.key_table_entries, s.source_cache_entries),
            flood::capacity(r)
        );
    }
    if s.flood_watch {
        out!(
            "  flood_watch: a strong flood is looked for every {} ms (while those reads copy at most {:.0} MB/s)",
            flood::WATCH_PERIOD.as_millis(),
            flood::READ_BUDGET / 1e6
        );
    }
    Ok(())
}
