//! Which columns of the rule table fit a width, pure and tested apart from
//! the drawing: every column has a priority, a header that names its unit
//! and a legend line. A column is shown at its full width (the widest of
//! its header and its cells) or not at all, so no header or number is ever
//! cut; numbers shrink by unit (`si`) before they are formatted. The shown
//! columns are always the first ones by priority (a prefix), drawn in
//! display order. Only the rule name may be shortened (with `…`), when even
//! it alone does not fit.

use super::{history::RuleHistory, state::RuleRow};
use crate::{
    agent::klimiter::PublishedStep,
    cli::format::{si, spark_text},
};

/// Seconds of drops the rule table's sparkline column shows.
pub const DROPS_POINTS: usize = 20;

/// Spaces between two columns (the view and `--once` alike).
pub const SPACING: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

#[derive(Clone, Copy, Debug)]
pub struct Column {
    pub header: &'static str,
    /// 0 first; columns are shown in this order while they fit.
    pub priority: u8,
    pub align: Align,
    /// A number (parses, with an optional k/M/G unit) or text.
    pub numeric: bool,
    pub legend: &'static str,
}

const fn col(header: &'static str, priority: u8, numeric: bool, legend: &'static str) -> Column {
    Column {
        header,
        priority,
        align: if numeric { Align::Right } else { Align::Left },
        numeric,
        legend,
    }
}

/// The rule table's columns, in display order.
pub const RULE_COLUMNS: &[Column] = &[
    col("rule", 0, false, "the rule's name in the profile"),
    col("match", 9, false, "what the rule matches (protocol, source, port)"),
    col("key", 10, false, "what buckets are kept per (src, src_prefix, dport, ...)"),
    col("limit", 11, false, "rate, burst and quota per key, or pass (exempt)"),
    col("offered pps", 1, true, "packets/s matched by the rule over the interval"),
    col("offered bit/s", 13, true, "bits/s matched by the rule over the interval"),
    col("passed pps", 4, true, "packets/s let through over the interval"),
    col("passed bit/s", 14, true, "bits/s let through over the interval"),
    col("dropped pps", 2, true, "packets/s dropped over the interval (every reason)"),
    col("would-drop pps", 5, true, "packets/s a dry-run limit would drop (they pass)"),
    col("drop %", 3, true, "dropped / offered over the interval, 0 to 100"),
    col("offered pkts", 7, true, "packets matched since attach"),
    col("dropped pkts", 8, true, "packets dropped since attach"),
    col("ratio", 15, true, "admission ratio set by the agent (1: all admitted)"),
    col("SYN/s", 16, true, "TCP SYNs (no ACK) offered per second, last second"),
    col("BBR in/max", 17, false, "BBR: in flight / its limit (- no data), ! overloaded"),
    col("KLimiter", 18, false, "why KLimiter last changed the ratio (- not an entry)"),
    col("top reason", 6, false, "the reason of most drops over the interval (rate, ...)"),
    col("drops 20 s", 12, false, "dropped pps, a mark per second, newest right (▁ 0, · unseen)"),
];

/// The breakers table's columns, in display order.
pub const BREAKER_COLUMNS: &[Column] = &[
    col("breaker", 0, false, "the breaker's name in the profile"),
    col("target", 4, false, "the addresses and port it guards"),
    col("mode", 6, false, "sre or state; dry: a dry-run (counts, refuses nothing)"),
    col("state", 1, false, "closed, throttling, open or half-open (probes ok/allowed)"),
    col("drop p", 2, true, "probability a new connect is refused locally, 0 to 1"),
    col("window s", 7, true, "seconds of the outcome window the counts cover"),
    col("requests", 3, true, "connects that reached the peer in the window"),
    col("accepts", 5, true, "connects the peer accepted in the window"),
    col("refused", 8, true, "connects the peer refused in the window"),
    col("timeouts", 9, true, "connects that timed out in the window"),
    col("local", 10, true, "connects refused locally (or would be, dry-run), window"),
    col("last change", 11, false, "when, to what and why the state last changed"),
];

/// One breaker's cells, in the order of [`BREAKER_COLUMNS`].
pub fn breaker_cells(b: &crate::agent::breakers::PublishedBreaker) -> Vec<String> {
    use crate::cli::format::{breaker_state_text, transition_text};
    let o = &b.window.outcomes;
    vec![
        b.name.clone(),
        b.target.clone(),
        format!("{}{}", b.mode, if b.dry_run { " dry" } else { "" }),
        breaker_state_text(b),
        format!("{:.2}", b.drop_probability),
        format!("{}", b.window.seconds),
        si(o.requests as f64),
        si(o.accepts as f64),
        si(o.refused_by_peer as f64),
        si(o.timeouts as f64),
        si((o.refused_locally + o.would_refuse) as f64),
        transition_text(b),
    ]
}

