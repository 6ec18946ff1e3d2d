//! One host's lease loop without its I/O: what the agent's
//! `agent::leases::LeaseLoop` and the simulator's hosts ([`super::sim`])
//! both run, so the simulator exercises the glue the agent adds around the
//! pure [`Manager`], not a copy of it.
//!
//! Around the manager it owns: the intake of the kernel's hot-key reports
//! (each names a key as the store does and as the kernel does, remembered
//! for the grants); the keys' offered counts and quota spending, read eight
//! times a refresh; the grant sink, which writes a lease into the key's
//! grant word (exactly what the store reserved, the lease's end beside it)
//! and tells a cut from a raise; and the settle hold: after a grant is lowered
//! no batch leaves for [`SETTLE`], so no acknowledgement of the lower grant
//! reaches the store before the kernel, which re-reads a grant word at most
//! every `grant::REFRESH_NS`, enforces it.
//!
//! The map side is a [`KeyBackend`] (the kernel's maps in the agent, a model
//! of them in the simulator); the store side is whoever runs the batches
//! [`HostLoop::tick`] returns and hands back [`HostLoop::on_reply`]. Time is
//! passed in: the manager's clock, monotonic microseconds, whose
//! nanoseconds are the kernel's clock.

use super::allocator::BatchReply;
use super::host::{Batch, GrantSink, HostConfig, Manager};
use super::{GlobalRule, Grant, Micros, Share};
use flowctl_common::{gcra, grant};
use std::collections::HashMap;

/// Most hot-key reports taken per tick.
pub const HOT_PER_TICK: usize = 4096;
/// How long a lowered grant needs to be in force in the kernel before it
/// is acknowledged to the store: the kernel re-reads a key's grant at most
/// every `grant::REFRESH_NS`; 10 ms more for the write itself.
pub const SETTLE: Micros = grant::REFRESH_NS / 1_000 + 10_000;
/// Hot keys and replies come any time: a driver without other work ticks
/// again this soon.
pub const LOOK_AGAIN: Micros = 20_000;
/// The offered counts are read eight times a refresh, at most this often.
const MIN_OBSERVE: Micros = 10_000;
/// The refresh interval assumed before any rule is known.
const DEFAULT_REFRESH: Micros = 1_000_000;

/// The kernel reported a key of a global rule hot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HotReport<K> {
    pub rule: String,
    /// The key as the store names it.
    pub key: String,
    /// The key as the backend names it.
    pub id: K,
}

/// The map side of the leases: where the kernel's reports and counters are
/// read and this host's grants written.
pub trait KeyBackend {
    /// The backend's own name of a key (the kernel's `BucketKey`).
    type Key: Clone;
    /// Up to `max` hot-key reports since the last call, of global rules
    /// only (reports of other records are dropped here).
    fn hot(&mut self, max: usize) -> Vec<HotReport<Self::Key>>;
    /// The key's offered counter (units, monotonic, refused ones included);
    /// None while the kernel holds no bucket for it.
    fn offered(&self, key: &Self::Key) -> Option<u64>;
    /// What the key has spent of its quota here, as `window::spent` counts
    /// it: (units in the window, ns until they have all left it). None
    /// when `rule` has no quota.
    fn quota_spent(&self, rule: &str, key: &Self::Key) -> Option<(u64, u64)>;
    /// Grants the key one unit per `interval_fp` with `burst_units` of
    /// depth and `quota` units per window until `expires_ns` (kernel
    /// clock), from the kernel's next re-read of the grant.
    fn set_lease(
        &mut self,
        key: &Self::Key,
        interval_fp: u64,
        burst_units: u64,
        quota: u64,
        expires_ns: u64,
    ) -> anyhow::Result<()>;
    /// Ends the key's lease here: back to the rule's default share.
    fn clear_grant(&mut self, key: &Self::Key) -> anyhow::Result<()>;
}

/// Units per second of a fixed-point emission interval, to the nearest:
/// the inverse of `gcra::interval_fp(rate, 1)`, which rounds the interval
/// up (exact for rates below about 350,000/s).
pub fn units_per_second(interval_fp: u64) -> u64 {
    let i = interval_fp.max(1) as u128;
    (((1_000_000_000u128 << gcra::FRAC_BITS) + i / 2) / i) as u64
}

