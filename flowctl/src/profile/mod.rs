//! Rule profiles: the TOML as written ([`RawProfile`]), then a validated
//! [`RuleSet`]. Every error names file, line, column and the problem, and a
//! profile with any error is rejected whole. docs/profile.md is the reference.

pub mod breaker;
pub mod cpu_source;
pub mod klimiter;

use flowctl_common::{
    action, gcra, key_kind,
    rate::{parse_amount, parse_duration_ns, parse_rate, Dimension, Rate},
    stats,
    tables::{Cidr, MatchSpec},
    unit, BucketKey, QuotaRing, SrcEntry, SrcKey, StatsBucket, COUNTER_RECORDS,
    DEFAULT_CONN_ENTRIES, DEFAULT_QUOTA_ENTRIES, DEFAULT_STATS_BUCKETS, DEFAULT_STATS_BUCKET_NS,
    DEFAULT_TABLE_ENTRIES, MAX_QUOTA_BUCKETS, MAX_RULES, MAX_STATS_BUCKETS, OPEN_BUCKETS,
    OPEN_BUCKET_NS, XDP_DROP, XDP_PASS,
};
use serde::Deserialize;
use std::{net::IpAddr, path::Path};
use toml::Spanned;

/// The largest standard Ethernet frame with one VLAN tag: a byte bucket must
/// hold at least one, or full-size packets could never pass.
pub const MIN_BYTE_BURST: u64 = 1518;
/// Default ceiling on the kernel memory a profile may preallocate.
pub const DEFAULT_MEMORY_BUDGET: u64 = 1 << 30;

#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}:{col}: {msg}")]
pub struct ProfileError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub msg: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    settings: Option<Spanned<RawSettings>>,
    #[serde(default)]
    rule: Vec<Spanned<RawRule>>,
    klimiter: Option<Spanned<klimiter::RawKlimiter>>,
    #[serde(default)]
    baseline: Vec<Spanned<klimiter::RawBaseline>>,
    #[serde(default)]
    breaker: Vec<Spanned<breaker::RawBreaker>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSettings {
    malformed: Option<Spanned<String>>,
    fragments: Option<Spanned<String>>,
    key_table_entries: Option<Spanned<i64>>,
    source_cache_entries: Option<Spanned<i64>>,
    quota_table_entries: Option<Spanned<i64>>,
    connection_table_entries: Option<Spanned<i64>>,
    memory_budget: Option<Spanned<String>>,
    grace_period: Option<Spanned<String>>,
    statistics: Option<Spanned<String>>,
    statistics_bucket: Option<Spanned<String>>,
    statistics_buckets: Option<Spanned<i64>>,
    cpu: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum RawPorts {
    One(i64),
    Range(String),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawAmount {
    Int(i64),
    Text(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Spanned<String>,
    proto: Option<Spanned<String>>,
    src: Option<Spanned<String>>,
    dport: Option<Spanned<RawPorts>>,
    action: Option<Spanned<String>>,
    unit: Option<Spanned<String>>,
    rate: Option<Spanned<String>>,
    burst: Option<Spanned<RawAmount>>,
    key: Option<Spanned<String>>,
    prefix_v4: Option<Spanned<i64>>,
    prefix_v6: Option<Spanned<i64>>,
    quota: Option<Spanned<RawAmount>>,
    quota_window: Option<Spanned<String>>,
    quota_buckets: Option<Spanned<i64>>,
    bbr: Option<Spanned<RawBbr>>,
    admission: Option<Spanned<String>>,
    admission_ratio: Option<Spanned<f64>>,
    priority: Option<Spanned<f64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBbr {
    cpu_threshold: Option<Spanned<i64>>,
    release_below: Option<Spanned<i64>>,
    window: Option<Spanned<String>>,
    buckets: Option<Spanned<i64>>,
    idle_timeout: Option<Spanned<String>>,
    reject: Option<Spanned<String>>,
    #[serde(default)]
    compat: Vec<Spanned<String>>,
}

/// A rule's BBR limiter, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BbrRule {
    /// CPU EMA (per-mille) at or above which the in-flight test is on.
    pub cpu_threshold: u32,
    /// Hysteresis: the test stays on until the CPU falls below this.
    pub release_below: u32,
    pub window_ns: u64,
    pub buckets: u32,
    /// Established connections silent this long stop counting as in flight.
    pub idle_timeout_ns: u64,
    /// Answer refused SYNs with a TCP RST instead of dropping them.
    pub reset: bool,
    pub compat: flowctl_common::bbr::Compat,
}

impl BbrRule {
    pub fn config(&self) -> flowctl_common::bbr::BbrConfig {
        flowctl_common::bbr::BbrConfig {
            cpu_threshold: self.cpu_threshold,
            buckets_per_second: (1_000_000_000 / (self.window_ns / self.buckets as u64).max(1))
                .max(1),
            cooldown_ns: 1_000_000_000,
            release_below: self.release_below,
            compat: self.compat,
        }
    }

    pub fn kernel_flags(&self) -> u8 {
        flowctl_common::bbr_flags::ON
            | if self.reset { flowctl_common::bbr_flags::RESET } else { 0 }
    }
}

/// Profile-wide settings, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub malformed_verdict: u32,
    pub fragment_verdict: u32,
    pub key_table_entries: u32,
    pub source_cache_entries: u32,
    pub quota_table_entries: u32,
    /// Tracked TCP connections of BBR rules.
    pub connection_table_entries: u32,
    pub memory_budget: u64,
    pub grace_ns: u64,
    pub stats: StatsSettings,
    /// Where the CPU signal comes from (`crate::controllers::cpu`).
    pub cpu_source: cpu_source::CpuSource,
}

/// Shape of the statistics rings, fixed when the program is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StatsSettings {
    /// `flowctl_common::stats::level::*`.
    pub level: u8,
    pub bucket_ns: u64,
    pub buckets: u32,
}

impl Default for StatsSettings {
    fn default() -> Self {
        Self {
            level: stats::level::FULL,
            bucket_ns: DEFAULT_STATS_BUCKET_NS,
            buckets: DEFAULT_STATS_BUCKETS,
        }
    }
}

impl StatsSettings {
    pub fn level_name(&self) -> &'static str {
        if self.level == stats::level::FULL {
            "full"
        } else {
            "control"
        }
    }

    /// Kernel bytes of the rings: per CPU, every counter record's ring.
    pub fn kernel_bytes(&self) -> u64 {
        let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as u64;
        COUNTER_RECORDS as u64 * self.buckets as u64 * size_of::<StatsBucket>() as u64 * ncpu
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            malformed_verdict: XDP_PASS,
            fragment_verdict: XDP_PASS,
            key_table_entries: DEFAULT_TABLE_ENTRIES,
            source_cache_entries: DEFAULT_TABLE_ENTRIES,
            quota_table_entries: DEFAULT_QUOTA_ENTRIES,
            connection_table_entries: DEFAULT_CONN_ENTRIES,
            memory_budget: DEFAULT_MEMORY_BUDGET,
            grace_ns: 3_000_000_000,
            stats: StatsSettings::default(),
            cpu_source: cpu_source::CpuSource::Host,
        }
    }
}

