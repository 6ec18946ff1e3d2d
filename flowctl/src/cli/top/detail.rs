//! The selected row's detail view (Enter): a rule's match and limits in
//! full, its rates and totals by unit, drops by reason, its history as
//! sparklines (and, where the terminal has the rows, BBR's in-flight
//! against its limit and each KLimiter baseline's level against its
//! threshold as charts), and its heaviest keys now; for a breaker, its
//! state, drop probability and outcomes over time.

use super::{
    columns::{self, fit_parts},
    history::{History, RuleHistory, Series, POINTS},
    keys::KeysNow,
    screen::Item,
    spark::{spark_row, SparkLine, SPARK_LABEL},
    state::{Attachment, RuleRow, Top},
};
use crate::{
    agent::breakers::{Published, PublishedBreaker},
    cli::format::{breaker_state_text, si, transition_text},
};
use ratatui::{
    layout::{Constraint, Layout, Rect},
    style::{Modifier, Style},
    symbols::Marker,
    text::Line,
    widgets::{Axis, Block, Borders, Chart, Dataset, GraphType, Paragraph, Row, Table},
    Frame,
};

/// Rows of one chart (BBR, a KLimiter baseline), borders included.
const CHART_ROWS: u16 = 8;
/// Rows the heaviest keys always get: a title, the header, three keys.
const KEYS_MIN_ROWS: u16 = 5;
/// How many heaviest keys to ask for (the view shows what fits).
pub const KEYS_WANTED: usize = 20;

pub fn draw(f: &mut Frame, top: &Top, hist: &History, item: &Item, keys: Option<&KeysNow>) {
    let area = f.area();
    let [status, body] = Layout::vertical([Constraint::Length(1), Constraint::Fill(1)]).areas(area);
    let what = match item {
        Item::Rule(id, name) => {
            let iface = top.attachments.iter().find(|a| a.id == *id).map(|a| a.iface.as_str());
            format!("details: {name} on {}", iface.unwrap_or("?"))
        }
        Item::Breaker(_, name) => format!("details: breaker {name}"),
    };
    let parts = [
        " flowctl top".to_string(),
        what,
        "Esc back, up/down rows, q quit".into(),
        format!("every {:.1}s", top.interval_s),
    ];
    f.render_widget(
        Paragraph::new(fit_parts(&parts, area.width as usize))
            .style(Style::default().add_modifier(Modifier::REVERSED)),
        status,
    );
    match item {
        Item::Rule(id, name) => {
            let Some(a) = top.attachments.iter().find(|a| a.id == *id) else { return };
            let Some(r) = a.rules.iter().find(|r| r.rule == *name) else { return };
            rule(f, body, a, r, hist.rule(*id, name), hist, keys);
        }
        Item::Breaker(cg, name) => {
            let Some(c) = top.breakers.iter().find(|c| c.cgroup_id == *cg) else { return };
            let Some(b) = c.breakers.iter().find(|b| b.name == *name) else { return };
            breaker(f, body, c, b, hist);
        }
    }
}

/// The label column of the facts ("would-drop" and a space).
const FACT_LABEL: usize = 11;

