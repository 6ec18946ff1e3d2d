//! A simulated fleet in one process on a virtual clock: the pure allocator
//! ([`Memory`]) standing in for Redis, and on every host, on its own
//! skewed clock, the agent's own lease loop ([`HostLoop`]: hot-key intake,
//! counter reads every refresh/8, the grant sink, the settle hold after a
//! cut) over a model of the kernel's global stage ([`FakeMap`]: a GCRA
//! bucket per key re-rated with [`flowctl_common::gcra::retarget`], whose
//! cached grant is re-read at most every `grant::REFRESH_NS`, so a written
//! grant takes effect at the bucket's next re-read; hot keys reported as
//! the kernel reports them). Messages have one-way delays and losses; the
//! agent takes the store's replies at its next tick. It measures what
//! docs/design.md ("Global limits: the bounds") states: the worst window's
//! admitted total against `L*t + B`, what the kernels enforce against what
//! the store reserves (and whether any cut was acknowledged before its
//! kernel enforced it), the time for a moved hot key to converge,
//! utilisation and store calls per host per second. The property tests and
//! `cargo xtask bench fleet` ([`report`]) run it.

use super::allocator::{BatchReply, Limits, Memory};
use super::bucket;
use super::host::{Batch, HostConfig};
use super::hostloop::{units_per_second, HostLoop, HotReport, KeyBackend};
use super::{GlobalRule, Micros, Share};
use flowctl_common::{gcra, grant, GlobalBucket, GrantValue};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

/// The one key the simulated fleet shares.
pub const KEY: &str = "k";

/// Who offers traffic for [`KEY`], in units per second fleet-wide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Load {
    /// Every host offers `total / hosts`.
    Uniform { total: u64 },
    /// Hosts 0..carriers offer `total / carriers`, the others nothing.
    Carriers { carriers: usize, total: u64 },
    /// Host `from` offers `total` until `at`, then host `to` does.
    Move { from: usize, to: usize, at: Micros, total: u64 },
    /// Host i offers `rate` in [start, stop) (hosts joining and leaving).
    Schedule(Vec<(Micros, Micros, u64)>),
}

impl Load {
    fn offered(&self, host: usize, hosts: usize, now: Micros) -> u64 {
        match *self {
            Load::Uniform { total } => total / hosts as u64,
            Load::Carriers { carriers, total } if host < carriers => total / carriers as u64,
            Load::Carriers { .. } => 0,
            Load::Move { from, at, total, .. } if now < at && host == from => total,
            Load::Move { to, at, total, .. } if now >= at && host == to => total,
            Load::Move { .. } => 0,
            Load::Schedule(ref v) => match v.get(host) {
                Some(&(start, stop, rate)) if now >= start && now < stop => rate,
                _ => 0,
            },
        }
    }
}

/// A simulation's settings.
#[derive(Clone, Debug)]
pub struct Config {
    pub hosts: usize,
    pub rule: GlobalRule,
    pub load: Load,
    pub duration: Micros,
    /// Traffic, buckets and timers advance in steps of this.
    pub step: Micros,
    /// One-way message delay, uniform in this range.
    pub delay: (Micros, Micros),
    /// Each message is lost with this probability (ppm).
    pub loss_ppm: u64,
    /// Each host's clock runs at a rate within +-this of the store's (ppm).
    pub skew_ppm: u64,
    /// FLUSHALL at this time.
    pub flush_at: Option<Micros>,
    /// The store is unreachable (every message lost) in [start, end).
    pub outage: Option<(Micros, Micros)>,
    /// (host, from): the host's messages are all lost from then on (a host
    /// cut off from the store; it keeps enforcing until its leases end).
    pub cut: Vec<(usize, Micros)>,
    pub seed: u64,
}

impl Config {
    /// 200 hosts, L = 20,000/s, B = 2,000, the load at twice L, refresh
    /// 1 s, lease 10 s, delays 0.5-2.5 ms, 1% loss, skew 500 ppm, 30 s.
    pub fn fleet(load: Load) -> Self {
        let mut rule = GlobalRule::new("sim", 20_000, 2_000);
        rule.epsilon_ppm = 1_000;
        Self {
            hosts: 200,
            rule,
            load,
            duration: 30_000_000,
            step: 10_000,
            delay: (500, 2_500),
            loss_ppm: 10_000,
            skew_ppm: 500,
            flush_at: None,
            outage: None,
            cut: Vec::new(),
            seed: 1,
        }
    }