/// One validated rule.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub name: String,
    pub line: usize,
    pub spec: MatchSpec,
    pub action: u8,
    pub unit: u8,
    pub key_kind: u8,
    pub prefix_v4: u8,
    pub prefix_v6: u8,
    /// As written, for display.
    pub rate_text: String,
    pub burst: u64,
    pub interval_fp: u64,
    pub burst_ns: u64,
    /// Quota: at most `quota_limit` units per `quota_buckets * quota_bucket_ns`.
    pub quota_limit: u32,
    pub quota_bucket_ns: u64,
    pub quota_buckets: u32,
    pub bbr: Option<BbrRule>,
    /// Where `bbr` was written (for errors that need the settings).
    pub bbr_span: Option<std::ops::Range<usize>>,
    /// Admission ratios hash the 5-tuple (a flow is wholly in or out) unless
    /// the rule asks for per-packet sampling.
    pub admission_per_flow: bool,
    /// A fixed admission ratio in parts per million (the control loops of
    /// the KLimiter work set it dynamically otherwise).
    pub admission_ppm: Option<u32>,
    /// KLimiter: the lowest ratio round 1 may cut this rule to (0 to 1).
    pub priority: f64,
    pub priority_span: Option<std::ops::Range<usize>>,
}

/// Default quota buckets K: the effective window is at most W + W/K.
pub const DEFAULT_QUOTA_BUCKETS: u64 = 10;

impl Rule {
    /// What must be equal for `apply` to keep this rule's bucket state.
    pub fn state_fingerprint(&self) -> String {
        format!(
            "{:?}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}",
            self.spec,
            self.action,
            self.unit,
            self.key_kind,
            self.prefix_v4,
            self.prefix_v6,
            self.interval_fp,
            self.burst_ns,
            self.quota_limit,
            self.quota_bucket_ns,
            self.quota_buckets
        )
    }

    pub fn key_name(&self) -> String {
        match self.key_kind {
            key_kind::RULE => "rule".into(),
            key_kind::SRC => "src".into(),
            key_kind::SRC_PREFIX => format!("src_prefix(/{},/{})", self.prefix_v4, self.prefix_v6),
            key_kind::DPORT => "dport".into(),
            key_kind::SRC_DPORT => "src_dport".into(),
            _ => "5tuple".into(),
        }
    }

