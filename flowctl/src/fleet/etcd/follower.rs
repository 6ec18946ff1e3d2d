//! The agent's side of a profile from etcd: where the agent starts from
//! (etcd, or the disk copy when etcd cannot give a good profile), and,
//! once it serves, which fetched profile to apply next and what became of
//! it.
//!
//! The watcher task ([`super::watch`]) hands over complete profiles; the
//! agent's tick asks [`Follower::take_newer`] for one to apply, applies it
//! through the same path as `flowctl apply` (all or nothing) and hands the
//! outcome to [`Follower::outcome`]. Every decision about versions is
//! here, in the agent's thread: a profile is applied only when its version
//! is above the last one handled (applied or rejected), a bad one is
//! rejected whole with its etcd key, line and column, and what the agent
//! enforces is published for `status` and the metrics (`etcd.json` in the
//! run directory) and reported to etcd.

use crate::{
    fleet::etcd::{
        access::{request, Access},
        disk::{DiskCopy, Saved},
        url::EtcdUrl,
        version::{judge, Candidate, Mirror, Verdict, Version},
        watch::{now_unix, Fetched, Handles, Report, Seed, Store, Timing, Watcher},
    },
    profile,
};
use anyhow::{anyhow, Result};
use etcd_client::GetOptions;
use serde::{Deserialize, Serialize};
use std::{
    path::{Path, PathBuf},
    sync::Arc,
};
use tokio::sync::Notify;

/// The run file `status` and the metrics read.
pub const PUBLISHED: &str = "etcd.json";

/// `attach --profile etcd://...` and its options.
#[derive(Clone, Debug)]
pub struct Config {
    pub url: EtcdUrl,
    pub access: Access,
    pub timing: Timing,
    pub disk: DiskCopy,
    /// This agent's name under `PREFIX/agents/`.
    pub agent: String,
}

impl Config {
    pub fn new(
        url: EtcdUrl,
        access: Access,
        timing: Timing,
        cache_root: &Path,
        netns: Option<&str>,
        iface: &str,
    ) -> Self {
        let disk = DiskCopy::new(cache_root, &url.prefix, netns, iface);
        Self { url, access, timing, disk, agent: agent_name(netns, iface) }
    }
}

/// `HOSTNAME:IFACE`, or `HOSTNAME:NETNS:IFACE` for an interface in a
/// namespace: one name per attachment of the fleet.
pub fn agent_name(netns: Option<&str>, iface: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    match netns {
        Some(ns) => format!("{host}:{ns}:{iface}"),
        None => format!("{host}:{iface}"),
    }
}

/// What the agent starts from: the profile staged in a file for the usual
/// attach path, and where it came from.
pub struct Start {
    pub path: PathBuf,
    pub candidate: Candidate,
    /// From the disk copy, and why etcd could not give it.
    pub from_disk: Option<String>,
    seed: Seed,
}

