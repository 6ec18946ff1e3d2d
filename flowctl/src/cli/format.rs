//! Text for people, in one place: rates, limits, breakers, counters; used
//! by `check`, `status`, `top` and `explain` alike.

use crate::{
    agent::{
        breakers::{Published, PublishedBreaker},
        syn_totals::RecordSyns,
    },
    profile,
};
use flowctl_common::{reason, RuleCounters};

/// Human rates: 1234567 -> "1.23M".
pub fn si(v: f64) -> String {
    let (v, unit) = if v >= 1e9 {
        (v / 1e9, "G")
    } else if v >= 1e6 {
        (v / 1e6, "M")
    } else if v >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    if unit.is_empty() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}{unit}")
    }
}

pub fn limit_text(r: &profile::Rule) -> String {
    if r.action == flowctl_common::action::PASS {
        return "pass (exempt)".into();
    }
    if r.block {
        return "block (every packet dropped)".into();
    }
    let mut parts = Vec::new();
    if r.interval_fp != 0 {
        parts.push(format!("{} {} burst {}", r.rate_text, r.unit_name(), r.burst));
    }
    if let Some(q) = r.quota_text() {
        parts.push(format!("quota {q}"));
    }
    let scope = match &r.global {
        None => String::new(),
        Some(g) => format!(
            ", fleet-wide (before a lease: {})",
            g.share.as_ref().map(|s| s.text.as_str()).unwrap_or("nothing")
        ),
    };
    let nested: String = r
        .limits
        .iter()
        .map(|l| format!(", and {} burst {} per {}", l.rate_text, l.burst, l.key_name()))
        .collect();
    format!(
        "{} per {}{nested}{scope}{}{}",
        parts.join(", "),
        r.key_name(),
        if r.book_retransmits { ", refused SYNs book their retransmission" } else { "" },
        if r.action == flowctl_common::action::DRY_RUN { " (dry-run)" } else { "" }
    )
}

pub fn breaker_text(b: &profile::breaker::Breaker) -> String {
    use crate::profile::breaker::BreakerMode;
    let mode = match &b.mode {
        BreakerMode::Sre { k_milli, min_requests, max_drop_ppm } => {
            format!(
                "sre K={} min {min_requests} cap {}",
                *k_milli as f64 / 1000.0,
                *max_drop_ppm as f64 / 1e6
            )
        }
        BreakerMode::State(c) => format!(
            "state failure>{} min {} sleep {}s probes {}",
            c.failure_ppm as f64 / 1e6,
            c.min_requests,
            c.sleep_ns as f64 / 1e9,
            c.probes
        ),
    };
    format!(
        "{mode}, window {}s/{}, {}{}{}",
        b.window_ns as f64 / 1e9,
        b.buckets,
        profile::breaker::errno_name(b.errno),
        b.cgroup.as_ref().map(|c| format!(", cgroup {c}")).unwrap_or_default(),
        if b.dry_run { " (dry-run)" } else { "" }
    )
}

/// A breaker's state, with its probes while half-open.
pub fn breaker_state_text(b: &PublishedBreaker) -> String {
    match &b.probes {
        Some(p) => format!("{} {}/{}", b.state, p.succeeded, p.allowed),
        None => b.state.clone(),
    }
}

/// The last transition: how long ago, to what, why.
pub fn transition_text(b: &PublishedBreaker) -> String {
    let Some(t) = &b.last_transition else { return "-".into() };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    format!("{:.1}s ago -> {} ({})", now.saturating_sub(t.unix_ms) as f64 / 1e3, t.to, t.reason)
}

/// One text line per breaker (`top --once`, `status`).
pub fn breaker_lines(c: &Published) -> Vec<String> {
    let mut out = vec![format!(
        "{:<14} {:<24} {:<6} {:<14} {:>6} {:>9} {:>8} {:>8} {:>8} {:>6}  {}",
        "breaker",
        "target",
        "mode",
        "state",
        "drop p",
        "requests",
        "accepts",
        "failed",
        "local",
        "window",
        "last change"
    )];
    for b in &c.breakers {
        out.push(format!(
            "{:<14} {:<24} {:<6} {:<14} {:>6.2} {:>9} {:>8} {:>8} {:>8} {:>5}s  {}",
            b.name,
            b.target,
            b.mode,
            breaker_state_text(b),
            b.drop_probability,
            b.window.outcomes.requests,
            b.window.outcomes.accepts,
            b.window.outcomes.failures(),
            b.window.outcomes.refused_locally + b.window.outcomes.would_refuse,
            b.window.seconds,
            transition_text(b)
        ));
    }
    out
}

