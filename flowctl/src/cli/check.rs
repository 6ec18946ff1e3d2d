//! `flowctl check FILE`: validates a profile and says what it costs.

use crate::{
    cli::format::{breaker_text, limit_text},
    profile::{self, human_bytes},
};
use anyhow::Result;
use std::path::Path;

pub fn check(path: &Path) -> Result<()> {
    let set = profile::load(path)?;
    out!("{}: ok, {} rules, {} breakers", path.display(), set.rules.len(), set.breakers.len());
    if !set.rules.is_empty() {
        out!(
        "kernel memory: {} preallocated (budget {}; key table {} entries, source cache {} entries)",
        human_bytes(set.settings.kernel_memory_bytes()),
        human_bytes(set.settings.memory_budget),
        set.settings.key_table_entries,
        set.settings.source_cache_entries
        );
    }
    for r in &set.rules {
        out!("  {:<20} {:<40} {}", r.name, r.match_text(), limit_text(r));
    }
    for b in &set.breakers {
        out!("  breaker {:<12} {:<40} {}", b.name, b.target.to_string(), breaker_text(b));
    }
    for advice in set.rules.iter().filter_map(|r| r.advice()) {
        out!("note: {advice}");
    }
    Ok(())
}