    /// The worst round trip.
    pub fn rtt(&self) -> Micros {
        2 * self.delay.1
    }
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Per window length t: the worst window's admitted total over
    /// `L*(1+eps)*t + B + allowances` (the bound; at most 1 when it holds).
    pub worst: Vec<(Micros, f64)>,
    /// The largest sum of enforced lease rates over L, at any step.
    pub max_enforced: f64,
    /// The largest sum of the store's reservations over L, at any step.
    pub max_reserved: f64,
    /// Admitted over min(offered, L*t) after the first refresh.
    pub utilisation: f64,
    /// Load::Move: from the move until the new host enforces 90% of its
    /// fair share.
    pub converge: Option<Micros>,
    /// Store calls per host per second, over all hosts and over the hosts
    /// that carried the key.
    pub ops_per_host_s: f64,
    pub ops_per_active_host_s: f64,
    pub admitted: u64,
    pub offered: u64,
    /// A host enforced a lease the store no longer reserved for it.
    pub outlived_store: u64,
    /// Requests that reached the store reporting less than their host's
    /// kernel enforced ([`Fleet::acked_before_enforced`]).
    pub acked_before_enforced: u64,
    /// Acknowledgements of a cut ([`Fleet::cuts_acked`]).
    pub cuts_acked: u64,
}

/// A small deterministic generator (SplitMix64): the simulator must be
/// reproducible from its seed and lives outside the test-only crates.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability ppm / 1e6.
    pub fn chance(&mut self, ppm: u64) -> bool {
        self.next_u64() % 1_000_000 < ppm
    }
}

/// A host's kernel for the simulated rule, as the global stage runs it
/// (flowctl-ebpf/src/stages/global.rs): the grants the agent writes
/// (`FLOWCTL_GRANTS`: the word, the quota share, the lease's end) and a
/// bucket per key (`GlobalBucket`) with its cached copy of the grant,
/// re-read from the map only when it is older than `grant::REFRESH_NS` or
/// its lease has ended, so a written grant takes effect at the bucket's
/// next re-read, not at once; re-rated from the old word's parameters to
/// the new one's with `gcra::retarget`. Each packet adds to the key's
/// offered count; a refused packet reports its key hot, and so does an
/// unleased key past half its default burst, each at most every
/// `grant::HOT_EVERY_NS`. Not modelled: quotas (the simulated rule has
/// none), the TAT's debt mark and remembered debt (a new bucket starts
/// full, as one whose key never owed anything does), and other CPUs.
#[derive(Clone, Debug)]
pub struct FakeMap {
    rule: String,
    /// The rule's default share as the bucket runs it without a lease:
    /// (interval_fp, depth ns), or [`REFUSE_ALL`] (`default_share = "none"`).
    default: (u64, u64),
    grants: BTreeMap<String, GrantValue>,
    buckets: BTreeMap<String, GlobalBucket>,
    /// The hot-key ring, oldest first.
    reports: Vec<HotReport<String>>,
}

/// The kernel's bucket of a global rule without a default share: refuses
/// everything, and a bucket re-rated from it starts empty.
const REFUSE_ALL: (u64, u64) = (u64::MAX, 0);

impl FakeMap {
    pub fn new(rule: &GlobalRule) -> Self {
        assert!(rule.quota.is_none(), "the simulator's kernel models no quota");
        Self {
            rule: rule.name.clone(),
            default: rule.default_share.map_or(REFUSE_ALL, |d| bucket::params(d.rate, d.burst)),
            grants: BTreeMap::new(),
            buckets: BTreeMap::new(),
            reports: Vec::new(),
        }
    }

    /// A packet of `cost` units for `key` at `now_ns` (host clock):
    /// admitted or not.
    pub fn admit(&mut self, key: &str, cost: u64, now_ns: u64) -> bool {
        let now = now_ns;
        let default = self.default;
        let b = self.buckets.entry(key.to_string()).or_default();
        b.offered += cost;
        let word = current_grant(b, self.grants.get(key), default, now);
        let leased = word != grant::NO_LEASE;
        let (interval, depth) = word_params(word, default);
        match gcra::admit(b.tat, now, gcra::increment_ns(interval, cost), depth) {
            None => {
                // Refused: the agent is asked for a lease (or a larger one).
                report_hot(b, &mut self.reports, &self.rule, key, now);
                false
            }
            Some(tat) => {
                b.tat = tat;
                if !leased && tat.saturating_sub(now) > depth / 2 {
                    // Past half the default burst: hot before it refuses.
                    report_hot(b, &mut self.reports, &self.rule, key, now);
                }
                true
            }
        }
    }

    /// The lease a packet of `key` would run under at `now_ns` (None: the
    /// default share), without touching the bucket: what the measures
    /// count as enforced.
    pub fn enforced(&self, key: &str, now_ns: u64) -> Option<Share> {
        let g = match self.buckets.get(key) {
            Some(b) if !stale(b, now_ns) => {
                GrantValue { word: b.grant, quota: b.quota, expires_ns: b.grant_expires_ns }
            }
            _ => stored(self.grants.get(key), now_ns),
        };
        let (interval, units) = grant::decode(g.word)?;
        Some(Share { rate: units_per_second(interval), burst: units, quota: g.quota })
    }
}

