//! The `[[rule]]` section: one rule's validation, in the steps a rule is
//! read in: name, match, action, (a `pass` rule stops there) unit, token
//! bucket, quota, admission, BBR, key. The first problem found is the one
//! reported, so the order of the steps is part of the behaviour. Checks
//! that need other sections (unique names, BBR against the statistics
//! rings, KLimiter's entries) are in `super::parse`.

use super::{
    error::{Ctx, ProfileError},
    model::{
        proto_name, BbrRule, DefaultShare, GlobalScope, List, NestedLimit, Rule, WarmUp,
        DEFAULT_QUOTA_BUCKETS, MIN_BYTE_BURST, TCP, UDP,
    },
    primitives::{amount, cidr, duration, keyword, name, ports, protocol, rate},
    raw::{RawAmount, RawBbr, RawRule},
};
use flowctl_common::{
    action, gcra, key_kind,
    rate::{Dimension, Rate},
    tables::{MatchSpec, Source},
    unit, MAX_NESTED_LIMITS, MAX_QUOTA_BUCKETS, OPEN_BUCKETS, OPEN_BUCKET_NS,
};
use toml::Spanned;

/// Validates one `[[rule]]`.
pub fn rule(cx: &Ctx, raw: &Spanned<RawRule>, lists: &[List]) -> Result<Rule, ProfileError> {
    let span = raw.span();
    let r = raw.get_ref();
    let name = name(
        cx,
        &r.name,
        64,
        "rule names are 1-64 characters of letters, digits, '-', '_' or '.'",
    )?;
    let spec = match_spec(cx, r, lists)?;
    let action = rule_action(cx, r)?;
    let mut rule = Rule {
        name,
        line: cx.line(&span),
        spec: MatchSpec { enforcing: action == action::DROP || action == BLOCK, ..spec },
        action,
        unit: unit::PACKETS,
        key_kind: key_kind::RULE,
        prefix_v4: 32,
        prefix_v6: 128,
        rate_text: String::new(),
        burst: 0,
        interval_fp: 0,
        burst_ns: 0,
        quota_limit: 0,
        quota_bucket_ns: 0,
        quota_buckets: 0,
        bbr: None,
        bbr_span: None,
        admission_per_flow: true,
        admission_ppm: None,
        priority: 0.0,
        priority_span: None,
        global: None,
        book_retransmits: false,
        limits: Vec::new(),
        warm_up: None,
        own_table: None,
        block: false,
    };
    if action == action::PASS {
        nothing_to_limit(cx, r, "pass")?;
        return Ok(rule);
    }
    if action == BLOCK {
        // A bucket that never holds a token: every packet is refused (and
        // counted as a rate drop), with no kernel stage of its own.
        nothing_to_limit(cx, r, "block")?;
        rule.action = action::DROP;
        rule.block = true;
        rule.rate_text = "block".into();
        rule.interval_fp = flowctl_common::BLOCK_INTERVAL_FP;
        rule.burst_ns = 0;
        return Ok(rule);
    }
    if r.rate.is_none() && r.quota.is_none() {
        return Err(cx.err(span, format!("rule `{}` needs a `rate` (e.g. \"100/s\", \"10Mbit/s\"), a `quota` (e.g. 60 with quota_window = \"1min\"), or action = \"pass\"", rule.name)));
    }
    let rate = r.rate.as_ref().map(|v| rate(cx, v)).transpose()?;
    let quota = r.quota.as_ref().map(|v| amount(cx, v, "quota")).transpose()?;
    rule.unit = rule_unit(cx, raw, rate, quota, rule.spec.proto)?;
    token_bucket(cx, r, rate, &mut rule)?;
    quota_window(cx, r, quota, &mut rule)?;
    if rule.interval_fp != 0 {
        rule.burst_ns = depth_ns(rule.unit, rule.interval_fp, rule.burst);
    }
    admission(cx, r, &mut rule)?;
    if let Some(b) = &r.bbr {
        if rule.unit != unit::CONNECTIONS || rule.spec.proto != Some(TCP) {
            return Err(cx.err(b.span(), "bbr needs proto = \"tcp\" and unit = \"connections\" (its requests are TCP connections)"));
        }
        rule.bbr = Some(bbr(cx, b.get_ref())?);
        rule.bbr_span = Some(b.span());
    }
    (rule.key_kind, rule.prefix_v4, rule.prefix_v6) = key(cx, r)?;
    rule.global = scope(cx, r, &rule)?;
    rule.book_retransmits = book_retransmits(cx, r, &rule)?;
    rule.limits = nested_limits(cx, r, &rule)?;
    rule.warm_up = warm_up(cx, r, &rule)?;
    rule.own_table = own_table(cx, r, &rule)?;
    Ok(rule)
}

