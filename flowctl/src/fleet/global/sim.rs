//! A simulated fleet in one process on a virtual clock: the pure allocator
//! ([`Memory`]) standing in for Redis, the real [`Manager`] per host, one
//! way message delays and losses, clock-rate skew per host, and a fake map
//! per host: a GCRA bucket per key (flowctl-common's, re-rated with
//! [`flowctl_common::gcra::retarget`]) admitting the host's offered traffic. It
//! measures what docs/design.md ("Global limits: the bounds") states:
//! the worst window's admitted total against `L*t + B`, the time for a
//! moved hot key to converge, utilisation and store calls per host per
//! second. The property tests and `cargo xtask bench fleet` ([`report`])
//! run it.

use super::allocator::{Limits, Memory};
use super::bucket;
use super::host::{Batch, GrantSink, HostConfig, Manager};
use super::{GlobalRule, Grant, Micros, Share};
use flowctl_common::gcra;
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

/// A host's map: one GCRA bucket per key, at the lease's parameters or
/// the rule's default allowance (none: refuse all).
#[derive(Clone, Debug)]
pub struct FakeMap {
    default: Option<(u64, u64)>,
    /// Host clock, ns: set by the driver before every call.
    pub now_ns: u64,
    buckets: BTreeMap<String, KeyBucket>,
}

/// One key's bucket in a [`FakeMap`].
#[derive(Clone, Copy, Debug)]
struct KeyBucket {
    /// (interval_fp, depth_ns); None refuses everything.
    params: Option<(u64, u64)>,
    tat: u64,
    lease: Option<Share>,
}

impl FakeMap {
    pub fn new(rule: &GlobalRule) -> Self {
        let default = rule.default_share.map(|d| bucket::params(d.rate, d.burst));
        Self { default, now_ns: 0, buckets: BTreeMap::new() }
    }

    /// Offers `cost` units for `key`: admitted or not.
    pub fn admit(&mut self, key: &str, cost: u64) -> bool {
        let now = self.now_ns;
        let b = self.bucket(key);
        let Some((interval, depth)) = b.params else { return false };
        match gcra::admit(b.tat, now, gcra::increment_ns(interval, cost), depth) {
            Some(tat) => {
                b.tat = tat;
                true
            }
            None => false,
        }
    }

    /// The lease the key's bucket enforces (None: the default allowance).
    pub fn lease(&self, key: &str) -> Option<Share> {
        self.buckets.get(key).and_then(|b| b.lease)
    }

    fn bucket(&mut self, key: &str) -> &mut KeyBucket {
        let params = self.default;
        // A new key's bucket starts full, as the kernel's does.
        self.buckets.entry(key.to_string()).or_insert(KeyBucket { params, tat: 0, lease: None })
    }

    fn set(&mut self, key: &str, params: Option<(u64, u64)>, lease: Option<Share>) {
        let now = self.now_ns;
        let b = self.bucket(key);
        b.tat = match (b.params, params) {
            (Some(old), Some(new)) => gcra::retarget(b.tat, now, old, new),
            // From refusing everything: an empty bucket.
            (None, Some(new)) => now + new.1,
            (_, None) => b.tat,
        };
        b.params = params;
        b.lease = lease;
    }
}

impl GrantSink for FakeMap {
    fn apply(&mut self, _rule: &str, key: &str, grant: &Grant) {
        let s = grant.share;
        self.set(key, Some(bucket::params(s.rate, s.burst)), Some(s));
    }