/// The kernel's `report_hot`: the key into the ring, at most every
/// `grant::HOT_EVERY_NS`.
fn report_hot(
    b: &mut GlobalBucket,
    reports: &mut Vec<HotReport<String>>,
    rule: &str,
    key: &str,
    now: u64,
) {
    if b.hot_ns != 0 && now.saturating_sub(b.hot_ns) < grant::HOT_EVERY_NS {
        return;
    }
    b.hot_ns = now;
    reports.push(HotReport { rule: rule.to_string(), key: key.to_string(), id: key.to_string() });
}

/// Whether a bucket's cached grant must be re-read at `now`: older than
/// `grant::REFRESH_NS`, never read, or its lease ended.
fn stale(b: &GlobalBucket, now: u64) -> bool {
    let live = b.grant == grant::NO_LEASE || now < b.grant_expires_ns;
    b.grant_read_ns == 0 || now.saturating_sub(b.grant_read_ns) > grant::REFRESH_NS || !live
}

/// The map's grant for a key at `now`: an ended one is no lease.
fn stored(g: Option<&GrantValue>, now: u64) -> GrantValue {
    match g {
        Some(g) if now < g.expires_ns => *g,
        _ => GrantValue { word: grant::NO_LEASE, quota: 0, expires_ns: 0 },
    }
}

/// (interval_fp, depth ns) a bucket runs at under `word`.
fn word_params(word: u64, default: (u64, u64)) -> (u64, u64) {
    grant::decode(word).map_or(default, |(i, units)| (i, gcra::increment_ns(i, units)))
}

/// The kernel's `current_grant`: the bucket's copy of the grant word, or
/// the map's when the copy is stale, the bucket re-rated when it changed.
fn current_grant(
    b: &mut GlobalBucket,
    g: Option<&GrantValue>,
    default: (u64, u64),
    now: u64,
) -> u64 {
    if !stale(b, now) {
        return b.grant;
    }
    let g = stored(g, now);
    if g.word != b.grant {
        let (from, to) = (word_params(b.grant, default), word_params(g.word, default));
        b.tat = gcra::retarget(b.tat, now, from, to);
    }
    (b.quota, b.grant_expires_ns, b.grant, b.grant_read_ns) = (g.quota, g.expires_ns, g.word, now);
    g.word
}

impl KeyBackend for FakeMap {
    /// The simulator names a key as the store does.
    type Key = String;

    fn hot(&mut self, max: usize) -> Vec<HotReport<String>> {
        let n = self.reports.len().min(max);
        self.reports.drain(..n).collect()
    }

    fn offered(&self, key: &String) -> Option<u64> {
        self.buckets.get(key).map(|b| b.offered)
    }

    fn quota_spent(&self, _rule: &str, _key: &String) -> Option<(u64, u64)> {
        None
    }

    fn set_lease(
        &mut self,
        key: &String,
        interval_fp: u64,
        burst_units: u64,
        quota: u64,
        expires_ns: u64,
    ) -> anyhow::Result<()> {
        let word = grant::encode(interval_fp, burst_units);
        self.grants.insert(key.clone(), GrantValue { word, quota, expires_ns });
        Ok(())
    }

    fn clear_grant(&mut self, key: &String) -> anyhow::Result<()> {
        self.grants.remove(key);
        Ok(())
    }
}

/// A host's clock: `offset + real * (1 + skew)`.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    pub offset: Micros,
    pub skew_ppm: i64,
}

impl Clock {
    pub fn at(&self, real: Micros) -> Micros {
        let scaled = real as i128 * (1_000_000 + self.skew_ppm as i128) / 1_000_000;
        self.offset + scaled as Micros
    }
}

/// One simulated host: the agent's lease loop over its kernel, on its own
/// clock.
pub struct SimHost {
    pub agent: HostLoop<FakeMap>,
    pub clock: Clock,
    /// The store's replies received and not yet taken: the agent takes
    /// them at its next tick, as the real one takes its store task's.
    inbox: Vec<(String, u64, BatchReply)>,
    /// Offered units accumulated below one unit, in millionths.
    carry: u64,
}

impl SimHost {
    /// The lease the host's kernel enforces for [`KEY`] at `real` (None:
    /// the default share).
    pub fn enforced(&self, real: Micros) -> Option<Share> {
        self.agent.backend().enforced(KEY, self.clock.at(real) * 1_000)
    }