/// `isolate = true` (with `table_entries`, default
/// `DEFAULT_OWN_TABLE_ENTRIES`): the rule's buckets in a table of their own.
/// For a local per-key rule's token bucket: the stages that keep per-key
/// state elsewhere (a quota's window, nested limits, a booking, a lease,
/// BBR's connections) or none per key (a ramp) would leave part of the
/// rule in the shared tables.
fn own_table(cx: &Ctx, r: &RawRule, rule: &Rule) -> Result<Option<u32>, ProfileError> {
    use flowctl_common::{DEFAULT_OWN_TABLE_ENTRIES, MAX_OWN_TABLE_ENTRIES, MIN_OWN_TABLE_ENTRIES};
    let isolate = r.isolate.as_ref().is_some_and(|i| *i.get_ref());
    let Some(i) = r.isolate.as_ref().filter(|_| isolate) else {
        if let Some(t) = &r.table_entries {
            return Err(cx.err(t.span(), "`table_entries` sizes an isolated rule's own table: add isolate = true, or drop it (other rules share key_table_entries)"));
        }
        return Ok(None);
    };
    let why = if rule.interval_fp == 0 {
        "isolate keeps the rule's token buckets in a table of their own: the rule needs a `rate`"
    } else if rule.key_kind == key_kind::RULE {
        "isolate is for per-key rules: a rule with key = \"rule\" has one bucket, which no flood evicts; give it a `key`, or drop isolate"
    } else if rule.quota_bucket_ns != 0 {
        "isolate does not combine with a quota (its windows live in the shared quota table): drop one of them"
    } else if !rule.limits.is_empty() {
        "isolate does not combine with nested limits ([[rule.limit]], whose buckets live in the shared key table): drop one of them"
    } else if rule.book_retransmits {
        "isolate does not combine with book_retransmits: drop one of them"
    } else if rule.global.is_some() {
        "isolate is for local rules (a global rule's keys live in the global key table)"
    } else if rule.warm_up.is_some() {
        "isolate does not combine with warm_up (a ramp is one bucket for the rule)"
    } else if rule.bbr.is_some() {
        "isolate does not combine with bbr (its connections are tracked in the shared connection table): drop one of them"
    } else {
        ""
    };
    if !why.is_empty() {
        return Err(cx.err(i.span(), why));
    }
    let entries = match &r.table_entries {
        None => DEFAULT_OWN_TABLE_ENTRIES,
        Some(t) if (MIN_OWN_TABLE_ENTRIES as i64..=MAX_OWN_TABLE_ENTRIES as i64).contains(t.get_ref()) => *t.get_ref() as u32,
        Some(t) => return Err(cx.err(t.span(), format!("table_entries must be {MIN_OWN_TABLE_ENTRIES} to {MAX_OWN_TABLE_ENTRIES}: the most keys of this rule live at once"))),
    };
    Ok(Some(entries))
}

/// `warm_up = "30s"` with `cold_factor` (default 3): for a local rule's
/// aggregate bucket (the default `key = "rule"`), which is what protects a
/// cold service; per key, a ramp would restart for every new source, so a
/// flood of new keys would each get the cold rate afresh and the service
/// the sum: refused there. Not with a quota, nested limits or bookings (the
/// ramp is its own stage beside the decision).
fn warm_up(cx: &Ctx, r: &RawRule, rule: &Rule) -> Result<Option<WarmUp>, ProfileError> {
    use flowctl_common::warm::{
        DEFAULT_COLD_FACTOR, MAX_COLD_FACTOR, MAX_WARM_UP_NS, MIN_COLD_FACTOR,
    };
    let Some(w) = &r.warm_up else {
        if let Some(c) = &r.cold_factor {
            return Err(cx.err(c.span(), "`cold_factor` belongs to a `warm_up` ramp: give the rule warm_up = \"30s\" (for example) or drop it"));
        }
        return Ok(None);
    };
    let warm_ns = duration(cx, w, "warm_up")?;
    let why = if !(1_000_000_000..=MAX_WARM_UP_NS).contains(&warm_ns) {
        "warm_up must be between 1s and 1h"
    } else if rule.interval_fp == 0 {
        "warm_up ramps the rule's rate: the rule needs a `rate`"
    } else if rule.key_kind != key_kind::RULE {
        "warm_up is for a rule's aggregate bucket (key = \"rule\"): per key, every new key would start cold on its own and the service would get the sum; drop `key`, or put the per-key limit in a [[rule.limit]] of another rule"
    } else if rule.global.is_some() {
        "warm_up is for local rules (a global rule's bucket runs at its lease's rate)"
    } else if rule.quota_bucket_ns != 0 {
        "warm_up does not combine with a quota: drop one of them"
    } else if !rule.limits.is_empty() {
        "warm_up does not combine with nested limits ([[rule.limit]]): drop one of them"
    } else if rule.book_retransmits {
        "warm_up does not combine with book_retransmits: drop one of them"
    } else {
        ""
    };
    if !why.is_empty() {
        return Err(cx.err(w.span(), why));
    }
    let cold_factor = match &r.cold_factor {
        None => DEFAULT_COLD_FACTOR,
        Some(c) if (MIN_COLD_FACTOR as i64..=MAX_COLD_FACTOR as i64).contains(c.get_ref()) => {
            *c.get_ref() as u8
        }
        Some(c) => {
            return Err(cx.err(
                c.span(),
                format!("cold_factor must be {MIN_COLD_FACTOR} to {MAX_COLD_FACTOR}: a cold rule admits rate / cold_factor"),
            ))
        }
    };
    Ok(Some(WarmUp { warm_ns, cold_factor }))
}

/// `[[rule.limit]]`: at most `MAX_NESTED_LIMITS`, on a rule with a `rate`
/// of its own on this host (a global rule's bucket runs at its lease; a
/// booked SYN would have to book every limit's token), each with a `rate`
/// in the rule's unit, a `burst` (default one second of it) and a `key`
/// (default `rule`).
fn nested_limits(cx: &Ctx, r: &RawRule, rule: &Rule) -> Result<Vec<NestedLimit>, ProfileError> {
    let Some(first) = r.limit.first() else { return Ok(Vec::new()) };
    let why = if r.limit.len() > MAX_NESTED_LIMITS {
        Some((r.limit[MAX_NESTED_LIMITS].span(), format!("rule `{}` has {} nested limits; at most {MAX_NESTED_LIMITS} (each costs every packet of the rule a key-table lookup)", rule.name, r.limit.len())))
    } else if rule.interval_fp == 0 {
        Some((
            first.span(),
            "nested limits add to the rule's own `rate`: give the rule one".to_string(),
        ))
    } else if rule.global.is_some() {
        Some((first.span(), "nested limits are for local rules (a global rule's bucket runs at its lease's rate): drop them, or drop scope = \"global\"".to_string()))
    } else if rule.book_retransmits {
        Some((first.span(), "nested limits do not combine with book_retransmits (a booked SYN would have to book a token of every limit): drop one of them".to_string()))
    } else {
        None
    };
    if let Some((span, why)) = why {
        return Err(cx.err(span, why));
    }
    let mut out = Vec::new();
    for raw in &r.limit {
        let l = raw.get_ref();
        let Some(rate_s) = &l.rate else {
            return Err(cx.err(
                raw.span(),
                "a nested limit needs a `rate` (e.g. \"1000/s\") in the rule's unit",
            ));
        };
        let b = bucket(cx, rate_s, rate(cx, rate_s)?, l.burst.as_ref(), rule)?;
        let (key_kind, prefix_v4, prefix_v6) = key_of(cx, &l.key, &l.prefix_v4, &l.prefix_v6)?;
        out.push(NestedLimit {
            line: cx.line(&raw.span()),
            key_kind,
            prefix_v4,
            prefix_v6,
            burst_ns: depth_ns(rule.unit, b.interval_fp, b.burst),
            rate_text: b.rate_text,
            burst: b.burst,
            interval_fp: b.interval_fp,
        });
    }
    Ok(out)
}