/// One rule's cells, in the order of [`RULE_COLUMNS`] (`history`: what
/// `top` has seen of it; `-` in its column without).
pub fn rule_cells(
    r: &RuleRow,
    klimiter: Option<&PublishedStep>,
    history: Option<&RuleHistory>,
) -> Vec<String> {
    let kl = klimiter
        .and_then(|k| k.entries.iter().find(|e| e.rule == r.rule))
        .map(|e| e.reason.clone())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "-".into());
    vec![
        r.rule.clone(),
        or_dash(&r.match_),
        or_dash(&r.key),
        or_dash(&r.limit),
        si(r.offered_pps),
        si(r.offered_bps),
        si(r.passed_pps),
        si(r.passed_bps),
        si(r.dropped_pps),
        si(r.would_drop_pps),
        format!("{:.1}", r.drop_pct),
        si(r.offered_total as f64),
        si(r.dropped_total as f64),
        format!("{:.3}", r.admission_ratio),
        si(r.syn_offered_ps),
        bbr_text(r),
        kl,
        or_dash(&r.top_reason),
        history
            .map(|h| {
                let mut points = vec![None; DROPS_POINTS.saturating_sub(h.dropped.len())];
                points.extend(h.dropped.last(DROPS_POINTS));
                spark_text(&points, None)
            })
            .unwrap_or_else(|| "-".into()),
    ]
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

fn len(s: &str) -> usize {
    s.chars().count()
}

/// The columns that fit `width` (with [`SPACING`] between them), as
/// (index into `cols`, width) in display order.
pub fn layout(cols: &[Column], rows: &[Vec<String>], width: usize) -> Vec<(usize, usize)> {
    let natural: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(i, c)| {
            rows.iter().map(|r| r.get(i).map_or(0, |s| len(s))).fold(len(c.header), usize::max)
        })
        .collect();
    let mut by_priority: Vec<usize> = (0..cols.len()).collect();
    by_priority.sort_by_key(|&i| cols[i].priority);
    let mut chosen: Vec<(usize, usize)> = Vec::new();
    let mut used = 0;
    for i in by_priority {
        let gap = if chosen.is_empty() { 0 } else { SPACING };
        if used + gap + natural[i] <= width {
            used += gap + natural[i];
            chosen.push((i, natural[i]));
        } else if chosen.is_empty() {
            // Even the first column alone is too wide: it gets what there is.
            chosen.push((i, width.max(len(cols[i].header))));
            break;
        } else {
            break;
        }
    }
    chosen.sort_by_key(|&(i, _)| i);
    chosen
}