    pub fn unit_name(&self) -> &'static str {
        match self.unit {
            unit::BYTES => "bytes",
            unit::CONNECTIONS => "connections",
            _ => "packets",
        }
    }

    pub fn action_name(&self) -> &'static str {
        match self.action {
            action::PASS => "pass",
            action::DRY_RUN => "dry-run",
            _ => "drop",
        }
    }

    pub fn quota_text(&self) -> Option<String> {
        (self.quota_limit != 0).then(|| {
            let w = self.quota_bucket_ns * self.quota_buckets as u64;
            format!(
                "{} {} per {} ms ({} buckets)",
                self.quota_limit,
                self.unit_name(),
                w / 1_000_000,
                self.quota_buckets
            )
        })
    }

    pub fn match_text(&self) -> String {
        let proto = match self.spec.proto {
            None => "any".to_string(),
            Some(p) => proto_name(p),
        };
        let src = self.spec.src.map(|c| c.to_string()).unwrap_or_else(|| "any".into());
        let ports = match self.spec.ports {
            None => "any".into(),
            Some((a, b)) if a == b => a.to_string(),
            Some((a, b)) => format!("{a}-{b}"),
        };
        format!("{proto} from {src} to port {ports}")
    }
}

pub fn proto_name(p: u8) -> String {
    match p {
        6 => "tcp".into(),
        17 => "udp".into(),
        1 => "icmp".into(),
        58 => "icmpv6".into(),
        n => n.to_string(),
    }
}

/// A validated profile.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleSet {
    pub settings: Settings,
    pub rules: Vec<Rule>,
    pub klimiter: klimiter::KlimiterSettings,
    pub baselines: Vec<klimiter::Baseline>,
    pub breakers: Vec<breaker::Breaker>,
}

/// Kernel bytes per preallocated LRU hash element: the element header
/// (hash node, LRU node, hash; ~60 bytes on 6.x) plus key and value rounded to
/// 8, plus one 8-byte bucket head. Calibrated against the memlock the kernel
/// reports in fdinfo (docs/design.md, `cargo xtask bench` prints both).
pub fn lru_bytes_per_entry(key: usize, value: usize) -> u64 {
    (60 + key.next_multiple_of(8) + value.next_multiple_of(8) + 8) as u64
}

/// Fixed kernel memory of the classification tables and counters (bytes).
pub fn fixed_table_bytes() -> u64 {
    use flowctl_common::*;
    let arrays = SLOTS * (PROTO_INDICES + PORT_INDICES + MAX_SRC_CLASSES) * size_of::<RuleBitmap>()
        + SLOTS * MAX_RULES * size_of::<RuleConfig>()
        + MAX_RULE_RECORDS * size_of::<ControlRecord>()
        + DEBT_SLOTS * size_of::<u64>()
        + MAX_RULE_RECORDS * OPEN_BUCKETS * size_of::<u64>();
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let counters = COUNTER_RECORDS * size_of::<RuleCounters>() * ncpu;
    (arrays + counters) as u64
}

impl Settings {
    /// Preallocated kernel memory of a data plane with these table sizes.
    pub fn kernel_memory_bytes(&self) -> u64 {
        let cache = self.source_cache_entries as u64
            * lru_bytes_per_entry(size_of::<SrcKey>(), size_of::<SrcEntry>());
        let keys = self.key_table_entries as u64
            * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<u64>());
        let quotas = self.quota_table_entries as u64
            * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<QuotaRing>());
        let conns = self.connection_table_entries as u64
            * lru_bytes_per_entry(size_of::<BucketKey>(), size_of::<flowctl_common::ConnEntry>());
        cache + keys + quotas + conns + fixed_table_bytes() + self.stats.kernel_bytes()
    }
}

struct Ctx<'a> {
    file: &'a str,
    text: &'a str,
}

impl Ctx<'_> {
    fn err(&self, span: std::ops::Range<usize>, msg: impl Into<String>) -> ProfileError {
        let (line, col) = line_col(self.text, span.start);
        ProfileError { file: self.file.to_string(), line, col, msg: msg.into() }
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    line_col_of(text, offset)
}

/// Line and column (1-based) of a byte offset in `text`.
pub fn line_col_of(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    (line, col)
}

/// Reads and validates a profile file.
pub fn load(path: &Path) -> Result<RuleSet, ProfileError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ProfileError {
        file: file.clone(),
        line: 0,
        col: 0,
        msg: format!("cannot read the profile: {e}"),
    })?;
    parse(&file, &text)
}