/// `book_retransmits = true`: for a `connections` rule with a rate of its
/// own, on this host, without a quota (a booked SYN is charged to the
/// bucket when it is refused; a quota would have to be booked with it).
fn book_retransmits(cx: &Ctx, r: &RawRule, rule: &Rule) -> Result<bool, ProfileError> {
    let Some(b) = &r.book_retransmits else { return Ok(false) };
    if !*b.get_ref() {
        return Ok(false);
    }
    let why = if rule.unit != unit::CONNECTIONS {
        "book_retransmits books tokens for retransmitted TCP SYNs: it needs unit = \"connections\""
    } else if rule.interval_fp == 0 {
        "book_retransmits books the bucket's tokens: the rule needs a `rate`"
    } else if rule.quota_bucket_ns != 0 {
        "book_retransmits does not combine with a quota (a booked SYN would have to book its quota too): drop one of them"
    } else if rule.global.is_some() {
        "book_retransmits is for local rules (a global rule's bucket runs at its lease's rate): drop it or scope = \"global\""
    } else {
        return Ok(true);
    };
    Err(cx.err(b.span(), why))
}

/// `scope`: `"local"` (the default: the limit is this host's) or
/// `"global"` (one limit across every host sharing the `[fleet]` store),
/// with its `default_share`: what a key admits here before its first lease
/// (a rate no higher than the rule's, `"none"`, or by default 1% of the rate
/// with 1% of the burst, at least one unit).
fn scope(cx: &Ctx, r: &RawRule, rule: &Rule) -> Result<Option<GlobalScope>, ProfileError> {
    let global = match &r.scope {
        None => false,
        Some(v) => keyword(
            cx,
            v,
            "scope",
            &[("local", false), ("global", true)],
            "use \"local\" (this host's limit) or \"global\" (one limit across the fleet)",
        )?,
    };
    if !global {
        if let Some(d) = &r.default_share {
            return Err(cx.err(d.span(), "`default_share` belongs to scope = \"global\""));
        }
        return Ok(None);
    }
    let scope_span = r.scope.as_ref().expect("global was written").span();
    let Some(rate_s) = &r.rate else {
        // The leases split the quota in the rate's proportions.
        let span = r.quota.as_ref().map(|q| q.span()).unwrap_or(scope_span);
        return Err(cx.err(span, "a global rule needs a `rate`: the fleet-wide limit (a quota is split between hosts in proportion to their shares of the rate)"));
    };
    // The leases split whole units per second (docs/fleet.md, "The
    // script": every amount an integer below 2^32).
    let limit = rate(cx, rate_s)?;
    if limit.num < limit.den || limit.num / limit.den > u32::MAX as u128 {
        return Err(cx.err(rate_s.span(), "a global rule's rate must be 1 to 4294967295 units per second (its leases split whole units per second)"));
    }
    if rule.burst > u32::MAX as u64 {
        let span = r.burst.as_ref().map(|b| b.span()).unwrap_or(scope_span.clone());
        return Err(cx.err(span, "a global rule's burst must be at most 4294967295 units"));
    }
    let min_burst = if rule.unit == unit::BYTES { MIN_BYTE_BURST } else { 1 };
    let share = match &r.default_share {
        Some(d) if d.get_ref() == "none" => None,
        Some(d) => {
            let s = rate(cx, d)?;
            if s.dim != limit.dim {
                return Err(cx.err(d.span(), "default_share must be in the rule's unit"));
            }
            // s.num / s.den <= limit.num / limit.den, compared exactly.
            if s.num * limit.den > limit.num * s.den {
                return Err(cx.err(d.span(), format!("default_share `{}` is above the rule's rate `{}`: it is what one host admits before its lease", d.get_ref(), rate_s.get_ref())));
            }
            if s.num == 0 || s.num > u64::MAX as u128 || s.den > u64::MAX as u128 {
                return Err(
                    cx.err(d.span(), "default_share out of range (use \"none\" for nothing)")
                );
            }
            let per_s = (s.num / s.den) as u64;
            // The quota in the share's proportion of the rate, rounded down.
            let quota = (rule.quota_limit as u128 * s.num * limit.den / (s.den * limit.num)) as u32;
            Some(DefaultShare {
                interval_fp: gcra::interval_fp(s.num as u64, s.den as u64),
                burst: per_s.clamp(min_burst, rule.burst.max(min_burst)),
                quota,
                text: d.get_ref().clone(),
            })
        }
        None => {
            // 1% of the rate: the interval a hundred times longer.
            let interval_fp = rule.interval_fp.saturating_mul(100);
            Some(DefaultShare {
                interval_fp,
                burst: (rule.burst / 100).max(min_burst),
                quota: rule.quota_limit / 100,
                text: format!("1% of {}", rule.rate_text),
            })
        }
    };
    Ok(Some(GlobalScope { share }))
}

/// What a packet must be to match: `proto`, `src`, `dst` and `dport` (which
/// needs a protocol with ports, when a protocol is named). Whether the rule
/// enforces is its action's (`enforcing` is left false).
fn match_spec(cx: &Ctx, r: &RawRule, lists: &[List]) -> Result<MatchSpec, ProfileError> {
    let proto = match &r.proto {
        None => None,
        Some(p) => protocol(cx, p)?,
    };
    let src = r.src.as_ref().map(|s| source(cx, s, lists)).transpose()?;
    let dst = r.dst.as_ref().map(|s| source(cx, s, lists)).transpose()?;
    if let (Some(Source::Prefix(s)), Some(Source::Prefix(d)), Some(at)) = (&src, &dst, &r.dst) {
        if s.addr.is_ipv4() != d.addr.is_ipv4() {
            return Err(cx.err(
                at.span(),
                format!("`dst` {d} and `src` {s} are of different IP versions: the rule could never match"),
            ));
        }
    }
    let ports = match &r.dport {
        None => None,
        Some(p) => {
            let range = ports(cx, p)?;
            if let Some(pr) = proto.filter(|pr| *pr != TCP && *pr != UDP) {
                return Err(cx.err(
                    p.span(),
                    format!("`dport` needs proto tcp or udp, not {}", proto_name(pr)),
                ));
            }
            Some(range)
        }
    };
    Ok(MatchSpec { proto, src, dst, ports, enforcing: false })
}

