//! The lease loop of an interface agent's global rules (docs/fleet.md,
//! "Global limits"): the kernel's hot-key reports and offered counts go in,
//! the store's grants come out into the kernel's grant map, through the
//! pure `fleet::global::host::Manager`. The Redis store is reached by a
//! task of its own, so this loop (and the packet path) never waits on the
//! network. Also what `status`, `top` and the metrics show of it
//! (`leases.json` in the run directory).

use crate::{
    dataplane::{state::AttachState, GlobalKeys},
    fleet::global::{
        allocator::BatchReply,
        host::{Batch, GrantSink, HostConfig, Manager},
        store::{Health, Store, StoreConfig},
        DefaultShare, GlobalRule, Grant, Share,
    },
    profile::{Fleet, RuleSet},
    system::clock::monotonic_ns,
};
use anyhow::{Context, Result};
use flowctl_common::{gcra, grant, window::Window, BucketKey};
use serde::{Deserialize, Serialize};
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};
use tokio::sync::mpsc;

/// The run-directory file `status`, `top` and the metrics read.
pub const PUBLISHED: &str = "leases.json";
/// Most hot-key reports taken per tick.
const HOT_PER_TICK: usize = 4096;
/// Most keys with (or waiting for) a lease, across the global rules: the
/// kernel's grant map holds this many.
const MAX_KEYS: usize = flowctl_common::MAX_GRANTS as usize;
/// How long a lowered grant needs to be in force in the kernel before it
/// is acknowledged to the store: the kernel re-reads a key's grant at most
/// every `grant::REFRESH_NS`; 10 ms more for the write itself.
const SETTLE: Duration = Duration::from_nanos(grant::REFRESH_NS + 10_000_000);
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
    Health { health: String, up: bool, rtt: Option<Duration> },
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
        let (health, up) = match store.health() {
            Health::Unknown => ("not asked yet".to_string(), false),
            Health::Ok { .. } => ("ok".into(), true),
            Health::Unreachable { error, .. } => (format!("unreachable: {error}"), false),
            Health::EpochChanged { rule, .. } => {
                (format!("lost its state (rule {rule} learning for one lease)"), true)
            }
        };
        let _ = events.send(Event::Health { health, up, rtt: store.rtt() });
    }
}

/// The kernel side of the grants: a lease's share into the key's grant word,
/// a revoked lease out (back to the rule's default share).
struct MapSink {
    keys: GlobalKeys,
    /// (rule, key as the store names it) -> the kernel's key.
    known: HashMap<(String, String), BucketKey>,
    /// The grant applied per key, to tell a cut from a raise.
    applied: HashMap<(String, String), Share>,
    /// A grant was lowered: acknowledge nothing before this.
    settle_until: Option<Instant>,
    errors: u64,
}

impl GrantSink for MapSink {
    fn apply(&mut self, rule: &str, key: &str, g: &Grant) {
        let id = (rule.to_string(), key.to_string());
        let Some(k) = self.known.get(&id) else { return };
        // A burst share rounded to nothing would refuse every packet of a
        // key that has a rate: at least one unit (the bound's slack is one
        // unit per host).
        let burst = g.share.burst.max(1);
        let rate = g.share.rate;
        if self.applied.get(&id).is_some_and(|old| old.exceeds(&g.share)) {
            self.settle_until = Some(Instant::now() + SETTLE);
        }
        // The kernel ends the lease by itself when the agent does (its
        // clock is the manager's, in us): a grant never outlives its lease.
        let ends = g.expires.saturating_mul(1_000);
        match self.keys.set_lease(k, gcra::interval_fp(rate.max(1), 1), burst, g.share.quota, ends)
        {
            Ok(()) => {
                self.applied.insert(id, g.share);
            }
            Err(e) => {
                self.errors += 1;
                tracing::warn!("global rule {rule}: granting {key}: {e:#}");
            }
        }
    }

    fn revoke(&mut self, rule: &str, key: &str) {
        let id = (rule.to_string(), key.to_string());
        let Some(k) = self.known.get(&id) else { return };
        // Back to the default share: lower than any lease, so settle too.
        self.settle_until = Some(Instant::now() + SETTLE);
        self.applied.remove(&id);
        if let Err(e) = self.keys.clear_grant(k) {
            self.errors += 1;
            tracing::warn!("global rule {rule}: ending the lease of {key}: {e:#}");
        }
    }
}

/// A global rule of the running profile.
struct RuleInfo {
    spec: GlobalRule,
    key_kind: u8,
    /// The kernel's quota window of the rule (None without a quota).
    quota: Option<Window>,
}