/// Validates profile text; `file` is used in error messages.
pub fn parse(file: &str, text: &str) -> Result<RuleSet, ProfileError> {
    let cx = Ctx { file, text };
    let raw: RawProfile = toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        cx.err(span, e.message().to_string())
    })?;
    // Where a memory-budget error points: the table size that drives it, else
    // the budget, else the [settings] table, else the top of the file.
    let mut budget_span = 0..0;
    let settings = match raw.settings {
        Some(s) => {
            let table_span = s.span();
            let inner = s.into_inner();
            budget_span = inner
                .key_table_entries
                .as_ref()
                .map(|v| v.span())
                .or_else(|| inner.source_cache_entries.as_ref().map(|v| v.span()))
                .or_else(|| inner.memory_budget.as_ref().map(|v| v.span()))
                .unwrap_or(table_span);
            settings(&cx, inner)?
        }
        None => Settings::default(),
    };
    if raw.rule.is_empty() && raw.breaker.is_empty() {
        return Err(ProfileError {
            file: file.into(),
            line: 1,
            col: 1,
            msg: "the profile has no [[rule]] and no [[breaker]]".into(),
        });
    }
    if raw.rule.len() > MAX_RULES {
        let span = raw.rule[MAX_RULES].span();
        return Err(cx.err(span, format!("too many rules: at most {MAX_RULES}")));
    }
    let mut rules: Vec<Rule> = Vec::new();
    for r in raw.rule {
        let span = r.span();
        let rule = rule(&cx, span.clone(), r.into_inner())?;
        if rules.iter().any(|o| o.name == rule.name) {
            return Err(cx.err(span, format!("duplicate rule name `{}`", rule.name)));
        }
        // BBR reads its window from the statistics ring: one BBR bucket per
        // ring bucket, and the window inside the ring (one bucket is the
        // one being filled).
        if let (Some(b), Some(bs)) = (&rule.bbr, &rule.bbr_span) {
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
        }
        rules.push(rule);
    }
    let klimiter = match &raw.klimiter {
        Some(k) => klimiter::settings(k.get_ref(), |v| {
            parse_duration_ns(v.get_ref()).map_err(|e| (v.span(), format!("bad duration: {e}")))
        })
        .map_err(|(sp, m)| cx.err(sp, m))?,
        None => Default::default(),
    };
    let names: Vec<String> = rules.iter().map(|r| r.name.clone()).collect();
    let mut baselines: Vec<klimiter::Baseline> = Vec::new();
    for b in &raw.baseline {
        let parsed = klimiter::baseline(b.get_ref(), &names).map_err(|(sp, m)| cx.err(sp, m))?;
        if baselines.iter().any(|o| o.name == parsed.name) {
            return Err(cx.err(b.span(), format!("duplicate baseline name `{}`", parsed.name)));
        }
        baselines.push(parsed);
    }
    let egress = baselines
        .iter()
        .filter(|b| matches!(b.source, klimiter::LevelSource::Egress { .. }))
        .count();
    if egress > flowctl_common::MAX_EGRESS_TARGETS {
        return Err(ProfileError {
            file: file.into(),
            line: 1,
            col: 1,
            msg: format!(
                "{egress} egress baselines: at most {}",
                flowctl_common::MAX_EGRESS_TARGETS
            ),
        });
    }
    // A rule is either under KLimiter's control or has a fixed ratio.
    for (i, r) in rules.iter().enumerate() {
        let controlled = baselines.iter().any(|b| b.entries.contains(&i));
        if controlled && r.admission_ppm.is_some() {
            return Err(ProfileError { file: file.into(), line: r.line, col: 1, msg: format!("rule `{}` has a fixed admission_ratio and is an entry of a baseline: KLimiter sets its ratio; drop one", r.name) });
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
    let mut breakers = Vec::new();
    for b in &raw.breaker {
        let line = line_col(text, b.span().start).0;
        let parsed = breaker::breaker(b.get_ref(), line).map_err(|(sp, m)| cx.err(sp, m))?;
        breakers.push((parsed, b.span()));
    }
    breaker::check_all(&breakers).map_err(|(sp, m)| cx.err(sp, m))?;
    let breakers = breakers.into_iter().map(|(b, _)| b).collect();
    let set = RuleSet { settings, rules, klimiter, baselines, breakers };
    let need = set.settings.kernel_memory_bytes();
    if need > set.settings.memory_budget {
        return Err(cx.err(
            budget_span,
            format!(
                "the tables need {} of kernel memory, over the budget of {} (lower key_table_entries/source_cache_entries or raise settings.memory_budget)",
                human_bytes(need),
                human_bytes(set.settings.memory_budget)
            ),
        ));
    }
    Ok(set)
}

pub fn human_bytes(n: u64) -> String {
    if n >= 1 << 30 {
        format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64)
    } else if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", n as f64 / 1024.0)
    }
}

fn verdict(cx: &Ctx, v: &Spanned<String>) -> Result<u32, ProfileError> {
    match v.get_ref().as_str() {
        "pass" => Ok(XDP_PASS),
        "drop" => Ok(XDP_DROP),
        other => {
            Err(cx.err(v.span(), format!("unknown verdict `{other}`: use \"pass\" or \"drop\"")))
        }
    }
}