/// The loop of one host's global rules.
pub struct HostLoop<B: KeyBackend> {
    manager: Manager,
    grants: Grants<B>,
    /// Batches held back while a lowered grant settles in the kernel.
    held: Vec<Batch>,
    next_observe: Micros,
    /// Giving everything back ([`release_all`](Self::release_all)): the
    /// kernel's hot keys and counters are no longer taken, so a key that
    /// still has traffic is not asked for again the moment it is released.
    releasing: bool,
}

/// The grants side: the backend, what the kernel calls each key, what was
/// applied, and whether a cut is still settling.
struct Grants<B: KeyBackend> {
    backend: B,
    /// (rule, key as the store names it) -> the backend's key.
    known: HashMap<(String, String), B::Key>,
    /// The grant applied per key, to tell a cut from a raise.
    applied: HashMap<(String, String), Share>,
    /// A grant was lowered: acknowledge nothing before this.
    settle_until: Option<Micros>,
    errors: u64,
}

/// The manager's [`GrantSink`]: the grants at the time of the call.
struct SinkAt<'a, B: KeyBackend> {
    grants: &'a mut Grants<B>,
    now: Micros,
}

impl<B: KeyBackend> GrantSink for SinkAt<'_, B> {
    fn apply(&mut self, rule: &str, key: &str, g: &Grant) {
        let s = &mut *self.grants;
        let id = (rule.to_string(), key.to_string());
        let Some(k) = s.known.get(&id) else { return };
        // Exactly what the store reserves: rounding a burst up would take
        // more than it counts. A share without burst (none is free, or a
        // zero grant) admits nothing; the store never grants a rate
        // without a unit of burst (`allocator::usable`).
        let burst = if g.share.rate == 0 { 0 } else { g.share.burst };
        let rate = g.share.rate;
        if s.applied.get(&id).is_some_and(|old| old.exceeds(&g.share)) {
            s.settle_until = Some(self.now + SETTLE);
        }
        // The kernel ends the lease by itself when the agent does (its
        // clock is the manager's, in us): a grant never outlives its lease.
        let ends = g.expires.saturating_mul(1_000);
        let interval = gcra::interval_fp(rate.max(1), 1);
        match s.backend.set_lease(k, interval, burst, g.share.quota, ends) {
            Ok(()) => {
                s.applied.insert(id, g.share);
            }
            Err(e) => {
                s.errors += 1;
                tracing::warn!("global rule {rule}: granting {key}: {e:#}");
            }
        }
    }

    fn revoke(&mut self, rule: &str, key: &str) {
        let s = &mut *self.grants;
        let id = (rule.to_string(), key.to_string());
        let Some(k) = s.known.get(&id) else { return };
        // Back to the default share: lower than any lease, so settle too.
        s.settle_until = Some(self.now + SETTLE);
        s.applied.remove(&id);
        if let Err(e) = s.backend.clear_grant(k) {
            s.errors += 1;
            tracing::warn!("global rule {rule}: ending the lease of {key}: {e:#}");
        }
    }
}

impl<B: KeyBackend> HostLoop<B> {
    pub fn new(cfg: HostConfig, backend: B) -> Self {
        let grants = Grants {
            backend,
            known: HashMap::new(),
            applied: HashMap::new(),
            settle_until: None,
            errors: 0,
        };
        Self {
            manager: Manager::new(cfg),
            grants,
            held: Vec::new(),
            next_observe: 0,
            releasing: false,
        }
    }

    /// Adds a global rule, or updates its spec ([`Manager::set_rule`]).
    pub fn set_rule(&mut self, spec: GlobalRule) {
        self.manager.set_rule(spec);
    }

    /// Drops a rule: its leased keys go back to the default share.
    pub fn remove_rule(&mut self, rule: &str, now: Micros) {
        self.manager.remove_rule(rule, &mut SinkAt { grants: &mut self.grants, now });
    }