/// `src` or `dst`: a prefix, or `@name` of a `[[list]]`.
fn source(cx: &Ctx, s: &Spanned<String>, lists: &[List]) -> Result<Source, ProfileError> {
    let Some(wanted) = s.get_ref().trim().strip_prefix('@') else {
        return Ok(Source::Prefix(cidr(cx, s)?));
    };
    match lists.iter().find(|l| l.prefixes.name == wanted) {
        Some(l) => Ok(Source::List(l.prefixes.clone())),
        None => {
            let names: Vec<&str> = lists.iter().map(|l| l.prefixes.name.as_str()).collect();
            let declared = if names.is_empty() {
                "the profile declares none".to_string()
            } else {
                format!("declared: {}", names.join(", "))
            };
            Err(cx.err(s.span(), format!("no [[list]] named `{wanted}` ({declared})")))
        }
    }
}

fn rule_action(cx: &Ctx, r: &RawRule) -> Result<u8, ProfileError> {
    match &r.action {
        None => Ok(action::DROP),
        Some(a) => keyword(
            cx,
            a,
            "action",
            &[
                ("drop", action::DROP),
                ("pass", action::PASS),
                ("dry-run", action::DRY_RUN),
                ("dry_run", action::DRY_RUN),
                ("block", BLOCK),
            ],
            "use drop, pass, dry-run or block",
        ),
    }
}

/// A bucket's depth in ns for `burst` of the rule's `unit`: bytes round
/// the product up (a packet as long as the burst passes), packets and
/// connections take `burst` whole increments (`gcra::burst_ns`).
pub(crate) fn depth_ns(unit: u8, interval_fp: u64, burst: u64) -> u64 {
    if unit == unit::BYTES {
        gcra::byte_burst_ns(interval_fp, burst)
    } else {
        gcra::burst_ns(interval_fp, burst)
    }
}

/// `action = "block"` as `rule_action` reads it (the rule's kernel action
/// is `drop`, with a bucket that refuses everything).
const BLOCK: u8 = u8::MAX;

/// A `pass` rule limits nothing and a `block` rule drops everything: a
/// limit on either is a mistake.
fn nothing_to_limit(cx: &Ctx, r: &RawRule, word: &str) -> Result<(), ProfileError> {
    let mut keys = vec![
        ("rate", r.rate.as_ref().map(|x| x.span())),
        ("burst", r.burst.as_ref().map(|x| x.span())),
        ("key", r.key.as_ref().map(|x| x.span())),
        ("quota", r.quota.as_ref().map(|x| x.span())),
        ("[[rule.limit]]", r.limit.first().map(|x| x.span())),
        ("isolate", r.isolate.as_ref().map(|x| x.span())),
        ("table_entries", r.table_entries.as_ref().map(|x| x.span())),
    ];
    if word == "block" {
        // A block rule drops every packet of its match: anything that would
        // narrow or shape that (`unit = "connections"` would read as "block
        // new connections only") is refused rather than ignored.
        keys.extend([
            ("unit", r.unit.as_ref().map(|x| x.span())),
            ("prefix_v4", r.prefix_v4.as_ref().map(|x| x.span())),
            ("prefix_v6", r.prefix_v6.as_ref().map(|x| x.span())),
            ("quota_window", r.quota_window.as_ref().map(|x| x.span())),
            ("quota_buckets", r.quota_buckets.as_ref().map(|x| x.span())),
            ("warm_up", r.warm_up.as_ref().map(|x| x.span())),
            ("cold_factor", r.cold_factor.as_ref().map(|x| x.span())),
            ("bbr", r.bbr.as_ref().map(|x| x.span())),
            ("scope", r.scope.as_ref().map(|x| x.span())),
            ("default_share", r.default_share.as_ref().map(|x| x.span())),
            ("admission", r.admission.as_ref().map(|x| x.span())),
            ("admission_ratio", r.admission_ratio.as_ref().map(|x| x.span())),
            ("priority", r.priority.as_ref().map(|x| x.span())),
            ("book_retransmits", r.book_retransmits.as_ref().map(|x| x.span())),
        ]);
    }
    if let Some((f, Some(s))) = keys.into_iter().find(|(_, s)| s.is_some()) {
        return Err(cx.err(s, format!("`{f}` has no effect on a rule with action = \"{word}\"")));
    }
    Ok(())
}

/// The unit: as written, else the dimension of the rate or the quota
/// (bytes), else packets. Connections are TCP SYNs.
fn rule_unit(
    cx: &Ctx,
    raw: &Spanned<RawRule>,
    rate: Option<Rate>,
    quota: Option<(u64, Dimension)>,
    proto: Option<u8>,
) -> Result<u8, ProfileError> {
    let r = raw.get_ref();
    let implied_bytes = rate
        .map(|x| x.dim == Dimension::Bytes)
        .or(quota.map(|q| q.1 == Dimension::Bytes))
        .unwrap_or(false);
    let unit = match &r.unit {
        None if implied_bytes => unit::BYTES,
        None => unit::PACKETS,
        Some(u) => keyword(
            cx,
            u,
            "unit",
            &[
                ("packets", unit::PACKETS),
                ("bytes", unit::BYTES),
                ("connections", unit::CONNECTIONS),
            ],
            "use packets, bytes or connections",
        )?,
    };
    if unit == unit::CONNECTIONS && proto.is_some_and(|p| p != TCP) {
        return Err(cx.err(
            r.unit.as_ref().map(|u| u.span()).unwrap_or(raw.span()),
            "unit = \"connections\" counts TCP SYNs: use proto = \"tcp\"",
        ));
    }
    Ok(unit)
}