fn table_size(cx: &Ctx, v: &Spanned<i64>) -> Result<u32, ProfileError> {
    let n = *v.get_ref();
    if !(1024..=(1 << 26)).contains(&n) {
        return Err(cx.err(v.span(), format!("table size {n} out of range: 1024 to {}", 1 << 26)));
    }
    Ok(n as u32)
}

fn settings(cx: &Ctx, s: RawSettings) -> Result<Settings, ProfileError> {
    let mut out = Settings::default();
    if let Some(v) = &s.malformed {
        out.malformed_verdict = verdict(cx, v)?;
    }
    if let Some(v) = &s.fragments {
        out.fragment_verdict = verdict(cx, v)?;
    }
    if let Some(v) = &s.key_table_entries {
        out.key_table_entries = table_size(cx, v)?;
    }
    if let Some(v) = &s.source_cache_entries {
        out.source_cache_entries = table_size(cx, v)?;
    }
    if let Some(v) = &s.quota_table_entries {
        out.quota_table_entries = table_size(cx, v)?;
    }
    if let Some(v) = &s.connection_table_entries {
        out.connection_table_entries = table_size(cx, v)?;
    }
    if let Some(v) = &s.memory_budget {
        out.memory_budget = match parse_amount(v.get_ref()) {
            Ok((n, Dimension::Bytes)) => n,
            Ok(_) => {
                return Err(cx.err(v.span(), "memory_budget needs a byte unit, e.g. \"512MiB\""))
            }
            Err(e) => return Err(cx.err(v.span(), format!("bad memory_budget: {e}"))),
        };
    }
    if let Some(v) = &s.grace_period {
        out.grace_ns = parse_duration_ns(v.get_ref())
            .map_err(|e| cx.err(v.span(), format!("bad grace_period: {e}")))?;
    }
    if let Some(v) = &s.statistics {
        out.stats.level = match v.get_ref().as_str() {
            "full" => stats::level::FULL,
            "control" => stats::level::CONTROL,
            other => return Err(cx.err(v.span(), format!("unknown statistics level `{other}`: use \"full\" or \"control\" (only what the control loops read)"))),
        };
    }
    if let Some(v) = &s.cpu {
        out.cpu_source =
            cpu_source::CpuSource::parse(v.get_ref()).map_err(|e| cx.err(v.span(), e))?;
    }
    if let Some(v) = &s.statistics_bucket {
        let ns = parse_duration_ns(v.get_ref())
            .map_err(|e| cx.err(v.span(), format!("bad statistics_bucket: {e}")))?;
        if !(10_000_000..=10_000_000_000).contains(&ns) {
            return Err(cx.err(v.span(), "statistics_bucket must be between 10ms and 10s"));
        }
        out.stats.bucket_ns = ns;
    }
    if let Some(v) = &s.statistics_buckets {
        let n = *v.get_ref();
        if !(10..=MAX_STATS_BUCKETS as i64).contains(&n) {
            return Err(cx.err(
                v.span(),
                format!("statistics_buckets {n} out of range: 10 to {MAX_STATS_BUCKETS}"),
            ));
        }
        out.stats.buckets = n as u32;
    }
    Ok(out)
}

fn bbr(cx: &Ctx, b: &RawBbr) -> Result<BbrRule, ProfileError> {
    let mut out = BbrRule {
        cpu_threshold: 800,
        release_below: 0,
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
        out.window_ns = parse_duration_ns(v.get_ref())
            .map_err(|e| cx.err(v.span(), format!("bad bbr window: {e}")))?;
    }
    if let Some(v) = &b.buckets {
        let n = *v.get_ref();
        if !(2..=1000).contains(&n) {
            return Err(cx.err(v.span(), format!("bbr buckets {n} out of range: 2 to 1000")));
        }
        out.buckets = n as u32;
    }
    if let Some(v) = &b.idle_timeout {
        let ns = parse_duration_ns(v.get_ref())
            .map_err(|e| cx.err(v.span(), format!("bad idle_timeout: {e}")))?;
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
        out.reset = match v.get_ref().as_str() {
            "drop" => false,
            "reset" => true,
            other => return Err(cx.err(v.span(), format!("unknown reject `{other}`: use \"drop\" or \"reset\" (answer refused SYNs with a TCP RST)"))),
        };
    }
    for c in &b.compat {
        match c.get_ref().as_str() {
            "floor_max_inflight" => out.compat.floor_max_inflight = true,
            "empty_window_zero" => out.compat.empty_window_zero = true,
            "cooldown_from_first_drop" => out.compat.cooldown_from_first_drop = true,
            "kratos" => out.compat = flowctl_common::bbr::Compat::KRATOS,
            other => {
                return Err(cx.err(
                    c.span(),
                    format!("unknown compat switch `{other}`: floor_max_inflight, empty_window_zero, cooldown_from_first_drop or kratos (all three)"),
                ))
            }
        }
    }
    Ok(out)
}