    /// Runs what is due at `now`: the kernel's hot keys ask for leases, the
    /// leased keys' counters are read (eight times a refresh), leases that
    /// ran out end; returns the batches to send now, none while a lowered
    /// grant settles (they wait, and go with the first tick after it).
    pub fn tick(&mut self, now: Micros) -> Vec<Batch> {
        if !self.releasing {
            self.take_hot(now);
            if now >= self.next_observe {
                self.observe(now);
            }
        }
        let due = self.manager.poll(now, &mut SinkAt { grants: &mut self.grants, now });
        self.held.extend(due);
        if self.grants.settle_until.is_some_and(|t| now < t) {
            return Vec::new();
        }
        self.grants.settle_until = None;
        std::mem::take(&mut self.held)
    }

    /// The store's answer to batch `seq` of `rule` (an error: the call
    /// failed, the grants stay until they end).
    pub fn on_reply(
        &mut self,
        rule: &str,
        seq: u64,
        result: Result<BatchReply, String>,
        now: Micros,
    ) {
        match result {
            Ok(reply) => {
                let mut sink = SinkAt { grants: &mut self.grants, now };
                self.manager.on_reply(rule, seq, &reply, now, &mut sink);
            }
            Err(e) => {
                tracing::debug!("global rule {rule}: store call failed: {e}");
                self.manager.on_failure(rule, seq, now);
            }
        }
    }

    /// When to tick next without news: soon, and when a settling cut is in
    /// force.
    pub fn next_wakeup(&self, now: Micros) -> Micros {
        let soon = now + LOOK_AGAIN;
        self.grants.settle_until.map_or(soon, |t| soon.min(t))
    }

    /// Until when outgoing batches are held (a lowered grant settling).
    pub fn settling_until(&self) -> Option<Micros> {
        self.grants.settle_until
    }

    /// Gives every lease back ([`Manager::release_all`]) and asks for none
    /// from now on (the agent is stopping).
    pub fn release_all(&mut self) {
        self.releasing = true;
        self.manager.release_all();
    }

    /// Whether every lease has been given back and acknowledged.
    pub fn released(&self) -> bool {
        self.manager.leases().is_empty()
    }

    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    pub fn backend(&self) -> &B {
        &self.grants.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.grants.backend
    }

    /// Grants the backend refused to write or clear.
    pub fn grant_errors(&self) -> u64 {
        self.grants.errors
    }

    fn take_hot(&mut self, now: Micros) {
        for h in self.grants.backend.hot(HOT_PER_TICK) {
            self.grants.known.insert((h.rule.clone(), h.key.clone()), h.id);
            self.manager.note_hot(&h.rule, &h.key, now);
        }
    }

