//! Rule profiles: the TOML as written (`raw`), validated section by
//! section (`settings`, `rule`, `klimiter`, `breaker`) into a [`RuleSet`]
//! (`model`), which this file puts together with the checks across
//! sections. Every error names file, line, column and the problem
//! (`error`), and a profile with any error is rejected whole.
//! docs/profile.md is the reference.
//!
//! Inside the wing, dependencies point one way, down this list:
//! - this file: uses everything below, and nothing uses it (the sections'
//!   tests call [`parse`], as callers do);
//! - the sections `settings`, `rule`, `klimiter`, `breaker`, and `memory`
//!   (the kernel-memory estimate): none uses another;
//! - `primitives`: the value parsers every section shares (names,
//!   keywords, prefixes, ports, protocols, durations, rates, amounts);
//! - `model` (the validated types), `raw` (serde's view of the TOML),
//!   `error` (the span-carrying context and [`ProfileError`]): leaves.
//!
//! Out of the wing, the profile names types of what it configures
//! (`crate::controllers::cpu::CpuSource`, KLimiter's default dead band).

pub mod breaker;
mod error;
mod fleet;
pub mod klimiter;
pub mod list;
mod memory;
mod model;
mod primitives;
mod raw;
mod rule;
pub(crate) use rule::depth_ns;
mod settings;
pub mod shaper;

pub use error::{line_col_of, ProfileError};
pub use memory::{
    fixed_table_bytes, host_cpus, human_bytes, list_trie_bytes, lru_bytes_per_entry,
    own_table_bytes,
};
// The model's types where callers name them; the breaker and KLimiter
// ones are named from `breaker` and `klimiter`.
pub use model::{
    proto_name, BbrRule, DefaultShare, Fleet, GlobalScope, Rule, RuleSet, Settings, StatsSettings,
    DEFAULT_MEMORY_BUDGET, DEFAULT_QUOTA_BUCKETS, MIN_BYTE_BURST,
};

use error::{Ctx, Span};
use flowctl_common::{MAX_EGRESS_TARGETS, MAX_LIST_PREFIXES, MAX_RULES};
use model::{Baseline, Breaker, LevelSource};
use raw::RawProfile;
use std::path::Path;

/// Reads and validates a profile file.
pub fn load(path: &Path) -> Result<RuleSet, ProfileError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ProfileError::unreadable(&file, &e))?;
    parse(&file, &text)
}

/// A profile to publish to a fleet: validated as each host will, except
/// that list files are not read here (each host reads its own copy, so
/// their paths must be absolute).
pub fn parse_for_fleet(file: &str, text: &str) -> Result<RuleSet, ProfileError> {
    parse_with(file, text, list::Files::Elsewhere)
}

/// The applied profile, for `flowctl list update NAME FILE` without an
/// agent: list `name`'s own file is not read (FILE replaces it, and the
/// profile's may be the broken one); every other list's is.
pub fn parse_for_list_update(file: &str, text: &str, name: &str) -> Result<RuleSet, ProfileError> {
    parse_with(file, text, list::Files::ReadExcept(name))
}

/// An applied profile's copy in the run-time directory, for readers that
/// ask the kernel which source matches what: its list files are not read
/// (a file list has its name and no prefixes).
pub fn load_recorded(path: &Path) -> Result<RuleSet, ProfileError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ProfileError::unreadable(&file, &e))?;
    parse_with(&file, &text, list::Files::Unread)
}

/// Validates profile text; `file` is used in error messages.
///
/// The first error found is the one returned, so the order is fixed,
/// whatever the order in the file: settings; each rule, with the checks
/// that need the settings or the rules before it; `[klimiter]`; each
/// baseline (they name rules); the checks between rules and baselines;
/// each breaker, then the checks across breakers; the memory budget.
pub fn parse(file: &str, text: &str) -> Result<RuleSet, ProfileError> {
    parse_with(file, text, list::Files::Read)
}