    /// One tick of the agent at `real`: the replies received, then what is
    /// due; the batches to send.
    fn tick(&mut self, real: Micros) -> Vec<Batch> {
        let now = self.clock.at(real);
        for (rule, seq, reply) in self.inbox.drain(..) {
            self.agent.on_reply(&rule, seq, Ok(reply), now);
        }
        self.agent.tick(now)
    }

    /// The step's traffic at `real`, `rate` units per second over `step`:
    /// (offered, admitted).
    fn offer(&mut self, rate: u64, step: Micros, real: Micros) -> (u64, u64) {
        self.carry += rate * step;
        let n = self.carry / 1_000_000;
        self.carry %= 1_000_000;
        let now_ns = self.clock.at(real) * 1_000;
        let map = self.agent.backend_mut();
        let admitted = (0..n).filter(|_| map.admit(KEY, 1, now_ns)).count() as u64;
        (n, admitted)
    }
}

enum Message {
    ToStore(usize, Batch),
    ToHost(usize, String, u64, BatchReply),
}

/// The store's clock starts here (Redis TIME is far from 0).
const STORE_BASE: Micros = 1_700_000_000_000_000;

/// A fleet on a virtual clock.
pub struct Fleet {
    pub cfg: Config,
    pub hosts: Vec<SimHost>,
    pub store: Memory,
    pub now: Micros,
    rng: Rng,
    queue: BinaryHeap<Reverse<(Micros, u64)>>,
    messages: BTreeMap<u64, Message>,
    next_id: u64,
    pub store_calls: u64,
    /// Requests that reached the store reporting less held than their
    /// host's kernel enforced then: an acknowledgement of a lowered grant
    /// before the kernel enforced it (the settle hold prevents it).
    pub acked_before_enforced: u64,
    /// Requests that reached the store reporting less held than it had
    /// recorded for their host: acknowledgements of a cut.
    pub cuts_acked: u64,
    epoch_seq: u64,
}

impl Fleet {
    pub fn new(cfg: Config) -> Self {
        let mut rng = Rng::new(cfg.seed);
        let hosts = (0..cfg.hosts)
            .map(|i| {
                let skew = cfg.skew_ppm as i64;
                let clock = Clock {
                    offset: rng.range(1_000_000, 1_000_000_000),
                    skew_ppm: rng.range(0, 2 * skew as u64) as i64 - skew,
                };
                let host = HostConfig {
                    host: format!("h{i}"),
                    max_keys: 1024,
                    timeout: 4 * cfg.delay.1 + 100_000,
                };
                let mut agent = HostLoop::new(host, FakeMap::new(&cfg.rule));
                agent.set_rule(cfg.rule.clone());
                SimHost { agent, clock, inbox: Vec::new(), carry: 0 }
            })
            .collect();
        let mut store = Memory::default();
        // A store that has been up past its learning lease.
        store.bootstrap(&cfg.rule.name, Limits::from(&cfg.rule), "e0", STORE_BASE - cfg.rule.lease);
        Self {
            cfg,
            hosts,
            store,
            now: 0,
            rng,
            queue: BinaryHeap::new(),
            messages: BTreeMap::new(),
            next_id: 0,
            store_calls: 0,
            acked_before_enforced: 0,
            cuts_acked: 0,
            epoch_seq: 0,
        }
    }

    fn store_now(&self, real: Micros) -> Micros {
        STORE_BASE + real
    }

    fn send(&mut self, at: Micros, m: Message) {
        let host = match &m {
            Message::ToStore(i, _) | Message::ToHost(i, ..) => *i,
        };
        let lost = self.rng.chance(self.cfg.loss_ppm)
            || self.cfg.outage.is_some_and(|(a, b)| at >= a && at < b)
            || self.cfg.cut.iter().any(|&(h, from)| h == host && at >= from);
        if lost {
            return;
        }
        let deliver = at + self.rng.range(self.cfg.delay.0, self.cfg.delay.1);
        self.next_id += 1;
        self.queue.push(Reverse((deliver, self.next_id)));
        self.messages.insert(self.next_id, m);
    }

    fn deliver(&mut self, real: Micros, m: Message) {
        match m {
            Message::ToStore(i, b) => {
                self.store_calls += 1;
                self.check_held(i, &b, real);
                self.epoch_seq += 1;
                let candidate = format!("e{}", self.epoch_seq);
                let now = self.store_now(real);
                let r = self.store.run_batch(&b.call(&self.cfg.rule, &candidate), now);
                self.send(real, Message::ToHost(i, b.rule, b.seq, r));
            }
            Message::ToHost(i, rule, seq, r) => self.hosts[i].inbox.push((rule, seq, r)),
        }
    }

