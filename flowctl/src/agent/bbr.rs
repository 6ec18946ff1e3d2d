//! The agent's BBR loop: every statistics bucket (100 ms by default) it
//! reads each BBR rule's window from the kernel's rings, evaluates the pure
//! decision (`flowctl_common::bbr`) and writes the result into the rule's
//! control record (`Maps::update_control`, `ControlEdit::set_bbr`), where
//! the XDP program applies it to each SYN.
//!
//! What the kernel measures (docs/design.md, "BBR at L4"): an arrival is the
//! first admitted SYN of a tuple; a connection is in flight from the
//! client's handshake-completing ACK until FIN/RST, or for at most the
//! rule's idle timeout after it (the open ring stops counting it then);
//! a completion is a FIN/RST of an established connection, and its round
//! trip is the connection's lifetime from the SYN. `maxPass` counts
//! completions per bucket, so connections that only time out add nothing
//! to it (they have no round trip either).
//!
//! The in-flight count the kernel compares is the one summed here, so it
//! lags by at most one tick; the kernel refuses SYNs only while this loop
//! says the rule is overloaded, and not at all when the agent's heartbeat is
//! older than the grace period.

use crate::{
    dataplane::{state::AttachState, Maps},
    profile::RuleSet,
};
use anyhow::Result;
use flowctl_common::{
    bbr::{self, BbrBucket, BbrState},
    reason, stats, BbrControl, NO_CPU_SIGNAL,
};
use std::collections::{BTreeMap, HashMap};

/// One rule's loop state.
#[derive(Default)]
struct RuleLoop {
    record: u32,
    /// Complete buckets already read (complete buckets no longer change).
    buckets: BTreeMap<u64, BbrBucket>,
    state: BbrState,
    /// BBR drops counted by the kernel at the last tick.
    drops_seen: u64,
    /// The last tick at which the limiter was engaged (CPU over the
    /// threshold, or the test on); 0: never. A bucket that started before
    /// it is labelled loaded when it is read (`bucket_loaded`).
    engaged_at_ns: u64,
}

/// Whether the complete bucket `epoch` (of `bucket_ns`) counts as measured
/// under load: the limiter was engaged at a tick at or after its start.
/// Conservative at the edge: engagement right after the bucket ended labels
/// it too, and a loaded label only keeps the bucket out of the min-filter's
/// refresh (`bbr::filtered_min_rt_ms`).
fn bucket_loaded(engaged_at_ns: u64, epoch: u64, bucket_ns: u64) -> bool {
    engaged_at_ns != 0 && engaged_at_ns >= epoch.saturating_mul(bucket_ns)
}

#[derive(Default)]
pub struct BbrLoop {
    rules: HashMap<String, RuleLoop>,
}

impl BbrLoop {
    /// Evaluates every BBR rule of `set` at `now_ns` with CPU signal `cpu`
    /// (per-mille; `NO_CPU_SIGNAL` reads as idle) and writes the control
    /// records.
    pub fn tick(
        &mut self,
        maps: &mut Maps,
        state: &AttachState,
        set: &RuleSet,
        cpu: u32,
        now_ns: u64,
    ) -> Result<()> {
        let cpu = if cpu == NO_CPU_SIGNAL { 0 } else { cpu };
        let shape = state.stats;
        self.rules.retain(|name, _| set.rules.iter().any(|r| &r.name == name && r.bbr.is_some()));
        for (rule, rs) in set.rules.iter().zip(&state.rules) {
            let Some(b) = &rule.bbr else { continue };
            let cfg = b.config();
            let l = self.rules.entry(rule.name.clone()).or_default();
            if l.record != rs.record {
                *l = RuleLoop { record: rs.record, ..Default::default() };
                l.drops_seen = maps.counters(rs.record)?.dropped_pkts[reason::BBR];
            }
            let over = bbr::cpu_over(&mut l.state, &cfg, cpu);
            if over || bbr::active(&l.state, &cfg, cpu, now_ns) {
                l.engaged_at_ns = now_ns;
            }
            // The window: the buckets before the one being filled.
            let epochs = stats::complete_span(
                now_ns,
                shape.bucket_ns,
                shape.buckets,
                b.buckets.saturating_sub(1),
            );
            l.buckets.retain(|e, _| epochs.contains(e));
            for e in epochs.clone() {
                if let std::collections::btree_map::Entry::Vacant(slot) = l.buckets.entry(e) {
                    let s = maps.stats_epochs(rs.record, &shape, e..e + 1)?;
                    slot.insert(BbrBucket {
                        completed: s.completed,
                        rt_sum_us: s.rt_sum_us,
                        rt_count: s.rt_count,
                        loaded: bucket_loaded(l.engaged_at_ns, e, shape.bucket_ns),
                    });
                }
            }
            let window: Vec<BbrBucket> = l.buckets.values().copied().collect();
            let min_rt = bbr::filtered_min_rt_ms(&window, &mut l.state, &cfg);
            let max_pass = bbr::max_pass(&window);
            let max = bbr::in_flight_limit(max_pass, min_rt, &cfg);
            let in_flight = maps.in_flight(rs.record, b.idle_timeout_ns, now_ns)?;
            // The kernel drops; the cool-down is anchored at drops made while
            // the CPU is over threshold (`bbr::should_drop`'s rule).
            let drops = maps.counters(rs.record)?.dropped_pkts[reason::BBR];
            if drops > l.drops_seen
                && over
                && (l.state.drop_anchor_ns == 0 || !cfg.compat.cooldown_from_first_drop)
            {
                l.state.drop_anchor_ns = now_ns;
            }
            l.drops_seen = drops;
            if !bbr::active(&l.state, &cfg, cpu, now_ns) {
                l.state.drop_anchor_ns = 0;
            }
            let view = BbrControl {
                max_pass,
                min_rt_ms: min_rt.unwrap_or(0),
                max_in_flight: max,
                in_flight,
                overloaded: bbr::active(&l.state, &cfg, cpu, now_ns),
            };
            tracing::debug!(rule = %rule.name, cpu, drops, anchor = l.state.drop_anchor_ns, ?view, "bbr tick");
            maps.update_control(rs.record, now_ns, |c| c.set_bbr(&view))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::bucket_loaded;

    #[test]
    fn a_bucket_is_loaded_when_the_limiter_was_engaged_since_its_start() {
        const W: u64 = 100_000_000;
        assert!(!bucket_loaded(0, 5, W), "never engaged");
        assert!(!bucket_loaded(5 * W - 1, 5, W), "engaged before the bucket only");
        assert!(bucket_loaded(5 * W, 5, W));
        assert!(bucket_loaded(6 * W + 1, 5, W), "engaged at the tick that reads it");
    }
}
