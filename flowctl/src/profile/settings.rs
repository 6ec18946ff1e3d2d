//! The `[settings]` section: verdicts, table sizes, the memory budget, the
//! agent's grace period, the statistics rings and the CPU signal's source.
//! What is not written keeps its default ([`Settings::default`]).

use super::{
    error::{Ctx, ProfileError, Span},
    model::Settings,
    primitives::{duration, keyword},
    raw::RawSettings,
};
use crate::controllers::cpu::CpuSource;
use flowctl_common::{
    rate::{parse_amount, Dimension},
    stats, MAX_RULES, MAX_STATS_BUCKETS, XDP_DROP, XDP_PASS,
};
use toml::Spanned;

/// Validates `[settings]`.
pub fn settings(cx: &Ctx, s: &RawSettings) -> Result<Settings, ProfileError> {
    let mut out = Settings::default();
    if let Some(v) = &s.malformed {
        out.malformed_verdict = verdict(cx, v)?;
    }
    if let Some(v) = &s.fragments {
        out.fragment_verdict = verdict(cx, v)?;
    }
    for (raw, size) in [
        (&s.key_table_entries, &mut out.key_table_entries),
        (&s.source_cache_entries, &mut out.source_cache_entries),
        (&s.quota_table_entries, &mut out.quota_table_entries),
        (&s.connection_table_entries, &mut out.connection_table_entries),
        (&s.global_key_entries, &mut out.global_key_entries),
    ] {
        if let Some(v) = raw {
            *size = table_size(cx, v)?;
        }
    }
    if let Some(v) = &s.memory_budget {
        out.memory_budget = match parse_amount(v.get_ref()) {
            Ok((n, Dimension::Bytes)) => n,
            Ok(_) => {
                return Err(cx.err(v.span(), "memory_budget needs a byte unit, e.g. \"512MiB\""))
            }
            Err(e) => return Err(cx.err(v.span(), format!("bad memory_budget: {e}"))),
        };
    }
    if let Some(v) = &s.grace_period {
        out.grace_ns = duration(cx, v, "grace_period")?;
    }
    if let Some(v) = &s.statistics {
        out.stats.level = keyword(
            cx,
            v,
            "statistics level",
            &[("full", stats::level::FULL), ("control", stats::level::CONTROL)],
            "use \"full\" or \"control\" (only what the control loops read)",
        )?;
    }
    if let Some(v) = &s.flood_watch {
        out.flood_watch = *v.get_ref();
    }
    if let Some(v) = &s.cpu {
        out.cpu_source = CpuSource::parse(v.get_ref()).map_err(|e| cx.err(v.span(), e))?;
    }
    if let Some(v) = &s.statistics_bucket {
        let ns = duration(cx, v, "statistics_bucket")?;
        if !(10_000_000..=10_000_000_000).contains(&ns) {
            return Err(cx.err(v.span(), "statistics_bucket must be between 10ms and 10s"));
        }
        out.stats.bucket_ns = ns;
    }
    if let Some(v) = &s.statistics_buckets {
        let n = *v.get_ref();
        if !(10..=MAX_STATS_BUCKETS as i64).contains(&n) {
            return Err(cx.err(
                v.span(),
                format!("statistics_buckets {n} out of range: 10 to {MAX_STATS_BUCKETS}"),
            ));
        }
        out.stats.buckets = n as u32;
    }
    if let Some(v) = &s.max_rules {
        let n = *v.get_ref();
        if !(1..=MAX_RULES as i64).contains(&n) {
            return Err(cx.err(v.span(), format!("max_rules {n} out of range: 1 to {MAX_RULES}")));
        }
        out.stats.max_rules = n as u32;
    }
    Ok(out)
}

/// Where a memory-budget error points: the table size that drives it, else
/// the budget, else the `[settings]` table (else, with no `[settings]`, the
/// top of the file).
pub fn budget_span(s: &Spanned<RawSettings>) -> Span {
    let inner = s.get_ref();
    inner
        .key_table_entries
        .as_ref()
        .map(|v| v.span())
        .or_else(|| inner.source_cache_entries.as_ref().map(|v| v.span()))
        .or_else(|| inner.memory_budget.as_ref().map(|v| v.span()))
        .unwrap_or(s.span())
}

fn verdict(cx: &Ctx, v: &Spanned<String>) -> Result<u32, ProfileError> {
    keyword(cx, v, "verdict", &[("pass", XDP_PASS), ("drop", XDP_DROP)], "use \"pass\" or \"drop\"")
}

fn table_size(cx: &Ctx, v: &Spanned<i64>) -> Result<u32, ProfileError> {
    let n = *v.get_ref();
    if !(1024..=(1 << 26)).contains(&n) {
        return Err(cx.err(v.span(), format!("table size {n} out of range: 1024 to {}", 1 << 26)));
    }
    Ok(n as u32)
}