pub fn counters_json(name: &str, c: &RuleCounters) -> serde_json::Value {
    let mut by_reason = serde_json::Map::new();
    for (i, n) in reason::NAMES.iter().enumerate() {
        if c.dropped_pkts[i] > 0 {
            by_reason.insert(n.to_string(), c.dropped_pkts[i].into());
        }
    }
    serde_json::json!({
        "rule": name,
        "offered_pkts": c.offered_pkts, "offered_bytes": c.offered_bytes,
        "passed_pkts": c.passed_pkts, "passed_bytes": c.passed_bytes,
        "dropped_pkts": c.dropped_total(), "dropped_by_reason": by_reason,
        "would_drop_pkts": c.would_drop_pkts,
        "insert_failures": c.insert_failures, "key_inserts": c.key_inserts,
        "non_ip_pkts": c.non_ip_pkts, "malformed_pkts": c.malformed_pkts, "fragment_pkts": c.fragment_pkts,
        "unparsed_pkts": c.unparsed_pkts,
        "booked_syns": c.booked_syns, "redeemed_syns": c.redeemed_syns,
        "source_claims": c.source_claims, "sketched_pkts": c.sketched_pkts,
        "limit_refusals": c.limit_refusals,
    })
}

/// A counter record's SYNs since attach into its `status --json` entry:
/// `syn_seen`, `syn_passed`, `syn_dropped` (0 when not counted).
pub fn syn_json(entry: &mut serde_json::Value, syns: Option<&RecordSyns>) {
    let s = syns.cloned().unwrap_or_default();
    if let Some(o) = entry.as_object_mut() {
        o.insert("syn_seen".into(), s.seen.into());
        o.insert("syn_passed".into(), s.passed.into());
        o.insert("syn_dropped".into(), s.dropped().into());
    }
}

/// `status`'s table of counters since attach, one line per entry of
/// `status --json`'s `rules` (and `unmatched`): packets, then SYNs (new
/// TCP connections: what `unit = "connections"` rules limit).
pub fn counter_table(rows: &[&serde_json::Value]) -> Vec<String> {
    let line = |cells: [&str; 8]| {
        format!(
            "{:<20} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
            cells[0], cells[1], cells[2], cells[3], cells[4], cells[5], cells[6], cells[7]
        )
    };
    let mut out = vec![line([
        "rule",
        "offered",
        "passed",
        "dropped",
        "would-drop",
        "SYNs",
        "SYNs passed",
        "SYNs dropped",
    ])];
    for r in rows {
        let n = |k: &str| r[k].as_u64().unwrap_or(0).to_string();
        let cells = [
            n("offered_pkts"),
            n("passed_pkts"),
            n("dropped_pkts"),
            n("would_drop_pkts"),
            n("syn_seen"),
            n("syn_passed"),
            n("syn_dropped"),
        ];
        let name = r["rule"].as_str().unwrap_or("");
        out.push(
            line([
                name, &cells[0], &cells[1], &cells[2], &cells[3], &cells[4], &cells[5], &cells[6],
            ])
            .trim_end()
            .to_string(),
        );
    }
    out[0] = out[0].trim_end().to_string();
    out
}

/// The attachment's SYN totals (`status --json`'s `syn_totals`) as a line,
/// with the seconds the rings lost while no agent counted.
pub fn syn_line(t: &serde_json::Value) -> Option<String> {
    let n = |k: &str| t[k].as_u64();
    let (seen, passed, dropped) = (n("seen")?, n("passed")?, n("dropped")?);
    let lost = t["uncounted_s"].as_f64().unwrap_or(0.0);
    Some(format!(
        "SYNs since attach (new TCP connections, every rule): {seen} seen, {passed} passed, {dropped} dropped{}",
        if lost > 0.0 {
            format!(" ({lost:.1} s not counted: no agent read the statistics ring then)")
        } else {
            String::new()
        }
    ))
}