/// A port (`443`) or range (`"8000-8100"`).
pub(crate) fn parse_ports(p: &RawPorts) -> Result<(u16, u16), String> {
    match p {
        RawPorts::One(n) => port_pair(*n, *n),
        RawPorts::Range(s) => parse_port_text(s),
    }
}

/// `443` or `8000-8100` as text.
pub(crate) fn parse_port_text(s: &str) -> Result<(u16, u16), String> {
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let bad = || format!("bad port range `{s}`: use \"8000-8100\"");
    port_pair(
        a.trim().parse::<i64>().map_err(|_| bad())?,
        b.trim().parse::<i64>().map_err(|_| bad())?,
    )
}

fn port_pair(lo: i64, hi: i64) -> Result<(u16, u16), String> {
    if !(0..=65535).contains(&lo) || !(0..=65535).contains(&hi) {
        return Err("ports are 0 to 65535".into());
    }
    if lo > hi {
        return Err(format!("reversed port range {lo}-{hi}: write {hi}-{lo}"));
    }
    Ok((lo as u16, hi as u16))
}

pub(crate) fn parse_cidr(s: &str) -> Result<Cidr, String> {
    let (a, l) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let addr: IpAddr = a.trim().parse().map_err(|_| format!("`{a}` is not an IP address"))?;
    let max = Cidr::max_len(&addr);
    let len = match l {
        Some(l) => l.trim().parse::<u8>().map_err(|_| format!("bad prefix length `{l}`"))?,
        None => max,
    };
    if len > max {
        return Err(format!("prefix length /{len} is longer than /{max}"));
    }
    let c = Cidr { addr, len };
    let masked = Cidr { addr: mask(&addr, len), len };
    if masked.addr != addr {
        return Err(format!("host bits set in `{s}`: did you mean {masked}?"));
    }
    Ok(c)
}

fn mask(addr: &IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let m = if len == 0 { 0 } else { u32::MAX << (32 - len as u32) };
            IpAddr::V4((u32::from(*a) & m).into())
        }
        IpAddr::V6(a) => {
            let m = if len == 0 { 0 } else { u128::MAX << (128 - len as u32) };
            IpAddr::V6((u128::from(*a) & m).into())
        }
    }
}

