//! The etcd side of an agent: a tokio task that keeps a watch on the
//! profile, hands every complete change to the agent, and keeps the
//! agent's report alive under a lease. The agent applies (`follower`);
//! this task only reads, watches and reports, so nothing it does can touch
//! the data plane.
//!
//! One session: connect; relist when needed (a linearizable Get of the
//! prefix at revision R: the first start without etcd, and after a
//! compaction); watch [`generation`, `profile`] from the revision after
//! the last one seen, with progress notifications (require-leader is on the connection);
//! grant a lease and put the report under it. The session ends on a
//! compaction (relist at once), and fails on any error, a cancelled watch,
//! a lost lease, or a silent watch (no response, event or progress, within
//! the silence timeout, while a progress request goes out every third of
//! it), after which the task waits with a growing backoff and starts
//! another. Resuming from the last revision seen replays every publish
//! missed while away, in order, unless it was compacted.

use crate::fleet::etcd::{
    access::{request, Access},
    url::EtcdUrl,
    version::{seen_after, Candidate, Change, Mirror},
};
use anyhow::{bail, Result};
use etcd_client::{EventType, GetOptions, PutOptions, WatchOptions};
use serde::{Deserialize, Serialize};
use std::{sync::Arc, time::Duration};
use tokio::sync::{watch, Notify};

/// What the task hands the agent: the newest complete profile etcd holds
/// (or why there is none), and the store's health.
#[derive(Clone, Debug, Default)]
pub struct Fetched {
    pub latest: Option<Result<Candidate, String>>,
    pub store: Store,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum Store {
    #[default]
    Connecting,
    Watching {
        since_unix: u64,
    },
    Unreachable {
        since_unix: u64,
        error: String,
    },
}

/// What an agent says about itself under `PREFIX/agents/ID`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub agent: String,
    pub applied_generation: Option<u64>,
    pub applied_revision: Option<i64>,
    pub profile_hash: Option<String>,
    pub error: Option<String>,
    /// Enforcing the disk copy, not yet a profile read from etcd.
    pub from_disk_copy: bool,
    pub updated_unix: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// A watch with no response for this long is dead.
    pub silence: Duration,
    /// The report's lease: an agent gone for this long drops out of the
    /// rollout.
    pub lease_ttl: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self { silence: Duration::from_secs(30), lease_ttl: Duration::from_secs(10) }
    }
}

/// The agent's ends of the channels.
pub struct Handles {
    pub fetched: watch::Receiver<Fetched>,
    pub wake: Arc<Notify>,
    pub reports: watch::Sender<Report>,
}

pub struct Watcher {
    url: EtcdUrl,
    access: Access,
    timing: Timing,
    agent_key: String,
    mirror: Mirror,
    /// Every event up to this revision has been seen.
    seen: i64,
    relist: bool,
    to_agent: watch::Sender<Fetched>,
    wake: Arc<Notify>,
    reports: watch::Receiver<Report>,
}

/// Where a watcher starts: what a bootstrap Get read (mirror and its
/// revision), or nothing (a start from the disk copy: relist first).
pub struct Seed {
    pub mirror: Mirror,
    pub revision: Option<i64>,
}

impl Watcher {
    pub fn new(
        url: EtcdUrl,
        access: Access,
        timing: Timing,
        agent: &str,
        seed: Seed,
        first: Report,
    ) -> (Self, Handles) {
        let latest = seed.revision.map(|_| seed.mirror.candidate(&url.label(&url.profile_key())));
        let (to_agent, fetched) = watch::channel(Fetched { latest, store: Store::Connecting });
        let (reports_tx, reports) = watch::channel(first);
        let wake = Arc::new(Notify::new());
        let w = Self {
            agent_key: url.key(&format!("{}{agent}", super::url::AGENTS)),
            url,
            access,
            timing,
            mirror: seed.mirror,
            seen: seed.revision.unwrap_or(0),
            relist: seed.revision.is_none(),
            to_agent,
            wake: wake.clone(),
            reports,
        };
        (w, Handles { fetched, wake, reports: reports_tx })
    }

