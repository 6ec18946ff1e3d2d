//! The circuit-breaker part of a profile: `[[breaker]]` tables, each a
//! downstream target (prefix, port range), the processes it applies to (a
//! cgroup v2 path), a mode (`sre` or `state`) with its parameters, exempt
//! targets, the errno of a refused `connect()` and dry-run. Parsed with the
//! same spans as the rest; docs/profile.md is the reference.

use flowctl_common::{
    breaker::{StateConfig, MAX_TARGETS, MAX_WINDOW_BUCKETS},
    rate::parse_duration_ns,
    tables::Cidr,
};
use serde::Deserialize;
use std::net::IpAddr;
use toml::Spanned;

type Span = std::ops::Range<usize>;
type Error = (Span, String);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBreaker {
    pub name: Spanned<String>,
    pub target: Spanned<String>,
    pub port: Option<Spanned<crate::profile::RawPorts>>,
    pub cgroup: Option<Spanned<String>>,
    pub mode: Option<Spanned<String>>,
    pub errno: Option<Spanned<toml::Value>>,
    pub dry_run: Option<bool>,
    #[serde(default)]
    pub exempt: Vec<Spanned<String>>,
    pub window: Option<Spanned<String>>,
    pub buckets: Option<Spanned<i64>>,
    pub min_requests: Option<Spanned<i64>>,
    // sre
    pub k: Option<Spanned<f64>>,
    pub max_drop: Option<Spanned<f64>>,
    // state
    pub failure_ratio: Option<Spanned<f64>>,
    pub sleep: Option<Spanned<String>>,
    pub probes: Option<Spanned<i64>>,
}

/// How a breaker decides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BreakerMode {
    /// Google SRE adaptive throttling (Kratos `sreBreaker`).
    Sre { k_milli: u64, min_requests: u64, max_drop_ppm: u32 },
    /// Closed / open / half-open (Hystrix style).
    State(StateConfig),
}

impl BreakerMode {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sre { .. } => "sre",
            Self::State(_) => "state",
        }
    }
}

/// A downstream address range and port range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetSpec {
    pub net: Cidr,
    pub ports: (u16, u16),
}

impl std::fmt::Display for TargetSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let net = if self.net.len == Cidr::max_len(&self.net.addr) {
            self.net.addr.to_string()
        } else {
            self.net.to_string()
        };
        let net = if self.net.addr.is_ipv6() { format!("[{net}]") } else { net };
        match self.ports {
            (0, 65535) => write!(f, "{net}:*"),
            (a, b) if a == b => write!(f, "{net}:{a}"),
            (a, b) => write!(f, "{net}:{a}-{b}"),
        }
    }
}

/// A validated `[[breaker]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breaker {
    pub name: String,
    /// Line of its `[[breaker]]` header, for errors found at attach time
    /// (a cgroup that does not exist).
    pub line: usize,
    pub target: TargetSpec,
    /// The processes it applies to: a cgroup v2 path as written (absolute,
    /// or relative to the cgroup v2 mount); `None`: every process under the
    /// attach point.
    pub cgroup: Option<String>,
    pub mode: BreakerMode,
    pub window_ns: u64,
    pub buckets: u32,
    /// errno of a refused connect() (positive).
    pub errno: u32,
    pub dry_run: bool,
    pub exempt: Vec<TargetSpec>,
}

impl Breaker {
    /// What `apply` compares: a breaker whose identity is unchanged keeps
    /// its state (window, open/half-open, drop probability) across applies;
    /// errno, dry-run and exempt targets can change without a reset.
    pub fn identity(&self) -> (&str, &TargetSpec, &Option<String>, &BreakerMode, u64, u32) {
        (&self.name, &self.target, &self.cgroup, &self.mode, self.window_ns, self.buckets)
    }
}

/// errno names a profile may use (Linux x86-64/arm64 values).
pub const ERRNOS: [(&str, u32); 9] = [
    ("ECONNREFUSED", 111),
    ("ETIMEDOUT", 110),
    ("ECONNRESET", 104),
    ("ECONNABORTED", 103),
    ("EHOSTUNREACH", 113),
    ("ENETUNREACH", 101),
    ("EAGAIN", 11),
    ("EPERM", 1),
    ("EACCES", 13),
];