/// The token bucket of a `rate`: its interval and its burst (default: one
/// second of the rate, at least one unit, or one full frame for bytes).
fn token_bucket(
    cx: &Ctx,
    r: &RawRule,
    rate: Option<Rate>,
    rule: &mut Rule,
) -> Result<(), ProfileError> {
    let (Some(rate), Some(rate_s)) = (rate, &r.rate) else {
        if let Some(b) = &r.burst {
            return Err(cx.err(b.span(), "`burst` belongs to a `rate`; this rule has none"));
        }
        return Ok(());
    };
    let b = bucket(cx, rate_s, rate, r.burst.as_ref(), rule)?;
    (rule.rate_text, rule.interval_fp, rule.burst) = (b.rate_text, b.interval_fp, b.burst);
    Ok(())
}

/// A rate and burst, validated against the rule's unit.
struct Bucket {
    rate_text: String,
    interval_fp: u64,
    burst: u64,
}

/// The bucket of `rate` (as written: `rate_s`) with `burst`, in the unit
/// of `rule`: the rule's own, or one of its nested limits'.
fn bucket(
    cx: &Ctx,
    rate_s: &Spanned<String>,
    rate: Rate,
    burst: Option<&Spanned<RawAmount>>,
    rule: &Rule,
) -> Result<Bucket, ProfileError> {
    let bytes = rule.unit == unit::BYTES;
    if bytes != (rate.dim == Dimension::Bytes) {
        return Err(cx.err(
            rate_s.span(),
            if bytes {
                "a bytes rule needs a byte rate such as \"10Mbit/s\" or \"1MB/s\"".to_string()
            } else {
                format!("a byte rate needs unit = \"bytes\", not {}", rule.unit_name())
            },
        ));
    }
    let (num, den) = (rate.num, rate.den);
    if num > u64::MAX as u128 || den > u64::MAX as u128 {
        return Err(cx.err(rate_s.span(), "rate out of range"));
    }
    let interval_fp = gcra::interval_fp(num as u64, den as u64);
    let burst = match burst {
        None => {
            let per_s = rate.per_second() as u64;
            per_s.max(if bytes { MIN_BYTE_BURST } else { 1 })
        }
        Some(b) => {
            let (n, dim) = amount(cx, b, "burst")?;
            if bytes {
                if n < MIN_BYTE_BURST {
                    return Err(cx.err(b.span(), format!("byte burst {n} is below one full frame ({MIN_BYTE_BURST} bytes): such packets could never pass")));
                }
            } else if dim == Dimension::Bytes {
                return Err(cx.err(
                    b.span(),
                    format!("a byte-sized burst needs unit = \"bytes\", not {}", rule.unit_name()),
                ));
            }
            n
        }
    };
    Ok(Bucket { rate_text: rate_s.get_ref().clone(), interval_fp, burst })
}

/// A `quota` over `quota_window`, counted in `quota_buckets` buckets.
fn quota_window(
    cx: &Ctx,
    r: &RawRule,
    quota: Option<(u64, Dimension)>,
    rule: &mut Rule,
) -> Result<(), ProfileError> {
    let (Some((n, dim)), Some(q)) = (quota, &r.quota) else {
        for (f, s) in [
            ("quota_window", r.quota_window.as_ref().map(|x| x.span())),
            ("quota_buckets", r.quota_buckets.as_ref().map(|x| x.span())),
        ] {
            if let Some(s) = s {
                return Err(cx.err(s, format!("`{f}` needs a `quota`")));
            }
        }
        return Ok(());
    };
    if rule.unit == unit::BYTES && n < MIN_BYTE_BURST {
        return Err(cx.err(
            q.span(),
            format!("byte quota {n} is below one full frame ({MIN_BYTE_BURST} bytes)"),
        ));
    }
    if rule.unit != unit::BYTES && dim == Dimension::Bytes {
        return Err(cx.err(
            q.span(),
            format!("a byte-sized quota needs unit = \"bytes\", not {}", rule.unit_name()),
        ));
    }
    if n > u32::MAX as u64 {
        return Err(cx.err(q.span(), format!("quota {n} is over the limit of {}", u32::MAX)));
    }
    let Some(w) = &r.quota_window else {
        return Err(cx.err(q.span(), "a quota needs `quota_window` (e.g. \"1min\")"));
    };
    let window = duration(cx, w, "quota_window")?;
    let k = match &r.quota_buckets {
        Some(b) => {
            let k = *b.get_ref();
            if !(1..=MAX_QUOTA_BUCKETS as i64).contains(&k) {
                return Err(cx.err(
                    b.span(),
                    format!("quota_buckets {k} out of range 1..={MAX_QUOTA_BUCKETS}"),
                ));
            }
            k as u64
        }
        None => DEFAULT_QUOTA_BUCKETS,
    };
    let bucket_ns = window / k;
    if bucket_ns < 1_000_000 {
        return Err(cx.err(
            w.span(),
            format!("quota_window / quota_buckets must be at least 1ms (is {bucket_ns} ns)"),
        ));
    }
    rule.quota_limit = n as u32;
    rule.quota_bucket_ns = bucket_ns;
    rule.quota_buckets = k as u32;
    Ok(())
}

/// How admission ratios pick (`admission`), a fixed ratio
/// (`admission_ratio`) and KLimiter's floor (`priority`).
fn admission(cx: &Ctx, r: &RawRule, rule: &mut Rule) -> Result<(), ProfileError> {
    if let Some(a) = &r.admission {
        rule.admission_per_flow = keyword(
            cx,
            a,
            "admission",
            &[("flow", true), ("packet", false)],
            "\"flow\" (a 5-tuple hash keeps each flow wholly in or out) or \"packet\"",
        )?;
    }
    if let Some(p) = &r.priority {
        let v = *p.get_ref();
        if !(0.0..=1.0).contains(&v) {
            return Err(cx.err(p.span(), format!("priority {v} out of range: the lowest admission ratio KLimiter may cut this rule to in its first round, 0.0 to 1.0")));
        }
        rule.priority = v;
        rule.priority_span = Some(p.span());
    }
    if let Some(a) = &r.admission_ratio {
        let v = *a.get_ref();
        if !(0.0..=1.0).contains(&v) {
            return Err(cx.err(
                a.span(),
                format!(
                    "admission_ratio {v} out of range: 0.0 (admit no new flows) to 1.0 (admit all)"
                ),
            ));
        }
        rule.admission_ppm = Some((v * 1e6).round() as u32);
    }
    Ok(())
}

