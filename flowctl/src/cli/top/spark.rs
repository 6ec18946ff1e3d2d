//! A labelled sparkline, the one picture of a series both the main view's
//! history pane and the detail view draw: the label says the line's scale,
//! the newest point is at the right.

use super::{columns, history::Series};
use crate::cli::format::si;
use ratatui::{
    layout::{Constraint, Layout, Rect},
    widgets::{Paragraph, Sparkline},
    Frame,
};

/// The label before a sparkline: name, then "max" and the line's scale.
pub const SPARK_LABEL: usize = 30;
/// The widest name a sparkline label has room for ("admission drops/s").
const SPARK_NAME: usize = 17;

/// A sparkline to draw: its label, its points and its scale (`None`: its
/// own largest point; a ratio or a probability is drawn on 0 to 1).
pub struct SparkLine<'a> {
    pub label: String,
    pub series: &'a Series,
    pub scale: Option<f64>,
}

impl<'a> SparkLine<'a> {
    pub fn new(label: impl Into<String>, series: &'a Series) -> Self {
        Self { label: label.into(), series, scale: None }
    }

    /// On a fixed 0 to 1 scale.
    pub fn ratio(label: impl Into<String>, series: &'a Series) -> Self {
        Self { label: label.into(), series, scale: Some(1.0) }
    }
}

/// One labelled sparkline (as tall as `area`): the label with the line's
/// scale on its first row, then the newest `bars` points with the newest at
/// the right.
pub fn spark_row(f: &mut Frame, area: Rect, line: &SparkLine, bars: usize) {
    let SparkLine { label, series, scale } = line;
    let max = scale.unwrap_or_else(|| series.max_last(bars));
    let cols = Layout::horizontal([Constraint::Length(SPARK_LABEL as u16), Constraint::Fill(1)])
        .split(area);
    f.render_widget(Paragraph::new(spark_label(label, max)), Rect { height: 1, ..cols[0] });
    f.render_widget(sparkline(series, bars, max), cols[1]);
}

/// "name   max   4.74k ", [`SPARK_LABEL`] wide: numbers at or under 1 (a
/// ratio, a probability) keep two decimals.
pub fn spark_label(label: &str, max: f64) -> String {
    let scale = if max > 0.0 && max <= 1.0 { format!("{max:.2}") } else { si(max) };
    format!("{:<SPARK_NAME$} max {scale:>7} ", columns::ellipsize(label, SPARK_NAME))
}

/// A sparkline widget of the newest `bars` points (newest at the right),
/// scaled to `max`; gaps and zeros are blank.
pub fn sparkline(series: &Series, bars: usize, max: f64) -> Sparkline<'static> {
    // The widget takes integers: thousandths keep ratios and small rates.
    let scaled = |v: f64| (v * 1000.0).round().max(0.0) as u64;
    let mut points: Vec<Option<u64>> =
        series.last(bars).into_iter().map(|p| p.map(scaled)).collect();
    points.reverse();
    Sparkline::default()
        .data(points)
        .max(scaled(max).max(1))
        .direction(ratatui::widgets::RenderDirection::RightToLeft)
}
