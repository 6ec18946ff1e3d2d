//! The validated profile: what the agent, the data plane and the CLI read.
//! The sections (rule, settings, klimiter, breaker) build it from the raw
//! TOML, so a [`RuleSet`] from `parse` has passed every check. The kernel
//! memory these settings need is computed in `super::memory`.

use crate::controllers::cpu::CpuSource;
use flowctl_common::{
    action,
    breaker::StateConfig,
    key_kind, stats,
    tables::{Cidr, MatchSpec, PrefixList},
    unit, DEFAULT_CONN_ENTRIES, DEFAULT_GLOBAL_KEY_ENTRIES, DEFAULT_MAX_RULES,
    DEFAULT_QUOTA_ENTRIES, DEFAULT_STATS_BUCKETS, DEFAULT_STATS_BUCKET_NS, DEFAULT_TABLE_ENTRIES,
    MAX_RULES, XDP_PASS,
};

/// A validated profile.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleSet {
    pub settings: Settings,
    pub rules: Vec<Rule>,
    pub klimiter: KlimiterSettings,
    pub baselines: Vec<Baseline>,
    pub breakers: Vec<Breaker>,
    /// `[[shaper]]`: targets this host paces what it sends to.
    pub shapers: Vec<super::shaper::Shaper>,
    /// The store global rules share (required when there is one).
    pub fleet: Option<Fleet>,
    /// `[[list]]`: prefixes rules name with `src = "@name"` or `dst = "@name"`.
    pub lists: Vec<List>,
}

// ---- [[list]] ----

/// One validated `[[list]]`.
#[derive(Clone, Debug, PartialEq)]
pub struct List {
    pub prefixes: PrefixList,
    /// The file it was read from (resolved), `None` when inline: what
    /// `flowctl list update NAME` reads again.
    pub file: Option<std::path::PathBuf>,
    /// Where its prefixes were read from: the file above, or the one a
    /// `flowctl list update` named (`None`: inline, or not read).
    pub from: Option<std::path::PathBuf>,
    pub line: usize,
}

// ---- [fleet] ----

/// Default lease length and refresh interval of global rules' leases.
pub const DEFAULT_LEASE_NS: u64 = 5_000_000_000;
pub const DEFAULT_REFRESH_NS: u64 = 1_000_000_000;

/// `[fleet]`, validated: where the leases of global rules are kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fleet {
    /// `redis://HOST:PORT[/DB]`, `rediss://` for TLS.
    pub redis: String,
    pub redis_user: Option<String>,
    /// The password, read from this file when the agent connects (kept out
    /// of the profile).
    pub redis_password_file: Option<std::path::PathBuf>,
    /// The CA that signs the server's certificate (`rediss://` only).
    pub redis_ca: Option<std::path::PathBuf>,
    /// This host's client certificate and its key, PEM (`rediss://` to a
    /// Redis that asks for one: `tls-auth-clients yes`).
    pub redis_client_cert: Option<(std::path::PathBuf, std::path::PathBuf)>,
    pub lease_ns: u64,
    pub refresh_ns: u64,
    /// This host's name in the store (default: the host name).
    pub host: Option<String>,
}

/// A global rule: `interval_fp`, `burst` and `burst_ns` of the rule are the
/// fleet-wide limit L and burst B; a key without a lease admits `share`
/// here (nothing when `None`, `default_share = "none"`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GlobalScope {
    pub share: Option<DefaultShare>,
}

/// What one host admits of a key it holds no lease for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefaultShare {
    pub interval_fp: u64,
    pub burst: u64,
    /// Quota units per window, the rate's proportion of the rule's quota
    /// (0 without a quota).
    pub quota: u32,
    /// As written, or how the default was derived, for display.
    pub text: String,
}

// ---- [settings] ----

/// Default ceiling on the kernel memory a profile may preallocate.
pub const DEFAULT_MEMORY_BUDGET: u64 = 1 << 30;

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
    /// Keys of global rules (`FLOWCTL_GLOBAL_KEYS`).
    pub global_key_entries: u32,
    pub memory_budget: u64,
    pub grace_ns: u64,
    pub stats: StatsSettings,
    /// Where the CPU signal comes from (`crate::controllers::cpu`).
    pub cpu_source: CpuSource,
    /// Whether the agent's flood loop also watches for a flood's start
    /// every 10 ms (`crate::agent::flood::FloodLoop::watch`).
    pub flood_watch: bool,
    /// Not a profile key: whether the XDP object is loaded with its kernel
    /// events on (`flowctl-ebpf/src/events.rs`). The agent sets it when its
    /// log shows `flowctl::kernel` at debug (`system::log::kernel_events`);
    /// off, the verifier prunes them.
    pub kernel_events: bool,
    /// Not a profile key: whether the entry point parses the common header
    /// layout inline (`flowctl_common::globals::FAST_PARSE`). Always on in
    /// the agent; the benchmark and the fuzzer turn it off to hold the
    /// inline path against the parser's functions.
    pub fast_parse: bool,
    /// Not a profile key: the prefixes of the profile's lists, whose trie
    /// entries cost kernel memory (`super::memory`).
    pub list_prefixes: u64,
    /// Not a profile key: the entries of the isolated rules' own tables
    /// together (`isolate`, `table_entries`), which cost kernel memory too.
    pub own_table_entries: u64,
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
            global_key_entries: DEFAULT_GLOBAL_KEY_ENTRIES,
            memory_budget: DEFAULT_MEMORY_BUDGET,
            grace_ns: 3_000_000_000,
            stats: StatsSettings::default(),
            cpu_source: CpuSource::Host,
            flood_watch: false,
            kernel_events: false,
            fast_parse: true,
            list_prefixes: 0,
            own_table_entries: 0,
        }
    }
}