pub struct LeaseLoop {
    manager: Manager,
    sink: MapSink,
    rules: HashMap<String, RuleInfo>,
    /// Counter record -> rule name, for the kernel's reports.
    by_record: HashMap<u32, String>,
    jobs: mpsc::UnboundedSender<Job>,
    events: mpsc::UnboundedReceiver<Event>,
    /// Batches held back while a lowered grant settles in the kernel.
    held: Vec<Batch>,
    host: String,
    lease: Duration,
    store_url: String,
    health: String,
    up: bool,
    rtt: Option<Duration>,
    hosts: Option<u64>,
    next_observe: Instant,
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
            let per_s = |interval_fp: u64| -> u64 {
                // Units per second of a fixed-point interval, to the nearest
                // (the interval was rounded up from the rate as written).
                let i = interval_fp.max(1) as u128;
                (((1_000_000_000u128 << gcra::FRAC_BITS) + i / 2) / i) as u64
            };
            let mut spec = GlobalRule::new(&r.name, per_s(r.interval_fp), r.burst);
            spec.lease = fleet.lease_ns / 1_000;
            spec.refresh = fleet.refresh_ns / 1_000;
            spec.default_share = g
                .share
                .as_ref()
                .map(|s| DefaultShare { rate: per_s(s.interval_fp), burst: s.burst });
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
        let mut cfg = StoreConfig::new(&fleet.redis);
        cfg.username = fleet.redis_user.clone();
        if let Some(p) = &fleet.redis_password_file {
            let pw = std::fs::read_to_string(p)
                .with_context(|| format!("reading redis_password_file {}", p.display()))?;
            cfg.password = Some(pw.trim_end_matches(['\n', '\r']).to_string());
        }
        cfg.ca_file = fleet.redis_ca.clone();
        cfg.timeout = STORE_TIMEOUT;
        let store = Store::new(cfg).map_err(|e| anyhow::anyhow!("[fleet] redis: {e}"))?;
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
        let mut manager = Manager::new(HostConfig {
            host: host.clone(),
            max_keys: MAX_KEYS,
            timeout: STORE_TIMEOUT.as_micros() as u64 * 2,
        });
        let mut rules = HashMap::new();
        for (spec, key_kind, quota) in specs {
            spec.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
            manager.set_rule(spec.clone());
            rules.insert(spec.name.clone(), RuleInfo { spec, key_kind, quota });
        }
        let by_record = state
            .rules
            .iter()
            .filter(|r| rules.contains_key(&r.name))
            .map(|r| (r.record, r.name.clone()))
            .collect();
        let (jobs, job_rx) = mpsc::unbounded_channel();
        let (event_tx, events) = mpsc::unbounded_channel();
        rt.spawn(store_task(store, job_rx, event_tx));
        let sink = MapSink {
            keys: GlobalKeys::open(&state.id)?,
            known: HashMap::new(),
            applied: HashMap::new(),
            settle_until: None,
            errors: 0,
        };
        let now = Instant::now();
        Ok(Some(Self {
            manager,
            sink,
            rules,
            by_record,
            jobs,
            events,
            held: Vec::new(),
            host,
            lease: Duration::from_nanos(fleet.lease_ns),
            store_url: fleet.redis.clone(),
            health: "not asked yet".into(),
            up: false,
            rtt: None,
            hosts: None,
            next_observe: now,
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
            .rules
            .keys()
            .filter(|n| !specs.iter().any(|(s, _, _)| s.name == **n))
            .cloned()
            .collect();
        for name in gone {
            self.manager.remove_rule(&name, &mut self.sink);
            self.rules.remove(&name);
        }
        for (spec, key_kind, quota) in specs {
            if let Err(e) = spec.validate() {
                tracing::warn!("{e}");
                continue;
            }
            self.manager.set_rule(spec.clone());
            self.rules.insert(spec.name.clone(), RuleInfo { spec, key_kind, quota });
        }
        self.by_record = state
            .rules
            .iter()
            .filter(|r| self.rules.contains_key(&r.name))
            .map(|r| (r.record, r.name.clone()))
            .collect();
    }

    /// Runs what is due; returns when it wants to run next.
    pub fn tick(&mut self) -> Instant {
        let now = Instant::now();
        // The kernel's hot keys: ask for their leases.
        for h in self.sink.keys.hot(HOT_PER_TICK) {
            let Some(rule) = self.by_record.get(&h.record) else { continue };
            let Some(info) = self.rules.get(rule) else { continue };
            let key = crate::agent::heavy::describe_key(&h.key, info.key_kind);
            self.sink.known.insert((rule.clone(), key.clone()), h.key);
            self.manager.note_hot(rule, &key, now_us());
        }
        // Demand: the leased keys' offered counts, eight times a refresh.
        if now >= self.next_observe {
            let refresh = self.rules.values().map(|r| r.spec.refresh).min().unwrap_or(1_000_000);
            self.next_observe = now + Duration::from_micros((refresh / 8).max(10_000));
            for v in self.manager.leases() {
                let id = (v.rule.clone(), v.key.clone());
                let Some(k) = self.sink.known.get(&id) else { continue };
                if let Some(b) = self.sink.keys.bucket(k) {
                    self.manager.observe(&v.rule, &v.key, b.offered, now_us());
                }
                // What the key has spent of its quota here, so the store
                // keeps it reserved while it is in the window.
                if let Some(w) = self.rules.get(&v.rule).and_then(|r| r.quota.as_ref()) {
                    let (used, clear_in_ns) = self.sink.keys.quota_spent(k, w);
                    self.manager.observe_used(&v.rule, &v.key, used, clear_in_ns.div_ceil(1_000));
                }
            }
        }
        // The store's answers.
        while let Ok(ev) = self.events.try_recv() {
            match ev {
                Event::Reply { rule, seq, result: Ok(reply) } => {
                    self.manager.on_reply(&rule, seq, &reply, now_us(), &mut self.sink);
                }
                Event::Reply { rule, seq, result: Err(e) } => {
                    tracing::debug!("global rule {rule}: store call failed: {e}");
                    self.manager.on_failure(&rule, seq, now_us());
                }
                Event::Hosts(Ok(n)) => {
                    self.warn_of_default_allowances(self.hosts, n);
                    self.hosts = Some(n);
                }
                Event::Hosts(Err(_)) => {}
                Event::Health { health, up, rtt } => {
                    if health != self.health {
                        if up {
                            tracing::info!("redis {}: {health}", self.store_url);
                        } else {
                            tracing::warn!(
                                "redis {}: {health} (keeping the grants held, raising none)",
                                self.store_url
                            );
                        }
                    }
                    (self.health, self.up, self.rtt) = (health, up, rtt);
                }
            }
        }
        // Batches due, held back while a lowered grant settles in the kernel
        // (its acknowledgement must not come before the kernel enforces it).
        let due = self.manager.poll(now_us(), &mut self.sink);
        self.held.extend(due);
        if self.sink.settle_until.is_none_or(|t| now >= t) {
            self.sink.settle_until = None;
            for b in self.held.drain(..) {
                if let Some(info) = self.rules.get(&b.rule) {
                    let _ = self.jobs.send(Job::Run(info.spec.clone(), b));
                }
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
        // Hot keys and replies come any time: look again soon.
        let mut next = now + Duration::from_millis(20);
        if let Some(t) = self.sink.settle_until {
            next = next.min(t);
        }
        next
    }

    /// Says so in the log when the live-host count takes a rule's default
    /// allowances to or past its whole limit, and when it falls back below:
    /// the fleet grew into it, so no profile check could have caught it.
    fn warn_of_default_allowances(&self, before: Option<u64>, hosts: u64) {
        for r in self.rules.values() {
            let was = before.map_or(0.0, |n| r.spec.default_allowance_ratio(n));
            let now = r.spec.default_allowance_ratio(hosts);
            if now >= 1.0 && was < 1.0 {
                tracing::warn!(
                    "global rule {}: {hosts} live hosts with a default share of {}/s each may admit {:.0}/s before their leases arrive, {now:.2}x the limit of {}/s; set a smaller default_share, or \"none\" (docs/profile.md)",
                    r.spec.name,
                    r.spec.default_share.map_or(0, |d| d.rate),
                    now * r.spec.rate as f64,
                    r.spec.rate,
                );
            } else if now < 1.0 && was >= 1.0 {
                tracing::info!(
                    "global rule {}: {hosts} live hosts: default allowances back to {now:.2}x the limit",
                    r.spec.name
                );
            }
        }
    }

    /// `leases.json`: what `status`, `top` and the metrics show.
    fn publish(&self) -> Result<()> {
        let stats = self.manager.stats();
        let now = now_us();
        let mut rules: Vec<PublishedRule> = self
            .rules
            .values()
            .map(|r| PublishedRule {
                rule: r.spec.name.clone(),
                rate: r.spec.rate,
                burst: r.spec.burst,
                quota: r.spec.quota,
                quota_window_ms: r.spec.quota.map(|_| r.spec.quota_window / 1_000),
                default_share: r.spec.default_share.map(|d| d.rate),
                default_allowance: self.hosts.map(|n| r.spec.default_allowance_ratio(n)),
                leases: Vec::new(),
            })
            .collect();
        rules.sort_by(|a, b| a.rule.cmp(&b.rule));
        for v in self.manager.leases() {
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
                up: self.up,
                rtt_ms: self.rtt.map(|d| d.as_secs_f64() * 1e3),
                hosts: self.hosts,
            },
            batches: stats.batches,
            replies: stats.replies,
            failures: stats.failures,
            expired: stats.expired,
            over_cap: stats.over_cap,
            epoch_changes: stats.epoch_changes,
            grant_errors: self.sink.errors,
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
        self.manager.release_all();
    }

    /// Whether every lease has been given back and acknowledged.
    pub fn released(&self) -> bool {
        self.manager.leases().is_empty()
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
