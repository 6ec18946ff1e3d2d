//! The lease loop of an interface agent's global rules (docs/fleet.md,
//! "Global limits"): `fleet::global::hostloop::HostLoop` (the kernel's
//! hot-key reports and offered counts in, the store's grants out into the
//! kernel's grant map, a lowered grant left to settle before it is
//! acknowledged; the glue the simulator runs too) over the kernel's maps
//! ([`KernelKeys`]), plus what needs I/O: the Redis store, reached by a
//! task of its own so this loop (and the packet path) never waits on the
//! network, heartbeats, the default-allowance warnings, and what `status`,
//! `top` and the metrics show of it (`leases.json` in the run directory).

use crate::{
    dataplane::{state::AttachState, GlobalKeys},
    fleet::global::{
        allocator::BatchReply,
        host::{Batch, HostConfig},
        hostloop::{units_per_second, HostLoop, HotReport, KeyBackend},
        store::{Health, Store, StoreConfig},
        DefaultShare, GlobalRule,
    },
    profile::{Fleet, RuleSet},
    system::clock::monotonic_ns,
};
use anyhow::{Context, Result};
use flowctl_common::{window::Window, BucketKey};
use serde::{Deserialize, Serialize};
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};
use tokio::sync::mpsc;

/// The run-directory file `status`, `top` and the metrics read.
pub const PUBLISHED: &str = "leases.json";
/// Most keys with (or waiting for) a lease, across the global rules: the
/// kernel's grant map holds this many.
const MAX_KEYS: usize = flowctl_common::MAX_GRANTS as usize;
/// Deadline of every store call.
const STORE_TIMEOUT: Duration = Duration::from_millis(500);

/// The agent's clock for the manager: monotonic microseconds.
fn now_us() -> u64 {
    monotonic_ns() / 1_000
}

/// What the store task is asked to do.
enum Job {
    Run(GlobalRule, Batch),
    Heartbeat(String, Duration),
}

/// What it answers.
enum Event {
    Reply { rule: String, seq: u64, result: Result<BatchReply, String> },
    Hosts(Result<u64, String>),
    Health { health: String, state: &'static str, rtt: Option<Duration> },
}

/// The store's states as `status` and the metrics name them
/// (`flowctl_global_store_state{state}`).
pub const STORE_STATES: [&str; 4] = ["unknown", "ok", "unreachable", "learning"];

/// Whether the store answers in `state` (learning answers too).
fn store_up(state: &str) -> bool {
    state == STORE_STATES[1] || state == STORE_STATES[3]
}

/// The store task: one call at a time, in order.
async fn store_task(
    mut store: Store,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    events: mpsc::UnboundedSender<Event>,
) {
    while let Some(job) = jobs.recv().await {
        match job {
            Job::Run(rule, batch) => {
                let result = store.run(&rule, &batch).await.map_err(|e| e.to_string());
                let _ = events.send(Event::Reply { rule: rule.name, seq: batch.seq, result });
            }
            Job::Heartbeat(host, ttl) => {
                let n = store.heartbeat(&host, ttl).await.map_err(|e| e.to_string());
                let _ = events.send(Event::Hosts(n));
            }
        }
        let (health, state) = match store.health() {
            Health::Unknown => ("not asked yet".to_string(), STORE_STATES[0]),
            Health::Ok { .. } => ("ok".into(), STORE_STATES[1]),
            Health::Unreachable { error, .. } => (format!("unreachable: {error}"), STORE_STATES[2]),
            Health::EpochChanged { rule, .. } => {
                (format!("lost its state (rule {rule} learning for one lease)"), STORE_STATES[3])
            }
        };
        let _ = events.send(Event::Health { health, state, rtt: store.rtt() });
    }
}

/// The kernel's side of the leases: the global rules' buckets, grants and
/// hot-key ring, with what it takes to name their keys as the store does.
struct KernelKeys {
    keys: GlobalKeys,
    /// Global rule -> its key kind and the kernel's quota window (None
    /// without a quota).
    rules: HashMap<String, (u8, Option<Window>)>,
    /// Counter record -> rule name, for the kernel's reports.
    by_record: HashMap<u32, String>,
}

impl KernelKeys {
    /// The records of the global rules known, from the attachment's rules.
    fn map_records(&mut self, state: &AttachState) {
        self.by_record = state
            .rules
            .iter()
            .filter(|r| self.rules.contains_key(&r.name))
            .map(|r| (r.record, r.name.clone()))
            .collect();
    }
}

impl KeyBackend for KernelKeys {
    type Key = BucketKey;