/// A rule's `bbr = { ... }`.
fn bbr(cx: &Ctx, b: &RawBbr) -> Result<BbrRule, ProfileError> {
    let mut out = BbrRule {
        cpu_threshold: 800,
        release_below: 0, // = cpu_threshold unless written
        window_ns: 10_000_000_000,
        buckets: 100,
        idle_timeout_ns: 30_000_000_000,
        reset: false,
        compat: flowctl_common::bbr::Compat::default(),
    };
    if let Some(v) = &b.cpu_threshold {
        let n = *v.get_ref();
        if !(1..=1000).contains(&n) {
            return Err(cx.err(
                v.span(),
                format!("cpu_threshold {n} out of range: 1 to 1000 (per mille of the CPU signal)"),
            ));
        }
        out.cpu_threshold = n as u32;
    }
    out.release_below = out.cpu_threshold;
    if let Some(v) = &b.release_below {
        let n = *v.get_ref();
        if !(0..=out.cpu_threshold as i64).contains(&n) {
            return Err(cx.err(
                v.span(),
                format!(
                    "release_below {n} must be between 0 and cpu_threshold ({})",
                    out.cpu_threshold
                ),
            ));
        }
        out.release_below = n as u32;
    }
    if let Some(v) = &b.window {
        out.window_ns = duration(cx, v, "bbr window")?;
    }
    if let Some(v) = &b.buckets {
        let n = *v.get_ref();
        if !(2..=1000).contains(&n) {
            return Err(cx.err(v.span(), format!("bbr buckets {n} out of range: 2 to 1000")));
        }
        out.buckets = n as u32;
    }
    if let Some(v) = &b.idle_timeout {
        let ns = duration(cx, v, "idle_timeout")?;
        let max = (OPEN_BUCKETS as u64 - 1) * OPEN_BUCKET_NS;
        if !(OPEN_BUCKET_NS..=max).contains(&ns) {
            return Err(cx.err(
                v.span(),
                format!(
                    "idle_timeout must be between 1s and {}s (the open-connection ring's span)",
                    max / 1_000_000_000
                ),
            ));
        }
        out.idle_timeout_ns = ns;
    }
    if let Some(v) = &b.reject {
        out.reset = keyword(
            cx,
            v,
            "reject",
            &[("drop", false), ("reset", true)],
            "use \"drop\" or \"reset\" (answer refused SYNs with a TCP RST)",
        )?;
    }
    for c in &b.compat {
        match c.get_ref().as_str() {
            "floor_max_inflight" => out.compat.floor_max_inflight = true,
            "empty_window_zero" => out.compat.empty_window_zero = true,
            "cooldown_from_first_drop" => out.compat.cooldown_from_first_drop = true,
            "min_rt_from_window" => out.compat.min_rt_from_window = true,
            "kratos" => out.compat = flowctl_common::bbr::Compat::KRATOS,
            other => {
                return Err(cx.err(
                    c.span(),
                    format!("unknown compat switch `{other}`: floor_max_inflight, empty_window_zero, cooldown_from_first_drop, min_rt_from_window or kratos (all four)"),
                ))
            }
        }
    }
    Ok(out)
}

/// The key (`key_kind`) and, for `src_prefix`, its prefix lengths
/// (default /24 and /64; other keys use whole addresses).
fn key(cx: &Ctx, r: &RawRule) -> Result<(u8, u8, u8), ProfileError> {
    key_of(cx, &r.key, &r.prefix_v4, &r.prefix_v6)
}

/// `key` with its `prefix_v4` and `prefix_v6`, of a rule or a nested limit.
fn key_of(
    cx: &Ctx,
    key: &Option<Spanned<String>>,
    prefix_v4: &Option<Spanned<i64>>,
    prefix_v6: &Option<Spanned<i64>>,
) -> Result<(u8, u8, u8), ProfileError> {
    let kind = match key {
        None => key_kind::RULE,
        Some(k) => keyword(
            cx,
            k,
            "key",
            &[
                ("rule", key_kind::RULE),
                ("src", key_kind::SRC),
                ("src_prefix", key_kind::SRC_PREFIX),
                ("dport", key_kind::DPORT),
                ("src_dport", key_kind::SRC_DPORT),
                ("5tuple", key_kind::FIVE_TUPLE),
                ("five_tuple", key_kind::FIVE_TUPLE),
            ],
            "use rule, src, src_prefix, dport, src_dport or 5tuple",
        )?,
    };
    let prefix = |raw: &Option<Spanned<i64>>, max: i64, default: u8| match raw {
        None => Ok(default),
        Some(p) if kind != key_kind::SRC_PREFIX => {
            Err(cx.err(p.span(), "prefix_v4/prefix_v6 need key = \"src_prefix\""))
        }
        Some(p) => {
            let n = *p.get_ref();
            if !(1..=max).contains(&n) {
                return Err(cx.err(p.span(), format!("prefix length {n} out of range 1..={max}")));
            }
            Ok(n as u8)
        }
    };
    let v4 = prefix(prefix_v4, 32, 24)?;
    let v6 = prefix(prefix_v6, 128, 64)?;
    Ok(if kind == key_kind::SRC_PREFIX { (kind, v4, v6) } else { (kind, 32, 128) })
}

#[cfg(test)]
mod tests {
    use crate::profile::{parse, tests::err};
    use flowctl_common::unit;