/// Reads the profile from etcd (a linearizable Get of the prefix) and
/// validates it; when etcd is unreachable, refuses the credentials or holds
/// no good profile, starts from the disk copy, and says so.
pub async fn bootstrap(cfg: &Config) -> Result<Start> {
    let read = async {
        let mut client = cfg.access.connect(&cfg.url).await?;
        let get = client.get(cfg.url.key(""), Some(GetOptions::new().with_prefix()));
        let resp = request(&cfg.url, &cfg.access, "reading the profile", get).await?;
        let kvs = resp
            .kvs()
            .iter()
            .filter_map(|kv| Some((kv.key_str().ok()?, kv.value(), kv.mod_revision())));
        let mirror = Mirror::from_get(&cfg.url.profile_key(), &cfg.url.generation_key(), kvs);
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        anyhow::Ok((mirror, revision))
    };
    let label = cfg.url.label(&cfg.url.profile_key());
    // What this agent last applied: never gone back from, across restarts
    // as within a run.
    let last = cfg.disk.load().ok().flatten().map(|s| s.version);
    let why = match read.await {
        Ok((mirror, revision)) => {
            let checked = mirror.candidate(&label).and_then(|c| match last {
                Some(l) if judge(Some(l), c.version) == Verdict::Older => Err(format!(
                    "{}: etcd holds {}, older than the {l} of the disk copy; never applied (publish a newer one)",
                    c.label, c.version
                )),
                _ => profile::parse(&c.label, &c.text).map(|_| c).map_err(|e| e.to_string()),
            });
            match checked {
                Ok(candidate) => {
                    let path = cfg.disk.stage(&candidate.text)?;
                    let seed = Seed { mirror, revision: Some(revision) };
                    return Ok(Start { path, candidate, from_disk: None, seed });
                }
                Err(e) => e,
            }
        }
        Err(e) => format!("{e:#}"),
    };
    let saved = cfg.disk.load()?.ok_or_else(|| {
        anyhow!(
            "{why}; and there is no disk copy of a last good profile at {} to start from",
            cfg.disk.file().display()
        )
    })?;
    let candidate = Candidate {
        version: saved.version,
        label: saved.label.clone(),
        text: saved.profile.clone(),
        hash: saved.hash.clone(),
    };
    let path = cfg.disk.stage(&candidate.text)?;
    let seed = Seed { mirror: Mirror::default(), revision: None };
    Ok(Start { path, candidate, from_disk: Some(why), seed })
}

/// What `status` and the metrics show of an agent's etcd profile.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Published {
    pub source: String,
    pub agent: String,
    pub applied: Option<Version>,
    pub profile_hash: Option<String>,
    pub from_disk_copy: bool,
    /// The newest version seen in etcd (applied or not).
    pub latest: Option<Version>,
    /// Why the newest profile in etcd is not the one enforced.
    pub error: Option<String>,
    pub rejected_total: u64,
    pub store: Store,
    pub disk_copy: String,
}

/// An agent's etcd state, published in `RUN_DIR/etcd.json` (the
/// attachment's run directory); `None` when the agent has no etcd profile.
pub fn published(run_dir: &Path) -> Option<Published> {
    let text = std::fs::read_to_string(run_dir.join(PUBLISHED)).ok()?;
    serde_json::from_str(&text).ok()
}

pub struct Follower {
    cfg: Config,
    run_dir: PathBuf,
    fetched: tokio::sync::watch::Receiver<Fetched>,
    wake: Arc<Notify>,
    reports: tokio::sync::watch::Sender<Report>,
    /// The newest version applied or rejected.
    handled: Option<Version>,
    /// Staged, being applied.
    pending: Option<(Candidate, PathBuf)>,
    shown: Published,
}

impl Follower {
    /// The profile `start` gave is enforcing: keep it on disk (unless it
    /// came from there), publish into `run_dir`, and start the watcher on
    /// `rt`.
    pub fn start(cfg: Config, start: Start, run_dir: PathBuf, rt: &tokio::runtime::Handle) -> Self {
        let c = &start.candidate;
        let first = Report {
            agent: cfg.agent.clone(),
            applied_generation: Some(c.version.generation),
            applied_revision: Some(c.version.revision),
            profile_hash: Some(c.hash.clone()),
            error: None,
            from_disk_copy: start.from_disk.is_some(),
            updated_unix: now_unix(),
        };
        let (watcher, handles) = Watcher::new(
            cfg.url.clone(),
            cfg.access.clone(),
            cfg.timing,
            &cfg.agent,
            start.seed,
            first,
        );
        let f = Self::with(cfg, start.candidate, start.from_disk, run_dir, handles);
        rt.spawn(watcher.run());
        f
    }

