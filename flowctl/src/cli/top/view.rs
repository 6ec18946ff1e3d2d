//! Draws a [`Top`] state: one block per attachment, one row per rule.

use super::{
    columns,
    state::{SortBy, Top},
};
use crate::cli::format::si;
use ratatui::{
    layout::{Constraint, Layout},
    style::{Modifier, Style},
    text::Line,
    widgets::{Block, Borders, Cell, Paragraph, Row, Table},
    Frame,
};

pub fn draw(f: &mut Frame, top: &Top, sort: SortBy, paused: bool, legend: bool) {
    let area = f.area();
    let n = (top.attachments.len() + top.breakers.len()).max(1);
    let mut constraints = vec![Constraint::Length(1)];
    constraints.extend(std::iter::repeat_n(Constraint::Fill(1), n));
    let chunks = Layout::vertical(constraints).split(area);
    let mut parts = vec![" flowctl top".to_string(), format!("sort: {}", sort.name())];
    if paused {
        parts.push("PAUSED".into());
    }
    parts.push("keys: s sort, p pause, ? legend, q quit".into());
    parts.push(format!("every {:.1}s", top.interval_s));
    let status = columns::fit_parts(&parts, area.width as usize);
    f.render_widget(
        Paragraph::new(Line::from(status)).style(Style::default().add_modifier(Modifier::REVERSED)),
        chunks[0],
    );
    if top.attachments.is_empty() && top.breakers.is_empty() {
        f.render_widget(
            Paragraph::new(
                "no flowctl attachments (start one with `flowctl attach IFACE --profile FILE`)",
            ),
            chunks[1],
        );
        if legend {
            draw_legend(f, false);
        }
        return;
    }
    for (i, c) in top.breakers.iter().enumerate() {
        let area = chunks[top.attachments.len() + i + 1];
        let inner = area.width.saturating_sub(2) as usize;
        let title = columns::fit_parts(
            &["breakers".into(), format!("cgroup {}", c.cgroup), format!("agent pid {}", c.pid)],
            inner.saturating_sub(2),
        );
        let cells: Vec<Vec<String>> = c.breakers.iter().map(columns::breaker_cells).collect();
        f.render_widget(table(columns::BREAKER_COLUMNS, &cells, inner, &title), area);
    }
    for (i, a) in top.attachments.iter().enumerate() {
        let area = chunks[i + 1];
        // Inside the borders, less a space either side of the title.
        let inner = area.width.saturating_sub(2) as usize;
        let title = columns::fit_parts(&attachment_title_parts(a), inner.saturating_sub(2));
        let mut rows = a.rules.clone();
        sort.apply(&mut rows);
        let cells: Vec<Vec<String>> =
            rows.iter().map(|r| columns::rule_cells(r, a.klimiter.as_ref())).collect();
        f.render_widget(table(columns::RULE_COLUMNS, &cells, inner, &title), area);
    }
    if legend {
        draw_legend(f, !top.breakers.is_empty());
    }
}

/// A table of the columns of `cols` that fit `width` (columns.rs decides).
fn table<'a>(
    cols: &'static [columns::Column],
    cells: &'a [Vec<String>],
    width: usize,
    title: &str,
) -> Table<'a> {
    let lay = columns::layout(cols, cells, width);
    let cell = |s: &str, i: usize, w: usize| {
        let line = Line::from(columns::ellipsize(s, w));
        Cell::from(match cols[i].align {
            columns::Align::Left => line,
            columns::Align::Right => line.right_aligned(),
        })
    };
    let header = Row::new(lay.iter().map(|&(i, w)| cell(cols[i].header, i, w)))
        .style(Style::default().add_modifier(Modifier::BOLD));
    let rows: Vec<Row> =
        cells.iter().map(|r| Row::new(lay.iter().map(|&(i, w)| cell(&r[i], i, w)))).collect();
    let widths: Vec<Constraint> = lay.iter().map(|&(_, w)| Constraint::Length(w as u16)).collect();
    Table::new(rows, widths)
        .header(header)
        .column_spacing(columns::SPACING as u16)
        .flex(ratatui::layout::Flex::Start)
        .block(Block::default().borders(Borders::ALL).title(format!(" {title} ")))
}

/// The title of an attachment's block, in parts by importance (the view
/// keeps as many whole parts as fit).
pub fn attachment_title_parts(a: &super::state::Attachment) -> Vec<String> {
    let iface = format!(
        "{}{}",
        a.iface,
        a.netns.as_ref().map(|n| format!(" (netns {n})")).unwrap_or_default()
    );
    let (up, mode) = (format!("up {}s", a.uptime_s), format!("{} mode", a.mode));
    if !a.agent_running {
        // Everything agent-computed (CPU, key tables, KLimiter) says so once.
        return vec![iface, "agent not running".into(), up, mode];
    }
    let mut parts =
        vec![iface, format!("CPU {}", a.cpu), up, mode, "agent running".into(), key_tables_text(a)];
    parts.extend(klimiter_text(a).split(" | ").filter(|s| !s.is_empty()).map(String::from));
    parts
}

