//! The one user-space write path to the rule records' control records
//! (`FLOWCTL_CONTROL`, read by the XDP program's admission and BBR stages).
//! Its writers: `apply` (fixed admission ratios, clearing BBR from rules
//! without it, resetting records new to a rule set), KLimiter's control
//! step (agent/klimiter.rs: its ratios) and BBR's tick (agent/bbr.rs: its
//! decision). What a change means is `flowctl_common::ControlEdit`'s; the
//! version and the stamp are `ControlRecord::update`'s.

use super::maps::Maps;
use anyhow::{Context, Result};
use flowctl_common::ControlEdit;

impl Maps {
    /// Reads record `record`'s control record, applies `edit` to it
    /// (`ControlRecord::update`: the version bumped and `updated_ns` set to
    /// `now_ns` when anything changed) and writes it back only then.
    /// Returns whether it changed.
    ///
    /// A read, then a write: a count the kernel adds to `bbr_admitted` in
    /// between is overwritten. Only BBR's tick, which restarts that count,
    /// writes often; the other writers write when a ratio moves.
    pub fn update_control(
        &mut self,
        record: u32,
        now_ns: u64,
        edit: impl FnOnce(&mut ControlEdit<'_>),
    ) -> Result<bool> {
        let mut c = self
            .control
            .get(&record, 0)
            .with_context(|| format!("reading control record {record}"))?;
        let changed = c.update(now_ns, edit);
        if changed {
            self.control
                .set(record, c, 0)
                .with_context(|| format!("writing control record {record}"))?;
        }
        Ok(changed)
    }
}