    /// The follower of a watcher's `handles`, enforcing `enforced` (from
    /// the disk copy when `from_disk` says why).
    fn with(
        cfg: Config,
        enforced: Candidate,
        from_disk: Option<String>,
        run_dir: PathBuf,
        handles: Handles,
    ) -> Self {
        let Handles { fetched, wake, reports } = handles;
        let mut f = Self {
            run_dir,
            fetched,
            wake,
            reports,
            handled: Some(enforced.version),
            pending: None,
            shown: Published {
                source: cfg.url.to_string(),
                agent: cfg.agent.clone(),
                disk_copy: cfg.disk.file().display().to_string(),
                ..Default::default()
            },
            cfg,
        };
        let disk = from_disk.is_some();
        f.shown.error = from_disk;
        f.applied(enforced, disk);
        f.cfg.disk.unstage();
        f
    }

    /// Wakes the agent's loop when the watcher has news.
    pub fn wake_handle(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// The staged file of a newer profile that validates, to apply now; a
    /// bad one is rejected here, whole.
    pub fn take_newer(&mut self) -> Option<PathBuf> {
        if !self.fetched.has_changed().unwrap_or(false) {
            return None;
        }
        let f = self.fetched.borrow_and_update().clone();
        if f.store != self.shown.store {
            match &f.store {
                Store::Unreachable { error, .. } => tracing::warn!(
                    "etcd: {error}; the last good profile ({}) keeps enforcing, reconnecting",
                    self.shown.applied.map(|v| v.to_string()).unwrap_or_default()
                ),
                Store::Watching { .. } => tracing::info!("etcd: watching {}", self.cfg.url),
                Store::Connecting => {}
            }
            self.shown.store = f.store.clone();
            self.publish();
        }
        let c = match f.latest? {
            Ok(c) => c,
            Err(e) => {
                self.set_error(e);
                return None;
            }
        };
        match judge(self.handled, c.version) {
            Verdict::Seen => {
                // etcd holds what the disk copy held: the agent is current.
                if self.shown.applied == Some(c.version) && self.shown.error.is_some() {
                    self.shown.error = None;
                    self.shown.from_disk_copy = false;
                    self.shown.latest = Some(c.version);
                    self.publish();
                }
                None
            }
            Verdict::Older => {
                let e = format!("{}: etcd holds {}, older than the {} this agent handled; never applied (publish a newer one)", c.label, c.version, self.handled.unwrap_or_default());
                self.set_error(e);
                None
            }
            Verdict::Take => {
                self.shown.latest = Some(c.version);
                if let Err(e) = profile::parse(&c.label, &c.text) {
                    self.rejected(c, e.to_string());
                    return None;
                }
                match self.cfg.disk.stage(&c.text) {
                    Ok(p) => {
                        self.pending = Some((c, p.clone()));
                        Some(p)
                    }
                    Err(e) => {
                        self.rejected(c, format!("{e:#}"));
                        None
                    }
                }
            }
        }
    }

    /// What applying the file [`take_newer`](Self::take_newer) gave did: `Err` holds
    /// the apply's message (nothing was applied).
    pub fn outcome(&mut self, result: Result<(), String>) {
        let Some((c, path)) = self.pending.take() else { return };
        match result {
            Ok(()) => self.applied(c, false),
            Err(e) => {
                // The apply names the staged file; the operator knows the key.
                let e = e.replace(&path.display().to_string(), &c.label);
                self.rejected(c, e)
            }
        }
        self.cfg.disk.unstage();
    }

    /// Where the enforced profile came from, for the attachment's state:
    /// `etcd://ENDPOINTS/PREFIX/profile (generation G (revision R))`.
    pub fn source(&self) -> String {
        let v = self.shown.applied.map(|v| format!(" ({v})")).unwrap_or_default();
        format!("{}{v}", self.cfg.url.label(&self.cfg.url.profile_key()))
    }

    fn applied(&mut self, c: Candidate, from_disk: bool) {
        self.handled = Some(c.version);
        if from_disk {
            crate::system::log::status(format_args!(
                "etcd could not give the profile ({}): enforcing the disk copy of {} from {}; watching etcd for a newer one",
                self.shown.error.as_deref().unwrap_or("unreachable"),
                c.version,
                self.cfg.disk.file().display()
            ));
        } else {
            let saved = Saved {
                label: c.label.clone(),
                version: c.version,
                hash: c.hash.clone(),
                saved_unix: now_unix(),
                profile: c.text.clone(),
            };
            if let Err(e) = self.cfg.disk.save(&saved) {
                tracing::warn!("keeping the disk copy of the profile: {e:#}");
            }
            tracing::info!("etcd: applied {} from {}", c.version, c.label);
            self.shown.error = None;
        }
        self.shown.applied = Some(c.version);
        self.shown.latest = self.shown.latest.max(Some(c.version));
        self.shown.profile_hash = Some(c.hash);
        self.shown.from_disk_copy = from_disk;
        self.publish();
    }

    fn rejected(&mut self, c: Candidate, error: String) {
        self.handled = Some(c.version);
        self.shown.rejected_total += 1;
        tracing::error!("etcd: rejected {} (the running profile stays): {error}", c.version);
        crate::system::log::status(format_args!(
            "etcd profile {} rejected whole, the running profile stays: {error}",
            c.version
        ));
        self.shown.error = Some(error);
        self.publish();
    }

    fn set_error(&mut self, e: String) {
        if self.shown.error.as_deref() != Some(&e) {
            tracing::warn!("{e}");
            self.shown.error = Some(e);
            self.publish();
        }
    }

    /// To `status` and the metrics (the run file) and to etcd (the report).
    fn publish(&mut self) {
        let s = &self.shown;
        let report = Report {
            agent: s.agent.clone(),
            applied_generation: s.applied.map(|v| v.generation),
            applied_revision: s.applied.map(|v| v.revision),
            profile_hash: s.profile_hash.clone(),
            error: s.error.clone(),
            from_disk_copy: s.from_disk_copy,
            updated_unix: now_unix(),
        };
        self.reports.send_if_modified(|r| {
            let changed = Report { updated_unix: r.updated_unix, ..report.clone() } != *r;
            if changed {
                *r = report;
            }
            changed
        });
        if let Err(e) = write_atomic(
            &self.run_dir.join(PUBLISHED),
            &serde_json::to_vec_pretty(s).unwrap_or_default(),
        ) {
            tracing::warn!("publishing the etcd state: {e:#}");
        }
    }

    /// The agent stops: `status` no longer shows an etcd state.
    pub fn stop(&self) {
        let _ = std::fs::remove_file(self.run_dir.join(PUBLISHED));
        self.cfg.disk.unstage();
    }
}

fn write_atomic(p: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = p.with_extension("json.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, p)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::etcd::version::profile_hash;

    const GOOD: &str = "[[rule]]\nname = \"a\"\nrate = \"10/s\"\n";
    const BAD: &str = "[[rule]]\nname = \"a\"\nrate = \"0/s\"\n";

    fn candidate(generation: u64, revision: i64, text: &str) -> Candidate {
        Candidate {
            version: Version { generation, revision },
            label: "etcd://h:2379/p/profile".into(),
            text: text.into(),
            hash: profile_hash(text),
        }
    }

    /// A follower enforcing generation 1, with channels the test drives in
    /// place of the watcher, in a scratch directory.
    fn follower(
        name: &str,
    ) -> (
        Follower,
        tokio::sync::watch::Sender<Fetched>,
        tokio::sync::watch::Receiver<Report>,
        PathBuf,
    ) {
        let root =
            std::env::temp_dir().join(format!("flowctl-follower-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let run = root.join("run");
        std::fs::create_dir_all(&run).unwrap();
        let url: EtcdUrl = "etcd://h:2379/p".parse().unwrap();
        let cfg = Config::new(
            url,
            Access::default(),
            Timing::default(),
            &root.join("cache"),
            None,
            "eth0",
        );
        let (tx, fetched) = tokio::sync::watch::channel(Fetched::default());
        let (reports, rx) = tokio::sync::watch::channel(Report::default());
        let handles = Handles { fetched, wake: Arc::new(Notify::new()), reports };
        let f = Follower::with(cfg, candidate(1, 2, GOOD), None, run, handles);
        (f, tx, rx, root)
    }

    fn offer(tx: &tokio::sync::watch::Sender<Fetched>, c: Result<Candidate, String>) {
        tx.send_modify(|f| f.latest = Some(c));
    }

    #[test]
    fn a_newer_good_profile_is_staged_applied_kept_on_disk_and_reported() {
        let (mut f, tx, rx, root) = follower("good");
        assert_eq!(f.take_newer(), None, "nothing new");
        assert_eq!(
            published(&f.run_dir).unwrap().applied,
            Some(Version { generation: 1, revision: 2 })
        );
        offer(&tx, Ok(candidate(2, 5, GOOD)));
        let staged = f.take_newer().expect("a newer profile");
        assert_eq!(std::fs::read_to_string(&staged).unwrap(), GOOD);
        f.outcome(Ok(()));
        assert!(!staged.exists(), "unstaged once applied");
        let p = published(&f.run_dir).unwrap();
        assert_eq!((p.applied, p.error), (Some(Version { generation: 2, revision: 5 }), None));
        assert_eq!(
            f.cfg.disk.load().unwrap().unwrap().version.generation,
            2,
            "the disk copy follows"
        );
        assert_eq!(rx.borrow().applied_generation, Some(2));
        assert_eq!(f.source(), "etcd://h:2379/p/profile (generation 2 at revision 5)");
        // The same version again (a relist): nothing to do.
        offer(&tx, Ok(candidate(2, 5, GOOD)));
        assert_eq!(f.take_newer(), None);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn bad_older_and_refused_profiles_are_rejected_whole_and_the_running_one_stays() {
        let (mut f, tx, rx, root) = follower("bad");
        offer(&tx, Ok(candidate(2, 5, BAD)));
        assert_eq!(f.take_newer(), None, "never staged");
        let p = published(&f.run_dir).unwrap();
        assert_eq!(p.applied.unwrap().generation, 1);
        let e = p.error.unwrap();
        assert!(
            e.starts_with("etcd://h:2379/p/profile:3:8:") && e.contains("greater than zero"),
            "{e}"
        );
        assert_eq!((p.rejected_total, p.latest.unwrap().generation), (1, 2));
        assert_eq!(rx.borrow().error.as_deref(), Some(e.as_str()), "reported too");
        // Rejected once: the same version again is not retried.
        offer(&tx, Ok(candidate(2, 5, BAD)));
        assert_eq!(f.take_newer(), None);
        assert_eq!(published(&f.run_dir).unwrap().rejected_total, 1);
        // An older version is never applied.
        offer(&tx, Ok(candidate(1, 9, GOOD)));
        assert_eq!(f.take_newer(), None);
        assert!(published(&f.run_dir).unwrap().error.unwrap().contains("older than"));
        // A host check refuses it: the apply's message, naming the key.
        offer(&tx, Ok(candidate(3, 7, GOOD)));
        let staged = f.take_newer().unwrap();
        f.outcome(Err(format!("{}: table sizes differ (nothing was applied)", staged.display())));
        let p = published(&f.run_dir).unwrap();
        assert_eq!(p.applied.unwrap().generation, 1);
        assert_eq!(
            p.error.as_deref(),
            Some("etcd://h:2379/p/profile: table sizes differ (nothing was applied)")
        );
        // The key gone: an error, the running profile stays.
        offer(&tx, Err("etcd://h:2379/p/profile: no profile there".into()));
        assert_eq!(f.take_newer(), None);
        assert!(published(&f.run_dir).unwrap().error.unwrap().contains("no profile there"));
        assert_eq!(
            f.cfg.disk.load().unwrap().unwrap().version.generation,
            1,
            "the disk copy stays"
        );
        f.stop();
        assert!(published(&f.run_dir).is_none(), "stop removes the published state");
        std::fs::remove_dir_all(root).unwrap();
    }
}