    /// Demand: the leased keys' offered counts, and what they spent of
    /// their quotas here, so the store keeps that reserved while it is in
    /// the window.
    fn observe(&mut self, now: Micros) {
        let refresh = self.manager.rules().map(|r| r.refresh).min().unwrap_or(DEFAULT_REFRESH);
        self.next_observe = now + (refresh / 8).max(MIN_OBSERVE);
        for v in self.manager.leases() {
            let id = (v.rule, v.key);
            let Some(k) = self.grants.known.get(&id) else { continue };
            let backend = &self.grants.backend;
            if let Some(offered) = backend.offered(k) {
                self.manager.observe(&id.0, &id.1, offered, now);
            }
            if let Some((used, clear_in_ns)) = backend.quota_spent(&id.0, k) {
                self.manager.observe_used(&id.0, &id.1, used, clear_in_ns.div_ceil(1_000));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::allocator::{Limits, Memory};
    use super::*;
    use std::collections::BTreeMap;

    /// A backend that records what it is told and serves what it is given.
    #[derive(Default)]
    struct Recorder {
        reports: Vec<HotReport<u32>>,
        offered: BTreeMap<u32, u64>,
        /// Key -> (interval_fp, burst, quota, expires_ns).
        leases: BTreeMap<u32, (u64, u64, u64, u64)>,
        cleared: Vec<u32>,
        quota: Option<(u64, u64)>,
        refuse_writes: bool,
        /// Counter reads.
        reads: std::cell::Cell<u64>,
    }

    impl KeyBackend for Recorder {
        type Key = u32;
        fn hot(&mut self, max: usize) -> Vec<HotReport<u32>> {
            let n = self.reports.len().min(max);
            self.reports.drain(..n).collect()
        }
        fn offered(&self, key: &u32) -> Option<u64> {
            self.reads.set(self.reads.get() + 1);
            self.offered.get(key).copied()
        }
        fn quota_spent(&self, _rule: &str, _key: &u32) -> Option<(u64, u64)> {
            self.quota
        }
        fn set_lease(&mut self, key: &u32, i: u64, b: u64, q: u64, e: u64) -> anyhow::Result<()> {
            anyhow::ensure!(!self.refuse_writes, "map full");
            self.leases.insert(*key, (i, b, q, e));
            Ok(())
        }
        fn clear_grant(&mut self, key: &u32) -> anyhow::Result<()> {
            self.leases.remove(key);
            self.cleared.push(*key);
            Ok(())
        }
    }

    const RULE: &str = "web";

    fn setup() -> (HostLoop<Recorder>, GlobalRule, Memory) {
        let rule = GlobalRule::new(RULE, 1000, 100);
        let cfg = HostConfig { host: "a".into(), max_keys: 10, timeout: 200_000 };
        let mut l = HostLoop::new(cfg, Recorder::default());
        l.set_rule(rule.clone());
        let mut store = Memory::default();
        store.bootstrap(RULE, Limits::from(&rule), "e", 0);
        (l, rule, store)
    }

    fn report(l: &mut HostLoop<Recorder>, key: &str, id: u32) {
        let r = HotReport { rule: RULE.into(), key: key.into(), id };
        l.backend_mut().reports.push(r);
    }

    /// Runs the batches through the store and hands the replies back.
    fn answer(l: &mut HostLoop<Recorder>, store: &mut Memory, rule: &GlobalRule, b: Vec<Batch>) {
        for b in b {
            let r = store.run_batch(&b.call(rule, "x"), 1_000_000_000 + b.sent_at);
            l.on_reply(&b.rule, b.seq, Ok(r), b.sent_at + 1_000);
        }
    }

    /// A reply granting `share` to the one key of batch `b`.
    fn grant(b: &Batch, share: Share) -> BatchReply {
        let mut r = Memory::default();
        let rule = GlobalRule::new(RULE, 1000, 100);
        r.bootstrap(RULE, Limits::from(&rule), "e", 0);
        let mut reply = r.run_batch(&b.call(&rule, "x"), 1_000_000_000);
        reply.replies[0].grant = share;
        reply
    }

    #[test]
    fn a_hot_key_is_asked_for_at_once_and_its_grant_written() {
        let (mut l, rule, mut store) = setup();
        report(&mut l, "k", 7);
        let b = l.tick(0);
        assert_eq!(b.len(), 1, "a new hot key's batch goes in the same tick");
        assert_eq!(b[0].items[0].key, "k");
        answer(&mut l, &mut store, &rule, b);
        let (interval, burst, quota, ends) = l.backend().leases[&7];
        assert_eq!((units_per_second(interval), burst, quota), (1000, 100, 0));
        // The kernel ends the lease with the agent, on the same clock.
        assert_eq!(ends, rule.local_lease() * 1_000);
        assert_eq!(l.settling_until(), None, "a first grant is a raise");
    }

    /// Ticks at `at`, takes the one batch due and answers it at `at + 1`
    /// with a grant of `rate` and `burst`; returns when it was answered.
    fn granted(l: &mut HostLoop<Recorder>, at: Micros, rate: u64, burst: u64) -> Micros {
        let b = l.tick(at).remove(0);
        l.on_reply(RULE, b.seq, Ok(grant(&b, Share { rate, burst, quota: 0 })), at + 1);
        at + 1
    }

    #[test]
    fn a_lowered_grant_holds_every_batch_until_the_kernel_enforces_it() {
        let (mut l, _rule, _store) = setup();
        report(&mut l, "k", 7);
        granted(&mut l, 0, 800, 80);
        // The cut, at 1 s: its acknowledgement is due at once (urgent).
        let cut = granted(&mut l, 1_000_000, 300, 30);
        assert_eq!(l.settling_until(), Some(cut + SETTLE));
        assert_eq!(l.next_wakeup(cut), cut + LOOK_AGAIN);
        assert_eq!(l.next_wakeup(cut + SETTLE - 1_000), cut + SETTLE);
        for t in (cut..cut + SETTLE).step_by(5_000) {
            assert!(l.tick(t).is_empty(), "a batch left at {t}, before the cut settled");
        }
        let ack = l.tick(cut + SETTLE);
        assert_eq!(ack.len(), 1, "the held acknowledgement goes once settled");
        assert_eq!(ack[0].items[0].held.rate, 300, "it acknowledges the lower grant");
        assert_eq!(l.settling_until(), None);
    }

    #[test]
    fn a_raise_holds_nothing_and_a_revoke_settles() {
        let (mut l, _rule, _store) = setup();
        report(&mut l, "k", 7);
        granted(&mut l, 0, 300, 30);
        granted(&mut l, 1_000_000, 900, 90);
        assert_eq!(l.settling_until(), None);
        // The lease runs out with nothing answering: cleared, and settled.
        let end = l.manager().lease(RULE, "k").unwrap().expires;
        l.tick(end);
        assert_eq!(l.backend().cleared, vec![7]);
        assert_eq!(l.settling_until(), Some(end + SETTLE));
    }

    #[test]
    fn a_released_key_with_traffic_is_not_asked_for_again() {
        let (mut l, rule, mut store) = setup();
        report(&mut l, "k", 7);
        let b = l.tick(0);
        answer(&mut l, &mut store, &rule, b);
        assert!(!l.released());
        l.release_all();
        // The kernel still reports the key hot (its traffic goes on).
        let mut t = 1_000;
        while !l.released() && t < 2_000_000 {
            report(&mut l, "k", 7);
            let b = l.tick(t);
            answer(&mut l, &mut store, &rule, b);
            t += 20_000;
        }
        assert!(l.released(), "given back and acknowledged by {t} us");
        report(&mut l, "k", 7);
        assert!(l.tick(t).is_empty(), "and not asked for again");
        assert!(l.released());
    }

    #[test]
    fn a_grant_is_written_as_the_store_reserved_it() {
        let (mut l, _rule, _store) = setup();
        report(&mut l, "k", 7);
        // A burst the store did not reserve is not made up: written as it is.
        granted(&mut l, 0, 5, 0);
        assert_eq!(l.backend().leases[&7].1, 0, "no burst: nothing admitted, nothing over");
        granted(&mut l, 1_000_000, 5, 2);
        assert_eq!(l.backend().leases[&7].1, 2);
    }

    #[test]
    fn counters_are_read_eight_times_a_refresh() {
        let (mut l, rule, mut store) = setup();
        report(&mut l, "k", 7);
        l.backend_mut().quota = Some((40, 2_500_000));
        let first = l.tick(0);
        answer(&mut l, &mut store, &rule, first);
        // 100 units a second, offered each ms; a read only every refresh/8.
        let mut demand = Vec::new();
        for ms in 1..=3_000u64 {
            l.backend_mut().offered.insert(7, ms / 10);
            let b = l.tick(ms * 1_000);
            demand.extend(b.iter().map(|b| b.items[0].demand));
            answer(&mut l, &mut store, &rule, b);
        }
        assert!(!demand.is_empty());
        assert!(demand.iter().skip(1).all(|d| (100..=110).contains(d)), "{demand:?}");
        let v = &l.manager().leases()[0];
        assert_eq!(v.used, 40, "the quota spent is reported too");
        // At 0, then every 125 ms up to 3 s.
        assert_eq!(l.backend().reads.get(), 25);
    }

    #[test]
    fn a_failed_call_or_write_keeps_the_grant_held() {
        let (mut l, _rule, _store) = setup();
        report(&mut l, "k", 7);
        let b = l.tick(0).remove(0);
        l.on_reply(RULE, b.seq, Err("timed out".into()), 1);
        assert_eq!(l.manager().stats().failures, 1);
        l.backend_mut().refuse_writes = true;
        granted(&mut l, 1_000_000, 500, 50);
        assert_eq!(l.grant_errors(), 1);
        assert!(l.backend().leases.is_empty());
    }

    #[test]
    fn units_per_second_inverts_the_interval() {
        for rate in [1, 3, 7, 20, 999, 20_000, 123_457, 300_000] {
            assert_eq!(units_per_second(gcra::interval_fp(rate, 1)), rate);
        }
    }
}