/// The `?` legend: every column of the rule table (and of the breakers',
/// when there are breakers and room), over the middle.
fn draw_legend(f: &mut Frame, breakers: bool) {
    let mut lines = columns::legend_lines(columns::RULE_COLUMNS);
    // The breakers' part when it fits too (it does from 33 rows).
    let both = columns::RULE_COLUMNS.len() + 1 + columns::BREAKER_COLUMNS.len() + 2;
    if breakers && both <= f.area().height as usize {
        lines.push(String::new());
        lines.extend(columns::legend_lines(columns::BREAKER_COLUMNS));
    }
    let area = f.area();
    let w = (lines.iter().map(|l| l.chars().count()).max().unwrap_or(0) + 2)
        .min(area.width as usize) as u16;
    let h = (lines.len() + 2).min(area.height as usize) as u16;
    let rect = ratatui::layout::Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    };
    let text: Vec<Line> = lines.into_iter().map(Line::from).collect();
    f.render_widget(ratatui::widgets::Clear, rect);
    f.render_widget(
        Paragraph::new(text)
            .wrap(ratatui::widgets::Wrap { trim: false })
            .block(Block::default().borders(Borders::ALL).title(" legend (? or Esc closes) ")),
        rect,
    );
}

/// KLimiter's baselines for the title: level/threshold and what it does.
pub fn klimiter_text(a: &super::state::Attachment) -> String {
    let Some(k) = &a.klimiter else { return String::new() };
    k.baselines
        .iter()
        .map(|b| {
            format!(
                " | {} {}/{:.0} {}",
                b.name,
                b.level.map(|l| format!("{l:.0}")).unwrap_or_else(|| "?".into()),
                b.threshold,
                b.band
            )
        })
        .collect()
}