/// "label      value" lines, `width` wide: a long value wraps at its
/// words, under itself.
fn info_lines(rows: &[(&str, String)], width: u16) -> Vec<Line<'static>> {
    let room = (width as usize).saturating_sub(FACT_LABEL).max(10);
    let mut out = Vec::new();
    for (label, value) in rows {
        let mut line = String::new();
        let mut first = true;
        for word in value.split(' ') {
            if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > room {
                let l = if first { *label } else { "" };
                out.push(Line::from(format!("{l:<FACT_LABEL$}{line}")));
                line.clear();
                first = false;
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
        let l = if first { *label } else { "" };
        out.push(Line::from(format!("{l:<FACT_LABEL$}{line}")));
    }
    out
}

fn rule(
    f: &mut Frame,
    area: Rect,
    a: &Attachment,
    r: &RuleRow,
    h: Option<&RuleHistory>,
    hist: &History,
    keys: Option<&KeysNow>,
) {
    let title = fit_parts(
        &[
            format!("rule {}", r.rule),
            format!(
                "{}{}",
                a.iface,
                a.netns.as_ref().map(|n| format!(" (netns {n})")).unwrap_or_default()
            ),
        ],
        (area.width as usize).saturating_sub(4),
    );
    let block = Block::default().borders(Borders::ALL).title(format!(" {title} "));
    let inner = block.inner(area);
    f.render_widget(block, area);
    let info = rule_facts(a, r, inner.width);
    let info_h = info.len() as u16;
    let bars = (inner.width as usize).saturating_sub(SPARK_LABEL).min(POINTS);

    // Sparklines: offered, passed and dropped always; the rest while rows last.
    let empty = Series::default();
    let h_or = |pick: fn(&RuleHistory) -> &Series| h.map(pick).unwrap_or(&empty);
    let core: Vec<SparkLine> = vec![
        SparkLine::new("offered pps", h_or(|h| &h.offered)),
        SparkLine::new("passed pps", h_or(|h| &h.passed)),
        SparkLine::new("dropped pps", h_or(|h| &h.dropped)),
    ];
    let mut extra: Vec<SparkLine> = Vec::new();
    if let Some(h) = h {
        for (i, s) in h.reasons.iter().enumerate() {
            if s.any_last(bars) {
                extra.push(SparkLine::new(
                    format!("{} drops/s", flowctl_common::reason::NAMES[i]),
                    s,
                ));
            }
        }
        if r.would_drop_total > 0 || h.would_drop.any_last(bars) {
            extra.push(SparkLine::new("would-drop pps", &h.would_drop));
        }
        extra.push(SparkLine::ratio("admission ratio", &h.ratio));
        if r.bbr.is_some() || h.bbr_in_flight.any_last(bars) {
            extra.push(SparkLine::new("BBR in flight", &h.bbr_in_flight));
            extra.push(SparkLine::new("BBR limit", &h.bbr_limit));
        }
    }
    let baselines = klimiter_baselines(a, &r.rule);
    for b in &baselines {
        if let Some(bh) = hist.baselines.get(&(a.id, b.clone())) {
            extra.push(SparkLine::new(format!("{b} level"), &bh.level));
        }
    }
    let fixed = info_h + 1 + core.len() as u16 + KEYS_MIN_ROWS;
    let mut spare = inner.height.saturating_sub(fixed);
    let extra: Vec<SparkLine> = extra.into_iter().take(spare as usize).collect();
    spare -= extra.len() as u16;
    // Charts where the rows remain: BBR, then each baseline.
    let mut charts: Vec<ChartData> = Vec::new();
    if let Some(h) = h.filter(|_| r.bbr.is_some()) {
        if spare >= CHART_ROWS {
            charts.push(ChartData::new(
                "BBR: in flight (line) against its limit (dots)".into(),
                &h.bbr_in_flight,
                &h.bbr_limit,
                bars,
            ));
            spare -= CHART_ROWS;
        }
    }
    for b in &baselines {
        let Some(bh) = hist.baselines.get(&(a.id, b.clone())) else { continue };
        if spare >= CHART_ROWS {
            let name = format!("KLimiter {b}: level (line) against its threshold (dots)");
            charts.push(ChartData::new(name, &bh.level, &bh.threshold, bars));
            spare -= CHART_ROWS;
        }
    }

    // What is left makes the first three lines taller (up to three rows).
    let core_h = 1 + (spare / core.len() as u16).min(2);
    let mut constraints = vec![Constraint::Length(info_h), Constraint::Length(1)];
    constraints.extend(std::iter::repeat_n(Constraint::Length(core_h), core.len()));
    constraints.extend(std::iter::repeat_n(Constraint::Length(1), extra.len()));
    constraints.extend(std::iter::repeat_n(Constraint::Length(CHART_ROWS), charts.len()));
    constraints.push(Constraint::Fill(1));
    let rows = Layout::vertical(constraints).split(inner);
    f.render_widget(Paragraph::new(info), rows[0]);
    let per = match h.map(|h| h.slice_s).unwrap_or(1.0) {
        1.0 => "second".to_string(),
        s => format!("{s} s"),
    };
    let caption =
        format!("history: last {bars} s, a bar per {per}, newest right, each line to its max");
    f.render_widget(
        Paragraph::new(columns::ellipsize(&caption, inner.width as usize))
            .style(Style::default().add_modifier(Modifier::BOLD)),
        rows[1],
    );
    let mut at = 2;
    for line in core.iter().chain(&extra) {
        spark_row(f, rows[at], line, bars);
        at += 1;
    }
    for c in &charts {
        f.render_widget(c.chart(bars), rows[at]);
        at += 1;
    }
    heavy_keys(f, rows[at], keys);
}

/// What the detail view says of a rule: its match and limit in full, a
/// small table of rates and totals (headers name the units), the drops by
/// reason and what the control loops do.
fn rule_facts(a: &Attachment, r: &RuleRow, width: u16) -> Vec<Line<'static>> {
    let drops = if r.drops.is_empty() {
        "none since attach".to_string()
    } else {
        r.drops
            .iter()
            .map(|d| {
                format!("{} {} pps ({} since attach)", d.reason, si(d.pps), si(d.total as f64))
            })
            .collect::<Vec<_>>()
            .join(" · ")
    };
    let mut control = vec![
        format!("admission ratio {:.3}", r.admission_ratio),
        format!("SYN {}/s offered, {}/s admitted", si(r.syn_offered_ps), si(r.syn_passed_ps)),
    ];
    if let Some(b) = &r.bbr {
        control.push(format!(
            "BBR in flight {} / limit {}{}, min RT {} ms, max pass {}",
            b.in_flight,
            b.max_in_flight.map(|m| m.to_string()).unwrap_or_else(|| "none yet".into()),
            if b.overloaded { " (overloaded)" } else { "" },
            b.min_rt_ms,
            b.max_pass
        ));
    }
    if let Some(e) = a.klimiter.as_ref().and_then(|k| k.entries.iter().find(|e| e.rule == r.rule)) {
        control.push(format!("KLimiter ratio {:.3}: {}", e.ratio, e.reason));
    }
    if let Some(g) = a.leases.as_ref().and_then(|l| l.rules.iter().find(|g| g.rule == r.rule)) {
        let held: Vec<_> = g.leases.iter().filter(|k| k.rate.is_some()).collect();
        control.push(format!(
            "global {}/s burst {} fleet-wide: {} keys leased here, {}/s granted, {} ({})",
            g.rate,
            g.burst,
            held.len(),
            held.iter().filter_map(|k| k.rate).sum::<u64>(),
            crate::cli::format::store_text(&a.leases.as_ref().expect("found").store),
            a.leases.as_ref().expect("found").store.health
        ));
    }
    if !a.agent_running {
        control.push("agent not running".into());
    }
    let mut lines = info_lines(
        &[("match", format!("{} (key {})", r.match_, r.key)), ("limit", r.limit.clone())],
        width,
    );
    let row = |name: &str, pps: String, bps: String, pkts: String, bytes: String| {
        Line::from(format!("{name:<FACT_LABEL$}{pps:>9}{bps:>10}{pkts:>12}{bytes:>13}"))
    };
    let dash = || "-".to_string();
    lines.push(
        row("", "pps".into(), "bit/s".into(), "pkts total".into(), "bytes total".into())
            .style(Style::default().add_modifier(Modifier::BOLD)),
    );
    lines.push(row(
        "offered",
        si(r.offered_pps),
        si(r.offered_bps),
        si(r.offered_total as f64),
        si(r.offered_bytes_total as f64),
    ));
    lines.push(row(
        "passed",
        si(r.passed_pps),
        si(r.passed_bps),
        si(r.passed_total as f64),
        si(r.passed_bytes_total as f64),
    ));
    let mut dropped = row("dropped", si(r.dropped_pps), dash(), si(r.dropped_total as f64), dash());
    dropped.push_span(format!("  {:.1} % of offered now", r.drop_pct));
    lines.push(dropped);
    lines.push(row(
        "would-drop",
        si(r.would_drop_pps),
        dash(),
        si(r.would_drop_total as f64),
        dash(),
    ));
    lines.extend(info_lines(&[("drops", drops), ("control", control.join(" · "))], width));
    lines
}