    /// Runs until the agent goes (its ends of the channels dropped).
    pub async fn run(mut self) {
        let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(8));
        loop {
            let mut watching = false;
            let r = self.session(&mut watching).await;
            if self.to_agent.is_closed() {
                return;
            }
            if watching {
                backoff.reset();
            }
            match r {
                Ok(()) => continue,
                Err(e) => {
                    let error = format!("{e:#}");
                    let since = match &self.to_agent.borrow().store {
                        Store::Unreachable { since_unix, .. } => *since_unix,
                        _ => now_unix(),
                    };
                    self.tell(|f| f.store = Store::Unreachable { since_unix: since, error });
                    tokio::time::sleep(backoff.next(jitter())).await;
                }
            }
        }
    }

    fn tell(&self, f: impl FnOnce(&mut Fetched)) {
        self.to_agent.send_modify(f);
        self.wake.notify_one();
    }

    fn label(&self) -> String {
        self.url.label(&self.url.profile_key())
    }

    /// One connection's life; `Ok` asks for a relist at once.
    async fn session(&mut self, watching: &mut bool) -> Result<()> {
        let (url, access) = (self.url.clone(), self.access.clone());
        let mut client = access.connect(&url).await?;
        if self.relist {
            let opts = GetOptions::new().with_prefix();
            let resp =
                request(&url, &access, "reading the profile", client.get(url.key(""), Some(opts)))
                    .await?;
            let kvs = resp
                .kvs()
                .iter()
                .filter_map(|kv| Some((kv.key_str().ok()?, kv.value(), kv.mod_revision())));
            self.mirror = Mirror::from_get(&url.profile_key(), &url.generation_key(), kvs);
            self.seen = resp.header().map(|h| h.revision()).unwrap_or(0);
            self.relist = false;
            let latest = self.mirror.candidate(&self.label());
            self.tell(|f| f.latest = Some(latest));
        }
        let opts = WatchOptions::new()
            .with_range(url.watch_range_end())
            .with_start_revision(self.seen + 1)
            .with_progress_notify();
        let mut stream = request(
            &url,
            &access,
            "starting the watch",
            client.watch(url.generation_key(), Some(opts)),
        )
        .await?;
        let ttl = self.timing.lease_ttl.as_secs().max(2) as i64;
        let lease =
            request(&url, &access, "granting the report's lease", client.lease_grant(ttl, None))
                .await?
                .id();
        let (mut keeper, mut alive) =
            request(&url, &access, "keeping the lease alive", client.lease_keep_alive(lease))
                .await?;
        self.put_report(&mut client, lease).await?;
        *watching = true;
        self.tell(|f| f.store = Store::Watching { since_unix: now_unix() });
        let silence = self.timing.silence;
        let mut renew = tokio::time::interval(Duration::from_secs(ttl as u64) / 3);
        let mut probe = tokio::time::interval(silence / 3);
        let mut heard = tokio::time::Instant::now();
        loop {
            tokio::select! {
                msg = stream.message() => {
                    let Some(resp) = msg? else { bail!("etcd ended the watch stream") };
                    heard = tokio::time::Instant::now();
                    if resp.compact_revision() > 0 {
                        // Revisions up to it are gone: read the prefix anew.
                        tracing::info!("etcd compacted revisions up to {} past this agent's {}: relisting", resp.compact_revision(), self.seen);
                        self.relist = true;
                        return Ok(());
                    }
                    if resp.canceled() {
                        bail!("etcd cancelled the watch: {}", resp.cancel_reason());
                    }
                    self.absorb(resp.events());
                }
                _ = probe.tick() => {
                    if heard.elapsed() >= silence {
                        bail!("the watch was silent for {silence:?} (no event, no progress notification)");
                    }
                    stream.request_progress().await?;
                }
                _ = renew.tick() => keeper.keep_alive().await?,
                msg = alive.message() => match msg? {
                    Some(r) if r.ttl() > 0 => {}
                    _ => bail!("the report's lease expired"),
                },
                changed = self.reports.changed() => {
                    if changed.is_err() {
                        return Ok(()); // the agent is gone; `run` ends
                    }
                    self.put_report(&mut client, lease).await?;
                }
            }
        }
    }

    /// One watch response: every change of one or more whole revisions.
    fn absorb(&mut self, events: &[etcd_client::Event]) {
        if events.is_empty() {
            return; // progress
        }
        let mut changes = Vec::new();
        let mut revisions = Vec::new();
        for e in events {
            let Some(kv) = e.kv() else { continue };
            let Ok(key) = kv.key_str() else { continue };
            revisions.push(kv.mod_revision());
            changes.push(match e.event_type() {
                EventType::Put => Change::Put {
                    key: key.to_string(),
                    value: kv.value().to_vec(),
                    mod_revision: kv.mod_revision(),
                },
                EventType::Delete => Change::Delete { key: key.to_string() },
            });
        }
        self.mirror.apply(&self.url.profile_key(), &self.url.generation_key(), &changes);
        self.seen = seen_after(self.seen, &revisions);
        let latest = self.mirror.candidate(&self.label());
        self.tell(|f| f.latest = Some(latest));
    }

    async fn put_report(&mut self, client: &mut etcd_client::Client, lease: i64) -> Result<()> {
        let mut r = self.reports.borrow_and_update().clone();
        r.updated_unix = now_unix();
        let value = serde_json::to_string(&r)?;
        let put =
            client.put(self.agent_key.clone(), value, Some(PutOptions::new().with_lease(lease)));
        request(&self.url, &self.access, "writing this agent's report", put).await?;
        Ok(())
    }
}

