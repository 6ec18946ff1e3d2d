//! `flowctl top --keys RULE`: the heaviest keys of one rule now, from the
//! kernel's packet samples and a Space-Saving sketch (`crate::agent::heavy`, which
//! states the error bound). With an agent running, the agent samples and
//! this asks it over the control socket; without one, this process samples
//! itself (a ring buffer has one reader) and turns sampling off on exit.

use crate::{
    agent::{
        heavy::{self, HeavyKeys, KeyWatcher},
        socket::Request,
    },
    dataplane::{
        pins::{self, AttachId},
        state::AttachState,
        Maps,
    },
};
use anyhow::{anyhow, bail, Result};
use ratatui::{
    crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers},
    layout::Constraint,
    style::{Modifier, Style},
    widgets::{Block, Borders, Row, Table},
};
use std::time::{Duration, Instant};

/// Where the reports come from.
// One per `top` process, so the size of `Local` does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    Agent(AttachId),
    /// No agent: sample here. Sampling is switched off again on drop.
    Local {
        watcher: KeyWatcher,
        maps: Maps,
        state: AttachState,
    },
}

impl Drop for Source {
    fn drop(&mut self) {
        if let Source::Local { watcher, maps, .. } = self {
            let _ = watcher.stop(maps);
        }
    }
}

impl Source {
    fn open(only: &crate::cli::Only) -> Result<Self> {
        let mut found = Vec::new();
        for id in pins::list_attachments() {
            if let Some(s) = AttachState::load(&id)? {
                if only.shows(&id, &s.iface) {
                    found.push((id, s));
                }
            }
        }
        let (id, _) = match found.len() {
            0 => bail!(
                "no flowctl attachment{}",
                only.iface().map(|i| format!(" on {i}")).unwrap_or_default()
            ),
            1 => found.remove(0),
            _ => bail!(
                "several attachments ({}): name the interface, e.g. `flowctl top {} --keys RULE`",
                found.iter().map(|(_, s)| s.iface.as_str()).collect::<Vec<_>>().join(", "),
                found[0].1.iface
            ),
        };
        Self::for_attachment(id)
    }

    /// Reports on `id`'s rules: from its agent, or sampled here.
    pub fn for_attachment(id: AttachId) -> Result<Self> {
        if pins::agent_running(&id) {
            return Ok(Source::Agent(id));
        }
        let state = AttachState::load(&id)?.ok_or_else(|| anyhow!("the attachment is gone"))?;
        let mut maps = Maps::open(&id)?;
        let mut watcher = KeyWatcher::open(&id)?;
        watcher.ask(&mut maps)?;
        Ok(Source::Local { watcher, maps, state })
    }

    /// Which attachment this reports on.
    pub fn attachment(&self) -> AttachId {
        match self {
            Source::Agent(id) => *id,
            Source::Local { state, .. } => state.id,
        }
    }

    /// Takes the samples the kernel wrote since (sampling here only).
    pub fn poll(&mut self) -> Result<()> {
        if let Source::Local { watcher, maps, .. } = self {
            watcher.poll(maps)?;
        }
        Ok(())
    }

    pub fn report(&mut self, rule: &str, n: usize) -> Result<HeavyKeys> {
        match self {
            Source::Agent(id) => {
                let resp = crate::agent::socket::call(
                    id,
                    &Request::Keys { rule: rule.to_string(), top: n },
                )?
                .ok_or_else(|| anyhow!("the agent stopped answering"))?;
                if !resp.ok {
                    bail!("{}", resp.message);
                }
                Ok(serde_json::from_value(
                    resp.data.ok_or_else(|| anyhow!("the agent sent no report"))?,
                )?)
            }
            Source::Local { watcher, maps, state } => {
                watcher.ask(maps)?;
                watcher.poll(maps)?;
                heavy::rule_report(watcher, maps, state, rule, n)
            }
        }
    }
}