/// The KLimiter baselines `rule` is an entry of.
fn klimiter_baselines(a: &Attachment, rule: &str) -> Vec<String> {
    a.klimiter
        .iter()
        .flat_map(|k| &k.baselines)
        .filter(|b| b.entries.iter().any(|e| e.rule == rule))
        .map(|b| b.name.clone())
        .collect()
}

/// A chart of a value (a line) against its limit (dots) over the newest
/// `bars` seconds; the points are kept here because the widget borrows them.
struct ChartData {
    title: String,
    value: Vec<(f64, f64)>,
    limit: Vec<(f64, f64)>,
    top: f64,
}

impl ChartData {
    fn new(title: String, value: &Series, limit: &Series, bars: usize) -> Self {
        let xy = |s: &Series| -> Vec<(f64, f64)> {
            let pts = s.last(bars);
            let n = pts.len() as f64;
            pts.into_iter()
                .enumerate()
                .filter_map(|(i, p)| p.map(|v| (i as f64 - n + 1.0, v)))
                .collect()
        };
        let (value, limit) = (xy(value), xy(limit));
        let top = value.iter().chain(&limit).map(|p| p.1).fold(1.0f64, f64::max) * 1.1;
        Self { title, value, limit, top }
    }

    fn chart(&self, bars: usize) -> Chart<'_> {
        let datasets = vec![
            Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .data(&self.value),
            Dataset::default().marker(Marker::Dot).graph_type(GraphType::Scatter).data(&self.limit),
        ];
        Chart::new(datasets)
            .block(Block::default().borders(Borders::ALL).title(format!(" {} ", self.title)))
            .x_axis(
                Axis::default()
                    .bounds([-(bars as f64), 0.0])
                    .labels([format!("-{bars} s"), "now".to_string()]),
            )
            .y_axis(Axis::default().bounds([0.0, self.top]).labels(["0".to_string(), si(self.top)]))
    }
}

