//! Draws the main screen: one block per attachment (a row per rule), one
//! per cgroup's breakers, the selected row's last minutes as sparklines,
//! and the `?` legend. The selected row's detail view is `detail.rs`.

use super::{
    columns, detail,
    history::{History, Series, POINTS},
    keys::KeysNow,
    screen::{Item, Screen},
    spark::{spark_row, SparkLine, SPARK_LABEL},
    state::Top,
};
use crate::cli::format::{si, spark_text, store_text};
use ratatui::{
    layout::{Constraint, Layout, Rect},
    style::{Modifier, Style},
    text::Line,
    widgets::{Block, Borders, Cell, Paragraph, Row, Table, TableState},
    Frame,
};

/// Rows the selected row's history pane needs at least (three one-row
/// sparklines and borders), and at most (four rows each).
const PANE_ROWS: usize = 5;
const PANE_MAX_ROWS: usize = 14;
/// Points of the CPU signal the title shows.
const CPU_POINTS: usize = 10;

pub fn draw(f: &mut Frame, top: &Top, hist: &History, screen: &Screen, keys: Option<&KeysNow>) {
    if screen.detail {
        if let Some(item) = screen.current(top) {
            detail::draw(f, top, hist, &item, keys);
            if screen.legend {
                draw_legend(f, !top.breakers.is_empty());
            }
            return;
        }
    }
    draw_main(f, top, hist, screen);
    if screen.legend {
        draw_legend(f, !top.breakers.is_empty());
    }
}

fn draw_main(f: &mut Frame, top: &Top, hist: &History, screen: &Screen) {
    let area = f.area();
    let current = screen.current(top);
    let blocks = top.attachments.len() + top.breakers.len();
    // A block needs its rows, a header and two borders.
    let needed: usize = top.attachments.iter().map(|a| a.rules.len() + 3).sum::<usize>()
        + top.breakers.iter().map(|c| c.breakers.len() + 3).sum::<usize>();
    // The pane when every table fits beside it: the tables take what they
    // need and the pane the rest, up to bars four rows high (what is left
    // stays blank); without the room, the tables share the screen.
    let spare = (area.height as usize).saturating_sub(1 + needed);
    let pane = current.is_some() && spare >= PANE_ROWS;
    let mut constraints = vec![Constraint::Length(1)];
    if pane {
        constraints.extend(
            top.attachments
                .iter()
                .map(|a| a.rules.len())
                .chain(top.breakers.iter().map(|c| c.breakers.len()))
                .map(|n| Constraint::Length(n as u16 + 3)),
        );
        constraints.push(Constraint::Length(spare.min(PANE_MAX_ROWS) as u16));
        constraints.push(Constraint::Fill(1));
    } else {
        constraints.extend(std::iter::repeat_n(Constraint::Fill(1), blocks.max(1)));
    }
    let chunks = Layout::vertical(constraints).split(area);
    let mut parts = vec![" flowctl top".to_string(), format!("sort: {}", screen.sort.name())];
    if screen.paused {
        parts.push("PAUSED".into());
    }
    parts.push("keys: s sort, p pause, ? legend, q quit".into());
    parts.push("up/down select, Enter details".into());
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
        return;
    }
    for (i, a) in top.attachments.iter().enumerate() {
        let mut rows = a.rules.clone();
        screen.sort.apply(&mut rows);
        let cells: Vec<Vec<String>> = rows
            .iter()
            .map(|r| columns::rule_cells(r, a.klimiter.as_ref(), hist.rule(a.id, &r.rule)))
            .collect();
        let selected = rows.iter().position(|r| current == Some(Item::Rule(a.id, r.rule.clone())));
        let title = attachment_title_parts(a, hist.cpu.get(&a.id));
        table_block(f, chunks[i + 1], columns::RULE_COLUMNS, &cells, &title, selected);
    }
    for (i, c) in top.breakers.iter().enumerate() {
        let cells: Vec<Vec<String>> = c.breakers.iter().map(columns::breaker_cells).collect();
        let selected = c
            .breakers
            .iter()
            .position(|b| current == Some(Item::Breaker(c.cgroup_id, b.name.clone())));
        let title =
            ["breakers".into(), format!("cgroup {}", c.cgroup), format!("agent pid {}", c.pid)];
        let area = chunks[top.attachments.len() + i + 1];
        table_block(f, area, columns::BREAKER_COLUMNS, &cells, &title, selected);
    }
    if let (true, Some(item)) = (pane, current) {
        draw_pane(f, chunks[chunks.len() - 2], hist, &item);
    }
}