/// The key table's fill for the title, marked approximate ("~").
pub fn key_tables_text(a: &super::state::Attachment) -> String {
    match a.key_tables.as_ref().and_then(|t| t.iter().find(|f| f.table == "keys")) {
        Some(f) => format!(
            "keys ~{}/{} (walked {:.0}s ago)",
            si(f.entries as f64),
            si(f.capacity as f64),
            f.walked_s_ago
        ),
        None => "keys: agent not running".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::top::state::{Attachment, RuleRow};
    use ratatui::{backend::TestBackend, Terminal};

    fn row(name: &str, offered: f64, dropped: f64) -> RuleRow {
        RuleRow {
            rule: name.into(),
            match_: "udp from any to port 53".into(),
            key: "src".into(),
            limit: "100/s".into(),
            offered_pps: offered,
            offered_bps: offered * 800.0,
            passed_pps: offered - dropped,
            passed_bps: 0.0,
            dropped_pps: dropped,
            drop_pct: if offered > 0.0 { 100.0 * dropped / offered } else { 0.0 },
            admission_ratio: 1.0,
            syn_offered_ps: 0.0,
            syn_passed_ps: 0.0,
            fin_rst_ps: 0.0,
            bbr: None,
            top_reason: if dropped > 0.0 { "rate".into() } else { String::new() },
            offered_total: 0,
            passed_total: 0,
            dropped_total: 0,
        }
    }

    fn fixture(agent: bool) -> Top {
        Top {
            schema: 1,
            interval_s: 1.0,
            attachments: vec![Attachment {
                iface: "veth0".into(),
                netns: Some("lab".into()),
                mode: "native".into(),
                uptime_s: 42,
                agent_running: agent,
                cpu: if agent { "n/a".into() } else { "agent not running".into() },
                cpu_permille: None,
                key_tables: agent.then(|| {
                    vec![crate::agent::occupancy::TableFill {
                        table: "keys",
                        entries: 12_345,
                        capacity: 1 << 20,
                        walked_s_ago: 3.0,
                    }]
                }),
                key_tables_note: String::new(),
                klimiter: None,
                rules: vec![row("quiet", 10.0, 0.0), row("noisy", 5000.0, 4000.0)],
            }],
            breakers: vec![],
        }
    }

    fn render(top: &Top, sort: SortBy, paused: bool) -> String {
        render_at(top, sort, paused, false, 240, 12)
    }

    fn render_at(top: &Top, sort: SortBy, paused: bool, legend: bool, w: u16, h: u16) -> String {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        t.draw(|f| draw(f, top, sort, paused, legend)).unwrap();
        let buf = t.backend().buffer().clone();
        (0..buf.area.height)
            .map(|y| {
                (0..buf.area.width).map(|x| buf[(x, y)].symbol().to_string()).collect::<String>()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn header_rows_and_units() {
        let s = render(&fixture(true), SortBy::Profile, false);
        assert!(s.contains("veth0 (netns lab) | CPU n/a | up 42s | native mode | agent running | keys ~12.35k/1.05M (walked 3s ago)"), "{s}");
        assert!(s.contains("offered pps") && s.contains("drop %"));
        assert!(s.contains("5.00k") && s.contains("80.0") && s.contains("rate"), "{s}");
        assert!(s.find("quiet").unwrap() < s.find("noisy").unwrap(), "profile order");
    }

    #[test]
    fn small_terminals_cut_nothing_and_the_legend_opens() {
        for (w, h) in [(80u16, 24u16), (120, 40)] {
            let s = render_at(&fixture(true), SortBy::Profile, false, false, w, h);
            let lines: Vec<&str> = s.lines().collect();
            assert!(lines[0].contains("? legend, q quit"), "{w}: {}", lines[0]);
            assert!(lines[1].starts_with("┌ veth0 (netns lab) | CPU n/a |"), "{w}: {}", lines[1]);
            let header = lines[2].trim_matches('│');
            for h in header.split("  ").map(str::trim).filter(|h| !h.is_empty()) {
                assert!(
                    columns::RULE_COLUMNS.iter().any(|c| c.header == h),
                    "{w}: header `{h}` cut in {header}"
                );
            }
            assert!(header.contains("drop %") && lines[4].contains("5.00k"), "{s}");
            assert!(!s.contains('…'), "{s}");
            let l = render_at(&fixture(true), SortBy::Profile, false, true, w, h);
            assert!(l.contains("legend (? or Esc closes)") && l.contains("drop %  "), "{l}");
        }
    }

    #[test]
    fn bbr_column_shows_in_flight_over_limit() {
        let mut top = fixture(true);
        top.attachments[0].rules[1].bbr = Some(crate::cli::top::state::BbrRow {
            max_pass: 25,
            min_rt_ms: 3,
            in_flight: 7,
            max_in_flight: Some(5),
            overloaded: true,
        });
        let s = render(&top, SortBy::Profile, false);
        assert!(s.contains("BBR in/max") && s.contains("7/5 !"), "{s}");
    }

    #[test]
    fn sorting_and_pause_show() {
        let s = render(&fixture(true), SortBy::Dropped, true);
        assert!(s.find("noisy").unwrap() < s.find("quiet").unwrap(), "dropped first");
        assert!(s.contains("sort: dropped pps") && s.contains("PAUSED"));
    }

    #[test]
    fn agent_only_fields_say_so_without_an_agent() {
        let s = render(&fixture(false), SortBy::Profile, false);
        assert!(s.contains("veth0 (netns lab) | agent not running | up 42s | native mode"), "{s}");
        assert!(!s.contains("CPU") && !s.contains("keys ~"), "{s}");
    }

    #[test]
    fn empty_state_says_how_to_start() {
        let s = render(
            &Top { schema: 1, interval_s: 1.0, attachments: vec![], breakers: vec![] },
            SortBy::Profile,
            false,
        );
        assert!(s.contains("no flowctl attachments"));
    }

    #[test]
    fn breakers_show_state_probability_window_and_last_change() {
        use crate::agent::breakers::{
            Published, PublishedBreaker, PublishedProbes, PublishedWindow, Transition,
        };
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
                as u64;
        let b = PublishedBreaker {
            name: "db".into(),
            target: "10.0.0.5:5432".into(),
            cgroup: None,
            mode: "state".into(),
            dry_run: false,
            errno: "ECONNREFUSED".into(),
            state: "half-open".into(),
            drop_probability: 1.0,
            window: PublishedWindow {
                seconds: 10.0,
                outcomes: flowctl_common::breaker::Outcomes {
                    requests: 40,
                    accepts: 3,
                    refused_by_peer: 37,
                    timeouts: 0,
                    refused_locally: 900,
                    would_refuse: 0,
                },
            },
            totals: Default::default(),
            probes: Some(PublishedProbes { allowed: 3, admitted: 2, succeeded: 1, failed: 0 }),
            last_transition: Some(Transition {
                from: "open".into(),
                to: "half-open".into(),
                unix_ms: now - 2_000,
                reason: "sleep elapsed".into(),
            }),
        };
        let mut top = fixture(true);
        top.breakers = vec![Published {
            cgroup: "/sys/fs/cgroup/app".into(),
            cgroup_id: 7,
            pid: 99,
            profile: "p.toml".into(),
            updated_unix_ms: now,
            breakers: vec![b],
        }];
        let s = render(&top, SortBy::Profile, false);
        assert!(s.contains("breakers | cgroup /sys/fs/cgroup/app | agent pid 99"), "{s}");
        assert!(s.contains("half-open 1/3") && s.contains("1.00") && s.contains("900"), "{s}");
        assert!(s.contains("ago -> half-open (sleep elapsed)"), "{s}");
        // At 80 columns: the first breaker columns, whole.
        let s = render_at(&top, SortBy::Profile, false, false, 80, 24);
        let header = s.lines().find(|l| l.starts_with("│breaker")).expect(&s);
        let shown: Vec<&str> =
            header.trim_matches('│').split("  ").map(str::trim).filter(|h| !h.is_empty()).collect();
        for h in &shown {
            assert!(columns::BREAKER_COLUMNS.iter().any(|c| c.header == *h), "`{h}` cut: {s}");
        }
        for h in ["breaker", "state", "drop p", "requests"] {
            assert!(shown.contains(&h), "{s}");
        }
        assert!(s.contains("half-open 1/3") && !s.contains('…'), "{s}");
    }
}