/// The heaviest keys now: the rest of the view.
fn heavy_keys(f: &mut Frame, area: Rect, keys: Option<&KeysNow>) {
    let [title, table] = Layout::vertical([Constraint::Length(1), Constraint::Fill(1)]).areas(area);
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let say = |f: &mut Frame, text: String| {
        f.render_widget(
            Paragraph::new(columns::ellipsize(&text, area.width as usize)).style(bold),
            title,
        )
    };
    let report = match keys {
        None | Some(KeysNow::Waiting) => {
            return say(f, "heaviest keys now: sampling started, first report shortly".into())
        }
        Some(KeysNow::Failed(why)) => return say(f, format!("heaviest keys now: {why}")),
        Some(KeysNow::Report(r)) => r,
    };
    let parts = [
        "heaviest keys now".to_string(),
        format!("1 in {} sampled", report.sample_every),
        format!("{:.0} samples", report.samples),
        "each pps high by at most its error".into(),
    ];
    say(f, fit_parts(&parts, area.width as usize));
    let header = Row::new(["key", "pps", "share %", "dropped pps", "error pps"]).style(bold);
    let rows: Vec<Row> = report
        .keys
        .iter()
        .map(|k| {
            Row::new([
                k.key.clone(),
                si(k.pps),
                format!("{:.1}", k.share_pct),
                si(k.dropped_pps),
                si(k.error_pps),
            ])
        })
        .collect();
    let rows = if rows.is_empty() { vec![Row::new(["no packets sampled yet"])] } else { rows };
    let key_w = report.keys.iter().map(|k| k.key.chars().count()).max().unwrap_or(0).max(22);
    let widths = [
        Constraint::Length(key_w as u16),
        Constraint::Length(8),
        Constraint::Length(7),
        Constraint::Length(11),
        Constraint::Length(9),
    ];
    f.render_widget(
        Table::new(rows, widths).header(header).flex(ratatui::layout::Flex::Start),
        table,
    );
}

