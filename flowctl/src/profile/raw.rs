//! The profile as written: what serde reads from the TOML, with the span of
//! every value an error may point at. Unknown keys are errors. Nothing here
//! is checked beyond its TOML type; the sections validate it into the model.

use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawProfile {
    pub settings: Option<Spanned<RawSettings>>,
    #[serde(default)]
    pub rule: Vec<Spanned<RawRule>>,
    pub klimiter: Option<Spanned<RawKlimiter>>,
    #[serde(default)]
    pub baseline: Vec<Spanned<RawBaseline>>,
    #[serde(default)]
    pub breaker: Vec<Spanned<RawBreaker>>,
    #[serde(default)]
    pub shaper: Vec<Spanned<RawShaper>>,
    pub fleet: Option<Spanned<RawFleet>>,
    #[serde(default)]
    pub list: Vec<Spanned<RawList>>,
}

/// `[[list]]`: named prefixes, from a file or inline.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawList {
    pub name: Spanned<String>,
    pub file: Option<Spanned<String>>,
    pub entries: Option<Spanned<Vec<Spanned<String>>>>,
}

/// `[[shaper]]`: a downstream target this host paces what it sends to.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawShaper {
    pub name: Spanned<String>,
    pub dst: Option<Spanned<String>>,
    pub proto: Option<Spanned<RawProto>>,
    pub dport: Option<Spanned<RawPorts>>,
    pub rate: Option<Spanned<String>>,
    pub per: Option<Spanned<String>>,
    pub action: Option<Spanned<String>>,
    pub horizon: Option<Spanned<String>>,
}

/// `[fleet]`: the store the global rules share (docs/fleet.md).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFleet {
    pub redis: Spanned<String>,
    pub redis_user: Option<Spanned<String>>,
    pub redis_password_file: Option<Spanned<String>>,
    pub redis_ca: Option<Spanned<String>>,
    pub redis_cert: Option<Spanned<String>>,
    pub redis_key: Option<Spanned<String>>,
    pub lease: Option<Spanned<String>>,
    pub refresh: Option<Spanned<String>>,
    pub host: Option<Spanned<String>>,
}

/// `[settings]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSettings {
    pub malformed: Option<Spanned<String>>,
    pub fragments: Option<Spanned<String>>,
    pub key_table_entries: Option<Spanned<i64>>,
    pub source_cache_entries: Option<Spanned<i64>>,
    pub quota_table_entries: Option<Spanned<i64>>,
    pub connection_table_entries: Option<Spanned<i64>>,
    pub global_key_entries: Option<Spanned<i64>>,
    pub memory_budget: Option<Spanned<String>>,
    pub grace_period: Option<Spanned<String>>,
    pub statistics: Option<Spanned<String>>,
    pub statistics_bucket: Option<Spanned<String>>,
    pub statistics_buckets: Option<Spanned<i64>>,
    pub max_rules: Option<Spanned<i64>>,
    pub cpu: Option<Spanned<String>>,
    pub flood_watch: Option<Spanned<bool>>,
}

/// A protocol by name (`"tcp"`) or number (`47`, or `"47"`).
#[derive(Deserialize)]
#[serde(untagged)]
pub enum RawProto {
    Number(i64),
    Name(String),
}

/// A port (`443`) or a range as text (`"8000-8100"`, or `"443"`).
#[derive(Deserialize)]
#[serde(untagged)]
pub enum RawPorts {
    One(i64),
    Range(String),
}

/// A count (`20`) or an amount with a unit (`"64KiB"`).
#[derive(Deserialize)]
#[serde(untagged)]
pub enum RawAmount {
    Int(i64),
    Text(String),
}

/// `[[rule]]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    pub name: Spanned<String>,
    pub proto: Option<Spanned<RawProto>>,
    pub src: Option<Spanned<String>>,
    pub dst: Option<Spanned<String>>,
    pub dport: Option<Spanned<RawPorts>>,
    pub action: Option<Spanned<String>>,
    pub unit: Option<Spanned<String>>,
    pub rate: Option<Spanned<String>>,
    pub burst: Option<Spanned<RawAmount>>,
    pub key: Option<Spanned<String>>,
    pub prefix_v4: Option<Spanned<i64>>,
    pub prefix_v6: Option<Spanned<i64>>,
    pub quota: Option<Spanned<RawAmount>>,
    pub quota_window: Option<Spanned<String>>,
    pub quota_buckets: Option<Spanned<i64>>,
    pub bbr: Option<Spanned<RawBbr>>,
    pub admission: Option<Spanned<String>>,
    pub admission_ratio: Option<Spanned<f64>>,
    pub priority: Option<Spanned<f64>>,
    pub scope: Option<Spanned<String>>,
    pub default_share: Option<Spanned<String>>,
    pub book_retransmits: Option<Spanned<bool>>,
    pub warm_up: Option<Spanned<String>>,
    pub cold_factor: Option<Spanned<i64>>,
    pub isolate: Option<Spanned<bool>>,
    pub table_entries: Option<Spanned<i64>>,
    #[serde(default)]
    pub limit: Vec<Spanned<RawLimit>>,
}

/// `[[rule.limit]]`: a nested limit of the rule above it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub rate: Option<Spanned<String>>,
    pub burst: Option<Spanned<RawAmount>>,
    pub key: Option<Spanned<String>>,
    pub prefix_v4: Option<Spanned<i64>>,
    pub prefix_v6: Option<Spanned<i64>>,
}

/// A rule's `bbr = { ... }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBbr {
    pub cpu_threshold: Option<Spanned<i64>>,
    pub release_below: Option<Spanned<i64>>,
    pub window: Option<Spanned<String>>,
    pub buckets: Option<Spanned<i64>>,
    pub idle_timeout: Option<Spanned<String>>,
    pub reject: Option<Spanned<String>>,
    #[serde(default)]
    pub compat: Vec<Spanned<String>>,
}

/// `[klimiter]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKlimiter {
    pub sample_period: Option<Spanned<String>>,
    pub control_period: Option<Spanned<String>>,
    pub dead_band: Option<Spanned<f64>>,
    pub stale_after: Option<Spanned<String>>,
}

/// `[[baseline]]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBaseline {
    pub name: Spanned<String>,
    pub threshold: Spanned<f64>,
    pub entries: Spanned<Vec<String>>,
    pub source: Spanned<RawSource>,
}

/// A baseline's `source = { kind = ..., ... }`: its errors point at the
/// whole table, so its values carry no spans of their own.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSource {
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

/// `[[breaker]]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    pub name: Spanned<String>,
    pub target: Spanned<String>,
    pub port: Option<Spanned<RawPorts>>,
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