/// A block with a table of the columns that fit, its title from `title`'s
/// parts that fit, the `selected` row highlighted.
fn table_block(
    f: &mut Frame,
    area: Rect,
    cols: &'static [columns::Column],
    cells: &[Vec<String>],
    title: &[String],
    selected: Option<usize>,
) {
    // Inside the borders, less a space either side of the title.
    let inner = area.width.saturating_sub(2) as usize;
    let title = columns::fit_parts(title, inner.saturating_sub(2));
    let mut state = TableState::default().with_selected(selected);
    f.render_stateful_widget(table(cols, cells, inner, &title), area, &mut state);
}

/// The selected row's last minutes: offered, passed and dropped for a
/// rule; drop probability, connects and local refusals for a breaker.
fn draw_pane(f: &mut Frame, area: Rect, hist: &History, item: &Item) {
    let bars = (area.width as usize).saturating_sub(2 + SPARK_LABEL).min(POINTS);
    let (name, lines): (&str, Vec<SparkLine>) = match item {
        Item::Rule(id, name) => {
            let Some(h) = hist.rule(*id, name) else { return };
            (
                name,
                vec![
                    SparkLine::new("offered pps", &h.offered),
                    SparkLine::new("passed pps", &h.passed),
                    SparkLine::new("dropped pps", &h.dropped),
                ],
            )
        }
        Item::Breaker(cg, name) => {
            let Some(h) = hist.breaker(*cg, name) else { return };
            (
                name,
                vec![
                    SparkLine::ratio("drop p", &h.drop_probability),
                    SparkLine::new("requests/s", &h.attempts),
                    SparkLine::new("local/s", &h.local),
                ],
            )
        }
    };
    let title = columns::fit_parts(
        &[
            format!("{name}: last {bars} s"),
            "a bar per second, newest right".into(),
            "Enter: details".into(),
        ],
        (area.width as usize).saturating_sub(4),
    );
    let block = Block::default().borders(Borders::ALL).title(format!(" {title} "));
    let inner = block.inner(area);
    f.render_widget(block, area);
    let rows = Layout::vertical(vec![Constraint::Fill(1); lines.len()]).split(inner);
    for (line, row) in lines.iter().zip(rows.iter()) {
        spark_row(f, *row, line, bars);
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
        .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED))
        .block(Block::default().borders(Borders::ALL).title(format!(" {title} ")))
}

/// The title of an attachment's block, in parts by importance (the view
/// keeps as many whole parts as fit).
pub fn attachment_title_parts(a: &super::state::Attachment, cpu: Option<&Series>) -> Vec<String> {
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
    // The CPU signal's last seconds on a fixed 0-100 % scale.
    let trend = cpu
        .filter(|s| !s.is_empty())
        .map(|s| format!(" {}", spark_text(&s.last(CPU_POINTS), Some(1000.0))))
        .unwrap_or_default();
    let mut parts = vec![
        iface,
        format!("CPU {}{trend}", a.cpu),
        up,
        mode,
        "agent running".into(),
        key_tables_text(a),
    ];
    if let Some(l) = &a.leases {
        parts.push(store_text(&l.store));
    }
    parts.extend(klimiter_text(a).split(" | ").filter(|s| !s.is_empty()).map(String::from));
    parts.extend(a.shapers.iter().map(shaper_text));
    parts
}

/// One shaper over the interval, as a title part and a `--once` line.
pub fn shaper_text(s: &super::state::ShaperRow) -> String {
    let dry = if s.dry_run { " dry-run:" } else { "" };
    format!(
        "shaper {} ({} at {}):{dry} {:.0} pps in, {:.0} out, {:.0} held {:.1} ms, {:.0} dropped, backlog {:.0} ms",
        s.shaper,
        s.dst,
        s.rate,
        s.offered_pps,
        s.sent_pps,
        s.delayed_pps,
        s.mean_delay_ms,
        s.horizon_drop_pps,
        s.backlog_ms
    )
}

