//! The lease script in a real Redis: against the pure allocator, with
//! authentication, after a FLUSHALL, and across a hung server.

use crate::redis::{runtime, Redis, TlsRedis};
use flowctl::fleet::global::store::StoreConfig;
use flowctl::fleet::global::{
    allocator::{Cell, Item, Memory},
    host::{Batch, GrantSink, HostConfig, Manager},
    sim::Rng,
    store::{Health, Store, StoreError},
    GlobalRule, Grant, Micros, Share,
};
use flowctl_tests::pki::Pki;
use flowctl_tests::unique;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The cell as it stands at `now`: live entries (leases, or used quota
/// still in a window), a learning deadline still
/// ahead (Redis drops a cell's key a second after its last lease ends, the
/// in-memory store at its next call; both mean the same).
fn live(mut cell: Cell, now: Micros) -> Cell {
    cell.hosts.retain(|_, e| e.lives(now));
    if cell.learn_until <= now {
        cell.learn_until = 0;
    }
    cell
}

fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// Hundreds of random batches (hosts, keys, held shares true or made up,
/// demands, used quota, stale sequence numbers, pauses that let leases
/// end, a quota window longer than the lease, a FLUSHALL half way) through the script in Redis and through the pure
/// allocator at the script's own clock: the same replies and the same
/// cells, every step.
pub fn lease_script_agrees_with_allocator() {
    let redis = Redis::start(None, &[]);
    let rt = runtime();
    let mut store = redis.store();
    let mut rule = GlobalRule::new(&unique("diff"), 1000, 300);
    rule.quota = Some(5000);
    // Longer than the lease: entries linger with their used quota.
    rule.quota_window = 400_000;
    rule.lease = 250_000;
    rule.refresh = 50_000;
    let seed = seed();
    let mut rng = Rng::new(seed);
    let mut memory = Memory::default();
    let hosts = ["a", "b", "c", "d"];
    let keys = ["k0", "k1", "k2"];
    let mut seqs = [0u64; 4];
    let mut held: BTreeMap<(usize, &str), Share> = BTreeMap::new();
    let (mut learning, mut stale, mut granted, mut compared) = (0, 0, 0, 0);
    let mut lingered = 0;
    for step in 0..400u64 {
        if step == 200 {
            assert_eq!(redis.cli(&["FLUSHALL"]), "OK");
            memory.flush();
        }
        let h = rng.range(0, 3) as usize;
        seqs[h] += 1;
        let seq = match rng.chance(100_000) {
            true => seqs[h].saturating_sub(rng.range(1, 3)),
            false => seqs[h],
        };
        // The first item is a new cell: its reply's expiry gives the
        // script's clock.
        let mut items = vec![Item::new(&format!("probe{step}"), Share::ZERO, 1)];
        for k in keys {
            if !rng.chance(600_000) {
                continue;
            }
            let h_held = match rng.chance(100_000) {
                true => Share {
                    rate: rng.range(0, 1200),
                    burst: rng.range(0, 400),
                    quota: rng.range(0, 6000),
                },
                false => held.get(&(h, k)).copied().unwrap_or_default(),
            };
            let demand = match rng.range(0, 3) {
                0 => 0,
                _ => rng.range(1, 3000),
            };
            let used = match rng.range(0, 3) {
                0 => 0,
                _ => rng.range(1, 6000),
            };
            // Up to past the window (the store caps it there).
            let used_for = rng.range(0, 500_000);
            items.push(Item { key: k.to_string(), held: h_held, demand, used, used_for });
        }
        let batch =
            Batch { rule: rule.name.clone(), host: hosts[h].into(), seq, sent_at: 0, items };
        let ran = Instant::now();
        let got = rt.block_on(store.run(&rule, &batch)).expect("batch");
        let now = got.replies[0].expires - rule.lease;
        let want = memory.run_batch(&batch.call(&rule, &got.epoch), now);
        assert_eq!(got, want, "step {step} (seed {seed}): {batch:?}");
        for (Item { key, .. }, reply) in batch.items.iter().zip(&got.replies).skip(1) {
            let in_redis = rt.block_on(store.cell(&rule.name, key)).expect("cell");
            lingered +=
                in_redis.hosts.values().filter(|e| e.expires <= now && e.lives(now)).count();
            // Redis drops a cell's key a second after its last lease; a
            // test stalled that long (a loaded machine) reads after the
            // cell is rightly gone, so that step's cells are not compared.
            if ran.elapsed() < Duration::from_millis(900) {
                assert_eq!(
                    live(in_redis, now),
                    live(memory.cell(&rule.name, key), now),
                    "step {step} (seed {seed}) cell {key}"
                );
                compared += 1;
            }
            learning += reply.learning as u32;
            stale += !reply.fresh as u32;
            granted += (reply.grant.rate > 0) as u32;
            if reply.fresh {
                held.insert((h, keys.iter().find(|k| **k == key).expect("key")), reply.grant);
            }
        }
        if rng.chance(300_000) {
            std::thread::sleep(Duration::from_millis(rng.range(1, 60)));
        }
    }
    // A cell with more hosts than one HSET chunk (the script writes 100
    // hosts a call), with leases long enough that all 250 stay.
    let mut rule = rule.clone();
    rule.name = unique("big");
    rule.lease = 30_000_000;
    for i in 0..250u64 {
        let items = vec![
            Item::new(&format!("probe-big{i}"), Share::ZERO, 1),
            Item::new("big", Share::ZERO, 1 + i),
        ];
        let batch =
            Batch { rule: rule.name.clone(), host: format!("b{i}"), seq: 1, sent_at: 0, items };
        let got = rt.block_on(store.run(&rule, &batch)).expect("batch");
        let now = got.replies[0].expires - rule.lease;
        assert_eq!(
            got,
            memory.run_batch(&batch.call(&rule, &got.epoch), now),
            "big cell, host {i}"
        );
        if i % 50 == 49 {
            let in_redis = rt.block_on(store.cell(&rule.name, "big")).expect("cell");
            assert_eq!(in_redis.hosts.len() as u64, i + 1);
            assert_eq!(
                live(in_redis, now),
                live(memory.cell(&rule.name, "big"), now),
                "big cell at {i}"
            );
        }
    }
    assert!(compared > 300, "only {compared} cells compared (a stalled machine?)");
    // The random walk covered every branch.
    assert!(
        learning > 0 && stale > 0 && granted > 20 && lingered > 0,
        "learning {learning} stale {stale} granted {granted} lingered {lingered}"
    );
}

/// AUTH: a wrong password and a missing one are refused with an error that
/// says so; the right one works; so does an ACL user, by config and by URL.
/// And the heartbeats' live-host count.
pub fn redis_auth_password_and_acl_user() {
    let redis =
        Redis::start(Some("s3cret-pw"), &["--user", "flowuser", "on", ">flow-pw", "~*", "+@all"]);
    let rt = runtime();
    let rule = GlobalRule::new(&unique("auth"), 100, 10);
    let refused = |cfg| {
        let e = rt.block_on(Store::new(cfg).expect("config").connect()).expect_err("refused");
        assert!(matches!(e, StoreError::Auth { .. }), "{e:?}");
        assert!(e.to_string().contains("authentication refused"), "{e}");
    };
    let mut wrong = redis.config();
    wrong.password = Some("wrong".into());
    refused(wrong);
    let mut none = redis.config();
    none.password = None;
    refused(none);
    let mut acl_wrong = redis.config();
    acl_wrong.username = Some("flowuser".into());
    acl_wrong.password = Some("s3cret-pw".into());
    refused(acl_wrong);

    let mut store = redis.store();
    rt.block_on(store.connect()).expect("the right password");
    let epoch = rt.block_on(store.bootstrap(&rule)).expect("bootstrap");
    assert!(matches!(store.health(), Health::Ok { .. }), "{:?}", store.health());

    let mut acl = redis.config();
    acl.username = Some("flowuser".into());
    acl.password = Some("flow-pw".into());
    acl.prefix = store_prefix(&redis, &store);
    let mut as_user = Store::new(acl).expect("config");
    assert_eq!(rt.block_on(as_user.bootstrap(&rule)).expect("ACL user"), epoch);

    // Heartbeats: the live-host count, and a host that stops beating
    // drops out after its TTL.
    let ttl = Duration::from_millis(400);
    assert_eq!(rt.block_on(store.heartbeat("h1", ttl)).expect("heartbeat"), 1);
    assert_eq!(rt.block_on(store.heartbeat("h2", ttl)).expect("heartbeat"), 2);
    assert_eq!(rt.block_on(store.heartbeat("h1", ttl)).expect("heartbeat"), 2);
    std::thread::sleep(ttl + Duration::from_millis(100));
    assert_eq!(rt.block_on(store.heartbeat("h3", ttl)).expect("heartbeat"), 1);
    assert!(store.rtt().is_some_and(|r| r < Duration::from_secs(2)), "{:?}", store.rtt());

    let mut by_url = redis.config();
    by_url.url = format!("{}?user=flowuser&pass=flow-pw", redis.url());
    by_url.password = None;
    rt.block_on(Store::new(by_url).expect("config").connect()).expect("ACL user in the URL");
}

/// The prefix a store was configured with (the meta key's first part).
fn store_prefix(_redis: &Redis, store: &Store) -> String {
    store.meta_key("x").trim_end_matches(":{x}:meta").to_string()
}

/// The tests' sink: what each key enforces.
#[derive(Default)]
struct Sink(BTreeMap<String, Share>);

impl GrantSink for Sink {
    fn apply(&mut self, _rule: &str, key: &str, grant: &Grant) {
        self.0.insert(key.to_string(), grant.share);
    }
    fn revoke(&mut self, _rule: &str, key: &str) {
        self.0.remove(key);
    }
}

/// A host: its manager, its sink, its own connection, an offered counter.
struct Agent {
    manager: Manager,
    sink: Sink,
    store: Store,
    offered: u64,
    rate: u64,
}

impl Agent {
    fn new(redis: &Redis, prefix: &str, rule: &GlobalRule, rate: u64, timeout: Duration) -> Self {
        let host_timeout = timeout.as_micros() as Micros + 100_000;
        let config = HostConfig { host: unique("host-"), max_keys: 16, timeout: host_timeout };
        let mut manager = Manager::new(config);
        manager.set_rule(rule.clone());
        let mut cfg = redis.config();
        cfg.prefix = prefix.to_string();
        cfg.timeout = timeout;
        Self {
            manager,
            sink: Sink::default(),
            store: Store::new(cfg).expect("config"),
            offered: 0,
            rate,
        }
    }

    /// One tick at `now`: traffic, then whatever batches are due.
    fn tick(
        &mut self,
        rt: &tokio::runtime::Runtime,
        rule: &GlobalRule,
        now: Micros,
        dt: Micros,
    ) -> Vec<Result<bool, StoreError>> {
        self.offered += self.rate * dt / 1_000_000;
        self.manager.note_hot(&rule.name, "k", now);
        self.manager.observe(&rule.name, "k", self.offered, now);
        let mut out = Vec::new();
        for b in self.manager.poll(now, &mut self.sink) {
            match rt.block_on(self.store.run(rule, &b)) {
                Ok(r) => {
                    self.manager.on_reply(&b.rule, b.seq, &r, now, &mut self.sink);
                    out.push(Ok(r.replies.iter().any(|r| r.learning)));
                }
                Err(e) => {
                    self.manager.on_failure(&b.rule, b.seq, now);
                    out.push(Err(e));
                }
            }
        }
        out
    }

    fn rate(&self) -> u64 {
        self.sink.0.get("k").map_or(0, |s| s.rate)
    }
}

fn enforced(agents: &[Agent]) -> Share {
    agents.iter().filter_map(|a| a.sink.0.get("k")).fold(Share::ZERO, |s, x| Share {
        rate: s.rate + x.rate,
        burst: s.burst + x.burst,
        quota: s.quota + x.quota,
    })
}

/// Three hosts share one key against a real Redis; FLUSHALL half way: the
/// store's new epoch is seen, the cells learn for one lease (no host's
/// grant rises meanwhile), the grants never sum above L or B, and they
/// converge again after it.
pub fn flushall_learns_and_keeps_the_bound() {
    let redis = Redis::start(None, &[]);
    let rt = runtime();
    let prefix = unique("flowctl-test-");
    let mut rule = GlobalRule::new(&unique("flush"), 1000, 100);
    rule.lease = 1_000_000;
    rule.refresh = 100_000;
    let timeout = Duration::from_secs(2);
    let mut boot = Agent::new(&redis, &prefix, &rule, 0, timeout);
    rt.block_on(boot.store.bootstrap(&rule)).expect("bootstrap");
    let mut agents: Vec<Agent> =
        [600, 300, 900].iter().map(|&r| Agent::new(&redis, &prefix, &rule, r, timeout)).collect();
    let start = Instant::now();
    let dt = 20_000;
    let flush_at = 2_500_000;
    let (mut flushed, mut saw_learning, mut before) = (false, false, vec![0; 3]);
    loop {
        let now = start.elapsed().as_micros() as Micros;
        // Converged after learning, or given up (asserted below).
        let converged = enforced(&agents).rate >= 900 && now > flush_at + 2 * rule.lease;
        if converged || now > flush_at + 10_000_000 {
            break;
        }
        if !flushed && now >= flush_at {
            assert_eq!(redis.cli(&["FLUSHALL"]), "OK");
            flushed = true;
        }
        for (i, a) in agents.iter_mut().enumerate() {
            let prev = a.rate();
            for r in a.tick(&rt, &rule, now, dt) {
                let learning = r.expect("batch");
                if flushed && learning {
                    saw_learning = true;
                    assert!(
                        a.rate() <= prev,
                        "host {i} rose from {prev} to {} while learning",
                        a.rate()
                    );
                    assert!(
                        matches!(a.store.health(), Health::EpochChanged { .. }),
                        "{:?}",
                        a.store.health()
                    );
                }
            }
            if !flushed {
                before[i] = a.rate();
            }
        }
        let e = enforced(&agents);
        assert!(e.rate <= rule.rate && e.burst <= rule.burst, "{e:?} at {now} us");
        std::thread::sleep(Duration::from_micros(dt));
    }
    assert!(saw_learning, "no learning reply after FLUSHALL");
    assert!(before.iter().sum::<u64>() >= 900, "not converged before the flush: {before:?}");
    let after = enforced(&agents);
    assert!(after.rate >= 900, "not converged after learning: {after:?}");
    for a in &agents {
        assert!(matches!(a.store.health(), Health::Ok { .. }), "{:?}", a.store.health());
    }
}

/// SIGSTOP of the server: the next batch fails within the client's
/// deadline, the store shows unreachable, the grant stays as it was (no
/// rate rises without a reply); SIGCONT: the next batch succeeds and the
/// store is healthy again.
pub fn sigstop_is_detected_and_grants_are_kept() {
    let redis = Redis::start(None, &[]);
    let rt = runtime();
    let prefix = unique("flowctl-test-");
    let mut rule = GlobalRule::new(&unique("stop"), 1000, 100);
    rule.lease = 5_000_000;
    rule.refresh = 200_000;
    // A short deadline: the outage must show within it.
    let timeout = Duration::from_millis(400);
    let mut a = Agent::new(&redis, &prefix, &rule, 500, timeout);
    rt.block_on(a.store.bootstrap(&rule)).expect("bootstrap");
    // Past the new store's learning lease: a real grant.
    std::thread::sleep(Duration::from_micros(rule.lease));
    let start = Instant::now();
    let clock = || start.elapsed().as_micros() as Micros;
    while a.rate() == 0 {
        assert!(clock() < 2_000_000, "no grant");
        a.tick(&rt, &rule, clock(), 20_000);
        std::thread::sleep(Duration::from_millis(20));
    }
    let held = a.rate();
    redis.server.pause();
    let paused = clock();
    let mut failures = 0;
    while clock() < paused + 1_500_000 {
        let before = Instant::now();
        for r in a.tick(&rt, &rule, clock(), 20_000) {
            let e = r.expect_err("a stopped server answers nothing");
            assert!(e.is_unreachable(), "{e:?}");
            assert!(
                before.elapsed() < Duration::from_millis(300 + 300),
                "detected after {:?}",
                before.elapsed()
            );
            failures += 1;
        }
        assert!(
            matches!(a.store.health(), Health::Unreachable { .. }) || failures == 0,
            "{:?}",
            a.store.health()
        );
        assert!(a.rate() <= held, "rose to {} without the store", a.rate());
        assert!(a.rate() > 0, "the grant was dropped before its lease ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(failures >= 2, "{failures} failed batches in 1.5 s");
    redis.server.resume();
    let resumed = clock();
    loop {
        let oks = a.tick(&rt, &rule, clock(), 20_000).into_iter().filter(|r| r.is_ok()).count();
        if oks > 0 && matches!(a.store.health(), Health::Ok { .. }) {
            break;
        }
        assert!(clock() < resumed + 2_000_000, "not recovered: {:?}", a.store.health());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(a.rate() > 0);
}

/// TLS (`rediss://`) to a Redis that asks for client certificates: with
/// the test CA, this host's certificate and key, and the password the lease
/// script runs; without a client certificate the handshake is refused, so
/// is it without the CA (the system's roots), each with an error that
/// names the server, and a wrong password over TLS is refused as such.
pub fn redis_over_tls() {
    let pki = Pki::new(&["127.0.0.1"]);
    let redis = TlsRedis::start(&pki, "tls-pw");
    let url = format!("rediss://127.0.0.1:{}/", redis.port);
    let ca = pki.file("ca.crt");
    let client = (PathBuf::from(pki.file("client.crt")), PathBuf::from(pki.file("client.key")));
    // The client connects from inside the server's namespace.
    let outcome = flowctl_tests::lab::Lab::in_ns(&redis.ns.0, move || {
        let rt = runtime();
        let config = |ca: Option<&str>, cert: bool, password: &str| {
            let mut cfg = StoreConfig::new(&url);
            cfg.ca_file = ca.map(PathBuf::from);
            cfg.client_cert = cert.then(|| client.clone());
            cfg.password = Some(password.to_string());
            cfg.timeout = Duration::from_secs(2);
            cfg
        };
        let connect = |cfg| rt.block_on(Store::new(cfg).expect("config").connect());
        let rule = GlobalRule::new(&unique("tls"), 100, 10);
        let mut store = Store::new(config(Some(&ca), true, "tls-pw")).expect("config");
        let epoch = rt.block_on(store.bootstrap(&rule)).map_err(|e| e.to_string());
        let no_cert = connect(config(Some(&ca), false, "tls-pw"));
        let no_ca = connect(config(None, true, "tls-pw"));
        let wrong = connect(config(Some(&ca), true, "nope"));
        (
            epoch,
            no_cert.map_err(|e| e.to_string()),
            no_ca.map_err(|e| e.to_string()),
            wrong.map_err(|e| (matches!(e, StoreError::Auth { .. }), e.to_string())),
        )
    });
    let (epoch, no_cert, no_ca, wrong) = outcome;
    assert!(epoch.is_ok(), "over mutual TLS: {epoch:?}");
    let e = no_cert.expect_err("no client certificate is refused");
    println!("without a client certificate: {e}");
    assert!(e.contains("127.0.0.1"), "{e}");
    let e = no_ca.expect_err("an unknown CA is refused");
    assert!(e.contains("127.0.0.1"), "{e}");
    let (auth, e) = wrong.expect_err("a wrong password is refused over TLS");
    assert!(auth && e.contains("authentication refused"), "{e}");
}