/// Waits between failed sessions: doubling from `first` up to `max`, each
/// wait shortened by up to a quarter at random so a fleet that lost etcd
/// together does not come back in step.
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Self {
        Self { first, max, next: first }
    }

    /// The next wait; `jitter` in [0, 1).
    pub fn next(&mut self, jitter: f64) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d.mul_f64(1.0 - 0.25 * jitter.clamp(0.0, 1.0))
    }

    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

/// [0, 1) from the clock's nanoseconds: enough to spread agents apart.
fn jitter() -> f64 {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (n % 1000) as f64 / 1000.0
}

pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(250), Duration::from_secs(2));
        let waits: Vec<_> = (0..5).map(|_| b.next(0.0).as_millis()).collect();
        assert_eq!(waits, [250, 500, 1000, 2000, 2000]);
        assert_eq!(b.next(0.999).as_millis(), 1500, "a quarter shorter at most");
        b.reset();
        assert_eq!(b.next(0.0).as_millis(), 250);
    }

    #[test]
    fn a_seed_from_a_get_is_offered_at_once_and_none_asks_for_a_relist() {
        let url: EtcdUrl = "etcd://h/p".parse().unwrap();
        let m =
            Mirror::from_get("/p/profile", "/p/generation", [("/p/profile", b"x".as_slice(), 4)]);
        let (w, h) = Watcher::new(
            url.clone(),
            Access::default(),
            Timing::default(),
            "a",
            Seed { mirror: m, revision: Some(9) },
            Report::default(),
        );
        assert_eq!((w.seen, w.relist, w.agent_key.as_str()), (9, false, "/p/agents/a"));
        let f = h.fetched.borrow().clone();
        assert_eq!(f.latest.unwrap().unwrap().version.revision, 4);
        let (w, h) = Watcher::new(
            url,
            Access::default(),
            Timing::default(),
            "a",
            Seed { mirror: Mirror::default(), revision: None },
            Report::default(),
        );
        assert!(w.relist && h.fetched.borrow().latest.is_none());
    }
}