pub fn errno_name(n: u32) -> String {
    ERRNOS
        .iter()
        .find(|(_, v)| *v == n)
        .map(|(s, _)| s.to_string())
        .unwrap_or_else(|| n.to_string())
}

fn duration(v: &Spanned<String>) -> Result<u64, Error> {
    parse_duration_ns(v.get_ref()).map_err(|e| (v.span(), format!("bad duration: {e}")))
}

fn ratio(v: &Spanned<f64>, what: &str, lo: f64, hi: f64) -> Result<f64, Error> {
    let x = *v.get_ref();
    if !(lo..=hi).contains(&x) || x.is_nan() {
        return Err((v.span(), format!("{what} must be between {lo} and {hi}")));
    }
    Ok(x)
}

fn count(v: &Spanned<i64>, what: &str, lo: i64, hi: i64) -> Result<i64, Error> {
    let x = *v.get_ref();
    if !(lo..=hi).contains(&x) {
        return Err((v.span(), format!("{what} must be between {lo} and {hi}")));
    }
    Ok(x)
}

/// `10.0.0.5`, `10.0.0.0/24`, `10.0.0.5:5432`, `[2001:db8::1]:443`,
/// `2001:db8::/32`: a prefix with an optional port or port range.
fn parse_exempt(s: &str, default_ports: (u16, u16)) -> Result<TargetSpec, String> {
    let (net, port) = if let Some(rest) = s.strip_prefix('[') {
        let (a, p) = rest.split_once(']').ok_or_else(|| format!("`{s}`: missing `]`"))?;
        (a, p.strip_prefix(':'))
    } else if s.matches(':').count() == 1 {
        let (a, p) = s.split_once(':').expect("one colon");
        (a, Some(p))
    } else {
        (s, None)
    };
    let net = crate::profile::parse_cidr(net)?;
    let ports = match port {
        None => default_ports,
        Some(p) => crate::profile::parse_port_text(p)?,
    };
    Ok(TargetSpec { net, ports })
}