fn parse_with(file: &str, text: &str, files: list::Files<'_>) -> Result<RuleSet, ProfileError> {
    let cx = Ctx { file, text };
    let raw: RawProfile = toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        cx.err(span, e.message().to_string())
    })?;
    let (settings, budget_span) = match &raw.settings {
        Some(s) => (settings::settings(&cx, s.get_ref())?, settings::budget_span(s)),
        None => (Settings::default(), 0..0),
    };
    if raw.rule.is_empty() && raw.breaker.is_empty() && raw.shaper.is_empty() {
        return Err(cx.err_at_top("the profile has no [[rule]], no [[breaker]] and no [[shaper]]"));
    }
    let max_rules = settings.stats.max_rules as usize;
    if raw.rule.len() > max_rules {
        let span = raw.rule[max_rules].span();
        let why = if max_rules < MAX_RULES {
            format!("too many rules: at most {max_rules} (raise [settings] max_rules, up to {MAX_RULES}; it sizes the per-CPU statistics rings)")
        } else {
            format!("too many rules: at most {MAX_RULES}")
        };
        return Err(cx.err(span, why));
    }
    let lists = list::lists(&cx, &raw.list, files)?;
    let mut rules: Vec<Rule> = Vec::new();
    // Lists no rule names yet count once (they are held to be updated).
    let mut list_prefixes = list::trie_share(&lists, &rules);
    for r in &raw.rule {
        let rule = rule::rule(&cx, r, &lists)?;
        if rules.iter().any(|o| o.name == rule.name) {
            return Err(cx.err(r.span(), format!("duplicate rule name `{}`", rule.name)));
        }
        bbr_fits_ring(&cx, &rule, &settings)?;
        rules.push(rule);
        // A list named on both sides takes the trie twice.
        list_prefixes = list::trie_share(&lists, &rules);
        if list_prefixes > MAX_LIST_PREFIXES as u64 {
            return Err(cx.err(
                r.span(),
                format!("the lists take {list_prefixes} trie entries with this rule's (a list named as both `src` and `dst` counts twice), more than {MAX_LIST_PREFIXES}: use the list on one side, or aggregate its prefixes"),
            ));
        }
    }
    let own_table_entries = rules.iter().filter_map(|r| r.own_table).map(u64::from).sum();
    let settings = Settings { list_prefixes, own_table_entries, ..settings };
    let klimiter = match &raw.klimiter {
        Some(k) => klimiter::settings(&cx, k.get_ref())?,
        None => Default::default(),
    };
    let names: Vec<String> = rules.iter().map(|r| r.name.clone()).collect();
    let mut baselines: Vec<Baseline> = Vec::new();
    for b in &raw.baseline {
        let parsed = klimiter::baseline(&cx, b, &names)?;
        if baselines.iter().any(|o| o.name == parsed.name) {
            return Err(cx.err(b.span(), format!("duplicate baseline name `{}`", parsed.name)));
        }
        baselines.push(parsed);
    }
    let egress =
        baselines.iter().filter(|b| matches!(b.source, LevelSource::Egress { .. })).count();
    if egress > MAX_EGRESS_TARGETS {
        return Err(
            cx.err_at_top(format!("{egress} egress baselines: at most {MAX_EGRESS_TARGETS}"))
        );
    }
    controlled_or_fixed(&cx, &rules, &baselines)?;
    let mut breakers: Vec<(Breaker, Span)> = Vec::new();
    for b in &raw.breaker {
        breakers.push((breaker::breaker(&cx, b)?, b.span()));
    }
    breaker::check_all(&cx, &breakers)?;
    let breakers = breakers.into_iter().map(|(b, _)| b).collect();
    let shapers = shaper::shapers(&cx, &raw.shaper)?;
    let fleet = raw.fleet.as_ref().map(|f| fleet::fleet(&cx, f)).transpose()?;
    if fleet.is_none() {
        if let Some((r, _)) = raw.rule.iter().zip(&rules).find(|(_, r)| r.global.is_some()) {
            let span = r.get_ref().scope.as_ref().map(|s| s.span()).unwrap_or(r.span());
            return Err(cx.err(span, "scope = \"global\" needs a [fleet] section with redis = \"redis://HOST:6379\": the store the hosts share the limit through"));
        }
    }
    // An applied profile's copy was compiled by the apply that recorded it;
    // its readers (`status` without an agent, `top`, `explain`) skip the
    // compile, 65,537 port bitmaps, which took a debug build seconds
    // under TCG on every `status`.
    if files != list::Files::Unread {
        sources_fit(&cx, &raw, &rules)?;
    }
    memory::check_budget(&cx, &settings, budget_span)?;
    Ok(RuleSet { settings, rules, klimiter, baselines, breakers, shapers, fleet, lists })
}

/// The rules' sources and destinations must fit the kernel's classes (lists that overlap
/// in many ways may not): compiled here as `apply` will, so `check`
/// refuses what `apply` could not write. Pointed at the first rule that
/// names a list.
fn sources_fit(cx: &Ctx, raw: &RawProfile, rules: &[Rule]) -> Result<(), ProfileError> {
    let specs: Vec<_> = rules.iter().map(|r| r.spec.clone()).collect();
    let Err(e) = flowctl_common::tables::compile(&specs, 0) else {
        return Ok(());
    };
    let at = rules
        .iter()
        .position(|r| {
            use flowctl_common::tables::Source::List;
            matches!(r.spec.src, Some(List(_))) || matches!(r.spec.dst, Some(List(_)))
        })
        .map_or(0..0, |i| raw.rule[i].span());
    Err(cx.err(at, e.to_string()))
}