    fn revoke(&mut self, _rule: &str, key: &str) {
        self.set(key, self.default, None);
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

/// One simulated host.
pub struct SimHost {
    pub manager: Manager,
    pub map: FakeMap,
    pub clock: Clock,
    offered_total: u64,
    /// Offered units accumulated below one unit, in millionths.
    carry: u64,
}

enum Message {
    ToStore(usize, Batch),
    ToHost(usize, String, u64, super::allocator::BatchReply),
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
                let mut manager = Manager::new(HostConfig {
                    host: format!("h{i}"),
                    max_keys: 1024,
                    timeout: 4 * cfg.delay.1 + 100_000,
                });
                manager.set_rule(cfg.rule.clone());
                SimHost { manager, map: FakeMap::new(&cfg.rule), clock, offered_total: 0, carry: 0 }
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

    fn poll_host(&mut self, i: usize, real: Micros) {
        let h = &mut self.hosts[i];
        let now = h.clock.at(real);
        h.map.now_ns = now * 1000;
        let batches = h.manager.poll(now, &mut h.map);
        for b in batches {
            self.send(real, Message::ToStore(i, b));
        }
    }

    fn deliver(&mut self, real: Micros, m: Message) {
        match m {
            Message::ToStore(i, b) => {
                self.store_calls += 1;
                self.epoch_seq += 1;
                let candidate = format!("e{}", self.epoch_seq);
                let now = self.store_now(real);
                let r = self.store.run_batch(&b.call(&self.cfg.rule, &candidate), now);
                self.send(real, Message::ToHost(i, b.rule, b.seq, r));
            }
            Message::ToHost(i, rule, seq, r) => {
                let h = &mut self.hosts[i];
                let now = h.clock.at(real);
                h.map.now_ns = now * 1000;
                h.manager.on_reply(&rule, seq, &r, now, &mut h.map);
                self.poll_host(i, real);
            }
        }
    }

    /// Advances one step: messages due within it at their own times, then
    /// the traffic of the step at its end. Returns (offered, admitted).
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
        let rule = self.cfg.rule.name.clone();
        for i in 0..self.hosts.len() {
            // Leases that ended by now end before this step's traffic.
            self.poll_host(i, end);
            let rate = self.cfg.load.offered(i, self.cfg.hosts, end);
            let h = &mut self.hosts[i];
            let now = h.clock.at(end);
            h.map.now_ns = now * 1000;
            h.carry += rate * self.cfg.step;
            let n = h.carry / 1_000_000;
            h.carry %= 1_000_000;
            let mut refused_unleased = false;
            for _ in 0..n {
                if h.map.admit(KEY, 1) {
                    admitted += 1;
                } else if h.map.lease(KEY).is_none() {
                    refused_unleased = true;
                }
            }
            offered += n;
            h.offered_total += n;
            if refused_unleased {
                h.manager.note_hot(&rule, KEY, now);
            }
            h.manager.observe(&rule, KEY, h.offered_total, now);
            self.poll_host(i, end);
        }
        (offered, admitted)
    }

    /// The sum of the rates the hosts enforce under leases now.
    pub fn enforced(&self) -> Share {
        self.hosts.iter().filter_map(|h| h.map.lease(KEY)).fold(Share::ZERO, |a, s| Share {
            rate: a.rate + s.rate,
            burst: a.burst + s.burst,
            quota: a.quota + s.quota,
        })
    }

    /// Hosts enforcing a lease the store does not reserve for them now
    /// (zero unless the store lost state).
    pub fn outliving_store(&self) -> u64 {
        let cell = self.store.cell(&self.cfg.rule.name, KEY);
        let now = self.store_now(self.now);
        let mut n = 0;
        for h in &self.hosts {
            if let Some(s) = h.map.lease(KEY) {
                let entry = cell.hosts.get(h.manager.host()).filter(|e| e.expires > now);
                if entry.is_none_or(|e| s.exceeds(&e.reserved(now))) {
                    n += 1;
                }
            }
        }
        n
    }

    /// Hosts without a lease now (each may admit the default allowance).
    pub fn unleased(&self) -> usize {
        self.hosts.iter().filter(|h| h.map.lease(KEY).is_none()).count()
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
            let to_rate = fleet.hosts[to].map.lease(KEY).map_or(0, |s| s.rate);
            if out.converge.is_none() && fleet.now >= at && to_rate * 10 >= fair * 9 {
                out.converge = Some(fleet.now - at);
            }
        }
    }
    let secs = cfg.duration as f64 / 1e6;
    out.admitted = admitted.iter().sum();
    out.offered = offered.iter().sum();
    out.ops_per_host_s = fleet.store_calls as f64 / cfg.hosts as f64 / secs;
    let active = fleet.hosts.iter().filter(|h| h.manager.stats().batches > 0).count().max(1);
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
        let mut lossless = short(Load::Move { from: 0, to: 1, at: 5_000_000, total: 40_000 });
        lossless.loss_ppm = 0;
        let c = run(lossless).converge.expect("converged");
        assert!(c <= bound, "{c} us > {bound} us");
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