/// A one-line sparkline of `points` scaled to `max` (their own largest
/// when `None`), for titles and table cells where a widget cannot go:
/// `▁` is zero, `▂` to `█` above zero (any traffic shows), `·` a second
/// nobody saw. One character per point, so `points.len()` wide.
pub fn spark_text(points: &[Option<f64>], max: Option<f64>) -> String {
    use ratatui::symbols::bar;
    const ABOVE_ZERO: [&str; 7] = [
        bar::ONE_QUARTER,
        bar::THREE_EIGHTHS,
        bar::HALF,
        bar::FIVE_EIGHTHS,
        bar::THREE_QUARTERS,
        bar::SEVEN_EIGHTHS,
        bar::FULL,
    ];
    let max = max.unwrap_or_else(|| points.iter().flatten().copied().fold(0.0, f64::max));
    points
        .iter()
        .map(|p| match *p {
            None => "·",
            Some(v) if v <= 0.0 || max <= 0.0 => bar::ONE_EIGHTH,
            Some(v) => {
                let step = ((v / max).min(1.0) * ABOVE_ZERO.len() as f64).ceil() as usize;
                ABOVE_ZERO[step.clamp(1, ABOVE_ZERO.len()) - 1]
            }
        })
        .collect()
}

/// The lease store of the global rules in a few words (`top`'s title and
/// detail view).
pub fn store_text(s: &crate::agent::leases::PublishedStore) -> String {
    format!(
        "store {}{}{}",
        if s.up { "ok" } else { "down" },
        s.rtt_ms.map(|ms| format!(" {ms:.1}ms")).unwrap_or_default(),
        s.hosts.map(|n| format!(" {n} hosts")).unwrap_or_default()
    )
}

/// The default shares of the live hosts against the rule's limit: the
/// extra term of the bound (docs/design.md), with a warning once the
/// fleet has grown to where the allowances alone are the whole limit.
fn default_allowance_line(
    r: &crate::agent::leases::PublishedRule,
    hosts: Option<u64>,
) -> Option<String> {
    let share = r.default_share?;
    let (Some(n), Some(ratio)) = (hosts, r.default_allowance) else {
        return Some(format!("    default share {share}/s per host before a key's lease"));
    };
    let warn = if ratio >= 1.0 {
        " WARNING: the allowances alone reach the limit; lower default_share or set it to \"none\""
    } else {
        ""
    };
    Some(format!(
        "    default share {share}/s per host before a key's lease: {n} hosts x {share}/s = {}/s, {:.0}% of the limit{warn}",
        n.saturating_mul(share),
        ratio * 100.0
    ))
}

