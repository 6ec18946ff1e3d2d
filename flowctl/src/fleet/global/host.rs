//! The agent's side of the leases, as a pure state machine: time is passed
//! in (the agent's monotonic clock in microseconds), the store is reached
//! by whoever drives it ([`Manager::poll`] hands out [`Batch`]es, the
//! driver runs them and hands back [`Manager::on_reply`] or
//! [`Manager::on_failure`]), and the kernel is reached through a
//! [`GrantSink`].
//!
//! It owns: which keys of which global rule have leases; the hot-key
//! intake; demand measurement from a per-key offered counter; when to send
//! a batch (every refresh interval, at once for a new hot key or to
//! acknowledge a lowered grant); applying replies; ending a lease locally
//! `lease * (1 - epsilon)` after its request was *sent*, which is never
//! after the store ends it; and a store that does not answer: the last
//! grants stay until they end, no rate is ever raised without a reply.
//!
//! Memory is bounded: at most [`HostConfig::max_keys`] keys across all
//! global rules. Past the cap a hot key is refused ([`Intake::OverCap`],
//! counted in [`Stats::over_cap`]) and keeps the default allowance until an
//! idle key (a measured demand of zero) is released and makes room.

use super::allocator::{BatchReply, Call, Item, Limits};
use super::{GlobalRule, Grant, Micros};
use std::collections::{BTreeMap, VecDeque};

/// A demand is measured over a window holding at least this many units
/// (when the history reaches back that far): an eighth of the rate's
/// resolution.
const DEMAND_MIN_UNITS: u64 = 8;

/// What a key with a measured demand of `d` units per second asks for:
/// `d + d/16 + 1`. The excess is bounded (a sixteenth, and one unit), costs
/// only utilisation where capacity is contended (the others' fair shares
/// are computed against it), and never the bound (the allocator caps every
/// grant by what the others leave). Zero stays zero: a release.
pub fn demand_headroom(d: u64) -> u64 {
    if d == 0 {
        0
    } else {
        d.saturating_add(d / 16).saturating_add(1)
    }
}

/// Where grants go: the lead's implementation writes them into the key's
/// bucket in the BPF map; the simulator's is a token bucket per key.
pub trait GrantSink {
    /// Enforce `grant.share` for the key: its rate, its depth (burst
    /// share) and its quota share. The bucket's credit in units must be
    /// kept (capped at the new depth), never scaled up by a higher rate
    /// ([`flowctl_common::gcra::retarget`]).
    fn apply(&mut self, rule: &str, key: &str, grant: &Grant);
    /// The key holds no lease any more: back to the rule's default
    /// allowance (nothing with `default_share = "none"`), credit capped the
    /// same way.
    fn revoke(&mut self, rule: &str, key: &str);
}

/// A host's settings.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// This agent's identity in the store. It must change when the agent
    /// restarts (say hostname and start time): the store rejects a request
    /// whose sequence number is not above the last one it saw from a host.
    pub host: String,
    /// Most keys with (or waiting for) a lease, across all global rules.
    pub max_keys: usize,
    /// A batch without an answer after this long has failed.
    pub timeout: Micros,
}

/// What [`Manager::note_hot`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intake {
    /// A new key: a batch is due at once.
    Added,
    /// Already leased or waiting.
    Known,
    /// At the cap: the key keeps the default allowance.
    OverCap,
    /// Not a global rule this manager knows.
    UnknownRule,
}

/// A batch of one rule's requests, for one script call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub rule: String,
    pub host: String,
    pub seq: u64,
    /// Host clock.
    pub sent_at: Micros,
    pub items: Vec<Item>,
}

impl Batch {
    /// The script call that carries this batch.
    pub fn call<'a>(&'a self, rule: &GlobalRule, candidate_epoch: &'a str) -> Call<'a> {
        Call {
            rule: &self.rule,
            limits: Limits::from(rule),
            candidate_epoch,
            host: &self.host,
            seq: self.seq,
            items: &self.items,
        }
    }
}