fn breaker(f: &mut Frame, area: Rect, c: &Published, b: &PublishedBreaker, hist: &History) {
    let title = fit_parts(
        &[format!("breaker {}", b.name), format!("cgroup {}", c.cgroup)],
        (area.width as usize).saturating_sub(4),
    );
    let block = Block::default().borders(Borders::ALL).title(format!(" {title} "));
    let inner = block.inner(area);
    f.render_widget(block, area);
    let o = &b.window.outcomes;
    let mut facts = vec![
        (
            "target",
            format!(
                "{} · mode {}{} · refuses with {}",
                b.target,
                b.mode,
                if b.dry_run { " (dry-run: counts, refuses nothing)" } else { "" },
                b.errno
            ),
        ),
        ("state", format!("{} · drop p {:.2}", breaker_state_text(b), b.drop_probability)),
        ("changed", transition_text(b)),
        (
            "window",
            format!(
                "{} s: requests {} · accepts {} · refused {} · timeouts {} · local {}",
                b.window.seconds,
                si(o.requests as f64),
                si(o.accepts as f64),
                si(o.refused_by_peer as f64),
                si(o.timeouts as f64),
                si((o.refused_locally + o.would_refuse) as f64)
            ),
        ),
        (
            "totals",
            if b.totals.is_empty() {
                "none yet".into()
            } else {
                b.totals
                    .iter()
                    .map(|(k, v)| format!("{k} {}", si(*v as f64)))
                    .collect::<Vec<_>>()
                    .join(" · ")
            },
        ),
    ];
    if let Some(p) = &b.probes {
        let probes = format!(
            "{} allowed · {} admitted · {} succeeded · {} failed",
            p.allowed, p.admitted, p.succeeded, p.failed
        );
        facts.insert(2, ("probes", probes));
    }
    let info = info_lines(&facts, inner.width);
    let info_h = info.len() as u16;
    let bars = (inner.width as usize).saturating_sub(SPARK_LABEL).min(POINTS);
    let h = hist.breaker(c.cgroup_id, &b.name);
    let empty = Series::default();
    let pick = |f: fn(&super::history::BreakerHistory) -> &Series| h.map(f).unwrap_or(&empty);
    let lines: Vec<SparkLine> = vec![
        SparkLine::ratio("drop p", pick(|h| &h.drop_probability)),
        SparkLine::new("requests/s", pick(|h| &h.attempts)),
        SparkLine::new("accepts/s", pick(|h| &h.successes)),
        SparkLine::new("refused/s", pick(|h| &h.refused_by_peer)),
        SparkLine::new("timeouts/s", pick(|h| &h.timeouts)),
        SparkLine::new("local/s", pick(|h| &h.local)),
    ];
    let mut constraints =
        vec![Constraint::Length(info_h), Constraint::Length(1), Constraint::Length(1)];
    // The lines share the rows left (taller bars), at most four each.
    let each = (inner.height.saturating_sub(info_h + 3) / lines.len() as u16).clamp(1, 4);
    constraints.extend(std::iter::repeat_n(Constraint::Length(each), lines.len()));
    constraints.push(Constraint::Fill(1));
    let rows = Layout::vertical(constraints).split(inner);
    f.render_widget(Paragraph::new(info), rows[0]);
    f.render_widget(
        Paragraph::new(columns::ellipsize(
            &format!(
                "history: last {bars} s, a bar per second, newest right, each line to its max"
            ),
            inner.width as usize,
        ))
        .style(Style::default().add_modifier(Modifier::BOLD)),
        rows[1],
    );
    // The state as one letter per second, right-aligned like the sparklines.
    let letters: String = h
        .map(|h| {
            let skip = h.state.len().saturating_sub(bars);
            h.state.iter().skip(skip).map(|c| c.unwrap_or('·')).collect()
        })
        .unwrap_or_default();
    let state_label = format!("{:<w$}", "state c t h o", w = SPARK_LABEL);
    f.render_widget(Paragraph::new(format!("{state_label}{letters:>bars$}")), rows[2]);
    for (i, line) in lines.iter().enumerate() {
        spark_row(f, rows[3 + i], line, bars);
    }
    f.render_widget(
        Paragraph::new("state letters: c closed, t throttling, h half-open, o open, · not seen"),
        rows[rows.len() - 1],
    );
}