pub(crate) fn breaker(raw: &RawBreaker, line: usize) -> Result<Breaker, Error> {
    let name = raw.name.get_ref().trim().to_string();
    if name.is_empty()
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
    {
        return Err((
            raw.name.span(),
            "a breaker name is letters, digits, `-`, `_` and `.`".into(),
        ));
    }
    let net =
        crate::profile::parse_cidr(raw.target.get_ref()).map_err(|m| (raw.target.span(), m))?;
    let ports = match &raw.port {
        None => (0, 65535),
        Some(p) => crate::profile::parse_ports(p.get_ref()).map_err(|m| (p.span(), m))?,
    };
    let target = TargetSpec { net, ports };
    let cgroup = match &raw.cgroup {
        None => None,
        Some(c) if c.get_ref().trim().is_empty() => {
            return Err((
                c.span(),
                "an empty cgroup path: leave `cgroup` out for every process".into(),
            ))
        }
        Some(c) if c.get_ref().split('/').any(|p| p == "..") => {
            return Err((c.span(), "`..` in a cgroup path".into()))
        }
        Some(c) => Some(c.get_ref().trim().to_string()),
    };
    let mode_name = raw.mode.as_ref().map(|m| m.get_ref().as_str()).unwrap_or("sre");
    let is_sre = match mode_name {
        "sre" => true,
        "state" => false,
        other => {
            return Err((
                raw.mode.as_ref().expect("named").span(),
                format!("unknown mode `{other}`: use \"sre\" or \"state\""),
            ))
        }
    };
    // Parameters of the other mode are mistakes, not silently ignored.
    let foreign: &[(&str, Option<Span>)] = if is_sre {
        &[
            ("failure_ratio", raw.failure_ratio.as_ref().map(|v| v.span())),
            ("sleep", raw.sleep.as_ref().map(|v| v.span())),
            ("probes", raw.probes.as_ref().map(|v| v.span())),
        ]
    } else {
        &[
            ("k", raw.k.as_ref().map(|v| v.span())),
            ("max_drop", raw.max_drop.as_ref().map(|v| v.span())),
        ]
    };
    for (key, span) in foreign {
        if let Some(sp) = span {
            return Err((
                sp.clone(),
                format!("`{key}` is not a parameter of mode \"{mode_name}\""),
            ));
        }
    }
    let window_ns = match &raw.window {
        Some(w) => duration(w)?,
        None if is_sre => 3_000_000_000,
        None => 10_000_000_000,
    };
    let buckets = match &raw.buckets {
        Some(b) => count(b, "buckets", 1, MAX_WINDOW_BUCKETS as i64)? as u32,
        None => 10,
    };
    if window_ns / (buckets as u64) < 10_000_000 {
        let sp = raw
            .window
            .as_ref()
            .map(|w| w.span())
            .or(raw.buckets.as_ref().map(|b| b.span()))
            .unwrap_or(raw.name.span());
        return Err((
            sp,
            "window / buckets must be at least 10ms (the agent reads the counters every 10-100 ms)"
                .into(),
        ));
    }
    let min_requests = match &raw.min_requests {
        Some(m) => count(m, "min_requests", 1, 1_000_000_000)? as u64,
        None if is_sre => 100,
        None => 20,
    };
    let mode = if is_sre {
        let k = match &raw.k {
            Some(k) => ratio(k, "k", 1.0, 100.0)?,
            None => 2.0,
        };
        let max_drop = match &raw.max_drop {
            Some(m) => ratio(m, "max_drop", 0.0, 1.0)?,
            None => 0.9,
        };
        BreakerMode::Sre {
            k_milli: (k * 1000.0).round() as u64,
            min_requests,
            max_drop_ppm: (max_drop * 1e6).round() as u32,
        }
    } else {
        let failure = match &raw.failure_ratio {
            Some(f) => ratio(f, "failure_ratio", 0.0, 1.0)?,
            None => 0.5,
        };
        let sleep_ns = match &raw.sleep {
            Some(s) => duration(s)?,
            None => 5_000_000_000,
        };
        let probes = match &raw.probes {
            Some(p) => count(p, "probes", 1, 1000)? as u32,
            None => 3,
        };
        BreakerMode::State(StateConfig {
            failure_ppm: (failure * 1e6).round() as u32,
            min_requests,
            sleep_ns,
            probes,
        })
    };
    let errno = match &raw.errno {
        None => 111,
        Some(v) => match v.get_ref() {
            toml::Value::String(s) => {
                ERRNOS.iter().find(|(n, _)| n.eq_ignore_ascii_case(s)).map(|(_, e)| *e).ok_or_else(
                    || {
                        (
                            v.span(),
                            format!(
                                "unknown errno `{s}`: use one of {} or a number",
                                ERRNOS.map(|(n, _)| n).join(", ")
                            ),
                        )
                    },
                )?
            }
            toml::Value::Integer(n) if (1..=4095).contains(n) => *n as u32,
            _ => {
                return Err((
                    v.span(),
                    "errno is a name like \"ECONNREFUSED\" or a number from 1 to 4095".into(),
                ))
            }
        },
    };
    let mut exempt = Vec::new();
    for e in &raw.exempt {
        exempt.push(
            parse_exempt(e.get_ref().trim(), ports)
                .map_err(|m| (e.span(), format!("exempt target: {m}")))?,
        );
    }
    Ok(Breaker {
        name,
        line,
        target,
        cgroup,
        mode,
        window_ns,
        buckets,
        errno,
        dry_run: raw.dry_run.unwrap_or(false),
        exempt,
    })
}

/// Checks across breakers: unique names and the kernel's target slots.
pub(crate) fn check_all(breakers: &[(Breaker, Span)]) -> Result<(), Error> {
    for (i, (b, sp)) in breakers.iter().enumerate() {
        if breakers[..i].iter().any(|(o, _)| o.name == b.name) {
            return Err((sp.clone(), format!("duplicate breaker name `{}`", b.name)));
        }
    }
    let slots: usize = breakers.iter().map(|(b, _)| 1 + b.exempt.len()).sum();
    if slots > MAX_TARGETS {
        let sp = breakers.last().map(|(_, s)| s.clone()).unwrap_or(0..0);
        return Err((sp, format!("the breakers and their exempt targets take {slots} target slots; the kernel has {MAX_TARGETS}")));
    }
    Ok(())
}

