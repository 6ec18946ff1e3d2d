//! `flowctl top`: a live view of every attachment's rules, read-only, from
//! the pinned maps (works against a running agent and a kept data plane).

pub mod columns;
pub mod keys;
pub mod state;
pub mod view;

use anyhow::Result;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use state::SortBy;
use std::time::{Duration, Instant};

/// Restores the terminal however `top` ends (ratatui's init also installs a
/// panic hook that restores first).
pub(crate) struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// `--once`: two reads `interval` apart, printed as JSON or as text.
/// `width`: the text's width (`None`: the terminal's, or every column when
/// stdout is not a terminal).
pub fn once(
    interval: Duration,
    iface: Option<&str>,
    json: bool,
    width: Option<usize>,
) -> Result<()> {
    let a = state::sample();
    std::thread::sleep(interval);
    let b = state::sample();
    let top = state::compute(&a, &b, iface)?;
    if json {
        out!("{}", serde_json::to_string_pretty(&top)?);
        return Ok(());
    }
    let width = width.unwrap_or_else(|| {
        use std::io::IsTerminal;
        if std::io::stdout().is_terminal() {
            ratatui::crossterm::terminal::size().map(|(w, _)| w as usize).unwrap_or(usize::MAX)
        } else {
            // A pipe or a file: every column.
            usize::MAX
        }
    });
    for a in &top.attachments {
        out!("{}", columns::fit_parts(&view::attachment_title_parts(a), width));
        let cells: Vec<Vec<String>> =
            a.rules.iter().map(|r| columns::rule_cells(r, a.klimiter.as_ref())).collect();
        for line in columns::text_table(columns::RULE_COLUMNS, &cells, width.saturating_sub(2)) {
            out!("  {line}");
        }
    }
    for c in &top.breakers {
        out!("breakers of cgroup {} (agent pid {})", c.cgroup, c.pid);
        let cells: Vec<Vec<String>> = c.breakers.iter().map(columns::breaker_cells).collect();
        for line in columns::text_table(columns::BREAKER_COLUMNS, &cells, width.saturating_sub(2)) {
            out!("  {line}");
        }
    }
    Ok(())
}

pub fn run(interval: Duration, iface: Option<&str>) -> Result<()> {
    let mut terminal = ratatui::try_init()?;
    let _guard = TerminalGuard;
    let mut sort = SortBy::Profile;
    let mut paused = false;
    let mut legend = false;
    let mut prev = state::sample();
    // A first picture at once, from a short interval.
    std::thread::sleep(Duration::from_millis(200));
    let mut cur = state::sample();
    let mut top = state::compute(&prev, &cur, iface)?;
    let mut next = Instant::now() + interval;
    loop {
        terminal.draw(|f| view::draw(f, &top, sort, paused, legend))?;
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                match k.code {
                    KeyCode::Char('q') => break,
                    KeyCode::Esc if legend => legend = false,
                    KeyCode::Esc => break,
                    KeyCode::Char('?') => legend = !legend,
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => break,
                    KeyCode::Char('s') => sort = sort.next(),
                    KeyCode::Char('p') | KeyCode::Char(' ') => paused = !paused,
                    _ => {}
                }
            }
            continue;
        }
        next = Instant::now() + interval;
        if !paused {
            prev = cur;
            cur = state::sample();
            top = state::compute(&prev, &cur, iface)?;
        }
    }
    Ok(())
}
