//! The Redis side of the leases: connecting (by URL, with AUTH by password
//! or ACL user, TLS with the system's roots or a given CA and client
//! certificate), loading `lease.lua` (EVALSHA, loaded on NOSCRIPT), running
//! a host's batch, creating a rule's epoch, heartbeats for the live-host
//! count, the round-trip time, and the store's health as this agent sees
//! it. Every call has a deadline; a call that misses it drops the
//! connection (the next call reconnects) and marks the store unreachable.
//!
//! Key names (one `{hash tag}` per rule, so a rule's batch is one slot in a
//! cluster): `PREFIX:{RULE}:meta` (the rule's epoch and learning deadline),
//! `PREFIX:{RULE}:cell:KEY` (a cell), `PREFIX:hosts` (heartbeats).

use super::allocator::{BatchReply, Cell, Reply};
use super::host::Batch;
use super::{GlobalRule, Share};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, IntoConnectionInfo, RedisError, Script, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The lease allocator, run atomically in Redis.
pub const LEASE_SCRIPT: &str = include_str!("lease.lua");

/// A host's heartbeat: a member of one sorted set scored with its deadline
/// (Redis clock, ms), so the live-host count is one ZCARD after the dead
/// are dropped, with no scan of the keyspace. The set itself expires when
/// every host stopped.
const HEARTBEAT_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return redis.call('ZCARD', KEYS[1])
";

/// How to reach the store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// `redis://[user:password@]host:port`, `rediss://...` (TLS),
    /// `redis+unix:///path?user=U&pass=P`.
    pub url: String,
    /// Override the URL's user (an ACL user) and password.
    pub username: Option<String>,
    pub password: Option<String>,
    /// PEM roots to trust instead of the system's (rediss only).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and key (rediss with client authentication).
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// Prefix of every key flowctl writes.
    pub prefix: String,
    /// Deadline of every call (connecting included).
    pub timeout: Duration,
}

impl StoreConfig {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            username: None,
            password: None,
            ca_file: None,
            client_cert: None,
            prefix: "flowctl".to_string(),
            timeout: Duration::from_millis(500),
        }
    }
}

/// What went wrong, with the store's address (never its password).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis URL: {0}")]
    Url(String),
    #[error("reading {path}: {source}")]
    File { path: PathBuf, source: std::io::Error },
    #[error("redis at {addr}: authentication refused ({detail}); check the password, or the ACL user and its rights (it needs EVALSHA, SCRIPT, HGET/HSET and the sorted-set commands on the prefix's keys)")]
    Auth { addr: String, detail: String },
    #[error("redis at {addr}: no answer within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("redis at {addr}: unreachable: {detail}")]
    Unreachable { addr: String, detail: String },
    #[error("redis at {addr}: {detail}")]
    Server { addr: String, detail: String },
    #[error("redis at {addr}: unexpected reply to the lease script: {detail}")]
    Reply { addr: String, detail: String },
}

impl StoreError {
    /// Whether the store could not be reached at all (as opposed to
    /// answering with an error).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, StoreError::Timeout { .. } | StoreError::Unreachable { .. })
    }
}

/// The store as this agent sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Nothing asked yet.
    Unknown,
    Ok {
        since: Instant,
    },
    /// No answer since `since` (the first failed call).
    Unreachable {
        since: Instant,
        error: String,
    },
    /// A rule's epoch changed (Redis lost its state: flushed, restarted
    /// without persistence, failed over): its cells learn for one lease.
    /// Stays until a reply no longer says learning.
    EpochChanged {
        at: Instant,
        rule: String,
    },
}

/// A connection to the store.
pub struct Store {
    cfg: StoreConfig,
    client: Client,
    addr: String,
    conn: Option<MultiplexedConnection>,
    lease: Script,
    heartbeat: Script,
    health: Health,
    rtt: Option<Duration>,
    epochs: std::collections::BTreeMap<String, String>,
}