/// An address as the kernel's target words (host order; IPv4 in word 0).
pub fn addr_words(a: &IpAddr) -> ([u32; 4], u8) {
    match a {
        IpAddr::V4(v) => ([u32::from(*v), 0, 0, 0], 4),
        IpAddr::V6(v) => {
            let o = v.octets();
            let w = |i: usize| u32::from_be_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], 6)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::parse;

    #[test]
    fn defaults_and_both_modes() {
        let set = parse(
            "p.toml",
            r#"
[[breaker]]
name = "db"
target = "10.0.0.0/24"
port = 5432
exempt = ["10.0.0.7", "10.0.0.8:6432", "[2001:db8::1]:443"]

[[breaker]]
name = "api"
target = "2001:db8::/32"
port = "8000-8100"
mode = "state"
errno = "ETIMEDOUT"
cgroup = "app.slice"
dry_run = true
"#,
        )
        .unwrap();
        assert!(set.rules.is_empty());
        let db = &set.breakers[0];
        assert_eq!(
            db.mode,
            BreakerMode::Sre { k_milli: 2000, min_requests: 100, max_drop_ppm: 900_000 }
        );
        assert_eq!((db.window_ns, db.buckets, db.errno, db.line), (3_000_000_000, 10, 111, 2));
        assert_eq!(db.target.to_string(), "10.0.0.0/24:5432");
        assert_eq!(
            db.exempt.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
            ["10.0.0.7:5432", "10.0.0.8:6432", "[2001:db8::1]:443"]
        );
        let api = &set.breakers[1];
        assert_eq!(
            api.mode,
            BreakerMode::State(StateConfig {
                failure_ppm: 500_000,
                min_requests: 20,
                sleep_ns: 5_000_000_000,
                probes: 3
            })
        );
        assert_eq!(
            (api.window_ns, api.errno, api.dry_run, api.cgroup.as_deref()),
            (10_000_000_000, 110, true, Some("app.slice"))
        );
        assert_eq!(api.target.ports, (8000, 8100));
    }

    fn err(text: &str) -> String {
        parse("p.toml", text).unwrap_err().to_string()
    }

    #[test]
    fn mistakes_name_the_line_and_say_why() {
        let e =
            err("[[breaker]]\nname = \"db\"\ntarget = \"10.0.0.1\"\nmode = \"sre\"\nprobes = 3\n");
        assert!(e.starts_with("p.toml:5:10: `probes` is not a parameter of mode \"sre\""), "{e}");
        let e = err("[[breaker]]\nname = \"db\"\ntarget = \"10.0.0.1\"\nerrno = \"EWHAT\"\n");
        assert!(e.starts_with("p.toml:4:9: unknown errno `EWHAT`"), "{e}");
        let e = err("[[breaker]]\nname = \"db\"\ntarget = \"10.0.0.1/8\"\n");
        assert!(e.starts_with("p.toml:3:10: host bits set"), "{e}");
        let e = err("[[breaker]]\nname = \"db\"\ntarget = \"10.0.0.1\"\nmax_drop = 1.5\n");
        assert!(e.contains("max_drop must be between 0 and 1"), "{e}");
        let e = err(
            "[[breaker]]\nname = \"db\"\ntarget = \"10.0.0.1\"\nexempt = [\"10.0.0.2:99999\"]\n",
        );
        assert!(e.starts_with("p.toml:4:11: exempt target: ports are 0 to 65535"), "{e}");
        let e = err("[[breaker]]\nname = \"db\"\ntarget = \"10.0.0.1\"\n[[breaker]]\nname = \"db\"\ntarget = \"10.0.0.2\"\n");
        assert!(e.starts_with("p.toml:4:1: duplicate breaker name `db`"), "{e}");
        let e = err("[[breaker]]\nname = \"db\"\ntarget = \"10.0.0.1\"\ncgroup = \"../x\"\n");
        assert!(e.contains("`..` in a cgroup path"), "{e}");
        let many: String = (0..17)
            .map(|i| format!("[[breaker]]\nname = \"b{i}\"\ntarget = \"10.0.0.{i}\"\n"))
            .collect();
        assert!(err(&many).contains("17 target slots; the kernel has 16"));
        assert!(err("").contains("no [[rule]] and no [[breaker]]"));
    }
}