/// Shape of the statistics rings, fixed when the program is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StatsSettings {
    /// `flowctl_common::stats::level::*`.
    pub level: u8,
    pub bucket_ns: u64,
    pub buckets: u32,
    /// `[settings] max_rules`: the rings hold `2 * max_rules + 1` records
    /// (`records`). A state file written before the setting existed had
    /// rings for every record.
    #[serde(default = "all_rules")]
    pub max_rules: u32,
}

fn all_rules() -> u32 {
    MAX_RULES as u32
}

impl Default for StatsSettings {
    fn default() -> Self {
        Self {
            level: stats::level::FULL,
            bucket_ns: DEFAULT_STATS_BUCKET_NS,
            buckets: DEFAULT_STATS_BUCKETS,
            max_rules: DEFAULT_MAX_RULES,
        }
    }
}

impl StatsSettings {
    /// Rings in the map: both slots' rule records and the unmatched
    /// traffic's (`stats::ring_record`).
    pub fn records(&self) -> u32 {
        2 * self.max_rules + 1
    }

    pub fn level_name(&self) -> &'static str {
        if self.level == stats::level::FULL {
            "full"
        } else {
            "control"
        }
    }
}

// ---- [[rule]] ----

/// The largest standard Ethernet frame with one VLAN tag: a byte bucket must
/// hold at least one, or full-size packets could never pass.
pub const MIN_BYTE_BURST: u64 = 1518;
/// Default quota buckets K: the effective window is at most W + W/K.
pub const DEFAULT_QUOTA_BUCKETS: u64 = 10;

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
    /// `scope = "global"`: one limit across the fleet (`None`: this host's).
    pub global: Option<GlobalScope>,
    /// `book_retransmits = true`: a refused SYN books the next token for
    /// its retransmission (docs/algorithms.md, 1.7).
    pub book_retransmits: bool,
    /// `[[rule.limit]]`: more token buckets, each with its own key, that a
    /// packet must pass besides the rule's own (at most `MAX_NESTED_LIMITS`).
    pub limits: Vec<NestedLimit>,
    /// `warm_up` (and `cold_factor`): the rule's aggregate bucket ramps
    /// from `rate / cold_factor` to its rate (docs/algorithms.md, 1.8).
    pub warm_up: Option<WarmUp>,
    /// `isolate = true`: the rule's buckets live in a table of their own
    /// of this many entries (`table_entries`), which no other rule's keys
    /// can evict (docs/design.md, "Where bucket state lives").
    pub own_table: Option<u32>,
    /// `action = "block"`: every packet is dropped (a `drop` rule whose
    /// bucket never holds a token).
    pub block: bool,
}

/// A rule's warm-up ramp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WarmUp {
    pub warm_ns: u64,
    pub cold_factor: u8,
}

impl WarmUp {
    pub fn ramp(&self) -> flowctl_common::warm::Ramp {
        flowctl_common::warm::Ramp { warm_ns: self.warm_ns, cold_factor: self.cold_factor as u64 }
    }
}

/// One `[[rule.limit]]`: a rate and burst in the rule's unit, per key of
/// its own kind.
#[derive(Clone, Debug, PartialEq)]
pub struct NestedLimit {
    pub line: usize,
    pub key_kind: u8,
    pub prefix_v4: u8,
    pub prefix_v6: u8,
    /// As written, for display.
    pub rate_text: String,
    pub burst: u64,
    pub interval_fp: u64,
    pub burst_ns: u64,
}

impl NestedLimit {
    pub fn key_name(&self) -> String {
        key_name(self.key_kind, self.prefix_v4, self.prefix_v6)
    }
}

/// A key kind as `check` and `status` show it.
pub fn key_name(kind: u8, prefix_v4: u8, prefix_v6: u8) -> String {
    match kind {
        key_kind::RULE => "rule".into(),
        key_kind::SRC => "src".into(),
        key_kind::SRC_PREFIX => format!("src_prefix(/{prefix_v4},/{prefix_v6})"),
        key_kind::DPORT => "dport".into(),
        key_kind::SRC_DPORT => "src_dport".into(),
        _ => "5tuple".into(),
    }
}

