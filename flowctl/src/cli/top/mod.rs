//! `flowctl top`: a live view of every attachment's rules, read-only, from
//! the pinned maps (works against a running agent and a kept data plane).

pub mod columns;
pub mod detail;
pub mod history;
pub mod keys;
pub mod screen;
pub mod spark;
pub mod state;
pub mod view;

use anyhow::Result;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use screen::{Item, Screen};
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
    only: &super::Only,
    json: bool,
    width: Option<usize>,
) -> Result<()> {
    let a = state::sample();
    std::thread::sleep(interval);
    let b = state::sample();
    let top = state::compute(&a, &b, only)?;
    // What the statistics rings still hold (the drops column).
    let mut hist = history::History::default();
    hist.update(&top);
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
        out!("{}", columns::fit_parts(&view::attachment_title_parts(a, None), width));
        let cells: Vec<Vec<String>> = a
            .rules
            .iter()
            .map(|r| columns::rule_cells(r, a.klimiter.as_ref(), hist.rule(a.id, &r.rule)))
            .collect();
        for line in columns::text_table(columns::RULE_COLUMNS, &cells, width.saturating_sub(2)) {
            out!("  {line}");
        }
        for s in &a.shapers {
            out!("  {}", view::shaper_text(s));
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

/// How often the detail view takes the kernel's key samples (a ring buffer
/// that fills between reads).
const KEYS_POLL: Duration = Duration::from_millis(250);

pub fn run(interval: Duration, only: &super::Only) -> Result<()> {
    let mut terminal = ratatui::try_init()?;
    let _guard = TerminalGuard;
    let mut screen = Screen::default();
    let mut hist = history::History::default();
    let mut prev = state::sample();
    // A first picture at once, from a short interval.
    std::thread::sleep(Duration::from_millis(200));
    let mut cur = state::sample();
    let mut top = state::compute(&prev, &cur, only)?;
    hist.update(&top);
    let mut keys = HeavyKeysPanel::default();
    let mut next = Instant::now() + interval;
    loop {
        keys.follow(&screen, &top);
        terminal.draw(|f| view::draw(f, &top, &hist, &screen, keys.now.as_ref()))?;
        let until_read = next.saturating_duration_since(Instant::now());
        let wait = if keys.source.is_some() { until_read.min(KEYS_POLL) } else { until_read };
        if event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                match k.code {
                    KeyCode::Char('q') => break,
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => break,
                    KeyCode::Esc if screen.legend => screen.legend = false,
                    KeyCode::Esc if screen.detail => screen.detail = false,
                    KeyCode::Esc => break,
                    KeyCode::Char('?') => screen.legend = !screen.legend,
                    KeyCode::Char('s') => screen.sort = screen.sort.next(),
                    KeyCode::Char('p') | KeyCode::Char(' ') => screen.paused = !screen.paused,
                    KeyCode::Up | KeyCode::Char('k') => screen.step(&top, -1),
                    KeyCode::Down | KeyCode::Char('j') => screen.step(&top, 1),
                    KeyCode::Enter => screen.detail = screen.current(&top).is_some(),
                    _ => {}
                }
            }
            continue;
        }
        keys.poll();
        if Instant::now() < next {
            continue;
        }
        next = Instant::now() + interval;
        if !screen.paused {
            prev = cur;
            cur = state::sample();
            top = state::compute(&prev, &cur, only)?;
            hist.update(&top);
            keys.refresh();
        }
    }
    Ok(())
}

/// The detail view's heaviest keys: a sampling source while a rule's
/// detail is open (sampling stops when it closes), and its last report.
#[derive(Default)]
struct HeavyKeysPanel {
    source: Option<keys::Source>,
    rule: Option<String>,
    now: Option<keys::KeysNow>,
}

impl HeavyKeysPanel {
    /// Opens, switches or closes the source for what the screen shows.
    fn follow(&mut self, screen: &Screen, top: &state::Top) {
        let want = match (screen.detail, screen.current(top)) {
            (true, Some(Item::Rule(id, rule))) => Some((id, rule)),
            _ => None,
        };
        let Some((id, rule)) = want else {
            *self = Self::default();
            return;
        };
        if self.source.as_ref().is_none_or(|s| s.attachment() != id) {
            *self = Self::default();
            match keys::Source::for_attachment(id) {
                Ok(s) => self.source = Some(s),
                Err(e) => self.now = Some(keys::KeysNow::Failed(format!("{e:#}"))),
            }
        }
        if self.rule.as_deref() != Some(rule.as_str()) {
            self.rule = Some(rule);
            self.now = None;
            self.refresh();
            if matches!(self.now, Some(keys::KeysNow::Report(ref r)) if r.samples == 0.0) {
                self.now = Some(keys::KeysNow::Waiting);
            }
        }
    }

    fn poll(&mut self) {
        if let Some(s) = &mut self.source {
            if let Err(e) = s.poll() {
                self.now = Some(keys::KeysNow::Failed(format!("{e:#}")));
            }
        }
    }

    fn refresh(&mut self) {
        let (Some(s), Some(rule)) = (&mut self.source, &self.rule) else { return };
        self.now = Some(match s.report(rule, detail::KEYS_WANTED) {
            Ok(r) => keys::KeysNow::Report(r),
            Err(e) => keys::KeysNow::Failed(format!("{e:#}")),
        });
    }
}