    fn hot(&mut self, max: usize) -> Vec<HotReport<BucketKey>> {
        let mut out = Vec::new();
        for h in self.keys.hot(max) {
            let Some(rule) = self.by_record.get(&h.record) else { continue };
            let Some((key_kind, _)) = self.rules.get(rule) else { continue };
            let key = crate::agent::heavy::describe_key(&h.key, *key_kind);
            out.push(HotReport { rule: rule.clone(), key, id: h.key });
        }
        out
    }

    fn offered(&self, key: &BucketKey) -> Option<u64> {
        self.keys.bucket(key).map(|b| b.offered)
    }

    fn quota_spent(&self, rule: &str, key: &BucketKey) -> Option<(u64, u64)> {
        let (_, window) = self.rules.get(rule)?;
        Some(self.keys.quota_spent(key, window.as_ref()?))
    }

    fn set_lease(
        &mut self,
        key: &BucketKey,
        interval_fp: u64,
        burst_units: u64,
        quota: u64,
        expires_ns: u64,
    ) -> Result<()> {
        self.keys.set_lease(key, interval_fp, burst_units, quota, expires_ns)
    }

    fn clear_grant(&mut self, key: &BucketKey) -> Result<()> {
        self.keys.clear_grant(key)
    }
}

pub struct LeaseLoop {
    leases: HostLoop<KernelKeys>,
    jobs: mpsc::UnboundedSender<Job>,
    events: mpsc::UnboundedReceiver<Event>,
    host: String,
    lease: Duration,
    store_url: String,
    health: String,
    state: &'static str,
    rtt: Option<Duration>,
    hosts: Option<u64>,
    next_heartbeat: Instant,
    next_publish: Instant,
    run_dir: std::path::PathBuf,
}

/// The profile's global rules as the lease mechanism sees them, with their
/// key kinds and quota windows.
fn global_rules(set: &RuleSet, fleet: &Fleet) -> Vec<(GlobalRule, u8, Option<Window>)> {
    set.rules
        .iter()
        .filter_map(|r| {
            let g = r.global.as_ref()?;
            // Units per second of the intervals, to the nearest (each was
            // rounded up from the rate as written).
            let mut spec = GlobalRule::new(&r.name, units_per_second(r.interval_fp), r.burst);
            spec.lease = fleet.lease_ns / 1_000;
            spec.refresh = fleet.refresh_ns / 1_000;
            spec.default_share = g
                .share
                .as_ref()
                .map(|s| DefaultShare { rate: units_per_second(s.interval_fp), burst: s.burst });
            let quota = (r.quota_bucket_ns != 0)
                .then_some(Window { bucket_ns: r.quota_bucket_ns, buckets: r.quota_buckets });
            if let Some(w) = &quota {
                spec.quota = Some(r.quota_limit as u64);
                spec.quota_window = w.window_ns() / 1_000;
            }
            Some((spec, r.key_kind, quota))
        })
        .collect()
}

/// A global rule of the profile into the loop: its spec to the manager,
/// its key kind and quota window to the kernel's side.
fn add_rule(
    leases: &mut HostLoop<KernelKeys>,
    spec: GlobalRule,
    key_kind: u8,
    quota: Option<Window>,
) {
    leases.backend_mut().rules.insert(spec.name.clone(), (key_kind, quota));
    leases.set_rule(spec);
}

/// How the agent reaches the profile's store: the URL, the ACL user, the
/// password read from its file now (kept out of the profile), the CA, and
/// this host's client certificate for mutual TLS.
fn store_config(fleet: &Fleet) -> Result<StoreConfig> {
    let mut cfg = StoreConfig::new(&fleet.redis);
    cfg.username = fleet.redis_user.clone();
    if let Some(p) = &fleet.redis_password_file {
        let pw = std::fs::read_to_string(p)
            .with_context(|| format!("reading redis_password_file {}", p.display()))?;
        cfg.password = Some(pw.trim_end_matches(['\n', '\r']).to_string());
    }
    cfg.ca_file = fleet.redis_ca.clone();
    cfg.client_cert = fleet.redis_client_cert.clone();
    cfg.timeout = STORE_TIMEOUT;
    Ok(cfg)
}

impl LeaseLoop {
    /// The loop for `set`'s global rules (`None` without any), with its
    /// store task started. The store is not reached yet: a store that is
    /// down leaves every key at its default share until it answers.
    pub fn start(
        state: &AttachState,
        set: &RuleSet,
        rt: &tokio::runtime::Handle,
    ) -> Result<Option<Self>> {
        let Some(fleet) = set.fleet.as_ref() else { return Ok(None) };
        let specs = global_rules(set, fleet);
        if specs.is_empty() {
            return Ok(None);
        }
        let store =
            Store::new(store_config(fleet)?).map_err(|e| anyhow::anyhow!("[fleet] redis: {e}"))?;
        let name = fleet.host.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "host".into())
        });
        // The store refuses sequence numbers that go back, so a restarted
        // agent is a new host: its name, interface and start.
        let host = format!(
            "{name}/{}/{}",
            state.iface,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0)
        );
        let cfg = HostConfig {
            host: host.clone(),
            max_keys: MAX_KEYS,
            timeout: STORE_TIMEOUT.as_micros() as u64 * 2,
        };
        let keys = KernelKeys {
            keys: GlobalKeys::open(&state.id)?,
            rules: HashMap::new(),
            by_record: HashMap::new(),
        };
        let mut leases = HostLoop::new(cfg, keys);
        for (spec, key_kind, quota) in specs {
            spec.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
            add_rule(&mut leases, spec, key_kind, quota);
        }
        leases.backend_mut().map_records(state);
        let (jobs, job_rx) = mpsc::unbounded_channel();
        let (event_tx, events) = mpsc::unbounded_channel();
        rt.spawn(store_task(store, job_rx, event_tx));
        let now = Instant::now();
        Ok(Some(Self {
            leases,
            jobs,
            events,
            host,
            lease: Duration::from_nanos(fleet.lease_ns),
            store_url: fleet.redis.clone(),
            health: "not asked yet".into(),
            state: STORE_STATES[0],
            rtt: None,
            hosts: None,
            next_heartbeat: now,
            next_publish: now,
            run_dir: state.id.run_dir(),
        }))
    }

    /// Whether `set` needs a new loop (another store or host name), rather
    /// than [`update`](Self::update).
    pub fn same_store(&self, set: &RuleSet) -> bool {
        set.fleet.as_ref().is_some_and(|f| f.redis == self.store_url)
    }

    /// A new profile with the same store: its global rules' new limits (the
    /// leases stay), rules gone given back.
    pub fn update(&mut self, state: &AttachState, set: &RuleSet) {
        let Some(fleet) = set.fleet.as_ref() else { return };
        let specs = global_rules(set, fleet);
        let gone: Vec<String> = self
            .leases
            .manager()
            .rules()
            .map(|r| r.name.clone())
            .filter(|n| !specs.iter().any(|(s, _, _)| s.name == *n))
            .collect();
        for name in gone {
            self.leases.remove_rule(&name, now_us());
            self.leases.backend_mut().rules.remove(&name);
        }
        for (spec, key_kind, quota) in specs {
            if let Err(e) = spec.validate() {
                tracing::warn!("{e}");
                continue;
            }
            add_rule(&mut self.leases, spec, key_kind, quota);
        }
        self.leases.backend_mut().map_records(state);
    }

    /// Runs what is due; returns when it wants to run next.
    pub fn tick(&mut self) -> Instant {
        let now = Instant::now();
        let us = now_us();
        // The store's answers.
        while let Ok(ev) = self.events.try_recv() {
            match ev {
                Event::Reply { rule, seq, result } => {
                    self.leases.on_reply(&rule, seq, result, us);
                }
                Event::Hosts(Ok(n)) => {
                    self.warn_of_default_allowances(self.hosts, n);
                    self.hosts = Some(n);
                }
                Event::Hosts(Err(_)) => {}
                Event::Health { health, state, rtt } => {
                    if health != self.health {
                        if store_up(state) {
                            tracing::info!("redis {}: {health}", self.store_url);
                        } else {
                            tracing::warn!(
                                "redis {}: {health} (keeping the grants held, raising none)",
                                self.store_url
                            );
                        }
                    }
                    (self.health, self.state, self.rtt) = (health, state, rtt);
                }
            }
        }
        // The kernel's hot keys and counters in, the batches due out (none
        // while a lowered grant settles in the kernel).
        for b in self.leases.tick(us) {
            if let Some(spec) = self.leases.manager().rule(&b.rule) {
                let _ = self.jobs.send(Job::Run(spec.clone(), b));
            }
        }
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + self.lease / 2;
            let _ = self.jobs.send(Job::Heartbeat(self.host.clone(), self.lease));
        }
        if now >= self.next_publish {
            self.next_publish = now + Duration::from_millis(500);
            if let Err(e) = self.publish() {
                tracing::warn!("publishing lease state: {e:#}");
            }
        }
        now + Duration::from_micros(self.leases.next_wakeup(us).saturating_sub(us))
    }

    /// Says so in the log when the live-host count takes a rule's default
    /// allowances to or past its whole limit, and when it falls back below:
    /// the fleet grew into it, so no profile check could have caught it.
    fn warn_of_default_allowances(&self, before: Option<u64>, hosts: u64) {
        for r in self.leases.manager().rules() {
            let was = before.map_or(0.0, |n| r.default_allowance_ratio(n));
            let now = r.default_allowance_ratio(hosts);
            if now >= 1.0 && was < 1.0 {
                tracing::warn!(
                    "global rule {}: {hosts} live hosts with a default share of {}/s each may admit {:.0}/s before their leases arrive, {now:.2}x the limit of {}/s; set a smaller default_share, or \"none\" (docs/profile.md)",
                    r.name,
                    r.default_share.map_or(0, |d| d.rate),
                    now * r.rate as f64,
                    r.rate,
                );
            } else if now < 1.0 && was >= 1.0 {
                tracing::info!(
                    "global rule {}: {hosts} live hosts: default allowances back to {now:.2}x the limit",
                    r.name
                );
            }
        }
    }

    /// `leases.json`: what `status`, `top` and the metrics show.
    fn publish(&self) -> Result<()> {
        let stats = self.leases.manager().stats();
        let now = now_us();
        let mut rules: Vec<PublishedRule> = self
            .leases
            .manager()
            .rules()
            .map(|r| PublishedRule {
                rule: r.name.clone(),
                rate: r.rate,
                burst: r.burst,
                quota: r.quota,
                quota_window_ms: r.quota.map(|_| r.quota_window / 1_000),
                default_share: r.default_share.map(|d| d.rate),
                default_allowance: self.hosts.map(|n| r.default_allowance_ratio(n)),
                leases: Vec::new(),
            })
            .collect();
        rules.sort_by(|a, b| a.rule.cmp(&b.rule));
        for v in self.leases.manager().leases() {
            let Some(r) = rules.iter_mut().find(|r| r.rule == v.rule) else { continue };
            let has_quota = r.quota.is_some();
            r.leases.push(PublishedLease {
                key: v.key.clone(),
                rate: v.grant.map(|g| g.share.rate),
                burst: v.grant.map(|g| g.share.burst),
                quota: v.grant.filter(|_| has_quota).map(|g| g.share.quota),
                quota_used: has_quota.then_some(v.used),
                demand: v.demand,
                target: v.target,
                expires_in_ms: v.grant.map(|g| g.expires.saturating_sub(now) / 1_000),
                learning: v.grant.is_some_and(|g| g.learning),
            });
        }
        let p = Published {
            updated_ns: monotonic_ns(),
            host: self.host.clone(),
            store: PublishedStore {
                url: self.store_url.clone(),
                health: self.health.clone(),
                state: self.state.to_string(),
                up: store_up(self.state),
                rtt_ms: self.rtt.map(|d| d.as_secs_f64() * 1e3),
                hosts: self.hosts,
            },
            batches: stats.batches,
            replies: stats.replies,
            failures: stats.failures,
            expired: stats.expired,
            over_cap: stats.over_cap,
            epoch_changes: stats.epoch_changes,
            grant_errors: self.leases.grant_errors(),
            rules,
        };
        let path = self.run_dir.join(PUBLISHED);
        let tmp = self.run_dir.join(format!("{PUBLISHED}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec_pretty(&p)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// The agent is stopping: give every lease back (the kernel's grants
    /// are cleared as the store's replies come, before they are
    /// acknowledged), so the other hosts get the capacity now rather than
    /// when the leases end.
    pub fn release_all(&mut self) {
        tracing::info!("giving the global rules' leases back");
        self.leases.release_all();
    }

    /// Whether every lease has been given back and acknowledged.
    pub fn released(&self) -> bool {
        self.leases.released()
    }

    /// The agent stops: its published state goes. Leases not given back
    /// end on their own, within one lease length, in the kernel too (each
    /// grant carries its end), so a kept data plane goes back to the
    /// default shares then.
    pub fn stop(&self) {
        let _ = std::fs::remove_file(self.run_dir.join(PUBLISHED));
    }
}

/// `leases.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Published {
    pub updated_ns: u64,
    /// This agent's name in the store.
    pub host: String,
    pub store: PublishedStore,
    pub batches: u64,
    pub replies: u64,
    pub failures: u64,
    /// Leases that ended here before a refresh arrived.
    pub expired: u64,
    /// Hot keys refused a lease: at the cap of `MAX_GRANTS`.
    pub over_cap: u64,
    pub epoch_changes: u64,
    pub grant_errors: u64,
    pub rules: Vec<PublishedRule>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PublishedStore {
    /// Without credentials (the profile refuses them in the URL).
    pub url: String,
    pub health: String,
    /// One of [`STORE_STATES`] (older agents did not say: empty).
    #[serde(default)]
    pub state: String,
    pub up: bool,
    pub rtt_ms: Option<f64>,
    /// Live hosts (heartbeats within a lease).
    pub hosts: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PublishedRule {
    pub rule: String,
    /// The fleet-wide limit per key.
    pub rate: u64,
    pub burst: u64,
    /// The fleet-wide quota per key and its window (None without one).
    #[serde(default)]
    pub quota: Option<u64>,
    #[serde(default)]
    pub quota_window_ms: Option<u64>,
    /// Units per second one host admits of a key before its first lease
    /// (None: `default_share = "none"`).
    #[serde(default)]
    pub default_share: Option<u64>,
    /// The live hosts' default shares as a fraction of `rate`
    /// ([`GlobalRule::default_allowance_ratio`]; None until the store has
    /// counted the hosts).
    #[serde(default)]
    pub default_allowance: Option<f64>,
    pub leases: Vec<PublishedLease>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PublishedLease {
    pub key: String,
    /// This host's grant (None: asked, not granted yet).
    pub rate: Option<u64>,
    pub burst: Option<u64>,
    /// This host's quota share per window (None: no grant, or no quota).
    #[serde(default)]
    pub quota: Option<u64>,
    /// Quota units spent here in the key's window (None without a quota).
    #[serde(default)]
    pub quota_used: Option<u64>,
    /// Offered units per second here.
    pub demand: Option<u64>,
    /// This host's fair share.
    pub target: u64,
    pub expires_in_ms: Option<u64>,
    pub learning: bool,
}

/// The published lease state of an attachment, when its agent runs
/// (`agent_fresh`) and has global rules.
pub fn published(state: &AttachState, agent_fresh: bool) -> Option<Published> {
    if !agent_fresh {
        return None;
    }
    let text = std::fs::read(state.id.run_dir().join(PUBLISHED)).ok()?;
    serde_json::from_slice(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::store_config;
    use crate::profile::parse;

    #[test]
    fn the_profile_says_how_to_reach_the_store() {
        let dir = std::env::temp_dir().join(format!("flowctl-store-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pw = dir.join("redis.pass");
        std::fs::write(&pw, "s3cret\n").unwrap();
        let text = format!(
            "[fleet]\nredis = \"rediss://10.0.0.1:6380\"\nredis_user = \"flowctl\"\nredis_password_file = \"{}\"\nredis_ca = \"/etc/ca.pem\"\nredis_cert = \"/etc/c.pem\"\nredis_key = \"/etc/k.pem\"\n[[rule]]\nname = \"g\"\nrate = \"10/s\"\nkey = \"src\"\nscope = \"global\"\n",
            pw.display()
        );
        let set = parse("p.toml", &text).unwrap();
        let cfg = store_config(set.fleet.as_ref().unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(cfg.url, "rediss://10.0.0.1:6380");
        assert_eq!(cfg.username.as_deref(), Some("flowctl"));
        assert_eq!(cfg.password.as_deref(), Some("s3cret"), "the file's line, without its newline");
        assert_eq!(cfg.ca_file, Some("/etc/ca.pem".into()));
        assert_eq!(cfg.client_cert, Some(("/etc/c.pem".into(), "/etc/k.pem".into())));
        // An unreadable password file refuses the attach, naming the file.
        let gone = parse("p.toml", &text).unwrap();
        let e = store_config(gone.fleet.as_ref().unwrap()).unwrap_err();
        assert!(format!("{e:#}").contains("reading redis_password_file"), "{e:#}");
    }
}
