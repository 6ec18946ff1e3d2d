//! The `[[breaker]]` section: each a downstream target (prefix, port
//! range), the processes it applies to (a cgroup v2 path), a mode (`sre` or
//! `state`) with its parameters, exempt targets, the errno of a refused
//! `connect()` and dry-run; then the checks across breakers (unique names,
//! the kernel's target slots). docs/profile.md is the reference.

use super::{
    error::{Ctx, ProfileError, Span},
    primitives::{cidr, duration, keyword, name, parse_cidr, parse_port_text, ports},
    raw::RawBreaker,
};
use flowctl_common::breaker::{StateConfig, MAX_TARGETS, MAX_WINDOW_BUCKETS};
use toml::Spanned;

// The validated breaker types live in `model`; callers name them here.
pub use super::{
    model::{errno_name, Breaker, BreakerMode, TargetSpec, ERRNOS},
    primitives::addr_words,
};

/// Validates one `[[breaker]]`.
pub(super) fn breaker(cx: &Ctx, raw: &Spanned<RawBreaker>) -> Result<Breaker, ProfileError> {
    let line = cx.line(&raw.span());
    let raw = raw.get_ref();
    let name =
        name(cx, &raw.name, usize::MAX, "a breaker name is letters, digits, `-`, `_` and `.`")?;
    let target = TargetSpec {
        net: cidr(cx, &raw.target)?,
        ports: raw.port.as_ref().map(|p| ports(cx, p)).transpose()?.unwrap_or((0, 65535)),
    };
    let cgroup = cgroup(cx, raw)?;
    let is_sre = is_sre(cx, raw)?;
    let (window_ns, buckets) = window(cx, raw, is_sre)?;
    let mode = mode(cx, raw, is_sre)?;
    let errno = match &raw.errno {
        None => 111,
        Some(v) => errno(cx, v)?,
    };
    let mut exempt = Vec::new();
    for e in &raw.exempt {
        exempt.push(
            parse_exempt(e.get_ref().trim(), target.ports)
                .map_err(|m| cx.err(e.span(), format!("exempt target: {m}")))?,
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

/// The processes it applies to: a cgroup path below the attach point.
fn cgroup(cx: &Ctx, raw: &RawBreaker) -> Result<Option<String>, ProfileError> {
    match &raw.cgroup {
        None => Ok(None),
        Some(c) if c.get_ref().trim().is_empty() => {
            Err(cx.err(c.span(), "an empty cgroup path: leave `cgroup` out for every process"))
        }
        Some(c) if c.get_ref().split('/').any(|p| p == "..") => {
            Err(cx.err(c.span(), "`..` in a cgroup path"))
        }
        Some(c) => Ok(Some(c.get_ref().trim().to_string())),
    }
}

/// `mode`: `sre` (the default) or `state`; the other mode's parameters
/// are mistakes, not silently ignored.
fn is_sre(cx: &Ctx, raw: &RawBreaker) -> Result<bool, ProfileError> {
    let is_sre = match &raw.mode {
        None => true,
        Some(m) => {
            keyword(cx, m, "mode", &[("sre", true), ("state", false)], "use \"sre\" or \"state\"")?
        }
    };
    let mode_name = if is_sre { "sre" } else { "state" };
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
            return Err(
                cx.err(sp.clone(), format!("`{key}` is not a parameter of mode \"{mode_name}\""))
            );
        }
    }
    Ok(is_sre)
}

/// The rolling window of outcomes and its buckets (default 3 s, or 10 s
/// for `state`, in 10).
fn window(cx: &Ctx, raw: &RawBreaker, is_sre: bool) -> Result<(u64, u32), ProfileError> {
    let window_ns = match &raw.window {
        Some(w) => duration(cx, w, "duration")?,
        None if is_sre => 3_000_000_000,
        None => 10_000_000_000,
    };
    let buckets = match &raw.buckets {
        Some(b) => count(cx, b, "buckets", 1, MAX_WINDOW_BUCKETS as i64)? as u32,
        None => 10,
    };
    if window_ns / (buckets as u64) < 10_000_000 {
        let sp = raw
            .window
            .as_ref()
            .map(|w| w.span())
            .or(raw.buckets.as_ref().map(|b| b.span()))
            .unwrap_or(raw.name.span());
        return Err(cx.err(
            sp,
            "window / buckets must be at least 10ms (the agent reads the counters every 10-100 ms)",
        ));
    }
    Ok((window_ns, buckets))
}

/// The mode's parameters, with `min_requests` (default 100, or 20 for
/// `state`).
fn mode(cx: &Ctx, raw: &RawBreaker, is_sre: bool) -> Result<BreakerMode, ProfileError> {
    let min_requests = match &raw.min_requests {
        Some(m) => count(cx, m, "min_requests", 1, 1_000_000_000)? as u64,
        None if is_sre => 100,
        None => 20,
    };
    if is_sre {
        let k = match &raw.k {
            Some(k) => ratio(cx, k, "k", 1.0, 100.0)?,
            None => 2.0,
        };
        let max_drop = match &raw.max_drop {
            Some(m) => ratio(cx, m, "max_drop", 0.0, 1.0)?,
            None => 0.9,
        };
        return Ok(BreakerMode::Sre {
            k_milli: (k * 1000.0).round() as u64,
            min_requests,
            max_drop_ppm: (max_drop * 1e6).round() as u32,
        });
    }
    let failure = match &raw.failure_ratio {
        Some(f) => ratio(cx, f, "failure_ratio", 0.0, 1.0)?,
        None => 0.5,
    };
    let sleep_ns = match &raw.sleep {
        Some(s) => duration(cx, s, "duration")?,
        None => 5_000_000_000,
    };
    let probes = match &raw.probes {
        Some(p) => count(cx, p, "probes", 1, 1000)? as u32,
        None => 3,
    };
    Ok(BreakerMode::State(StateConfig {
        failure_ppm: (failure * 1e6).round() as u32,
        min_requests,
        sleep_ns,
        probes,
    }))
}

/// Checks across breakers: unique names and the kernel's target slots.
pub(super) fn check_all(cx: &Ctx, breakers: &[(Breaker, Span)]) -> Result<(), ProfileError> {
    for (i, (b, sp)) in breakers.iter().enumerate() {
        if breakers[..i].iter().any(|(o, _)| o.name == b.name) {
            return Err(cx.err(sp.clone(), format!("duplicate breaker name `{}`", b.name)));
        }
    }
    let slots: usize = breakers.iter().map(|(b, _)| 1 + b.exempt.len()).sum();
    if slots > MAX_TARGETS {
        let sp = breakers.last().map(|(_, s)| s.clone()).unwrap_or(0..0);
        return Err(cx.err(sp, format!("the breakers and their exempt targets take {slots} target slots; the kernel has {MAX_TARGETS}")));
    }
    Ok(())
}

fn ratio(cx: &Ctx, v: &Spanned<f64>, what: &str, lo: f64, hi: f64) -> Result<f64, ProfileError> {
    let x = *v.get_ref();
    if !(lo..=hi).contains(&x) || x.is_nan() {
        return Err(cx.err(v.span(), format!("{what} must be between {lo} and {hi}")));
    }
    Ok(x)
}

fn count(cx: &Ctx, v: &Spanned<i64>, what: &str, lo: i64, hi: i64) -> Result<i64, ProfileError> {
    let x = *v.get_ref();
    if !(lo..=hi).contains(&x) {
        return Err(cx.err(v.span(), format!("{what} must be between {lo} and {hi}")));
    }
    Ok(x)
}

/// A name of [`ERRNOS`] in any case, or a number from 1 to 4095.
fn errno(cx: &Ctx, v: &Spanned<toml::Value>) -> Result<u32, ProfileError> {
    match v.get_ref() {
        toml::Value::String(s) => {
            ERRNOS.iter().find(|(n, _)| n.eq_ignore_ascii_case(s)).map(|(_, e)| *e).ok_or_else(
                || {
                    cx.err(
                        v.span(),
                        format!(
                            "unknown errno `{s}`: use one of {} or a number",
                            ERRNOS.map(|(n, _)| n).join(", ")
                        ),
                    )
                },
            )
        }
        toml::Value::Integer(n) if (1..=4095).contains(n) => Ok(*n as u32),
        _ => {
            Err(cx
                .err(v.span(), "errno is a name like \"ECONNREFUSED\" or a number from 1 to 4095"))
        }
    }
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
    let net = parse_cidr(net)?;
    let ports = match port {
        None => default_ports,
        Some(p) => parse_port_text(p)?,
    };
    Ok(TargetSpec { net, ports })
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
        assert!(err("").contains("no [[rule]], no [[breaker]] and no [[shaper]]"));
    }
}