impl Store {
    /// Parses the URL and reads the TLS files; connects on first use.
    pub fn new(cfg: StoreConfig) -> Result<Self, StoreError> {
        let mut info =
            cfg.url.as_str().into_connection_info().map_err(|e| StoreError::Url(e.to_string()))?;
        let mut settings = info.redis_settings().clone();
        if let Some(u) = &cfg.username {
            settings = settings.set_username(u);
        }
        if let Some(p) = &cfg.password {
            settings = settings.set_password(p);
        }
        info = info.set_redis_settings(settings);
        let addr = info.addr().to_string();
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|source| StoreError::File { path: path.clone(), source })
        };
        let client = match (&cfg.ca_file, &cfg.client_cert) {
            (None, None) => Client::open(info),
            (ca, cert) => {
                let root_cert = ca.as_ref().map(read).transpose()?;
                let client_tls = match cert {
                    Some((c, k)) => {
                        Some(redis::ClientTlsConfig { client_cert: read(c)?, client_key: read(k)? })
                    }
                    None => None,
                };
                Client::build_with_tls(info, redis::TlsCertificates { client_tls, root_cert })
            }
        }
        .map_err(|e| StoreError::Url(e.to_string()))?;
        Ok(Self {
            cfg,
            client,
            addr,
            conn: None,
            lease: Script::new(LEASE_SCRIPT),
            heartbeat: Script::new(HEARTBEAT_SCRIPT),
            health: Health::Unknown,
            rtt: None,
            epochs: Default::default(),
        })
    }

    pub fn health(&self) -> &Health {
        &self.health
    }

    /// The last successful call's round trip.
    pub fn rtt(&self) -> Option<Duration> {
        self.rtt
    }

    /// The address, for messages.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn meta_key(&self, rule: &str) -> String {
        format!("{}:{{{rule}}}:meta", self.cfg.prefix)
    }

    pub fn cell_key(&self, rule: &str, key: &str) -> String {
        format!("{}:{{{rule}}}:cell:{key}", self.cfg.prefix)
    }

    pub fn hosts_key(&self) -> String {
        format!("{}:hosts", self.cfg.prefix)
    }

    fn classify(&self, e: RedisError) -> StoreError {
        let addr = self.addr.clone();
        let auth = matches!(e.kind(), redis::ErrorKind::AuthenticationFailed)
            || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"));
        if auth {
            return StoreError::Auth { addr, detail: e.to_string() };
        }
        if e.is_timeout() {
            return StoreError::Timeout { addr, timeout: self.cfg.timeout };
        }
        if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
            return StoreError::Unreachable { addr, detail: e.to_string() };
        }
        StoreError::Server { addr, detail: e.to_string() }
    }

    /// Records a call's outcome in the health and drops a connection that
    /// failed to answer.
    fn record<T>(&mut self, started: Instant, r: Result<T, StoreError>) -> Result<T, StoreError> {
        match &r {
            Ok(_) => {
                self.rtt = Some(started.elapsed());
                if !matches!(self.health, Health::Ok { .. } | Health::EpochChanged { .. }) {
                    self.health = Health::Ok { since: Instant::now() };
                }
            }
            Err(e) if e.is_unreachable() => {
                self.conn = None;
                if !matches!(self.health, Health::Unreachable { .. }) {
                    self.health = Health::Unreachable { since: started, error: e.to_string() };
                }
            }
            Err(e @ StoreError::Auth { .. }) => {
                self.conn = None;
                self.health = Health::Unreachable { since: started, error: e.to_string() };
            }
            Err(_) => {}
        }
        r
    }

    async fn connection(&mut self) -> Result<MultiplexedConnection, StoreError> {
        if let Some(c) = &self.conn {
            return Ok(c.clone());
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.cfg.timeout))
            .set_response_timeout(Some(self.cfg.timeout));
        let connect = self.client.get_multiplexed_async_connection_with_config(&config);
        let c = match tokio::time::timeout(self.cfg.timeout, connect).await {
            Ok(r) => r.map_err(|e| self.classify(e))?,
            Err(_) => {
                return Err(StoreError::Timeout {
                    addr: self.addr.clone(),
                    timeout: self.cfg.timeout,
                })
            }
        };
        self.conn = Some(c.clone());
        Ok(c)
    }

    async fn call<T: redis::FromRedisValue>(
        &mut self,
        cmd: impl FnOnce(MultiplexedConnection) -> redis::RedisFuture<'static, T>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let r = async {
            let conn = self.connection().await?;
            match tokio::time::timeout(self.cfg.timeout, cmd(conn)).await {
                Ok(r) => r.map_err(|e| self.classify(e)),
                Err(_) => {
                    Err(StoreError::Timeout { addr: self.addr.clone(), timeout: self.cfg.timeout })
                }
            }
        }
        .await;
        self.record(started, r)
    }

    /// Connects (AUTH included) and checks with a PING: the round trip.
    pub async fn connect(&mut self) -> Result<Duration, StoreError> {
        self.conn = None;
        self.call(|mut c| {
            Box::pin(async move { redis::cmd("PING").query_async::<String>(&mut c).await })
        })
        .await?;
        Ok(self.rtt.unwrap_or_default())
    }

    /// Creates the rule's record if it is missing (a new epoch, learning
    /// for one lease) and loads the script: an empty batch. Returns the
    /// epoch.
    pub async fn bootstrap(&mut self, rule: &GlobalRule) -> Result<String, StoreError> {
        let batch = Batch {
            rule: rule.name.clone(),
            host: String::new(),
            seq: 0,
            sent_at: 0,
            items: vec![],
        };
        Ok(self.run(rule, &batch).await?.epoch)
    }

    /// One batch: one EVALSHA of the lease script.
    pub async fn run(
        &mut self,
        rule: &GlobalRule,
        batch: &Batch,
    ) -> Result<BatchReply, StoreError> {
        let mut keys = vec![self.meta_key(&rule.name)];
        keys.extend(batch.items.iter().map(|it| self.cell_key(&rule.name, &it.key)));
        let limits = super::allocator::Limits::from(rule);
        let mut args: Vec<String> = [limits.rate, limits.burst, limits.quota, limits.lease]
            .iter()
            .map(u64::to_string)
            .collect();
        args.extend([fresh_epoch(), batch.host.clone(), batch.seq.to_string()]);
        args.push(limits.quota_window.to_string());
        for it in &batch.items {
            let h = it.held;
            let v = [h.rate, h.burst, h.quota, it.demand, it.used, it.used_for];
            args.extend(v.iter().map(u64::to_string));
        }
        let raw: Vec<Value> = self.invoke(self.lease.clone(), keys, args).await?;
        let reply = parse_reply(&raw, batch.items.len())
            .map_err(|detail| StoreError::Reply { addr: self.addr.clone(), detail })?;
        self.note_epoch(&rule.name, &reply);
        Ok(reply)
    }

    fn note_epoch(&mut self, rule: &str, reply: &BatchReply) {
        let learning = reply.replies.iter().any(|r| r.learning);
        let changed = self.epochs.get(rule).is_some_and(|e| *e != reply.epoch);
        self.epochs.insert(rule.to_string(), reply.epoch.clone());
        if changed {
            self.health = Health::EpochChanged { at: Instant::now(), rule: rule.to_string() };
        } else if matches!(&self.health, Health::EpochChanged { rule: r, .. } if r == rule)
            && !learning
        {
            self.health = Health::Ok { since: Instant::now() };
        }
    }

    /// This host is alive for `ttl`; returns the live-host count N.
    pub async fn heartbeat(&mut self, host: &str, ttl: Duration) -> Result<u64, StoreError> {
        let args = vec![host.to_string(), ttl.as_millis().to_string()];
        self.invoke(self.heartbeat.clone(), vec![self.hosts_key()], args).await
    }

    /// EVALSHA, and SCRIPT LOAD then EVALSHA again when Redis does not
    /// have the script (a restart, a flush of the script cache).
    async fn invoke<T: redis::FromRedisValue + Send + 'static>(
        &mut self,
        script: Script,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<T, StoreError> {
        self.call(move |mut c| {
            Box::pin(async move {
                let mut inv = script.prepare_invoke();
                for k in &keys {
                    inv.key(k);
                }
                for a in &args {
                    inv.arg(a);
                }
                inv.invoke_async(&mut c).await
            })
        })
        .await
    }

    /// A cell as stored (empty when absent): for `status` and the tests.
    pub async fn cell(&mut self, rule: &str, key: &str) -> Result<Cell, StoreError> {
        let name = self.cell_key(rule, key);
        let fields: Vec<(String, String)> = self
            .call(move |mut c| {
                Box::pin(async move { redis::cmd("HGETALL").arg(name).query_async(&mut c).await })
            })
            .await?;
        Cell::from_fields(fields.iter().map(|(f, v)| (f.as_str(), v.as_str()))).ok_or_else(|| {
            StoreError::Reply {
                addr: self.addr.clone(),
                detail: "a cell field does not parse".into(),
            }
        })
    }
}