/// The store as this host sees it, per rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StoreView {
    /// Nothing asked yet.
    #[default]
    Unknown,
    Ok,
    /// Host clock: the first unanswered batch was sent.
    Unreachable {
        since: Micros,
    },
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub batches: u64,
    pub replies: u64,
    pub failures: u64,
    /// Replies to a batch that was not the last one sent (ignored).
    pub stale_replies: u64,
    pub over_cap: u64,
    /// Leases that ended on the host before a refresh arrived.
    pub expired: u64,
    /// Times the epoch in a reply differed from the one before.
    pub epoch_changes: u64,
}

/// A key's lease, for `status` and `top`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    pub rule: String,
    pub key: String,
    pub grant: Option<Grant>,
    /// Measured offered units per second (None: not measured yet).
    pub demand: Option<u64>,
    /// The store's fair share for this host in the last reply.
    pub target: u64,
    /// Quota units spent here in the key's current window, as last read.
    pub used: u64,
}

#[derive(Clone, Debug, Default)]
struct KeyState {
    lease: Option<Grant>,
    demand: Option<u64>,
    target: u64,
    /// (offered total, host clock): the latest observation, and earlier
    /// ones at least `refresh / 16` apart, oldest first.
    last: Option<(u64, Micros)>,
    history: VecDeque<(u64, Micros)>,
    /// Give the lease back (the agent is stopping): demand 0 from now on.
    release: bool,
    /// Quota units admitted in the key's current window here (the kernel's
    /// ring), as last read, and how long (store clock) until they have all
    /// left it.
    used: u64,
    used_for: Micros,
}

#[derive(Clone, Debug)]
struct InFlight {
    seq: u64,
    sent_at: Micros,
    items: Vec<Item>,
}

#[derive(Clone, Debug)]
struct RuleState {
    spec: GlobalRule,
    keys: BTreeMap<String, KeyState>,
    in_flight: Option<InFlight>,
    next_refresh: Micros,
    urgent: bool,
    store: StoreView,
    epoch: Option<String>,
}

/// One agent's leases.
#[derive(Clone, Debug)]
pub struct Manager {
    cfg: HostConfig,
    rules: BTreeMap<String, RuleState>,
    next_seq: u64,
    stats: Stats,
}

impl Manager {
    pub fn new(cfg: HostConfig) -> Self {
        Self { cfg, rules: BTreeMap::new(), next_seq: 1, stats: Stats::default() }
    }