/// BBR reads its window from the statistics ring: one BBR bucket per ring
/// bucket, and the window inside the ring (one bucket is the one being
/// filled).
fn bbr_fits_ring(cx: &Ctx, rule: &Rule, settings: &Settings) -> Result<(), ProfileError> {
    let (Some(b), Some(bs)) = (&rule.bbr, &rule.bbr_span) else {
        return Ok(());
    };
    let width = b.window_ns / b.buckets as u64;
    let st = &settings.stats;
    if width != st.bucket_ns || b.window_ns % b.buckets as u64 != 0 {
        return Err(cx.err(
            bs.clone(),
            format!(
                "bbr window / buckets is {} ms, but the statistics ring's buckets are {} ms: make them equal (e.g. window = \"10s\", buckets = 100 with the default statistics_bucket = \"100ms\")",
                width as f64 / 1e6,
                st.bucket_ns as f64 / 1e6
            ),
        ));
    }
    if b.buckets > st.buckets {
        return Err(cx.err(bs.clone(), format!("bbr buckets ({}) must not exceed statistics_buckets ({}): the window is read from the ring", b.buckets, st.buckets)));
    }
    Ok(())
}

/// A rule is either under KLimiter's control (an entry of a baseline) or
/// has a fixed admission ratio, and only a controlled rule has a priority.
fn controlled_or_fixed(
    cx: &Ctx,
    rules: &[Rule],
    baselines: &[Baseline],
) -> Result<(), ProfileError> {
    for (i, r) in rules.iter().enumerate() {
        let controlled = baselines.iter().any(|b| b.entries.contains(&i));
        if controlled && r.admission_ppm.is_some() {
            return Err(cx.err_at_line(r.line, format!("rule `{}` has a fixed admission_ratio and is an entry of a baseline: KLimiter sets its ratio; drop one", r.name)));
        }
        if !controlled {
            if let Some(sp) = &r.priority_span {
                return Err(cx.err(
                    sp.clone(),
                    format!("rule `{}` has a priority but no [[baseline]] lists it", r.name),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowctl_common::unit;

    /// The error of a profile that must be rejected (the sections' tests use it too).
    pub(super) fn err(text: &str) -> ProfileError {
        parse("p.toml", text).unwrap_err()
    }

    const GOOD: &str = r#"
[settings]
key_table_entries = 65536
source_cache_entries = 65536

[[rule]]
name = "trusted"
src = "10.0.0.0/8"
action = "pass"

[[rule]]
name = "web"
proto = "tcp"
dport = "80-443"
unit = "connections"
rate = "60/min"
burst = 20
key = "src_prefix"
prefix_v4 = 24

[[rule]]
name = "bulk"
rate = "10Mbit/s"
burst = "64KiB"
key = "src"
"#;

    #[test]
    fn good_profile() {
        let s = parse("p.toml", GOOD).unwrap();
        assert_eq!(s.rules.len(), 3);
        assert_eq!(s.rules[1].unit, unit::CONNECTIONS);
        assert_eq!(s.rules[1].prefix_v4, 24);
        assert_eq!(s.rules[1].prefix_v6, 64);
        assert_eq!(s.rules[2].unit, unit::BYTES);
        assert_eq!(s.rules[2].burst, 65536);
        assert_eq!(s.rules[1].line, 11); // GOOD starts with a newline
    }

    fn with_rule(body: &str) -> String {
        format!("[[rule]]\nname = \"r\"\n{body}\n")
    }

    /// A protocol by name, by number, or by number as text.
    #[test]
    fn protocols_by_name_and_number() {
        for (written, want) in
            [("\"tcp\"", Some(6)), ("47", Some(47)), ("\"47\"", Some(47)), ("\"any\"", None)]
        {
            let s =
                parse("p.toml", &with_rule(&format!("proto = {written}\nrate = \"1/s\""))).unwrap();
            assert_eq!(s.rules[0].spec.proto, want, "{written}");
        }
    }

    #[test]
    fn each_error_class_names_line_and_column() {
        let cases: &[(&str, usize, &str)] = &[
            ("[[rule]\nname = 1", 1, "expected"),
            (&with_rule("src = \"10.0.0.1/8\"\nrate = \"1/s\""), 3, "host bits set"),
            (&with_rule("src = \"10.0.0.300\"\nrate = \"1/s\""), 3, "not an IP"),
            (&with_rule("rate = \"0/s\""), 3, "greater than zero"),
            (&with_rule("rate = \"1/s\"\nburst = 0"), 4, "greater than zero"),
            (&with_rule("rate = \"10Mbit/s\"\nburst = \"1000B\""), 4, "below one full frame"),
            (
                &with_rule("proto = \"tcp\"\ndport = \"90-80\"\nrate = \"1/s\""),
                4,
                "reversed port range",
            ),
            (&with_rule("rate = \"1/s\"\ncolour = \"red\""), 4, "unknown field"),
            (&with_rule("rate = \"1/s\"\nkey = \"moon\""), 4, "unknown key"),
            (&with_rule("proto = 300\nrate = \"1/s\""), 3, "outside 0-255"),
            (&with_rule("proto = \"gre\"\nrate = \"1/s\""), 3, "unknown protocol"),
            (
                "[[rule]]\nname = \"a\"\nrate = \"1/s\"\n[[rule]]\nname = \"a\"\nrate = \"1/s\"",
                4,
                "duplicate rule name",
            ),
        ];
        for (text, line, needle) in cases {
            let e = err(text);
            assert_eq!(e.line, *line, "{text}: {e}");
            assert!(e.col >= 1);
            assert!(e.to_string().contains(needle), "{text}: {e}");
            assert!(e.to_string().starts_with("p.toml:"), "{e}");
        }
    }

    #[test]
    fn flood_watch_is_off_unless_asked_for_and_a_boolean() {
        let rule = "[[rule]]\nname = \"a\"\nrate = \"1/s\"\n";
        assert!(!parse("p", rule).unwrap().settings.flood_watch);
        let on = parse("p", &format!("[settings]\nflood_watch = true\n{rule}")).unwrap();
        assert!(on.settings.flood_watch);
        let e = parse("p", &format!("[settings]\nflood_watch = \"yes\"\n{rule}")).unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        assert!(e.to_string().contains("boolean"), "{e}");
    }

    #[test]
    fn bbr_and_admission_settings() {
        let tcp =
            "[[rule]]\nname = \"w\"\nproto = \"tcp\"\nunit = \"connections\"\nrate = \"100/s\"\n";
        let s = parse(
            "p",
            &format!(
                "{tcp}bbr = {{ cpu_threshold = 700, reject = \"reset\", compat = [\"kratos\"] }}\n"
            ),
        )
        .unwrap();
        let b = s.rules[0].bbr.as_ref().unwrap();
        assert_eq!(
            (b.cpu_threshold, b.buckets, b.window_ns, b.reset),
            (700, 100, 10_000_000_000, true)
        );
        assert_eq!(b.compat, flowctl_common::bbr::Compat::KRATOS);
        assert_eq!(b.config().buckets_per_second, 10);
        let one =
            parse("p", &format!("{tcp}bbr = {{ compat = [\"min_rt_from_window\"] }}\n")).unwrap();
        let c = one.rules[0].bbr.as_ref().unwrap().compat;
        assert!(c.min_rt_from_window && !c.floor_max_inflight && !c.cooldown_from_first_drop);
        for (text, line, needle) in [
            (
                "[[rule]]\nname = \"w\"\nrate = \"1/s\"\nbbr = { }\n".to_string(),
                4,
                "needs proto = \"tcp\"",
            ),
            (
                format!("{tcp}bbr = {{ window = \"10s\", buckets = 50 }}\n"),
                6,
                "statistics ring's buckets are 100 ms",
            ),
            (
                format!("[settings]\nstatistics_buckets = 50\n{tcp}bbr = {{ }}\n"),
                8,
                "must not exceed statistics_buckets",
            ),
            (format!("{tcp}bbr = {{ compat = [\"fast\"] }}\n"), 6, "unknown compat switch"),
            (format!("{tcp}bbr = {{ reject = \"ignore\" }}\n"), 6, "unknown reject"),
            (
                format!("{tcp}bbr = {{ idle_timeout = \"5min\" }}\n"),
                6,
                "idle_timeout must be between",
            ),
            (format!("{tcp}admission_ratio = 1.5\n"), 6, "out of range"),
            (format!("{tcp}admission = \"sometimes\"\n"), 6, "unknown admission"),
            (
                "[settings]\ncpu = \"cgroup:relative\"\n[[rule]]\nname = \"a\"\nrate = \"1/s\"\n"
                    .to_string(),
                2,
                "starts with /",
            ),
        ] {
            let e = err(&text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
        let a =
            parse("p", &format!("{tcp}admission_ratio = 0.25\nadmission = \"packet\"\n")).unwrap();
        assert_eq!(
            (a.rules[0].admission_ppm, a.rules[0].admission_per_flow),
            (Some(250_000), false)
        );
    }
}
