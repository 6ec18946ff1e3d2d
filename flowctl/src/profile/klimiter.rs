//! The KLimiter sections: `[klimiter]` timing and `[[baseline]]` tables,
//! each a threshold, its entries (rules) and a level source. A rule's
//! `priority` (its floor) is read with the rule; whether a baseline lists
//! it is checked in `super::parse`.

use super::{
    error::{Ctx, ProfileError},
    model::{TCP, UDP},
    primitives::{addr_words, duration, name, parse_prefix, Prefix},
    raw::{RawBaseline, RawKlimiter, RawSource},
};
use flowctl_common::tables::Cidr;
use toml::Spanned;

// The validated KLimiter types live in `model`; callers name them here.
pub use super::model::{Baseline, KlimiterSettings, LevelSource};

/// Validates `[klimiter]`.
pub(super) fn settings(cx: &Ctx, raw: &RawKlimiter) -> Result<KlimiterSettings, ProfileError> {
    let mut k = KlimiterSettings::default();
    if let Some(v) = &raw.sample_period {
        k.sample_period_ns = duration(cx, v, "duration")?;
    }
    if let Some(v) = &raw.control_period {
        k.control_period_ns = duration(cx, v, "duration")?;
    }
    if k.sample_period_ns < 100_000_000 || k.control_period_ns < k.sample_period_ns {
        let span = raw
            .control_period
            .as_ref()
            .or(raw.sample_period.as_ref())
            .map(|v| v.span())
            .unwrap_or(0..0);
        return Err(cx.err(span, "klimiter: sample_period must be at least 100ms and control_period at least sample_period"));
    }
    if let Some(v) = &raw.dead_band {
        if !(0.0..0.5).contains(v.get_ref()) {
            return Err(
                cx.err(v.span(), format!("dead_band {} out of range: 0.0 to 0.5", v.get_ref()))
            );
        }
        k.dead_band = *v.get_ref();
    }
    if let Some(v) = &raw.stale_after {
        k.stale_after_ns = duration(cx, v, "duration")?;
    }
    Ok(k)
}

/// Validates one `[[baseline]]`; `rule_names` are the profile's rules, in
/// order (entries are their indices).
pub(super) fn baseline(
    cx: &Ctx,
    raw: &Spanned<RawBaseline>,
    rule_names: &[String],
) -> Result<Baseline, ProfileError> {
    let raw = raw.get_ref();
    let name =
        name(cx, &raw.name, usize::MAX, "baseline names are letters, digits, '-', '_' or '.'")?;
    let t = *raw.threshold.get_ref();
    if !(t > 0.0 && t.is_finite()) {
        return Err(
            cx.err(raw.threshold.span(), format!("threshold {t} must be a positive number"))
        );
    }
    let names = raw.entries.get_ref();
    let entries: Vec<usize> = if names.len() == 1 && names[0] == "all" {
        (0..rule_names.len()).collect()
    } else {
        let mut v = Vec::new();
        for n in names {
            match rule_names.iter().position(|r| r == n) {
                Some(i) => v.push(i),
                None => {
                    return Err(cx.err(
                        raw.entries.span(),
                        format!(
                        "baseline {name}: no rule named `{n}` (entries name rules, or [\"all\"])"
                    ),
                    ))
                }
            }
        }
        v
    };
    if entries.is_empty() {
        return Err(cx.err(raw.entries.span(), format!("baseline {name} lists no entries")));
    }
    let source = level_source(cx, &raw.source)?;
    Ok(Baseline { name, threshold: t, entries, source })
}

/// A baseline's `source`: errors point at the whole table, but for an
/// unknown `kind`.
fn level_source(cx: &Ctx, raw: &Spanned<RawSource>) -> Result<LevelSource, ProfileError> {
    let s = raw.get_ref();
    let at_source = |msg: &str| cx.err(raw.span(), msg);
    Ok(match s.kind.get_ref().as_str() {
        "cpu" => LevelSource::Cpu,
        "gauge" => match (&s.file, &s.command, &s.url) {
            (Some(f), None, None) => LevelSource::File(f.clone()),
            (None, Some(c), None) => LevelSource::Command(c.clone()),
            (None, None, Some(u)) => {
                if !u.starts_with("http://") {
                    return Err(at_source(
                        "gauge url: only http:// endpoints (Prometheus text format)",
                    ));
                }
                let Some(m) = &s.metric else {
                    return Err(at_source(
                        "a gauge url needs `metric`, the name of the sample to read",
                    ));
                };
                LevelSource::Http { url: u.clone(), metric: m.clone() }
            }
            _ => return Err(at_source("a gauge reads exactly one of `file`, `command` or `url`")),
        },
        "egress" => egress(s).map_err(|m| at_source(&m))?,
        other => {
            return Err(cx.err(
                s.kind.span(),
                format!("unknown source kind `{other}`: cpu, gauge or egress"),
            ))
        }
    })
}

/// `kind = "egress"`: the downstream endpoint the TC egress program counts
/// packets (or SYNs) to. Its `dst` may have host bits set, and its `dport`
/// is 1-65535 or a `"lo-hi"` range: unlike a rule's or a breaker's.
fn egress(s: &RawSource) -> Result<LevelSource, String> {
    let iface = s.iface.clone().ok_or(
        "an egress source needs `iface`, the interface traffic to the downstream leaves by",
    )?;
    let dst = s
        .dst
        .as_deref()
        .ok_or("an egress source needs `dst`, the downstream's address or prefix")?;
    let Prefix { addr: ip, len } = parse_prefix(dst).map_err(|m| format!("egress dst: {m}"))?;
    let max = Cidr::max_len(&ip);
    let prefix_len = match len {
        Some((n, _)) if n <= max => n,
        Some((_, l)) => return Err(format!("egress dst: bad prefix length `{l}`")),
        None => max,
    };
    let (addr, family) = addr_words(&ip);
    let mut t = flowctl_common::EgressTarget { prefix_len, family, addr, ..Default::default() };
    t.proto = match s.proto.as_deref().unwrap_or("any") {
        "any" => 0,
        "tcp" => TCP,
        "udp" => UDP,
        other => return Err(format!("egress proto `{other}`: tcp, udp or any")),
    };
    (t.port_lo, t.port_hi) = match &s.dport {
        None => (0, u16::MAX),
        Some(toml::Value::Integer(p)) if (1..=65535).contains(p) => (*p as u16, *p as u16),
        Some(toml::Value::String(r)) => {
            let (a, b) = r
                .split_once('-')
                .ok_or(format!("egress dport `{r}`: a port or a range \"lo-hi\""))?;
            let (a, b): (u16, u16) = (
                a.trim().parse().map_err(|_| format!("egress dport `{r}`"))?,
                b.trim().parse().map_err(|_| format!("egress dport `{r}`"))?,
            );
            if a > b {
                return Err(format!("egress dport `{r}`: reversed range"));
            }
            (a, b)
        }
        Some(v) => {
            return Err(format!("egress dport `{v:?}`: a port (1-65535) or a range \"lo-hi\""))
        }
    };
    let connections = match s.unit.as_deref().unwrap_or("packets") {
        "packets" => false,
        "connections" => {
            if t.proto == UDP {
                return Err(
                    "egress unit = \"connections\" counts TCP SYNs: it needs proto tcp or any"
                        .into(),
                );
            }
            true
        }
        other => return Err(format!("egress unit `{other}`: packets or connections")),
    };
    Ok(LevelSource::Egress { iface, target: t, connections })
}