    pub fn host(&self) -> &str {
        &self.cfg.host
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Adds a global rule, or updates its spec (its keys and leases stay;
    /// the next batch carries the new limits).
    pub fn set_rule(&mut self, spec: GlobalRule) {
        match self.rules.get_mut(&spec.name) {
            Some(r) => r.spec = spec,
            None => {
                let name = spec.name.clone();
                let state = RuleState {
                    spec,
                    keys: BTreeMap::new(),
                    in_flight: None,
                    next_refresh: 0,
                    urgent: false,
                    store: StoreView::Unknown,
                    epoch: None,
                };
                self.rules.insert(name, state);
            }
        }
    }

    /// The spec of a global rule this manager knows.
    pub fn rule(&self, name: &str) -> Option<&GlobalRule> {
        self.rules.get(name).map(|r| &r.spec)
    }

    /// Every global rule this manager knows, by name.
    pub fn rules(&self) -> impl Iterator<Item = &GlobalRule> {
        self.rules.values().map(|r| &r.spec)
    }

    /// Drops a rule: its leased keys go back to the default allowance (the
    /// store's entries end with their leases).
    pub fn remove_rule(&mut self, rule: &str, sink: &mut impl GrantSink) {
        if let Some(r) = self.rules.remove(rule) {
            for (key, k) in r.keys {
                if k.lease.is_some() {
                    sink.revoke(rule, &key);
                }
            }
        }
    }

    fn key_count(&self) -> usize {
        self.rules.values().map(|r| r.keys.len()).sum()
    }

    /// The kernel reports a key of a global rule as hot (refused without a
    /// lease, or demand above half its share). A new key gets a batch at
    /// once.
    pub fn note_hot(&mut self, rule: &str, key: &str, _now: Micros) -> Intake {
        let count = self.key_count();
        let Some(r) = self.rules.get_mut(rule) else { return Intake::UnknownRule };
        if r.keys.contains_key(key) {
            return Intake::Known;
        }
        if count >= self.cfg.max_keys {
            self.stats.over_cap += 1;
            return Intake::OverCap;
        }
        r.keys.insert(key.to_string(), KeyState::default());
        r.urgent = true;
        Intake::Added
    }

    /// The key's offered counter (units, monotonic, refused packets
    /// included) read at `now`; call it at least every `refresh / 8`.
    /// Keys without a lease or a pending one are ignored: only hot keys
    /// are measured.
    pub fn observe(&mut self, rule: &str, key: &str, offered_total: u64, now: Micros) {
        let Some(r) = self.rules.get_mut(rule) else { return };
        let spacing = (r.spec.refresh / 16).max(1);
        let Some(k) = r.keys.get_mut(key) else { return };
        if k.last.is_some_and(|(n, at)| n > offered_total || at > now) {
            // A counter that went backwards (a recreated map entry) restarts.
            k.history.clear();
        }
        k.last = Some((offered_total, now));
        if k.history.back().is_none_or(|(_, at)| now >= at + spacing) {
            k.history.push_back((offered_total, now));
            // At most one refresh interval back, in time, whatever the
            // cadence of the reads: a key whose traffic moved away must
            // not average in what it had more than a refresh ago (with
            // reads every refresh/8, sixteen entries reached back two).
            while k.history.len() > 16
                || k.history.front().is_some_and(|(_, at)| now > at + r.spec.refresh)
            {
                k.history.pop_front();
            }
        }
    }

    /// The quota units the key has admitted in its current window here
    /// and how long until they have all left it, on this host's clock (the
    /// kernel's quota ring, read with the offered count: `window::spent`).
    /// Reported with every request, so the store keeps them reserved that
    /// long; the duration is lengthened by epsilon, so it is never shorter
    /// on the store's clock.
    pub fn observe_used(&mut self, rule: &str, key: &str, used: u64, clear_in: Micros) {
        let Some(r) = self.rules.get_mut(rule) else { return };
        let used_for = r.spec.on_store_clock(clear_in);
        if let Some(k) = r.keys.get_mut(key) {
            (k.used, k.used_for) = (used, used_for);
        }
    }

    /// Ends leases that ran out, gives up on batches past the timeout, and
    /// returns the batches due now (at most one in flight per rule).
    pub fn poll(&mut self, now: Micros, sink: &mut impl GrantSink) -> Vec<Batch> {
        let mut out = Vec::new();
        for (name, r) in &mut self.rules {
            for (key, k) in &mut r.keys {
                if k.lease.is_some_and(|g| now >= g.expires) {
                    k.lease = None;
                    sink.revoke(name, key);
                    self.stats.expired += 1;
                }
            }
            if r.in_flight.as_ref().is_some_and(|f| now >= f.sent_at + self.cfg.timeout) {
                let f = r.in_flight.take().expect("checked");
                Self::mark_unreachable(r, f.sent_at);
                self.stats.failures += 1;
            }
            let due = r.urgent || now >= r.next_refresh;
            if r.in_flight.is_some() || !due || r.keys.is_empty() {
                continue;
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            let refresh = r.spec.refresh;
            let ask = r.spec.rate;
            let items: Vec<Item> = r
                .keys
                .iter_mut()
                .map(|(key, k)| Item {
                    key: key.clone(),
                    demand: Self::measure(k, refresh, ask),
                    held: k.lease.map(|g| g.share).unwrap_or_default(),
                    used: k.used,
                    used_for: k.used_for,
                })
                .collect();
            r.in_flight = Some(InFlight { seq, sent_at: now, items: items.clone() });
            r.next_refresh = now + refresh;
            r.urgent = false;
            self.stats.batches += 1;
            out.push(Batch {
                rule: name.clone(),
                host: self.cfg.host.clone(),
                seq,
                sent_at: now,
                items,
            });
        }
        out
    }

    /// Demand in units per second: the offered rate over the most recent
    /// quarter of a refresh interval (recent, so that a key whose traffic
    /// moved away gives its share back at its next batch), or further back,
    /// up to the whole history, until the window holds at least
    /// [`DEMAND_MIN_UNITS`] (a light key's quarter interval holds two or
    /// three packets, and a rate measured from them swings by a third
    /// between batches), unless that longer window's rate would have put
    /// twice as many in the quarter: then the traffic fell, and the
    /// quarter's rate is the demand (a key moved to another host gives its
    /// share back at its next batch, not one later). What the store is asked for is that plus
    /// [`demand_headroom`]: a grant of exactly the measured rate would
    /// refuse whatever the measurement missed. A key not measured yet asks
    /// for the whole rate (the allocator gives it its fair share). A
    /// measured zero releases the lease (no demand, no grant); once that is
    /// acknowledged the key is forgotten.
    fn measure(k: &mut KeyState, refresh: Micros, ask: u64) -> u64 {
        if k.release {
            return 0;
        }
        if let Some((n1, at1)) = k.last {
            let rate = |(n0, at0): (u64, Micros)| {
                let d = (n1 - n0) as u128 * 1_000_000 / (at1 - at0).max(1) as u128;
                d.min(u64::MAX as u128) as u64
            };
            let mut back = k.history.iter().rev().filter(|(_, at)| at1 >= at + refresh / 4);
            let quarter = back.next().copied();
            let mut window = quarter;
            while window.is_some_and(|(n0, _)| n1 - n0 < DEMAND_MIN_UNITS) {
                match back.next() {
                    Some(&w) => window = Some(w),
                    None => break,
                }
            }
            if let (Some(q), Some(w)) = (quarter, window) {
                // The longer window's rate would have put at least twice
                // DEMAND_MIN_UNITS in the quarter, which got fewer than
                // DEMAND_MIN_UNITS: the traffic fell (moved away), it is
                // not a light key's chance silence. The quarter says so.
                let expected = rate(w) as u128 * (at1 - q.1) as u128 / 1_000_000;
                let fell = expected >= 2 * DEMAND_MIN_UNITS as u128;
                k.demand = Some(if fell { rate(q) } else { rate(w) });
            }
        }
        k.demand.map_or(ask, demand_headroom)
    }

    fn mark_unreachable(r: &mut RuleState, since: Micros) {
        if !matches!(r.store, StoreView::Unreachable { .. }) {
            r.store = StoreView::Unreachable { since };
        }
    }

    /// The store's answer to batch `seq` of `rule`. Only the answer to the
    /// last batch sent is applied: an older one may have been overtaken by
    /// a request that reported a different `held`.
    pub fn on_reply(
        &mut self,
        rule: &str,
        seq: u64,
        reply: &BatchReply,
        now: Micros,
        sink: &mut impl GrantSink,
    ) {
        let Some(r) = self.rules.get_mut(rule) else { return };
        let Some(f) = r.in_flight.take_if(|f| f.seq == seq) else {
            self.stats.stale_replies += 1;
            return;
        };
        self.stats.replies += 1;
        r.store = StoreView::Ok;
        if r.epoch.as_ref().is_some_and(|e| *e != reply.epoch) {
            self.stats.epoch_changes += 1;
        }
        r.epoch = Some(reply.epoch.clone());
        let expires = f.sent_at + r.spec.local_lease();
        for (Item { key, held, demand, .. }, rep) in f.items.iter().zip(&reply.replies) {
            let Some(k) = r.keys.get_mut(key) else { continue };
            if !rep.fresh {
                continue;
            }
            k.target = rep.target;
            if rep.grant.rate * 10 < rep.target * 9 {
                // Below 90% of the fair share: the others are giving back;
                // ask again at half the interval.
                r.next_refresh = r.next_refresh.min(now + r.spec.refresh / 2);
            }
            if rep.grant.rate == 0 || now >= expires {
                // No positive lease: the default allowance.
                if k.lease.take().is_some() {
                    sink.revoke(rule, key);
                }
                if *demand == 0 && held.is_zero() {
                    // Released and acknowledged.
                    r.keys.remove(key);
                } else if *demand == 0 || !held.is_zero() {
                    // Acknowledge the release (or the cut to zero) at once.
                    r.urgent = true;
                }
                continue;
            }
            let grant = Grant { share: rep.grant, expires, learning: rep.learning };
            if k.lease.is_some_and(|old| old.share.exceeds(&rep.grant)) {
                // A cut keeps its capacity reserved until acknowledged:
                // acknowledge it at once so the others get it sooner.
                r.urgent = true;
            }
            k.lease = Some(grant);
            sink.apply(rule, key, &grant);
        }
    }

    /// Batch `seq` of `rule` failed (the store is unreachable, or refused
    /// it): the grants stay until they end; the next batch goes at the next
    /// refresh.
    pub fn on_failure(&mut self, rule: &str, seq: u64, _now: Micros) {
        let Some(r) = self.rules.get_mut(rule) else { return };
        if let Some(f) = r.in_flight.take_if(|f| f.seq == seq) {
            Self::mark_unreachable(r, f.sent_at);
            self.stats.failures += 1;
        }
    }

    /// Gives every lease back at once (an agent stopping cleanly): the next
    /// batches ask for nothing, then acknowledge, and the store frees the
    /// capacity without waiting for the leases to end. Done when
    /// [`leases`](Self::leases) is empty.
    pub fn release_all(&mut self) {
        for r in self.rules.values_mut() {
            r.keys.values_mut().for_each(|k| k.release = true);
            r.urgent |= !r.keys.is_empty();
        }
    }

    /// When [`poll`](Self::poll) has work next (a batch due, a timeout, a
    /// lease ending); None with no keys.
    pub fn next_wakeup(&self) -> Option<Micros> {
        let mut at: Option<Micros> = None;
        let mut earliest = |t: Micros| at = Some(at.map_or(t, |a| a.min(t)));
        for r in self.rules.values() {
            if let Some(f) = &r.in_flight {
                earliest(f.sent_at + self.cfg.timeout);
            } else if !r.keys.is_empty() {
                earliest(if r.urgent { 0 } else { r.next_refresh });
            }
            for k in r.keys.values() {
                if let Some(g) = k.lease {
                    earliest(g.expires);
                }
            }
        }
        at
    }

    /// The store as `rule`'s last batch saw it.
    pub fn store_view(&self, rule: &str) -> Option<&StoreView> {
        self.rules.get(rule).map(|r| &r.store)
    }

    /// The epoch of the last reply for `rule`.
    pub fn epoch(&self, rule: &str) -> Option<&str> {
        self.rules.get(rule).and_then(|r| r.epoch.as_deref())
    }

    /// The lease a key holds now (None: the default allowance).
    pub fn lease(&self, rule: &str, key: &str) -> Option<Grant> {
        self.rules.get(rule)?.keys.get(key)?.lease
    }

    /// Every key with or waiting for a lease.
    pub fn leases(&self) -> Vec<LeaseView> {
        let mut out = Vec::new();
        for (rule, r) in &self.rules {
            for (key, k) in &r.keys {
                out.push(LeaseView {
                    rule: rule.clone(),
                    key: key.clone(),
                    grant: k.lease,
                    demand: k.demand,
                    target: k.target,
                    used: k.used,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::allocator::{Limits, Memory};
    use super::super::Share;
    use super::*;

    #[derive(Default)]
    struct Sink(BTreeMap<(String, String), Share>);

    impl GrantSink for Sink {
        fn apply(&mut self, rule: &str, key: &str, grant: &Grant) {
            self.0.insert((rule.into(), key.into()), grant.share);
        }
        fn revoke(&mut self, rule: &str, key: &str) {
            self.0.remove(&(rule.to_string(), key.to_string()));
        }
    }

    fn setup(max_keys: usize) -> (Manager, GlobalRule, Memory) {
        let rule = GlobalRule::new("web", 1000, 100);
        let mut m = Manager::new(HostConfig { host: "a".into(), max_keys, timeout: 200_000 });
        m.set_rule(rule.clone());
        let mut store = Memory::default();
        // A store that has been up for a while (past its learning lease).
        store.bootstrap("web", Limits::from(&rule), "e", 0);
        (m, rule, store)
    }

    fn exchange(
        m: &mut Manager,
        store: &mut Memory,
        rule: &GlobalRule,
        now: Micros,
        sink: &mut Sink,
    ) {
        for b in m.poll(now, sink) {
            let r = store.run_batch(&b.call(rule, "x"), now + 10_000_000);
            m.on_reply(&b.rule, b.seq, &r, now + 1000, sink);
        }
    }

    #[test]
    fn a_hot_key_gets_a_lease_at_once_and_it_ends_locally_first() {
        let (mut m, rule, mut store) = setup(10);
        let mut sink = Sink::default();
        assert_eq!(m.note_hot("web", "k", 0), Intake::Added);
        assert_eq!(m.next_wakeup(), Some(0));
        exchange(&mut m, &mut store, &rule, 0, &mut sink);
        let g = m.lease("web", "k").expect("lease");
        assert_eq!(g.share.rate, 1000);
        assert_eq!(g.expires, rule.local_lease());
        assert!(g.expires < rule.lease);
        // Nothing answers any more: the grant stays until it ends, then the
        // key is back on the default allowance.
        let batches = m.poll(rule.refresh, &mut sink);
        assert_eq!(batches.len(), 1);
        m.on_failure("web", batches[0].seq, rule.refresh + 1);
        assert_eq!(m.store_view("web"), Some(&StoreView::Unreachable { since: rule.refresh }));
        assert!(sink.0.contains_key(&("web".into(), "k".into())));
        m.poll(rule.local_lease(), &mut sink);
        assert!(m.lease("web", "k").is_none() && sink.0.is_empty());
    }

    #[test]
    fn replies_to_an_overtaken_batch_are_ignored() {
        let (mut m, rule, mut store) = setup(10);
        let mut sink = Sink::default();
        m.note_hot("web", "k", 0);
        let first = m.poll(0, &mut sink).remove(0);
        // Timed out; the next one goes at the next refresh.
        let later = m.poll(rule.refresh, &mut sink).remove(0);
        let r1 = store.run_batch(&first.call(&rule, "e"), 20_000_000);
        m.on_reply("web", first.seq, &r1, rule.refresh + 10, &mut sink);
        assert_eq!(m.stats().stale_replies, 1);
        assert!(m.lease("web", "k").is_none());
        let r2 = store.run_batch(&later.call(&rule, "e"), 20_000_001);
        m.on_reply("web", later.seq, &r2, rule.refresh + 20, &mut sink);
        assert!(m.lease("web", "k").is_some());
    }

    #[test]
    fn the_cap_refuses_keys_and_idle_keys_make_room() {
        let (mut m, rule, mut store) = setup(1);
        let mut sink = Sink::default();
        assert_eq!(m.note_hot("web", "k1", 0), Intake::Added);
        assert_eq!(m.note_hot("web", "k2", 0), Intake::OverCap);
        m.observe("web", "k1", 0, 0);
        exchange(&mut m, &mut store, &rule, 0, &mut sink);
        // No traffic: released, acknowledged, gone.
        let mut now = 0;
        for _ in 0..3 {
            now += rule.refresh;
            m.observe("web", "k1", 0, now);
            exchange(&mut m, &mut store, &rule, now, &mut sink);
            exchange(&mut m, &mut store, &rule, now + 1, &mut sink);
        }
        assert!(m.leases().is_empty(), "{:?}", m.leases());
        assert!(store.cell("web", "k1").hosts.is_empty());
        assert_eq!(m.note_hot("web", "k2", now), Intake::Added);
    }

    #[test]
    fn release_all_gives_the_capacity_back() {
        let (mut m, rule, mut store) = setup(10);
        let mut sink = Sink::default();
        m.note_hot("web", "k", 0);
        exchange(&mut m, &mut store, &rule, 0, &mut sink);
        assert!(!store.cell("web", "k").hosts.is_empty());
        m.release_all();
        exchange(&mut m, &mut store, &rule, 1, &mut sink);
        exchange(&mut m, &mut store, &rule, 2, &mut sink);
        assert!(m.leases().is_empty() && sink.0.is_empty());
        assert!(store.cell("web", "k").hosts.is_empty());
    }

    #[test]
    fn demand_is_the_offered_rate() {
        let (mut m, rule, mut store) = setup(10);
        let mut sink = Sink::default();
        m.note_hot("web", "k", 0);
        m.observe("web", "k", 0, 0);
        exchange(&mut m, &mut store, &rule, 0, &mut sink);
        m.observe("web", "k", 300, rule.refresh);
        let b = m.poll(rule.refresh, &mut sink);
        assert_eq!(b[0].items[0].demand, demand_headroom(300));
        assert_eq!(m.leases()[0].demand, Some(300), "status shows what was measured");
    }

    #[test]
    fn a_light_key_asks_for_at_least_its_paced_rate() {
        // 20 units per second, one every 50 ms, refresh 500 ms: a quarter
        // interval holds two or three units (16/s or 24/s measured); the
        // window grows until it holds eight.
        let (mut m, rule, mut store) = setup(10);
        let mut sink = Sink::default();
        m.note_hot("web", "k", 0);
        let step = rule.refresh / 16;
        let mut asked = Vec::new();
        let mut now = 0;
        while now < 20 * rule.refresh {
            m.observe("web", "k", now / 50_000, now);
            for b in m.poll(now, &mut sink) {
                if now >= 2 * rule.refresh {
                    asked.push(b.items[0].demand);
                }
                let r = store.run_batch(&b.call(&rule, "x"), now + 10_000_000);
                m.on_reply(&b.rule, b.seq, &r, now + 1000, &mut sink);
            }
            now += step;
        }
        assert!(asked.len() >= 15, "{asked:?}");
        assert!(asked.iter().all(|d| (20..=24).contains(d)), "asked for {asked:?}");
    }

    #[test]
    fn a_key_whose_traffic_moved_away_asks_for_nothing_at_its_next_batch() {
        // 4,000 units per second for 10 refreshes, then silence (the key
        // moved to another host), read every refresh/8 as the agent does.
        let (mut m, rule, mut store) = setup(10);
        let mut sink = Sink::default();
        m.note_hot("web", "k", 0);
        let step = rule.refresh / 8;
        let moved = 10 * rule.refresh + 3 * step;
        let offered = |t: Micros| t.min(moved) * 4_000 / 1_000_000;
        let mut after = Vec::new();
        let mut now = 0;
        while now < moved + 2 * rule.refresh {
            m.observe("web", "k", offered(now), now);
            for b in m.poll(now, &mut sink) {
                if now > moved + rule.refresh / 4 {
                    after.push((now - moved, b.items[0].demand));
                }
                let r = store.run_batch(&b.call(&rule, "x"), now + 10_000_000);
                m.on_reply(&b.rule, b.seq, &r, now + 1000, &mut sink);
            }
            now += step;
        }
        // The first batch a quarter refresh after the move reports no
        // demand (the old window reached back past the move: 708/s).
        assert_eq!(after.first().map(|a| a.1), Some(0), "{after:?}");
    }
}