/// The heaviest keys as the detail view shows them.
#[derive(Clone, Debug, PartialEq)]
pub enum KeysNow {
    /// Sampling has started; no report yet.
    Waiting,
    Report(HeavyKeys),
    /// Why there is none (said in the view, never a stale report).
    Failed(String),
}

/// `--once`: start sampling, wait `interval`, print one report.
pub fn once(
    interval: Duration,
    only: &crate::cli::Only,
    rule: &str,
    n: usize,
    json: bool,
) -> Result<()> {
    let mut src = Source::open(only)?;
    src.report(rule, n)?; // validates the rule name and starts the agent's sampling
    let end = Instant::now() + interval;
    while Instant::now() < end {
        std::thread::sleep(
            Duration::from_millis(100).min(end.saturating_duration_since(Instant::now())),
        );
        if let Source::Local { watcher, maps, .. } = &mut src {
            watcher.poll(maps)?;
        }
    }
    let r = src.report(rule, n)?;
    if json {
        out!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        for line in text(&r) {
            out!("{line}");
        }
    }
    Ok(())
}

fn text(r: &HeavyKeys) -> Vec<String> {
    let mut v = vec![format!(
        "rule {}: heaviest keys (sampling 1 in {}, {:.0} samples; each pps may be high by at most its error, and no key above {} pps is missing)",
        r.rule,
        r.sample_every,
        r.samples,
        crate::cli::format::si(r.bound_pps)
    )];
    v.push(format!(
        "  {:<40} {:>10} {:>8} {:>12} {:>10}",
        "key", "pps", "share %", "dropped pps", "error pps"
    ));
    for k in &r.keys {
        v.push(format!(
            "  {:<40} {:>10} {:>8.1} {:>12} {:>10}",
            k.key,
            crate::cli::format::si(k.pps),
            k.share_pct,
            crate::cli::format::si(k.dropped_pps),
            crate::cli::format::si(k.error_pps)
        ));
    }
    v
}

/// The live view: refreshes every `interval`; q, Esc or Ctrl-C quits.
pub fn run(interval: Duration, only: &crate::cli::Only, rule: &str, n: usize) -> Result<()> {
    let mut src = Source::open(only)?;
    let mut report = src.report(rule, n)?;
    let mut terminal = ratatui::try_init()?;
    let _guard = super::TerminalGuard;
    let mut next = Instant::now() + interval.min(Duration::from_millis(500));
    loop {
        terminal.draw(|f| {
            let title = format!(
                " flowctl top --keys {} | 1 in {} sampled | error <= {} pps per key | q quit ",
                report.rule,
                report.sample_every,
                crate::cli::format::si(report.bound_pps)
            );
            let header = Row::new(["key", "pps", "share %", "dropped pps", "error pps"])
                .style(Style::default().add_modifier(Modifier::BOLD));
            let rows = report.keys.iter().map(|k| {
                Row::new(vec![
                    k.key.clone(),
                    crate::cli::format::si(k.pps),
                    format!("{:.1}", k.share_pct),
                    crate::cli::format::si(k.dropped_pps),
                    crate::cli::format::si(k.error_pps),
                ])
            });
            let widths = [
                Constraint::Min(40),
                Constraint::Length(10),
                Constraint::Length(8),
                Constraint::Length(12),
                Constraint::Length(10),
            ];
            f.render_widget(
                Table::new(rows, widths)
                    .header(header)
                    .block(Block::default().borders(Borders::ALL).title(title)),
                f.area(),
            );
        })?;
        let wait = next.saturating_duration_since(Instant::now()).min(Duration::from_millis(250));
        if event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                if k.kind == KeyEventKind::Press
                    && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
                        || (k.code == KeyCode::Char('c')
                            && k.modifiers.contains(KeyModifiers::CONTROL)))
                {
                    break;
                }
            }
            continue;
        }
        if let Source::Local { watcher, maps, .. } = &mut src {
            watcher.poll(maps)?;
        }
        if Instant::now() >= next {
            report = src.report(rule, n)?;
            next = Instant::now() + interval;
        }
    }
    Ok(())
}
