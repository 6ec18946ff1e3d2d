//! Which exposition format a scraper gets, negotiated on its `Accept`
//! header. prometheus-client encodes OpenMetrics 1.0 text (a counter
//! family `x` with samples `x_total`, a closing `# EOF`); a scraper that
//! does not ask for OpenMetrics gets the classic Prometheus text format
//! 0.0.4 instead, where the family is named after its samples
//! (`# TYPE x_total counter`) and nothing closes the body. Serving the
//! OpenMetrics body as `text/plain; version=0.0.4` made classic parsers
//! type every counter as untyped (promtool: "no help text").
//!
//! References: the OpenMetrics 1.0 specification (counters, `# EOF`, the
//! `application/openmetrics-text; version=1.0.0` media type) and
//! Prometheus' "Exposition formats" page (text format 0.0.4, `# HELP` and
//! `# TYPE` name the series as sampled).

/// The content type of an OpenMetrics body.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of a classic text body.
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The two formats the endpoint serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    OpenMetrics,
    Classic,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => OPENMETRICS,
            Format::Classic => CLASSIC,
        }
    }

    /// The body in this format, from prometheus-client's OpenMetrics text.
    pub fn body(self, openmetrics: String) -> String {
        match self {
            Format::OpenMetrics => openmetrics,
            Format::Classic => classic_text(&openmetrics),
        }
    }
}

/// The format for an `Accept` header (RFC 9110 section 12.5.1: media
/// ranges with optional `q` weights): OpenMetrics when the client weighs
/// `application/openmetrics-text` above zero and at least as high as
/// `text/plain`; the classic format otherwise, and without a header.
pub fn negotiate(accept: Option<&str>) -> Format {
    let Some(accept) = accept else { return Format::Classic };
    let (mut om, mut text) = (0.0f32, 0.0f32);
    for range in accept.split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or("").to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .and_then(|(_, v)| v.trim().parse::<f32>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" | "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    if om > 0.0 && om >= text {
        Format::OpenMetrics
    } else {
        Format::Classic
    }
}

/// OpenMetrics text as the classic text format: a counter family's
/// `# HELP` and `# TYPE` take the `_total` its samples carry, `# UNIT` and
/// `# EOF` go (the classic format has neither), and a type the classic
/// format lacks is given as `untyped`. Samples pass unchanged: both
/// formats write `name{labels} value` with the same escaping.
pub fn classic_text(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some((name, kind)) = line.strip_prefix("# TYPE ").and_then(|r| r.split_once(' ')) {
            if kind == "counter" {
                counters.insert(name.to_string());
            }
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            Some((p, name, tail))
        });
        match meta {
            Some((p, name, tail)) => {
                let name = if counters.contains(name) && !name.ends_with("_total") {
                    format!("{name}_total")
                } else {
                    name.to_string()
                };
                let tail = match (p, tail) {
                    ("# TYPE ", "counter" | "gauge" | "histogram" | "summary") => tail,
                    ("# TYPE ", _) => "untyped",
                    _ => tail,
                };
                out.push_str(p);
                out.push_str(&name);
                if !tail.is_empty() || p == "# TYPE " {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OM: &str = "# HELP flowctl_packets Packets by verdict.\n# TYPE flowctl_packets counter\nflowctl_packets_total{rule=\"udp\",verdict=\"passed\"} 12\n# HELP flowctl_rules Rules in the active profile.\n# TYPE flowctl_rules gauge\nflowctl_rules 1\n# HELP flowctl_x_seconds Something with a unit.\n# TYPE flowctl_x_seconds gauge\n# UNIT flowctl_x_seconds seconds\nflowctl_x_seconds 0.5\n# TYPE flowctl_state stateset\nflowctl_state{flowctl_state=\"ok\"} 1\n# EOF\n";

    #[test]
    fn counters_are_named_after_their_samples_and_the_om_lines_go() {
        assert_eq!(
            classic_text(OM),
            "# HELP flowctl_packets_total Packets by verdict.\n# TYPE flowctl_packets_total counter\nflowctl_packets_total{rule=\"udp\",verdict=\"passed\"} 12\n# HELP flowctl_rules Rules in the active profile.\n# TYPE flowctl_rules gauge\nflowctl_rules 1\n# HELP flowctl_x_seconds Something with a unit.\n# TYPE flowctl_x_seconds gauge\nflowctl_x_seconds 0.5\n# TYPE flowctl_state untyped\nflowctl_state{flowctl_state=\"ok\"} 1\n"
        );
    }

    #[test]
    fn accept_picks_the_format() {
        // What Prometheus 2.x sends by default: OpenMetrics preferred.
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(negotiate(Some(prom)), Format::OpenMetrics);
        // Prometheus with `scrape_classic` preferences, curl, promtool.
        assert_eq!(
            negotiate(Some("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5")),
            Format::Classic
        );
        assert_eq!(negotiate(Some("*/*")), Format::Classic);
        assert_eq!(negotiate(None), Format::Classic);
        assert_eq!(negotiate(Some("application/openmetrics-text; q=0")), Format::Classic);
        assert_eq!(negotiate(Some("Application/OpenMetrics-Text")), Format::OpenMetrics);
    }
}