/// Whole units per second of a GCRA interval (rounded down).
fn per_second(interval_fp: u64) -> u128 {
    (1_000_000_000u128 << flowctl_common::gcra::FRAC_BITS) / interval_fp as u128
}

impl Rule {
    /// What must be equal for `apply` to keep this rule's bucket state.
    pub fn state_fingerprint(&self) -> String {
        let limits: Vec<_> = self
            .limits
            .iter()
            .map(|l| (l.key_kind, l.prefix_v4, l.prefix_v6, l.interval_fp, l.burst_ns))
            .collect();
        format!(
            "{:?}|{:?}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{:?}",
            self.spec,
            self.global,
            self.action,
            self.unit,
            self.key_kind,
            self.prefix_v4,
            self.prefix_v6,
            self.interval_fp,
            self.burst_ns,
            self.quota_limit,
            self.quota_bucket_ns,
            self.quota_buckets,
            limits
        ) + &self.own_table.map_or(String::new(), |n| format!("|own {n}"))
    }

    pub fn key_name(&self) -> String {
        key_name(self.key_kind, self.prefix_v4, self.prefix_v6)
    }

    pub fn unit_name(&self) -> &'static str {
        match self.unit {
            unit::BYTES => "bytes",
            unit::CONNECTIONS => "connections",
            _ => "packets",
        }
    }

    /// Advice on a rule that is valid but will not do what it seems to
    /// say: a `connections` rate whose burst is below one second of it
    /// gives real TCP clients about the burst per second, because clients
    /// refused together retransmit together after the 1 s initial timeout
    /// (docs/algorithms.md, 1.7). `flowctl check` prints it.
    pub fn advice(&self) -> Option<String> {
        if self.unit != unit::CONNECTIONS
            || self.interval_fp == 0
            || self.book_retransmits
            || self.global.is_some()
            || self.action == action::PASS
        {
            return None;
        }
        // The rule's own bucket, then its nested limits: the first whose
        // burst is below one second of its rate.
        let own = (self.line, "", self.burst, self.interval_fp, &self.rate_text);
        let nested =
            self.limits.iter().map(|l| (l.line, "limit", l.burst, l.interval_fp, &l.rate_text));
        let (line, what, burst, _, rate) = std::iter::once(own)
            .chain(nested)
            .find(|(_, _, burst, interval_fp, _)| (*burst as u128) < per_second(*interval_fp))?;
        // book_retransmits books the rule's own bucket only (and does not
        // combine with nested limits).
        let also = if what.is_empty() { "" } else { " nested" };
        let or_book = if self.limits.is_empty() { " or book_retransmits = true" } else { "" };
        Some(format!(
            "rule `{}` (line {line}): the{also} burst {burst} is below one second of its rate ({rate}): TCP clients whose SYNs are refused retransmit together after 1 s, so they get about {burst} connections per second; use the default burst (one second of the rate){or_book} (docs/algorithms.md, 1.7)",
            self.name
        ))
    }

    pub fn action_name(&self) -> &'static str {
        match self.action {
            action::PASS => "pass",
            action::DRY_RUN => "dry-run",
            _ if self.block => "block",
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
        let src = self.spec.src.as_ref().map(|c| c.to_string()).unwrap_or_else(|| "any".into());
        let ports = match self.spec.ports {
            None => "any".into(),
            Some((a, b)) if a == b => a.to_string(),
            Some((a, b)) => format!("{a}-{b}"),
        };
        match &self.spec.dst {
            None => format!("{proto} from {src} to port {ports}"),
            Some(d) => format!("{proto} from {src} to {d} port {ports}"),
        }
    }
}

/// IP protocol numbers a profile may name.
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
/// The protocols with a name (`proto`); any other is written as its number.
pub const PROTOCOLS: [(&str, u8); 4] = [("tcp", TCP), ("udp", UDP), ("icmp", 1), ("icmpv6", 58)];

/// A protocol number as a profile writes it.
pub fn proto_name(p: u8) -> String {
    match PROTOCOLS.iter().find(|(_, n)| *n == p) {
        Some((name, _)) => (*name).into(),
        None => p.to_string(),
    }
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

// ---- [klimiter] and [[baseline]] ----

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
            dead_band: crate::controllers::klimiter::DEFAULT_DEAD_BAND,
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

// ---- [[breaker]] ----

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

#[cfg(test)]
mod tests {
    use crate::profile::parse;

    #[test]
    fn fingerprint_tracks_limits_not_names() {
        let a = parse("p", "[[rule]]\nname = \"a\"\nrate = \"1/s\"").unwrap();
        let b = parse("p", "[[rule]]\nname = \"b\"\nrate = \"1/s\"").unwrap();
        let c = parse("p", "[[rule]]\nname = \"a\"\nrate = \"2/s\"").unwrap();
        assert_eq!(a.rules[0].state_fingerprint(), b.rules[0].state_fingerprint());
        assert_ne!(a.rules[0].state_fingerprint(), c.rules[0].state_fingerprint());
    }
}