    #[test]
    fn quotas() {
        let s = parse("p", "[[rule]]\nname = \"q\"\nproto = \"tcp\"\nunit = \"connections\"\nquota = 60\nquota_window = \"1min\"\nkey = \"src_prefix\"\n").unwrap();
        let r = &s.rules[0];
        assert_eq!((r.quota_limit, r.quota_buckets, r.quota_bucket_ns), (60, 10, 6_000_000_000));
        assert_eq!(r.interval_fp, 0, "quota only: no bucket");
        let b = parse(
            "p",
            "[[rule]]\nname = \"q\"\nquota = \"1GiB\"\nquota_window = \"1h\"\nquota_buckets = 16\n",
        )
        .unwrap();
        assert_eq!((b.rules[0].unit, b.rules[0].quota_limit), (unit::BYTES, 1 << 30));
        for (text, line, needle) in [
            ("[[rule]]\nname = \"q\"\nquota = 5\n", 3, "quota_window"),
            (
                "[[rule]]\nname = \"q\"\nquota = 5\nquota_window = \"1s\"\nquota_buckets = 17\n",
                5,
                "out of range",
            ),
            ("[[rule]]\nname = \"q\"\nquota = 5\nquota_window = \"5ms\"\n", 4, "at least 1ms"),
            (
                "[[rule]]\nname = \"q\"\nrate = \"1/s\"\nquota_window = \"5s\"\n",
                4,
                "needs a `quota`",
            ),
            ("[[rule]]\nname = \"q\"\nquota = 0\nquota_window = \"5s\"\n", 3, "greater than zero"),
            (
                "[[rule]]\nname = \"q\"\nquota = 5\nquota_window = \"5s\"\nburst = 3\n",
                5,
                "belongs to a `rate`",
            ),
        ] {
            let e = err(text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn isolate_gives_a_per_key_rule_its_own_table_and_refuses_what_would_leak() {
        let base = "[[rule]]\nname = \"i\"\nrate = \"100/s\"\nkey = \"src\"\n";
        let p = parse("p", &format!("{base}isolate = true\n")).unwrap();
        assert_eq!(p.rules[0].own_table, Some(flowctl_common::DEFAULT_OWN_TABLE_ENTRIES));
        assert_eq!(p.settings.own_table_entries, 1 << 16);
        let p = parse("p", &format!("{base}isolate = true\ntable_entries = 4096\n")).unwrap();
        assert_eq!(p.rules[0].own_table, Some(4096));
        let plain = parse("p", base).unwrap();
        assert_eq!(plain.rules[0].own_table, None);
        // The state follows the table: a rule that changes tables starts
        // fresh, one that does not keeps its fingerprint as before.
        assert_ne!(p.rules[0].state_fingerprint(), plain.rules[0].state_fingerprint());
        assert!(!plain.rules[0].state_fingerprint().contains("own"));
        let p = parse("p", &format!("{base}isolate = false\n")).unwrap();
        assert_eq!(p.rules[0].own_table, None);
        for (extra, line, needle) in [
            ("table_entries = 4096\n", 5, "add isolate = true"),
            ("isolate = true\ntable_entries = 100\n", 6, "table_entries must be 1024 to"),
            ("isolate = true\nquota = 5\nquota_window = \"1s\"\n", 5, "quota"),
            ("isolate = true\nscope = \"global\"\n", 5, "local rules"),
            ("isolate = true\n[[rule.limit]]\nrate = \"1000/s\"\n", 5, "nested limits"),
        ] {
            let e = err(&format!("{base}{extra}"));
            assert_eq!(e.line, line, "{extra}: {e}");
            assert!(e.to_string().contains(needle), "{extra}: {e}");
        }
        for (text, needle) in [
            ("[[rule]]\nname = \"i\"\nrate = \"1/s\"\nisolate = true\n", "per-key rules"),
            ("[[rule]]\nname = \"i\"\nquota = 5\nquota_window = \"1s\"\nkey = \"src\"\nisolate = true\n", "needs a `rate`"),
            ("[[rule]]\nname = \"i\"\nproto = \"tcp\"\nunit = \"connections\"\nrate = \"5/s\"\nkey = \"src\"\nbook_retransmits = true\nisolate = true\n", "book_retransmits"),
            ("[[rule]]\nname = \"i\"\naction = \"pass\"\nisolate = true\n", "no effect"),
        ] {
            let e = err(text);
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
        // The tables count against the memory budget.
        let e = err(&format!("[settings]\nmemory_budget = \"256MiB\"\n{base}isolate = true\ntable_entries = 16777216\n"));
        assert!(e.to_string().contains("table_entries"), "{e}");
    }

    #[test]
    fn warm_up_ramps_a_rule_s_aggregate_bucket_only() {
        let base = "[[rule]]\nname = \"w\"\nrate = \"100/s\"\n";
        let p = parse("p", &format!("{base}warm_up = \"30s\"\n")).unwrap();
        assert_eq!(
            p.rules[0].warm_up,
            Some(super::WarmUp { warm_ns: 30_000_000_000, cold_factor: 3 })
        );
        let p = parse("p", &format!("{base}warm_up = \"2s\"\ncold_factor = 5\n")).unwrap();
        assert_eq!(p.rules[0].warm_up.map(|w| w.cold_factor), Some(5));
        for (extra, line, needle) in [
            ("warm_up = \"500ms\"\n", 4, "between 1s and 1h"),
            ("warm_up = \"2h\"\n", 4, "between 1s and 1h"),
            ("warm_up = \"soon\"\n", 4, "bad warm_up"),
            ("warm_up = \"10s\"\ncold_factor = 1\n", 5, "cold_factor must be 2 to 10"),
            ("warm_up = \"10s\"\ncold_factor = 11\n", 5, "cold_factor must be 2 to 10"),
            ("cold_factor = 3\n", 4, "belongs to a `warm_up`"),
            ("key = \"src\"\nwarm_up = \"10s\"\n", 5, "aggregate bucket"),
            ("quota = 5\nquota_window = \"1s\"\nwarm_up = \"10s\"\n", 6, "quota"),
            ("warm_up = \"10s\"\n[[rule.limit]]\nrate = \"1/s\"\n", 4, "nested limits"),
            ("scope = \"global\"\nwarm_up = \"10s\"\n", 5, "local rules"),
        ] {
            let text = format!("{base}{extra}");
            let e = err(&text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
        let e =
            err("[[rule]]\nname = \"w\"\nquota = 5\nquota_window = \"1s\"\nwarm_up = \"10s\"\n");
        assert!(e.to_string().contains("needs a `rate`"), "{e}");
    }

    #[test]
    fn a_small_connection_burst_gets_advice() {
        let rule = |extra: &str| {
            let text = format!("[[rule]]\nname = \"c\"\nproto = \"tcp\"\nunit = \"connections\"\nrate = \"50/s\"\n{extra}");
            parse("p", &text).unwrap().rules[0].advice()
        };
        let a = rule("burst = 10\n").expect("advice for burst 10 at 50/s");
        assert!(a.contains("line 1") && a.contains("about 10 connections per second"), "{a}");
        assert!(a.contains("book_retransmits"), "{a}");
        assert_eq!(rule(""), None, "the default burst is one second of the rate");
        assert_eq!(rule("burst = 50\n"), None);
        assert_eq!(rule("burst = 10\nbook_retransmits = true\n"), None);
        let packets = parse("p", "[[rule]]\nname = \"p\"\nrate = \"50/s\"\nburst = 1\n").unwrap();
        assert_eq!(packets.rules[0].advice(), None, "packet rules: nothing retransmits");
    }

    #[test]
    fn nested_limits() {
        let base = "[[rule]]\nname = \"n\"\nproto = \"tcp\"\nunit = \"connections\"\nrate = \"10/s\"\nkey = \"src\"\n";
        let text = format!("{base}[[rule.limit]]\nrate = \"1000/s\"\nkey = \"src_prefix\"\nprefix_v4 = 16\n[[rule.limit]]\nrate = \"20000/s\"\nburst = 500\n");
        let s = parse("p", &text).unwrap();
        let with_quota =
            format!("{base}quota = 5\nquota_window = \"1s\"\n[[rule.limit]]\nrate = \"1/s\"\n");
        assert_eq!(parse("p", &with_quota).unwrap().rules[0].limits.len(), 1, "a quota and limits");
        let l = &s.rules[0].limits;
        assert_eq!(l.len(), 2);
        assert_eq!(
            (l[0].key_kind, l[0].prefix_v4, l[0].burst, l[0].line),
            (flowctl_common::key_kind::SRC_PREFIX, 16, 1000, 7)
        );
        assert_eq!(
            (l[1].key_kind, l[1].burst, l[1].line),
            (flowctl_common::key_kind::RULE, 500, 11)
        );
        assert_ne!(
            s.rules[0].state_fingerprint(),
            parse("p", base).unwrap().rules[0].state_fingerprint(),
            "a rule's limits are part of its bucket state"
        );
        let four = format!("{base}{}", "[[rule.limit]]\nrate = \"100/s\"\n".repeat(4));
        for (text, line, needle) in [
            (four.as_str(), 13, "at most 3"),
            ("[[rule]]\nname = \"q\"\nquota = 5\nquota_window = \"1s\"\n[[rule.limit]]\nrate = \"1/s\"\n", 5, "own `rate`"),
            (&format!("{base}book_retransmits = true\n[[rule.limit]]\nrate = \"1/s\"\n"), 8, "book_retransmits"),
            (&format!("{base}[[rule.limit]]\nkey = \"src\"\n"), 7, "needs a `rate`"),
            (&format!("{base}[[rule.limit]]\nrate = \"1Mbit/s\"\n"), 8, "byte rate"),
            (&format!("{base}[[rule.limit]]\nrate = \"1/s\"\nprefix_v4 = 8\n"), 9, "src_prefix"),
            (&format!("{base}[[rule.limit]]\nrate = \"1/s\"\nkey = \"dst\"\n"), 9, "use rule, src"),
            (&format!("{base}[[rule.limit]]\nrate = \"1/s\"\nburtst = 3\n"), 9, "unknown field"),
            ("[[rule]]\nname = \"p\"\naction = \"pass\"\n[[rule.limit]]\nrate = \"1/s\"\n", 4, "no effect"),
            (&format!("{base}scope = \"global\"\n[[rule.limit]]\nrate = \"1/s\"\n[fleet]\nredis = \"redis://127.0.0.1:6379\"\n"), 8, "drop scope"),
        ] {
            let e = err(text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn a_small_nested_connection_burst_gets_advice() {
        let text = "[[rule]]\nname = \"c\"\nproto = \"tcp\"\nunit = \"connections\"\nrate = \"50/s\"\n[[rule.limit]]\nrate = \"100/s\"\nburst = 5\n";
        let a = parse("p", text).unwrap().rules[0].advice().expect("advice for the limit");
        assert!(a.contains("line 6") && a.contains("nested burst 5"), "{a}");
        assert!(!a.contains("book_retransmits"), "not for a rule with limits: {a}");
        let own = "[[rule]]\nname = \"c\"\nproto = \"tcp\"\nunit = \"connections\"\nrate = \"50/s\"\nburst = 5\n[[rule.limit]]\nrate = \"100/s\"\n";
        let a = parse("p", own).unwrap().rules[0].advice().expect("advice for the rule's own");
        assert!(a.contains("the burst 5") && !a.contains("book_retransmits"), "{a}");
    }

    #[test]
    fn book_retransmits_is_for_local_connection_rates() {
        let base = "[[rule]]\nname = \"c\"\nproto = \"tcp\"\nunit = \"connections\"\nrate = \"50/s\"\nburst = 10\n";
        let s = parse("p", &format!("{base}book_retransmits = true\n")).unwrap();
        assert!(s.rules[0].book_retransmits);
        assert!(!parse("p", base).unwrap().rules[0].book_retransmits);
        for (text, line, needle) in [
            (
                "[[rule]]\nname = \"c\"\nrate = \"50/s\"\nbook_retransmits = true\n",
                4,
                "unit = \"connections\"",
            ),
            (
                &format!("{base}quota = 100\nquota_window = \"1min\"\nbook_retransmits = true\n"),
                9,
                "does not combine with a quota",
            ),
            (
                &format!("{base}scope = \"global\"\nbook_retransmits = true\n[fleet]\nredis = \"redis://127.0.0.1:6379\"\n"),
                8,
                "for local rules",
            ),
            (&format!("{base}book_retransmits = \"yes\"\n"), 7, "boolean"),
        ] {
            let e = err(text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
    }
}