    /// A request of host `i` reaching the store at `real`: whether it
    /// acknowledges a cut, and whether before the host's kernel enforced it.
    fn check_held(&mut self, i: usize, b: &Batch, real: Micros) {
        let Some(item) = b.items.iter().find(|it| it.key == KEY) else { return };
        let cell = self.store.cell(&b.rule, KEY);
        let was = cell.hosts.get(&b.host).map(|e| e.acked);
        self.cuts_acked += was.is_some_and(|w| w.exceeds(&item.held)) as u64;
        let enforced = self.hosts[i].enforced(real);
        self.acked_before_enforced += enforced.is_some_and(|e| e.exceeds(&item.held)) as u64;
    }

    /// Advances one step: messages due within it at their own times, then
    /// at its end each host's traffic of the step and its agent's tick.
    /// Returns (offered, admitted).
    pub fn step(&mut self) -> (u64, u64) {
        let end = self.now + self.cfg.step;
        if let Some(at) = self.cfg.flush_at {
            if self.now < at && at <= end {
                self.store.flush();
            }
        }
        while let Some(Reverse((t, id))) = self.queue.peek().copied() {
            if t > end {
                break;
            }
            self.queue.pop();
            let m = self.messages.remove(&id).expect("queued message");
            self.deliver(t, m);
        }
        self.now = end;
        let (mut offered, mut admitted) = (0, 0);
        for i in 0..self.hosts.len() {
            let rate = self.cfg.load.offered(i, self.cfg.hosts, end);
            let (o, a) = self.hosts[i].offer(rate, self.cfg.step, end);
            offered += o;
            admitted += a;
            for b in self.hosts[i].tick(end) {
                self.send(end, Message::ToStore(i, b));
            }
        }
        (offered, admitted)
    }

    /// The sum of the shares the hosts' kernels enforce under leases now.
    pub fn enforced(&self) -> Share {
        let leases = self.hosts.iter().filter_map(|h| h.enforced(self.now));
        leases.fold(Share::ZERO, |a, s| Share {
            rate: a.rate + s.rate,
            burst: a.burst + s.burst,
            quota: a.quota + s.quota,
        })
    }

    /// Hosts whose kernel enforces a lease the store does not reserve for
    /// them now (zero unless the store lost state).
    pub fn outliving_store(&self) -> u64 {
        let cell = self.store.cell(&self.cfg.rule.name, KEY);
        let now = self.store_now(self.now);
        let mut n = 0;
        for h in &self.hosts {
            if let Some(s) = h.enforced(self.now) {
                let entry = cell.hosts.get(h.agent.manager().host()).filter(|e| e.expires > now);
                if entry.is_none_or(|e| s.exceeds(&e.reserved(now))) {
                    n += 1;
                }
            }
        }
        n
    }

    /// Hosts whose kernel enforces no lease now (each may admit the
    /// default allowance).
    pub fn unleased(&self) -> usize {
        self.hosts.iter().filter(|h| h.enforced(self.now).is_none()).count()
    }
}