/// The `?` legend: every column of the rule table (and of the breakers',
/// when there are breakers and room), over the middle.
fn draw_legend(f: &mut Frame, breakers: bool) {
    let mut lines = columns::legend_lines(columns::RULE_COLUMNS);
    lines.extend(columns::key_legend_lines());
    // The breakers' part when it fits too (it does from 36 rows).
    let both = lines.len() + 1 + columns::BREAKER_COLUMNS.len() + 2;
    if breakers && both <= f.area().height as usize {
        lines.push(String::new());
        lines.extend(columns::legend_lines(columns::BREAKER_COLUMNS));
    }
    let area = f.area();
    let w = (lines.iter().map(|l| l.chars().count()).max().unwrap_or(0) + 2)
        .min(area.width as usize) as u16;
    let h = (lines.len() + 2).min(area.height as usize) as u16;
    let rect = Rect {
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
    use crate::cli::top::spark::spark_label;
    use crate::{
        cli::top::state::{Attachment, RuleRow, SortBy},
        dataplane::pins::AttachId,
    };
    use ratatui::{backend::TestBackend, Terminal};

    fn row(name: &str, offered: f64, dropped: f64) -> RuleRow {
        RuleRow::example(name, offered, dropped)
    }

    fn breaker_fixture() -> crate::agent::breakers::Published {
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
        Published {
            cgroup: "/sys/fs/cgroup/app".into(),
            cgroup_id: 7,
            pid: 99,
            profile: "p.toml".into(),
            updated_unix_ms: now,
            breakers: vec![b],
        }
    }

    fn fixture(agent: bool) -> Top {
        Top {
            schema: 1,
            interval_s: 1.0,
            attachments: vec![Attachment {
                id: AttachId { netns_ino: 1, ifindex: 2 },
                stats: Default::default(),
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
                leases: None,
                shapers: vec![],
                rules: vec![row("quiet", 10.0, 0.0), row("noisy", 5000.0, 4000.0)],
            }],
            breakers: vec![],
        }
    }

    fn render(top: &Top, sort: SortBy, paused: bool) -> String {
        render_at(top, sort, paused, false, 240, 12)
    }

    fn render_at(top: &Top, sort: SortBy, paused: bool, legend: bool, w: u16, h: u16) -> String {
        let screen = Screen { sort, paused, legend, ..Default::default() };
        render_screen(top, &History::default(), &screen, None, w, h)
    }

    fn render_screen(
        top: &Top,
        hist: &History,
        screen: &Screen,
        keys: Option<&KeysNow>,
        w: u16,
        h: u16,
    ) -> String {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        t.draw(|f| draw(f, top, hist, screen, keys)).unwrap();
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
    fn shapers_show_in_the_title_and_as_json() {
        let mut top = fixture(true);
        top.attachments[0].shapers = vec![crate::cli::top::state::ShaperRow {
            shaper: "db".into(),
            dst: "10.0.0.5".into(),
            rate: "500/s".into(),
            per: "aggregate".into(),
            dry_run: false,
            offered_pps: 900.0,
            offered_bps: 1e6,
            sent_pps: 500.0,
            delayed_pps: 500.0,
            mean_delay_ms: 150.0,
            horizon_drop_pps: 400.0,
            backlog_ms: 199.0,
            horizon_drops_total: 4000,
        }];
        let text = shaper_text(&top.attachments[0].shapers[0]);
        assert_eq!(text, "shaper db (10.0.0.5 at 500/s): 900 pps in, 500 out, 500 held 150.0 ms, 400 dropped, backlog 199 ms");
        let wide = render_at(&top, SortBy::Profile, false, false, 400, 30);
        assert!(wide.contains("shaper db (10.0.0.5 at 500/s)"), "{wide}");
        let json = serde_json::to_value(&top).unwrap();
        assert_eq!(json["attachments"][0]["shapers"][0]["sent_pps"], 500.0);
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
        let mut top = fixture(true);
        top.breakers = vec![breaker_fixture()];
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

    /// A history of `n` seconds for every rule of `top`: a flood that
    /// starts halfway, and a ratio and CPU signal that move.
    fn history_of(top: &Top, n: usize) -> History {
        let mut hist = History::default();
        for a in &top.attachments {
            for r in &a.rules {
                let h = hist.rules.entry((a.id, r.rule.clone())).or_default();
                h.slice_s = 1.0;
                h.by_reason = true;
                for i in 0..n {
                    let flood = if i >= n / 2 { r.dropped_pps } else { 0.0 };
                    h.offered.push(Some(r.offered_pps - r.dropped_pps + flood));
                    h.passed.push(Some(r.passed_pps));
                    h.dropped.push(Some(flood));
                    h.reasons[flowctl_common::reason::RATE].push(Some(flood));
                    h.would_drop.push(Some(0.0));
                    h.ratio.push(Some(1.0 - 0.5 * (i as f64 / n as f64)));
                }
            }
            let cpu = hist.cpu.entry(a.id).or_default();
            for i in 0..n {
                cpu.push(Some((i * 1000 / n) as f64));
            }
        }
        hist
    }

    fn keys_report() -> KeysNow {
        KeysNow::Report(crate::agent::heavy::HeavyKeys {
            rule: "noisy".into(),
            sample_every: 16,
            samples: 4200.0,
            bound_pps: 40.0,
            keys: vec![crate::agent::heavy::HeavyKey {
                key: "10.9.8.7".into(),
                pps: 4100.0,
                share_pct: 82.0,
                dropped_pps: 3900.0,
                error_pps: 12.0,
            }],
        })
    }

    #[test]
    fn the_selected_rule_gets_a_history_pane_and_the_title_the_cpu_trend() {
        let mut top = fixture(true);
        top.attachments[0].cpu = "45.0% (host)".into();
        let hist = history_of(&top, 60);
        let mut screen = Screen::default();
        screen.step(&top, 1);
        assert_eq!(screen.current(&top), Some(Item::Rule(top.attachments[0].id, "noisy".into())));
        let s = render_screen(&top, &hist, &screen, None, 80, 24);
        assert!(s.contains("noisy: last 48 s"), "{s}");
        let label = spark_label("dropped pps", 4000.0);
        let dropped = s.lines().find(|l| l.contains(&label)).expect(&s);
        assert!(dropped.contains('█') && dropped.contains("    "), "a flood halfway: {dropped}");
        // The CPU signal's last ten seconds, on a 0-100 % scale.
        assert!(s.contains("CPU 45.0% (host) ▇▇████████"), "{s}");
        // Moving past the last row stays on it.
        screen.step(&top, 5);
        assert_eq!(screen.current(&top), Some(Item::Rule(top.attachments[0].id, "noisy".into())));
        screen.step(&top, -5);
        assert_eq!(screen.current(&top), Some(Item::Rule(top.attachments[0].id, "quiet".into())));
    }

    #[test]
    fn the_detail_view_shows_the_rule_whole_its_history_and_its_heaviest_keys() {
        let mut top = fixture(true);
        top.attachments[0].rules[1].drops = vec![crate::cli::top::state::ReasonDrops {
            reason: "rate",
            pps: 4000.0,
            total: 123_456,
        }];
        top.attachments[0].rules[1].limit =
            "100/s packets burst 20 per src, quota 1000 per 60s per src".into();
        let hist = history_of(&top, 180);
        let screen = Screen {
            selected: Some(Item::Rule(top.attachments[0].id, "noisy".into())),
            detail: true,
            ..Default::default()
        };
        for (w, h) in [(80u16, 24u16), (120, 40), (220, 50)] {
            let s = render_screen(&top, &hist, &screen, Some(&keys_report()), w, h);
            println!("detail at {w}x{h}:\n{s}");
            assert!(s.lines().next().unwrap().contains("details: noisy on veth0"), "{s}");
            assert!(
                s.contains("100/s packets burst 20 per src, quota 1000 per 60s per src"),
                "{s}"
            );
            assert!(s.contains("rate 4.00k pps (123.46k since attach)"), "{s}");
            for (name, max) in
                [("offered pps", 5000.0), ("passed pps", 1000.0), ("dropped pps", 4000.0)]
            {
                let label = spark_label(name, max);
                assert!(s.contains(label.trim_end()), "{w}x{h}: {label}:\n{s}");
            }
            assert!(s.contains("heaviest keys now | 1 in 16 sampled"), "{w}x{h}:\n{s}");
            assert!(s.contains("10.9.8.7") && s.contains("82.0"), "{w}x{h}:\n{s}");
            assert!(!s.contains('…'), "{w}x{h}: nothing cut:\n{s}");
            if h >= 40 {
                assert!(s.contains(spark_label("rate drops/s", 4000.0).trim_end()), "{s}");
                assert!(s.contains(spark_label("admission ratio", 1.0).trim_end()), "{s}");
            }
        }
        // Before the first report, and when there is none.
        let s = render_screen(&top, &hist, &screen, Some(&KeysNow::Waiting), 80, 24);
        assert!(s.contains("heaviest keys now: sampling started"), "{s}");
        let failed = KeysNow::Failed("the agent stopped answering".into());
        let s = render_screen(&top, &hist, &screen, Some(&failed), 80, 24);
        assert!(s.contains("heaviest keys now: the agent stopped answering"), "{s}");
    }

    #[test]
    fn bbr_and_klimiter_get_charts_where_the_rows_allow() {
        use crate::agent::klimiter::{
            PublishedBaseline, PublishedEntry, PublishedShare, PublishedStep,
        };
        let mut top = fixture(true);
        let id = top.attachments[0].id;
        top.attachments[0].rules[1].bbr = Some(crate::cli::top::state::BbrRow {
            max_pass: 25,
            min_rt_ms: 3,
            in_flight: 7,
            max_in_flight: Some(5),
            overloaded: true,
        });
        top.attachments[0].klimiter = Some(PublishedStep {
            baselines: vec![PublishedBaseline {
                name: "db".into(),
                level: Some(80.0),
                threshold: 70.0,
                band: "cutting".into(),
                entries: vec![PublishedShare {
                    rule: "noisy".into(),
                    coefficient: Some(0.5),
                    share: Some(1.0),
                }],
            }],
            entries: vec![PublishedEntry {
                rule: "noisy".into(),
                ratio: 0.5,
                reason: "cut: db over threshold".into(),
            }],
        });
        let mut hist = history_of(&top, 120);
        let h = hist.rules.get_mut(&(id, "noisy".into())).unwrap();
        for i in 0..120 {
            h.bbr_in_flight.push(Some((i % 10) as f64));
            h.bbr_limit.push(Some(5.0));
        }
        let b = hist.baselines.entry((id, "db".into())).or_default();
        for i in 0..120 {
            b.level.push(Some(60.0 + (i % 30) as f64));
            b.threshold.push(Some(70.0));
        }
        let screen = Screen {
            selected: Some(Item::Rule(id, "noisy".into())),
            detail: true,
            ..Default::default()
        };
        let s = render_screen(&top, &hist, &screen, Some(&keys_report()), 220, 50);
        println!("{s}");
        assert!(s.contains("BBR: in flight (line) against its limit (dots)"), "{s}");
        assert!(s.contains("KLimiter db: level (line) against its threshold (dots)"), "{s}");
        assert!(s.contains("BBR in flight 7 / limit 5 (overloaded)"), "{s}");
        assert!(s.contains("KLimiter ratio 0.500: cut: db over threshold"), "{s}");
        assert!(s.contains("10.9.8.7"), "the keys still show: {s}");
        // At 80x24 no chart fits; the keys keep their rows.
        let s = render_screen(&top, &hist, &screen, Some(&keys_report()), 80, 24);
        assert!(!s.contains("against its limit") && s.contains("10.9.8.7"), "{s}");
    }

    #[test]
    fn a_breakers_detail_shows_its_state_over_time() {
        let mut top = fixture(true);
        top.breakers = vec![breaker_fixture()];
        let mut hist = History::default();
        let bh = hist.breakers.entry((7, "db".into())).or_default();
        for i in 0..60 {
            bh.state.push_back(Some(if i < 30 { 'c' } else { 'o' }));
            bh.drop_probability.push(Some(if i < 30 { 0.0 } else { 1.0 }));
            bh.attempts.push(Some(10.0));
            bh.successes.push(Some(if i < 30 { 10.0 } else { 0.0 }));
            bh.refused_by_peer.push(Some(0.0));
            bh.timeouts.push(Some(if i < 30 { 0.0 } else { 10.0 }));
            bh.local.push(Some(if i < 30 { 0.0 } else { 90.0 }));
        }
        let mut screen = Screen::default();
        screen.step(&top, 2);
        assert_eq!(screen.current(&top), Some(Item::Breaker(7, "db".into())));
        let s = render_screen(&top, &hist, &screen, None, 80, 24);
        println!("{s}");
        assert!(s.contains("db: last 48 s"), "the pane: {s}");
        screen.detail = true;
        let s = render_screen(&top, &hist, &screen, None, 80, 24);
        println!("{s}");
        assert!(s.contains("details: breaker db"), "{s}");
        assert!(s.contains("half-open 1/3 · drop p 1.00"), "{s}");
        let state = s.lines().find(|l| l.contains("state c t h o")).expect(&s);
        assert!(state.contains("cccooo"), "{state}");
        assert!(s.contains(spark_label("local/s", 90.0).trim_end()), "{s}");
        assert!(!s.contains('…'), "{s}");
    }
}