/// What `status` says of the global rules' leases: the store, then per
/// rule the keys this host holds leases for.
pub fn lease_lines(p: &crate::agent::leases::Published) -> Vec<String> {
    let s = &p.store;
    let mut v = vec![format!(
        "global rules: store {} {}{}{}",
        s.url,
        s.health,
        s.rtt_ms.map(|ms| format!(", rtt {ms:.1} ms")).unwrap_or_default(),
        s.hosts.map(|n| format!(", {n} hosts")).unwrap_or_default()
    )];
    for r in &p.rules {
        let quota = match (r.quota, r.quota_window_ms) {
            (Some(q), Some(ms)) => format!(" quota {q} per {ms} ms"),
            _ => String::new(),
        };
        v.push(format!(
            "  {}: {}/s burst {}{quota} fleet-wide; {} keys leased here",
            r.rule,
            r.rate,
            r.burst,
            r.leases.iter().filter(|k| k.rate.is_some()).count()
        ));
        if let Some(line) = default_allowance_line(r, s.hosts) {
            v.push(line);
        }
        for k in r.leases.iter().take(10) {
            let quota = match (k.quota, k.quota_used) {
                (Some(q), Some(u)) => format!(" quota {q} ({u} spent)"),
                (None, Some(u)) => format!(" ({u} of the quota spent)"),
                _ => String::new(),
            };
            v.push(format!(
                "    {}: {}{quota} (demand {}, fair share {}/s{})",
                k.key,
                match (k.rate, k.burst) {
                    (Some(r), Some(b)) => format!("{r}/s burst {b}"),
                    _ => "asked, not granted yet".into(),
                },
                k.demand.map(|d| format!("{d}/s")).unwrap_or_else(|| "not measured yet".into()),
                k.target,
                k.expires_in_ms
                    .map(|ms| format!(", {:.1} s left", ms as f64 / 1e3))
                    .unwrap_or_default()
            ));
        }
        if r.leases.len() > 10 {
            v.push(format!(
                "    ... and {} more (status --json lists them all)",
                r.leases.len() - 10
            ));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_weighs_the_default_allowances_against_the_limit() {
        use crate::agent::leases::PublishedRule;
        let rule = |share: Option<u64>, ratio: Option<f64>| PublishedRule {
            rule: "api".into(),
            rate: 1000,
            burst: 100,
            quota: None,
            quota_window_ms: None,
            default_share: share,
            default_allowance: ratio,
            leases: Vec::new(),
        };
        assert_eq!(default_allowance_line(&rule(None, Some(0.0)), Some(3)), None);
        let few = default_allowance_line(&rule(Some(10), Some(0.03)), Some(3)).unwrap();
        assert!(few.ends_with("3 hosts x 10/s = 30/s, 3% of the limit"), "{few}");
        let many = default_allowance_line(&rule(Some(10), Some(1.2)), Some(120)).unwrap();
        assert!(many.contains("1200/s, 120% of the limit WARNING"), "{many}");
        let uncounted = default_allowance_line(&rule(Some(10), None), None).unwrap();
        assert!(uncounted.ends_with("10/s per host before a key's lease"), "{uncounted}");
    }

    #[test]
    fn spark_text_marks_zero_traffic_and_gaps_apart() {
        let s = spark_text(&[None, Some(0.0), Some(1.0), Some(50.0), Some(100.0)], None);
        assert_eq!(s, "·▁▂▅█");
        // A fixed scale: 50 of 1000 is low but not zero.
        assert_eq!(spark_text(&[Some(50.0), Some(1000.0), Some(2000.0)], Some(1000.0)), "▂██");
        assert_eq!(spark_text(&[Some(0.0), Some(0.0)], None), "▁▁");
    }

    #[test]
    fn status_shows_syns_since_attach_next_to_the_packets() {
        let mut conn = counters_json(
            "new-https-connections",
            &RuleCounters { offered_pkts: 130, passed_pkts: 100, ..Default::default() },
        );
        let syns = RecordSyns { seen: 42, passed: 30, ..Default::default() };
        syn_json(&mut conn, Some(&syns));
        assert_eq!((conn["syn_seen"].clone(), conn["syn_dropped"].clone()), (42.into(), 12.into()));
        let mut quiet = counters_json("unmatched", &RuleCounters::default());
        syn_json(&mut quiet, None);
        assert_eq!(quiet["syn_seen"], 0);
        let t = counter_table(&[&conn, &quiet]);
        assert_eq!(
            t[0],
            "rule                      offered       passed      dropped   would-drop         SYNs  SYNs passed SYNs dropped"
        );
        let cells: Vec<&str> = t[1].split_whitespace().collect();
        assert_eq!(cells, ["new-https-connections", "130", "100", "0", "0", "42", "30", "12"]);
        assert!(t.iter().all(|l| l == l.trim_end()));
        let j = serde_json::json!({"seen": 42, "passed": 30, "dropped": 12, "uncounted_s": 0.0});
        assert_eq!(
            syn_line(&j).unwrap(),
            "SYNs since attach (new TCP connections, every rule): 42 seen, 30 passed, 12 dropped"
        );
        let lost = serde_json::json!({"seen": 1, "passed": 1, "dropped": 0, "uncounted_s": 12.5});
        assert!(syn_line(&lost)
            .unwrap()
            .ends_with("(12.5 s not counted: no agent read the statistics ring then)"));
        assert_eq!(syn_line(&serde_json::Value::Null), None);
    }
}
