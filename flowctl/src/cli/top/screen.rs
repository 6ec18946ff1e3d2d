//! What the operator chose to look at (sort, pause, legend, the selected
//! row, its detail view), apart from what is measured (`state`,
//! `history`) and from how it is drawn (`view`, `detail`).

use super::state::{SortBy, Top};
use crate::dataplane::pins::AttachId;

/// A row the arrow keys can select.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    Rule(AttachId, String),
    /// A breaker: its cgroup's id and its name.
    Breaker(u64, String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Screen {
    pub sort: SortBy,
    pub paused: bool,
    pub legend: bool,
    /// The selected row (`None`: the first one).
    pub selected: Option<Item>,
    /// The selected row's detail view is open.
    pub detail: bool,
}

impl Default for Screen {
    fn default() -> Self {
        Self { sort: SortBy::Profile, paused: false, legend: false, selected: None, detail: false }
    }
}

impl Screen {
    /// Every selectable row in drawing order: each attachment's rules in
    /// the sort order, then the breakers.
    pub fn items(&self, top: &Top) -> Vec<Item> {
        let mut out = Vec::new();
        for a in &top.attachments {
            let mut rows = a.rules.clone();
            self.sort.apply(&mut rows);
            out.extend(rows.into_iter().map(|r| Item::Rule(a.id, r.rule)));
        }
        for c in &top.breakers {
            out.extend(c.breakers.iter().map(|b| Item::Breaker(c.cgroup_id, b.name.clone())));
        }
        out
    }

    /// The selected row if it is still there, else the first row.
    pub fn current(&self, top: &Top) -> Option<Item> {
        let items = self.items(top);
        self.selected.clone().filter(|s| items.contains(s)).or_else(|| items.first().cloned())
    }

    /// Moves the selection `by` rows (negative: up), stopping at the ends.
    pub fn step(&mut self, top: &Top, by: isize) {
        let items = self.items(top);
        if items.is_empty() {
            return;
        }
        let at = self.current(top).and_then(|c| items.iter().position(|i| *i == c)).unwrap_or(0);
        let to = (at as isize + by).clamp(0, items.len() as isize - 1) as usize;
        self.selected = Some(items[to].clone());
    }
}
