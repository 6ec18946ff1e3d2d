//! The KLimiter part of a profile: `[klimiter]` timing, `priority` on rules
//! (their floor) and `[[baseline]]` tables with a level source. Parsed with
//! the same spans as the rest, so every error names file, line and column.

use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawKlimiter {
    pub sample_period: Option<Spanned<String>>,
    pub control_period: Option<Spanned<String>>,
    pub dead_band: Option<Spanned<f64>>,
    pub stale_after: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBaseline {
    pub name: Spanned<String>,
    pub threshold: Spanned<f64>,
    pub entries: Spanned<Vec<String>>,
    pub source: Spanned<RawSource>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSource {
    pub kind: Spanned<String>,
    pub file: Option<String>,
    pub command: Option<String>,
    pub url: Option<String>,
    pub metric: Option<String>,
    pub iface: Option<String>,
    pub dst: Option<String>,
    pub dport: Option<toml::Value>,
    pub proto: Option<String>,
    pub unit: Option<String>,
}

/// KLimiter timing.
#[derive(Clone, Debug, PartialEq)]
pub struct KlimiterSettings {
    pub sample_period_ns: u64,
    pub control_period_ns: u64,
    pub dead_band: f64,
    /// A level source failing this long releases its entries.
    pub stale_after_ns: u64,
}

impl Default for KlimiterSettings {
    fn default() -> Self {
        Self {
            sample_period_ns: 1_000_000_000,
            control_period_ns: 5_000_000_000,
            dead_band: 0.03,
            stale_after_ns: 30_000_000_000,
        }
    }
}

/// Where a baseline's level comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum LevelSource {
    /// The agent's CPU signal (per mille).
    Cpu,
    /// A number in a file.
    File(String),
    /// A command's standard output (a number), run with a timeout.
    Command(String),
    /// One metric of a Prometheus text endpoint (http:// only).
    Http { url: String, metric: String },
    /// Packets (or new TCP connections) this host sends to a downstream
    /// endpoint, counted by the TC egress program on `iface`.
    Egress { iface: String, target: flowctl_common::EgressTarget, connections: bool },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Baseline {
    pub name: String,
    pub threshold: f64,
    /// Indices of the rules (entries) that load it.
    pub entries: Vec<usize>,
    pub source: LevelSource,
}

pub(crate) type Err = (std::ops::Range<usize>, String);

pub(crate) fn settings(
    raw: &RawKlimiter,
    duration: impl Fn(&Spanned<String>) -> Result<u64, Err>,
) -> Result<KlimiterSettings, Err> {
    let mut k = KlimiterSettings::default();
    if let Some(v) = &raw.sample_period {
        k.sample_period_ns = duration(v)?;
    }
    if let Some(v) = &raw.control_period {
        k.control_period_ns = duration(v)?;
    }
    if k.sample_period_ns < 100_000_000 || k.control_period_ns < k.sample_period_ns {
        let span = raw
            .control_period
            .as_ref()
            .or(raw.sample_period.as_ref())
            .map(|v| v.span())
            .unwrap_or(0..0);
        return Err((span, "klimiter: sample_period must be at least 100ms and control_period at least sample_period".into()));
    }
    if let Some(v) = &raw.dead_band {
        if !(0.0..0.5).contains(v.get_ref()) {
            return Err((v.span(), format!("dead_band {} out of range: 0.0 to 0.5", v.get_ref())));
        }
        k.dead_band = *v.get_ref();
    }
    if let Some(v) = &raw.stale_after {
        k.stale_after_ns = duration(v)?;
    }
    Ok(k)
}

pub(crate) fn baseline(raw: &RawBaseline, rule_names: &[String]) -> Result<Baseline, Err> {
    let name = raw.name.get_ref().trim().to_string();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err((
            raw.name.span(),
            "baseline names are letters, digits, '-', '_' or '.'".into(),
        ));
    }
    let t = *raw.threshold.get_ref();
    if !(t > 0.0 && t.is_finite()) {
        return Err((raw.threshold.span(), format!("threshold {t} must be a positive number")));
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
                    return Err((
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
        return Err((raw.entries.span(), format!("baseline {name} lists no entries")));
    }
    let s = raw.source.get_ref();
    let source = match s.kind.get_ref().as_str() {
        "cpu" => LevelSource::Cpu,
        "gauge" => match (&s.file, &s.command, &s.url) {
            (Some(f), None, None) => LevelSource::File(f.clone()),
            (None, Some(c), None) => LevelSource::Command(c.clone()),
            (None, None, Some(u)) => {
                if !u.starts_with("http://") {
                    return Err((
                        raw.source.span(),
                        "gauge url: only http:// endpoints (Prometheus text format)".into(),
                    ));
                }
                let Some(m) = &s.metric else {
                    return Err((
                        raw.source.span(),
                        "a gauge url needs `metric`, the name of the sample to read".into(),
                    ));
                };
                LevelSource::Http { url: u.clone(), metric: m.clone() }
            }
            _ => {
                return Err((
                    raw.source.span(),
                    "a gauge reads exactly one of `file`, `command` or `url`".into(),
                ))
            }
        },
        "egress" => egress(s).map_err(|m| (raw.source.span(), m))?,
        other => {
            return Err((
                s.kind.span(),
                format!("unknown source kind `{other}`: cpu, gauge or egress"),
            ))
        }
    };
    Ok(Baseline { name, threshold: t, entries, source })
}

fn egress(s: &RawSource) -> Result<LevelSource, String> {
    let iface = s.iface.clone().ok_or(
        "an egress source needs `iface`, the interface traffic to the downstream leaves by",
    )?;
    let dst = s
        .dst
        .as_deref()
        .ok_or("an egress source needs `dst`, the downstream's address or prefix")?;
    let (addr, len) = match dst.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (dst, None),
    };
    let ip: std::net::IpAddr =
        addr.trim().parse().map_err(|_| format!("egress dst: `{addr}` is not an IP address"))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let prefix_len: u8 = match len {
        Some(l) => l
            .trim()
            .parse()
            .ok()
            .filter(|n| *n <= max)
            .ok_or(format!("egress dst: bad prefix length `{l}`"))?,
        None => max,
    };
    let mut t = flowctl_common::EgressTarget { prefix_len, ..Default::default() };
    match ip {
        std::net::IpAddr::V4(a) => {
            t.family = 4;
            t.addr[0] = u32::from(a);
        }
        std::net::IpAddr::V6(a) => {
            t.family = 6;
            let o = a.octets();
            for i in 0..4 {
                t.addr[i] =
                    u32::from_be_bytes([o[i * 4], o[i * 4 + 1], o[i * 4 + 2], o[i * 4 + 3]]);
            }
        }
    }
    t.proto = match s.proto.as_deref().unwrap_or("any") {
        "any" => 0,
        "tcp" => 6,
        "udp" => 17,
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
            if t.proto == 17 {
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