/// A random epoch candidate (used only when a rule's record is missing).
fn fresh_epoch() -> String {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS's randomness per process; the time
    // and a counter make every candidate differ.
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// `{epoch, then 7 integers per cell}`.
fn parse_reply(raw: &[Value], cells: usize) -> Result<BatchReply, String> {
    let int = |v: &Value| match v {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        other => Err(format!("expected a non-negative integer, got {other:?}")),
    };
    let epoch = match raw.first() {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::SimpleString(s)) => s.clone(),
        other => return Err(format!("expected the epoch first, got {other:?}")),
    };
    if raw.len() != 1 + 7 * cells {
        return Err(format!("{} values for {cells} cells", raw.len()));
    }
    let mut replies = Vec::with_capacity(cells);
    for c in raw[1..].chunks(7) {
        let v: Vec<u64> = c.iter().map(int).collect::<Result<_, _>>()?;
        replies.push(Reply {
            fresh: v[0] == 1,
            grant: Share { rate: v[1], burst: v[2], quota: v[3] },
            target: v[4],
            expires: v[5],
            learning: v[6] == 1,
        });
    }
    Ok(BatchReply { epoch, replies })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse() {
        let raw = vec![
            Value::BulkString(b"abc".to_vec()),
            Value::Int(1),
            Value::Int(10),
            Value::Int(2),
            Value::Int(0),
            Value::Int(12),
            Value::Int(99),
            Value::Int(0),
        ];
        let r = parse_reply(&raw, 1).unwrap();
        assert_eq!(r.epoch, "abc");
        assert_eq!(r.replies[0].grant, Share { rate: 10, burst: 2, quota: 0 });
        assert!(r.replies[0].fresh && !r.replies[0].learning);
        assert!(parse_reply(&raw, 2).is_err());
    }

    #[test]
    fn key_names_share_the_rules_hash_tag() {
        let s = Store::new(StoreConfig::new("redis://127.0.0.1:1/")).unwrap();
        assert_eq!(s.meta_key("web"), "flowctl:{web}:meta");
        assert_eq!(s.cell_key("web", "10.0.0.1"), "flowctl:{web}:cell:10.0.0.1");
        assert_eq!(s.addr(), "127.0.0.1:1");
    }

    #[test]
    fn a_bad_url_is_refused_clearly() {
        let e = Store::new(StoreConfig::new("http://nope")).err().unwrap();
        assert!(e.to_string().starts_with("redis URL"), "{e}");
    }

    #[test]
    fn epoch_candidates_differ() {
        assert_ne!(fresh_epoch(), fresh_epoch());
    }
}