/// `s` in `width` columns: as is when it fits, else cut with `…`.
pub fn ellipsize(s: &str, width: usize) -> String {
    if len(s) <= width {
        return s.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let mut out: String = s.chars().take(width - 1).collect();
    out.push('…');
    out
}

/// A cell padded to its column.
pub fn pad(s: &str, width: usize, align: Align) -> String {
    let s = ellipsize(s, width);
    match align {
        Align::Left => format!("{s:<width$}"),
        Align::Right => format!("{s:>width$}"),
    }
}

/// The table as text lines (header first) for `top --once`.
pub fn text_table(cols: &[Column], rows: &[Vec<String>], width: usize) -> Vec<String> {
    let lay = layout(cols, rows, width);
    let line = |cells: &dyn Fn(usize) -> String| {
        lay.iter()
            .map(|&(i, w)| pad(&cells(i), w, cols[i].align))
            .collect::<Vec<_>>()
            .join(&" ".repeat(SPACING))
            .trim_end()
            .to_string()
    };
    let mut out = vec![line(&|i| cols[i].header.to_string())];
    for r in rows {
        out.push(line(&|i| r.get(i).cloned().unwrap_or_default()));
    }
    out
}

/// A title from parts in order of importance: as many whole parts as fit
/// `width`, joined by " | "; the first cut with `…` if even it is too long.
pub fn fit_parts(parts: &[String], width: usize) -> String {
    let mut out = String::new();
    for (n, p) in parts.iter().filter(|p| !p.is_empty()).enumerate() {
        let candidate = if n == 0 { p.clone() } else { format!("{out} | {p}") };
        if len(&candidate) <= width {
            out = candidate;
        } else if n == 0 {
            return ellipsize(p, width);
        } else {
            break;
        }
    }
    out
}

/// The legend the `?` key shows: every column, its unit and meaning.
pub fn legend_lines(cols: &[Column]) -> Vec<String> {
    let w = RULE_COLUMNS.iter().chain(BREAKER_COLUMNS).map(|c| len(c.header)).max().unwrap_or(0);
    cols.iter().map(|c| format!("{:<w$}  {}", c.header, c.legend)).collect()
}

/// The legend's lines on keys and the history pane, after the columns'.
pub fn key_legend_lines() -> Vec<String> {
    let w = RULE_COLUMNS.iter().chain(BREAKER_COLUMNS).map(|c| len(c.header)).max().unwrap_or(0);
    [
        ("keys", "up/down select, Enter details, Esc back, s sort, p pause"),
        ("history", "the selected row's last seconds, a bar each, to its max"),
    ]
    .iter()
    .map(|(k, v)| format!("{k:<w$}  {v}"))
    .collect()
}

/// A BBR rule's in-flight count over its limit, "!" while the in-flight
/// test is on; "-" for rules without BBR (or without a running agent).
fn bbr_text(r: &RuleRow) -> String {
    match &r.bbr {
        Some(b) => format!(
            "{}/{}{}",
            b.in_flight,
            b.max_in_flight.map(|m| m.to_string()).unwrap_or_else(|| "-".into()),
            if b.overloaded { " !" } else { "" }
        ),
        None => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::top::state::BbrRow;

    fn demo_rows() -> Vec<RuleRow> {
        let mk = |name: &str, offered: f64, dropped: f64, m: &str, limit: &str| RuleRow {
            match_: m.into(),
            limit: limit.into(),
            offered_bps: offered * 8.0 * 512.0,
            passed_bps: (offered - dropped) * 8.0 * 512.0,
            admission_ratio: 0.875,
            syn_offered_ps: 1234.0,
            offered_total: 123_456_789,
            passed_total: 1_000,
            dropped_total: 98_765_432,
            ..RuleRow::example(name, offered, dropped)
        };
        let mut web = mk(
            "web-connections",
            4742.0,
            4542.0,
            "tcp from any to port 443",
            "50/s connections burst 100 per src",
        );
        web.bbr = Some(BbrRow {
            max_pass: 25,
            min_rt_ms: 3,
            in_flight: 1234,
            max_in_flight: Some(5000),
            overloaded: true,
        });
        vec![
            mk(
                "udp-service",
                4742.0,
                4542.0,
                "udp from any to port 7000",
                "200/s packets burst 50 per src",
            ),
            web,
            mk("quiet", 0.0, 0.0, "any", "pass (exempt)"),
        ]
    }

    fn cells() -> Vec<Vec<String>> {
        demo_rows().iter().map(|r| rule_cells(r, None, Some(&drops_history()))).collect()
    }

    /// Ten seconds of drops, a flood starting in the middle.
    fn drops_history() -> RuleHistory {
        let mut h = RuleHistory::default();
        for v in [0.0, 0.0, 0.0, 0.0, 0.0, 10.0, 4000.0, 4500.0, 4500.0, 4400.0] {
            h.dropped.push(Some(v));
        }
        h
    }

    #[test]
    fn the_drops_column_is_a_sparkline_of_whole_seconds() {
        let c = rule_cells(&demo_rows()[0], None, Some(&drops_history()));
        let i = RULE_COLUMNS.iter().position(|c| c.header == "drops 20 s").unwrap();
        assert_eq!(c[i], "··········▁▁▁▁▁▂████");
        assert_eq!(rule_cells(&demo_rows()[0], None, None)[i], "-");
    }

    fn parses_as_number(s: &str) -> bool {
        let s = s.trim_end_matches(['k', 'M', 'G']);
        s.parse::<f64>().is_ok()
    }

    #[test]
    fn nothing_is_cut_and_priority_order_holds_at_common_widths() {
        let rows = cells();
        for width in [80usize, 100, 120, 140, 220] {
            let lay = layout(RULE_COLUMNS, &rows, width);
            let used: usize =
                lay.iter().map(|&(_, w)| w).sum::<usize>() + SPACING * (lay.len() - 1);
            assert!(used <= width, "{width}: {used}");
            // The shown columns are the first ones by priority.
            let mut shown: Vec<u8> = lay.iter().map(|&(i, _)| RULE_COLUMNS[i].priority).collect();
            shown.sort();
            assert_eq!(shown, (0..shown.len() as u8).collect::<Vec<_>>(), "{width}");
            // Rule, offered, dropped and drop % always.
            assert!(lay.len() >= 4, "{width}");
            let text = text_table(RULE_COLUMNS, &rows, width);
            assert!(text.iter().all(|l| l.chars().count() <= width), "{width}: {text:?}");
            let header: Vec<&str> = text[0].split("  ").filter(|s| !s.is_empty()).collect();
            let all: Vec<&str> = RULE_COLUMNS.iter().map(|c| c.header).collect();
            assert_eq!(header.len(), lay.len(), "{width}: {}", text[0]);
            for h in &header {
                assert!(all.contains(&h.trim()), "{width}: header `{h}` cut");
            }
            for (line, row) in text[1..].iter().zip(&rows) {
                assert!(!line.contains('…'), "{width}: {line}");
                for &(i, _) in &lay {
                    let cell = &row[i];
                    assert!(line.contains(cell.as_str()), "{width}: `{cell}` not whole in {line}");
                    if RULE_COLUMNS[i].numeric {
                        assert!(parses_as_number(cell), "{cell}");
                    }
                }
            }
        }
    }

    #[test]
    fn narrow_shows_the_first_columns_and_wide_shows_everything() {
        let rows = cells();
        let headers = |w| {
            layout(RULE_COLUMNS, &rows, w)
                .iter()
                .map(|&(i, _)| RULE_COLUMNS[i].header)
                .collect::<Vec<_>>()
        };
        let at80 = headers(78);
        for h in ["rule", "offered pps", "dropped pps", "drop %", "passed pps"] {
            assert!(at80.contains(&h), "{at80:?}");
        }
        assert!(!at80.contains(&"limit"), "{at80:?}");
        assert_eq!(headers(400).len(), RULE_COLUMNS.len());
        // Display order is kept.
        assert_eq!(at80[0], "rule");
        assert_eq!(headers(400), RULE_COLUMNS.iter().map(|c| c.header).collect::<Vec<_>>());
    }

    #[test]
    fn a_dry_run_rule_shows_its_would_drops_next_to_dropped_from_80_columns() {
        let dry = RuleRow {
            would_drop_pps: 900.0,
            limit: "100/s packets burst 20 per src (dry-run)".into(),
            ..RuleRow::example("dry", 1000.0, 0.0)
        };
        let rows = vec![rule_cells(&dry, None, None)];
        let text = text_table(RULE_COLUMNS, &rows, 78);
        let header: Vec<&str> =
            text[0].split("  ").map(str::trim).filter(|s| !s.is_empty()).collect();
        let row: Vec<&str> = text[1].split("  ").map(str::trim).filter(|s| !s.is_empty()).collect();
        let at = |h: &str| {
            header.iter().position(|x| *x == h).unwrap_or_else(|| panic!("{h}: {text:?}"))
        };
        assert_eq!(at("would-drop pps"), at("dropped pps") + 1, "{text:?}");
        assert_eq!((row[at("would-drop pps")], row[at("dropped pps")]), ("900", "0"));
        // Narrower, it goes before the four that always show.
        let narrow = layout(RULE_COLUMNS, &rows, 50);
        assert!(narrow.iter().all(|&(i, _)| RULE_COLUMNS[i].header != "would-drop pps"));
        assert!(narrow.len() >= 4);
    }

    #[test]
    fn a_too_long_rule_name_is_ellipsized_not_the_numbers() {
        let rows = vec![vec!["a-very-long-rule-name-indeed".to_string(); RULE_COLUMNS.len()]];
        let lay = layout(RULE_COLUMNS, &rows, 10);
        assert_eq!(lay, vec![(0, 10)]);
        assert_eq!(pad(&rows[0][0], 10, Align::Left), "a-very-lo…");
    }

    #[test]
    fn titles_drop_whole_parts() {
        let parts: Vec<String> = ["veth0 (netns lab)", "native mode", "up 42s", "CPU 12.5% (host)"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            fit_parts(&parts, 200),
            "veth0 (netns lab) | native mode | up 42s | CPU 12.5% (host)"
        );
        assert_eq!(fit_parts(&parts, 40), "veth0 (netns lab) | native mode | up 42s");
        assert_eq!(fit_parts(&parts, 10), "veth0 (ne…");
    }

    #[test]
    fn the_legend_names_every_column() {
        for cols in [RULE_COLUMNS, BREAKER_COLUMNS] {
            let l = legend_lines(cols);
            assert_eq!(l.len(), cols.len());
            for c in cols {
                assert!(l.iter().any(|x| x.starts_with(c.header) && x.contains(c.legend)));
            }
            // It fits 80x24 inside its border: one line per column.
            assert!(l.iter().all(|x| x.chars().count() <= 76), "{l:?}");
            assert!(l.len() + 2 <= 24);
            let keys = key_legend_lines();
            assert!(keys.iter().all(|x| x.chars().count() <= 76), "{keys:?}");
            assert!(RULE_COLUMNS.len() + keys.len() + 2 <= 24);
            // Priorities are distinct, 0..n.
            let mut p: Vec<u8> = cols.iter().map(|c| c.priority).collect();
            p.sort();
            assert_eq!(p, (0..cols.len() as u8).collect::<Vec<_>>());
        }
    }
}