fn rule(cx: &Ctx, span: std::ops::Range<usize>, r: RawRule) -> Result<Rule, ProfileError> {
    let name = r.name.get_ref().trim().to_string();
    if name.is_empty()
        || name.len() > 64
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(cx.err(
            r.name.span(),
            "rule names are 1-64 characters of letters, digits, '-', '_' or '.'",
        ));
    }
    let proto = match &r.proto {
        None => None,
        Some(p) => Some(match p.get_ref().to_ascii_lowercase().as_str() {
            "any" => None,
            "tcp" => Some(6),
            "udp" => Some(17),
            "icmp" => Some(1),
            "icmpv6" => Some(58),
            other => match other.parse::<u8>() {
                Ok(n) => Some(n),
                Err(_) => {
                    return Err(cx.err(
                        p.span(),
                        format!(
                        "unknown protocol `{other}`: use tcp, udp, icmp, icmpv6, any or a number"
                    ),
                    ))
                }
            },
        }),
    }
    .flatten();
    let src = match &r.src {
        None => None,
        Some(s) => Some(parse_cidr(s.get_ref()).map_err(|m| cx.err(s.span(), m))?),
    };
    let ports = match &r.dport {
        None => None,
        Some(p) => {
            let (lo, hi) = parse_ports(p.get_ref()).map_err(|m| cx.err(p.span(), m))?;
            if let Some(pr) = proto {
                if pr != 6 && pr != 17 {
                    return Err(cx.err(
                        p.span(),
                        format!("`dport` needs proto tcp or udp, not {}", proto_name(pr)),
                    ));
                }
            }
            Some((lo, hi))
        }
    };
    let action_v = match &r.action {
        None => action::DROP,
        Some(a) => match a.get_ref().as_str() {
            "drop" => action::DROP,
            "pass" => action::PASS,
            "dry-run" | "dry_run" => action::DRY_RUN,
            other => {
                return Err(cx
                    .err(a.span(), format!("unknown action `{other}`: use drop, pass or dry-run")))
            }
        },
    };
    let spec = MatchSpec { proto, src, ports, enforcing: action_v == action::DROP };
    let mut rule = Rule {
        name,
        line: line_col(cx.text, span.start).0,
        spec,
        action: action_v,
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
    };
    if action_v == action::PASS {
        for (f, s) in [
            ("rate", r.rate.as_ref().map(|x| x.span())),
            ("burst", r.burst.as_ref().map(|x| x.span())),
            ("key", r.key.as_ref().map(|x| x.span())),
            ("quota", r.quota.as_ref().map(|x| x.span())),
        ] {
            if let Some(s) = s {
                return Err(
                    cx.err(s, format!("`{f}` has no effect on a rule with action = \"pass\""))
                );
            }
        }
        return Ok(rule);
    }
    if r.rate.is_none() && r.quota.is_none() {
        return Err(cx.err(span, format!("rule `{}` needs a `rate` (e.g. \"100/s\", \"10Mbit/s\"), a `quota` (e.g. 60 with quota_window = \"1min\"), or action = \"pass\"", rule.name)));
    }
    let rate: Option<Rate> = match &r.rate {
        Some(rs) => Some(
            parse_rate(rs.get_ref())
                .map_err(|e| cx.err(rs.span(), format!("bad rate `{}`: {e}", rs.get_ref())))?,
        ),
        None => None,
    };
    let quota_amount: Option<(u64, Dimension)> = match &r.quota {
        Some(q) => Some(match q.get_ref() {
            RawAmount::Int(n) if *n <= 0 => {
                return Err(cx.err(q.span(), "quota must be greater than zero"))
            }
            RawAmount::Int(n) => (*n as u64, Dimension::Count),
            RawAmount::Text(t) => {
                parse_amount(t).map_err(|e| cx.err(q.span(), format!("bad quota `{t}`: {e}")))?
            }
        }),
        None => None,
    };
    // The unit: as written, else the dimension of the rate or the quota.
    let implied_bytes = rate
        .map(|x| x.dim == Dimension::Bytes)
        .or(quota_amount.map(|q| q.1 == Dimension::Bytes))
        .unwrap_or(false);
    rule.unit = match &r.unit {
        None => {
            if implied_bytes {
                unit::BYTES
            } else {
                unit::PACKETS
            }
        }
        Some(u) => match u.get_ref().as_str() {
            "packets" => unit::PACKETS,
            "bytes" => unit::BYTES,
            "connections" => unit::CONNECTIONS,
            other => {
                return Err(cx.err(
                    u.span(),
                    format!("unknown unit `{other}`: use packets, bytes or connections"),
                ))
            }
        },
    };
    if rule.unit == unit::CONNECTIONS && proto.is_some_and(|p| p != 6) {
        return Err(cx.err(
            r.unit.as_ref().map(|u| u.span()).unwrap_or(span.clone()),
            "unit = \"connections\" counts TCP SYNs: use proto = \"tcp\"",
        ));
    }
    if let (Some(rate), Some(rate_s)) = (rate, &r.rate) {
        if (rule.unit == unit::BYTES) != (rate.dim == Dimension::Bytes) {
            return Err(cx.err(
                rate_s.span(),
                if rule.unit == unit::BYTES {
                    "a bytes rule needs a byte rate such as \"10Mbit/s\" or \"1MB/s\"".to_string()
                } else {
                    format!("a byte rate needs unit = \"bytes\", not {}", rule.unit_name())
                },
            ));
        }
        rule.rate_text = rate_s.get_ref().clone();
        let (num, den) = (rate.num, rate.den);
        if num > u64::MAX as u128 || den > u64::MAX as u128 {
            return Err(cx.err(rate_s.span(), "rate out of range"));
        }
        rule.interval_fp = gcra::interval_fp(num as u64, den as u64);
        rule.burst = match &r.burst {
            None => {
                // Default: one second's worth, at least one unit (one large
                // frame for byte rules).
                let per_s = rate.per_second() as u64;
                if rule.unit == unit::BYTES {
                    per_s.max(MIN_BYTE_BURST)
                } else {
                    per_s.max(1)
                }
            }
            Some(b) => {
                let (n, dim) = match b.get_ref() {
                    RawAmount::Int(n) if *n <= 0 => {
                        return Err(cx.err(b.span(), "burst must be greater than zero"))
                    }
                    RawAmount::Int(n) => (*n as u64, Dimension::Count),
                    RawAmount::Text(t) => parse_amount(t)
                        .map_err(|e| cx.err(b.span(), format!("bad burst `{t}`: {e}")))?,
                };
                if rule.unit == unit::BYTES {
                    if n < MIN_BYTE_BURST {
                        return Err(cx.err(b.span(), format!("byte burst {n} is below one full frame ({MIN_BYTE_BURST} bytes): such packets could never pass")));
                    }
                } else if dim == Dimension::Bytes {
                    return Err(cx.err(
                        b.span(),
                        format!(
                            "a byte-sized burst needs unit = \"bytes\", not {}",
                            rule.unit_name()
                        ),
                    ));
                }
                n
            }
        };
    } else if let Some(b) = &r.burst {
        return Err(cx.err(b.span(), "`burst` belongs to a `rate`; this rule has none"));
    }
    match (quota_amount, &r.quota) {
        (Some((n, dim)), Some(q)) => {
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
                return Err(
                    cx.err(q.span(), format!("quota {n} is over the limit of {}", u32::MAX))
                );
            }
            let Some(w) = &r.quota_window else {
                return Err(cx.err(q.span(), "a quota needs `quota_window` (e.g. \"1min\")"));
            };
            let window = parse_duration_ns(w.get_ref())
                .map_err(|e| cx.err(w.span(), format!("bad quota_window: {e}")))?;
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
                    format!(
                        "quota_window / quota_buckets must be at least 1ms (is {bucket_ns} ns)"
                    ),
                ));
            }
            rule.quota_limit = n as u32;
            rule.quota_bucket_ns = bucket_ns;
            rule.quota_buckets = k as u32;
        }
        _ => {
            for (f, s) in [
                ("quota_window", r.quota_window.as_ref().map(|x| x.span())),
                ("quota_buckets", r.quota_buckets.as_ref().map(|x| x.span())),
            ] {
                if let Some(s) = s {
                    return Err(cx.err(s, format!("`{f}` needs a `quota`")));
                }
            }
        }
    }
    if rule.interval_fp != 0 {
        rule.burst_ns = gcra::burst_ns(rule.interval_fp, rule.burst);
    }
    if let Some(a) = &r.admission {
        rule.admission_per_flow = match a.get_ref().as_str() {
            "flow" => true,
            "packet" => false,
            other => return Err(cx.err(a.span(), format!("unknown admission `{other}`: \"flow\" (a 5-tuple hash keeps each flow wholly in or out) or \"packet\""))),
        };
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
    if let Some(b) = &r.bbr {
        if rule.unit != unit::CONNECTIONS || rule.spec.proto != Some(6) {
            return Err(cx.err(b.span(), "bbr needs proto = \"tcp\" and unit = \"connections\" (its requests are TCP connections)"));
        }
        rule.bbr = Some(bbr(cx, b.get_ref())?);
        rule.bbr_span = Some(b.span());
    }
    if let Some(k) = &r.key {
        rule.key_kind = match k.get_ref().as_str() {
            "rule" => key_kind::RULE,
            "src" => key_kind::SRC,
            "src_prefix" => key_kind::SRC_PREFIX,
            "dport" => key_kind::DPORT,
            "src_dport" => key_kind::SRC_DPORT,
            "5tuple" | "five_tuple" => key_kind::FIVE_TUPLE,
            other => {
                return Err(cx.err(
                    k.span(),
                    format!(
                    "unknown key `{other}`: use rule, src, src_prefix, dport, src_dport or 5tuple"
                ),
                ))
            }
        };
    }
    for (raw, max, dflt, dst) in [(&r.prefix_v4, 32, 24, 0), (&r.prefix_v6, 128, 64, 1)] {
        let v = match raw {
            Some(p) => {
                if rule.key_kind != key_kind::SRC_PREFIX {
                    return Err(cx.err(p.span(), "prefix_v4/prefix_v6 need key = \"src_prefix\""));
                }
                let n = *p.get_ref();
                if !(1..=max).contains(&n) {
                    return Err(
                        cx.err(p.span(), format!("prefix length {n} out of range 1..={max}"))
                    );
                }
                n as u8
            }
            None => dflt,
        };
        if rule.key_kind == key_kind::SRC_PREFIX {
            if dst == 0 {
                rule.prefix_v4 = v
            } else {
                rule.prefix_v6 = v
            }
        }
    }
    Ok(rule)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> ProfileError {
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
    fn memory_budget_rejects_big_tables() {
        let e = err("[settings]\nkey_table_entries = 67108864\nmemory_budget = \"256MiB\"\n[[rule]]\nname = \"a\"\nrate = \"1/s\"");
        assert!(e.to_string().contains("over the budget"), "{e}");
        assert_eq!((e.line, e.col), (2, 21), "points at key_table_entries");
        let ok = parse("p", "[[rule]]\nname = \"a\"\nrate = \"1/s\"").unwrap();
        // Default tables: two 1M-entry LRU hashes, the quota and connection
        // tables and the statistics rings: about 300 MB on 2 CPUs.
        let mem = ok.settings.kernel_memory_bytes();
        assert!(mem > 200 << 20 && mem < 350 << 20, "{mem}");
    }

    #[test]
    fn fingerprint_tracks_limits_not_names() {
        let a = parse("p", "[[rule]]\nname = \"a\"\nrate = \"1/s\"").unwrap();
        let b = parse("p", "[[rule]]\nname = \"b\"\nrate = \"1/s\"").unwrap();
        let c = parse("p", "[[rule]]\nname = \"a\"\nrate = \"2/s\"").unwrap();
        assert_eq!(a.rules[0].state_fingerprint(), b.rules[0].state_fingerprint());
        assert_ne!(a.rules[0].state_fingerprint(), c.rules[0].state_fingerprint());
    }
}