/// Runs a simulation and measures it.
pub fn run(cfg: Config) -> Outcome {
    let mut fleet = Fleet::new(cfg.clone());
    let steps = (cfg.duration / cfg.step) as usize;
    let (mut admitted, mut offered, mut unleased) =
        (Vec::with_capacity(steps), Vec::with_capacity(steps), Vec::with_capacity(steps));
    let mut out = Outcome::default();
    let l = cfg.rule.rate as f64;
    for _ in 0..steps {
        let (o, a) = fleet.step();
        offered.push(o);
        admitted.push(a);
        unleased.push(fleet.unleased());
        let enforced = fleet.enforced();
        out.max_enforced = out.max_enforced.max(enforced.rate as f64 / l);
        let reserved = fleet.store.reserved(&cfg.rule.name, KEY, STORE_BASE + fleet.now);
        out.max_reserved = out.max_reserved.max(reserved.rate as f64 / l);
        if cfg.flush_at.is_none() {
            out.outlived_store += fleet.outliving_store();
        }
        if let Load::Move { to, at, total, .. } = cfg.load {
            let fair = total.min(cfg.rule.rate);
            let to_rate = fleet.hosts[to].enforced(fleet.now).map_or(0, |s| s.rate);
            if out.converge.is_none() && fleet.now >= at && to_rate * 10 >= fair * 9 {
                out.converge = Some(fleet.now - at);
            }
        }
    }
    let secs = cfg.duration as f64 / 1e6;
    out.admitted = admitted.iter().sum();
    out.offered = offered.iter().sum();
    out.acked_before_enforced = fleet.acked_before_enforced;
    out.cuts_acked = fleet.cuts_acked;
    out.ops_per_host_s = fleet.store_calls as f64 / cfg.hosts as f64 / secs;
    let active = fleet.hosts.iter().filter(|h| h.agent.manager().stats().batches > 0);
    let active = active.count().max(1);
    out.ops_per_active_host_s = fleet.store_calls as f64 / active as f64 / secs;
    // Utilisation after the first refresh (the fleet's start).
    let skip = (cfg.rule.refresh / cfg.step) as usize;
    let after: u64 = admitted[skip..].iter().sum();
    let offered_after: u64 = offered[skip..].iter().sum();
    let capacity = l * (steps - skip) as f64 * cfg.step as f64 / 1e6;
    out.utilisation = after as f64 / (offered_after as f64).min(capacity);
    let eps = 1.0 + cfg.rule.epsilon_ppm as f64 / 1e6;
    let allowance = cfg.rule.default_share.map_or((0.0, 0.0), |d| (d.rate as f64, d.burst as f64));
    for window in [100_000, 1_000_000, 5_000_000] {
        let w = (window / cfg.step) as usize;
        let mut worst: f64 = 0.0;
        let (mut sum, mut waiting) = (0u64, std::collections::VecDeque::new());
        for i in 0..steps {
            sum += admitted[i];
            waiting.push_back(unleased[i]);
            if i >= w {
                sum -= admitted[i - w];
                waiting.pop_front();
            }
            // A window of w steps spans (w - 1) steps of time between its
            // first and last admissions; the bucket bound is over that.
            let t = (waiting.len().saturating_sub(1)) as f64 * cfg.step as f64 / 1e6;
            let d = *waiting.iter().max().unwrap_or(&0) as f64;
            let bound =
                l * eps * t + cfg.rule.burst as f64 + d * (allowance.0 * eps * t + allowance.1);
            worst = worst.max(sum as f64 / bound);
        }
        out.worst.push((window, worst));
    }
    out
}

/// The scenarios `cargo xtask bench fleet` prints: uniform and skewed
/// load, a moved hot key, a flush, an outage; `quick` shortens them.
pub fn scenarios(quick: bool) -> Vec<(&'static str, Config)> {
    let shorten = |mut c: Config| {
        if quick {
            c.duration = c.duration.min(15_000_000);
        }
        c
    };
    let total = 40_000;
    let mut flush = Config::fleet(Load::Uniform { total });
    flush.flush_at = Some(8_000_000);
    let mut outage = Config::fleet(Load::Carriers { carriers: 3, total });
    outage.outage = Some((5_000_000, 9_000_000));
    let mut with_default = Config::fleet(Load::Uniform { total });
    with_default.rule.default_share = Some(super::DefaultShare { rate: 20, burst: 2 });
    vec![
        ("uniform, 200 hosts", Config::fleet(Load::Uniform { total })),
        ("1 host carries the key", Config::fleet(Load::Carriers { carriers: 1, total })),
        ("3 hosts carry the key", Config::fleet(Load::Carriers { carriers: 3, total })),
        (
            "hot key moves host 0 -> 1 at 10 s",
            Config::fleet(Load::Move { from: 0, to: 1, at: 10_000_000, total }),
        ),
        ("FLUSHALL at 8 s (uniform)", flush),
        ("store unreachable 5-9 s (3 hosts)", outage),
        ("uniform, default allowance 20/s", with_default),
    ]
    .into_iter()
    .map(|(n, c)| (n, shorten(c)))
    .collect()
}

/// Prints the simulated fleet's measurements, one scenario a line: the
/// worst window against the bound (L*t + B, plus allowances; <= 1 holds),
/// utilisation, convergence after a move, store calls per host per second.
pub fn report(out: &mut impl std::io::Write, quick: bool) -> std::io::Result<()> {
    writeln!(out, "simulated fleet: L = 20000/s, B = 2000, refresh 1 s, lease 10 s, 1% loss, delays 0.5-2.5 ms, skew +-500 ppm")?;
    writeln!(
        out,
        "{:<36} {:>8} {:>8} {:>8} {:>8} {:>6} {:>16} {:>10} {:>12}",
        "scenario",
        "A/bound",
        "(0.1 s)",
        "(1 s)",
        "(5 s)",
        "util",
        "converge",
        "ops/host/s",
        "(carriers)"
    )?;
    for (name, cfg) in scenarios(quick) {
        let bound = 2 * cfg.rule.refresh + cfg.rtt();
        let o = run(cfg);
        let worst = o.worst.iter().map(|w| w.1).fold(0.0, f64::max);
        let converge = match o.converge {
            Some(c) => format!("{:.2} s ({:.2}x)", c as f64 / 1e6, c as f64 / bound as f64),
            None => "-".to_string(),
        };
        writeln!(
            out,
            "{:<36} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>6.3} {:>16} {:>10.2} {:>12.2}",
            name,
            worst,
            o.worst[0].1,
            o.worst[1].1,
            o.worst[2].1,
            o.utilisation,
            converge,
            o.ops_per_host_s,
            o.ops_per_active_host_s
        )?;
    }
    writeln!(out, "converge: time for a moved hot key to reach 90% of its fair share, and its ratio to 2 x refresh + RTT")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A shorter fleet for the unit tier (debug builds).
    fn short(load: Load) -> Config {
        let mut c = Config::fleet(load);
        c.duration = 12_000_000;
        c
    }

    fn assert_bounds(name: &str, o: &Outcome) {
        for (w, r) in &o.worst {
            assert!(*r <= 1.0, "{name}: worst {w} us window at {r} of L*t + B: {o:?}");
        }
        assert!(o.max_enforced <= 1.0, "{name}: leases summed above L: {o:?}");
        assert!(o.max_reserved <= 1.0, "{name}: reservations summed above L: {o:?}");
        assert_eq!(o.outlived_store, 0, "{name}: a host outlived its lease in the store: {o:?}");
        assert_eq!(o.acked_before_enforced, 0, "{name}: a cut acknowledged early: {o:?}");
    }

    #[test]
    fn uniform_load_on_200_hosts_stays_within_the_bound() {
        let o = run(short(Load::Uniform { total: 40_000 }));
        assert_bounds("uniform", &o);
        // Every host is below its fair share by rounding and burst only.
        assert!(o.utilisation > 0.9, "{o:?}");
        // A batch a refresh plus acknowledgements: a few calls per second.
        assert!(o.ops_per_host_s < 4.0, "{o:?}");
    }

    #[test]
    fn one_and_three_carriers_stay_within_the_bound() {
        for carriers in [1, 3] {
            let o = run(short(Load::Carriers { carriers, total: 40_000 }));
            assert_bounds(&format!("{carriers} carriers"), &o);
            assert!(o.utilisation > 0.9, "{carriers} carriers: {o:?}");
        }
    }

    #[test]
    fn a_moved_hot_key_converges_within_two_refreshes_and_a_round_trip() {
        let cfg = short(Load::Move { from: 0, to: 1, at: 5_000_000, total: 40_000 });
        let bound = 2 * cfg.rule.refresh + cfg.rtt();
        let o = run(cfg);
        assert_bounds("move", &o);
        // Lost messages (1%) can cost a refresh; without losses it is within the bound.
        let c = o.converge.expect("converged");
        assert!(c <= bound + 1_000_000, "{c} us: {o:?}");
        // Without losses it is within the bound wherever in the refresh
        // cycle the move falls (a demand history reaching back two
        // refreshes once cost one more at some phases).
        for phase in [0, 125_000, 250_000, 375_000, 500_000, 625_000, 750_000, 875_000] {
            let at = 5_000_000 + phase;
            let mut lossless = short(Load::Move { from: 0, to: 1, at, total: 40_000 });
            lossless.loss_ppm = 0;
            let c = run(lossless).converge.expect("converged");
            assert!(c <= bound, "moved at {at} us: converged in {c} us > {bound} us");
        }
    }

    /// The settle hold, end to end: a hot key moving to another host cuts
    /// the first host's lease and shares out what it gives back, and no
    /// acknowledgement of a cut reaches the store while the cut host's
    /// kernel still runs its old grant (re-read every `grant::REFRESH_NS`).
    #[test]
    fn no_cut_is_acknowledged_before_the_kernel_enforces_it() {
        let moved = Load::Move { from: 0, to: 1, at: 4_000_000, total: 40_000 };
        for load in [moved, Load::Carriers { carriers: 3, total: 40_000 }] {
            let mut cfg = short(load);
            cfg.loss_ppm = 0;
            let o = run(cfg);
            assert!(o.cuts_acked > 0, "no cut to check: {o:?}");
            assert_eq!(o.acked_before_enforced, 0, "{o:?}");
            assert_eq!(o.outlived_store, 0, "{o:?}");
        }
    }

    #[test]
    fn a_flush_learns_and_keeps_the_bound() {
        let mut cfg = short(Load::Carriers { carriers: 3, total: 40_000 });
        cfg.flush_at = Some(4_000_000);
        let o = run(cfg);
        for (w, r) in &o.worst {
            assert!(*r <= 1.0, "worst {w} us window at {r}: {o:?}");
        }
        assert!(o.max_enforced <= 1.0, "{o:?}");
    }

    #[test]
    fn an_outage_raises_nothing_and_keeps_the_bound() {
        let mut cfg = short(Load::Carriers { carriers: 3, total: 40_000 });
        cfg.outage = Some((3_000_000, 7_000_000));
        cfg.rule.default_share = Some(super::super::DefaultShare { rate: 20, burst: 2 });
        let o = run(cfg);
        assert_bounds("outage", &o);
    }

    #[test]
    fn the_default_allowance_is_within_its_term() {
        let mut cfg = short(Load::Uniform { total: 40_000 });
        cfg.rule.default_share = Some(super::super::DefaultShare { rate: 20, burst: 2 });
        assert_bounds("default allowance", &run(cfg));
    }

    #[test]
    fn the_report_prints_every_scenario() {
        let mut out = Vec::new();
        report(&mut out, true).unwrap();
        let text = String::from_utf8(out).unwrap();
        println!("{text}");
        assert_eq!(text.lines().count(), 2 + scenarios(true).len() + 1, "{text}");
    }

    /// The full report (30 s scenarios), for the numbers in the docs:
    /// `cargo test -p flowctl --lib full_report -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn full_report() {
        report(&mut std::io::stdout(), false).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Random delays (up to 80 ms one way), losses (up to 30%), hosts
        /// joining and leaving (traffic starts and stops), hosts cut off
        /// from the store, clock rates within epsilon: at every step the
        /// leases enforced sum to at most L and B, the store's reservations
        /// too, and no host enforces a lease the store no longer reserves
        /// for it (leases end on the agent first).
        #[test]
        fn leases_never_sum_above_the_limit(
            hosts in proptest::collection::vec((0u64..6_000_000, 0u64..6_000_000, 0u64..3_000), 2..7),
            delay_max in 0u64..80_000,
            loss_ppm in 0u64..300_000,
            cut in proptest::option::of((0usize..6, 0u64..6_000_000)),
            seed in 0u64..u64::MAX,
            rate in 100u64..5_000,
        ) {
            let schedule: Vec<_> = hosts.iter().map(|&(a, b, r)| (a.min(b), a.max(b), r)).collect();
            let mut rule = GlobalRule::new("p", rate, rate / 5 + 1);
            rule.lease = 2_000_000;
            rule.refresh = 400_000;
            rule.epsilon_ppm = 20_000;
            let cfg = Config {
                hosts: schedule.len(),
                rule,
                load: Load::Schedule(schedule),
                duration: 7_000_000,
                step: 5_000,
                delay: (0, delay_max),
                loss_ppm,
                skew_ppm: 20_000,
                flush_at: None,
                outage: None,
                cut: cut.into_iter().collect(),
                seed,
            };
            let l = cfg.rule.rate;
            let b = cfg.rule.burst;
            let mut fleet = Fleet::new(cfg.clone());
            for _ in 0..cfg.duration / cfg.step {
                fleet.step();
                let e = fleet.enforced();
                prop_assert!(e.rate <= l && e.burst <= b, "enforced {e:?} at {}", fleet.now);
                let r = fleet.store.reserved("p", KEY, STORE_BASE + fleet.now);
                prop_assert!(r.rate <= l && r.burst <= b, "reserved {r:?} at {}", fleet.now);
                prop_assert_eq!(fleet.outliving_store(), 0, "at {}", fleet.now);
            }
        }

        /// The same after a FLUSHALL: the store forgets, learns for a
        /// lease, and the leases enforced still sum to at most L.
        #[test]
        fn a_flush_never_lets_leases_sum_above_the_limit(
            hosts in proptest::collection::vec(0u64..3_000, 2..6),
            flush_at in 500_000u64..4_000_000,
            delay_max in 0u64..50_000,
            loss_ppm in 0u64..200_000,
            seed in 0u64..u64::MAX,
        ) {
            let mut rule = GlobalRule::new("p", 2_000, 400);
            rule.lease = 2_000_000;
            rule.refresh = 400_000;
            rule.epsilon_ppm = 20_000;
            let schedule = hosts.iter().map(|&r| (0, u64::MAX, r)).collect();
            let mut cfg = Config::fleet(Load::Schedule(schedule));
            cfg.hosts = hosts.len();
            cfg.rule = rule;
            cfg.duration = 6_000_000;
            cfg.step = 5_000;
            cfg.delay = (0, delay_max);
            cfg.loss_ppm = loss_ppm;
            cfg.skew_ppm = 20_000;
            cfg.flush_at = Some(flush_at);
            cfg.seed = seed;
            let mut fleet = Fleet::new(cfg.clone());
            for _ in 0..cfg.duration / cfg.step {
                fleet.step();
                let e = fleet.enforced();
                prop_assert!(e.rate <= 2_000 && e.burst <= 400, "enforced {e:?} at {}", fleet.now);
            }
        }
    }
}
