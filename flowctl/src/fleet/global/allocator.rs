//! The lease allocator: a pure function of one (rule, key) cell as the
//! store keeps it, one host's request and the store's clock, giving the
//! cell's new state and the host's grant. `lease.lua` is the same algorithm,
//! step for step, run atomically in Redis; the differential test in the
//! `fleet` target holds them to the same outputs. [`Memory`] is a store
//! made of this function (the simulator's Redis).
//!
//! The algorithm (docs/fleet.md, "Global limits"), in the order both sides
//! run it:
//! 1. drop the cell's entries whose lease has ended (`expires <= now`);
//! 2. a request whose `seq` is not above the host's stored one is stale
//!    (a retry that arrived late): nothing changes for it;
//! 3. a host that says it holds more than the cell reserves for it proves
//!    the store lost state the epoch did not reveal (an eviction, a
//!    failover to a replica that missed writes): the cell learns for one
//!    lease;
//! 4. the others' reservation is the sum of `max(granted, acked)` over
//!    their live entries: a lowered grant keeps its old capacity until the
//!    host acknowledges it (its next request's `held`) or its lease ends;
//! 5. the host's target is its demand-weighted max-min fair share of L
//!    ([`fair_share`]);
//! 6. the grant is the target (learning: what the host holds), capped by
//!    what the others leave unreserved, so the sum of reservations never
//!    exceeds L; the burst and quota shares follow the rate's proportion of
//!    L, capped the same way.

use super::{GlobalRule, Micros, Share, MAX_AMOUNT, SHARE_ONE};
use std::collections::BTreeMap;

/// A host's entry in a cell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// The last grant the store made to this host.
    pub granted: Share,
    /// What the host said it held in its last request.
    pub acked: Share,
    /// The host's demand, units per second.
    pub demand: u64,
    /// Store clock: the lease ends.
    pub expires: Micros,
    /// The host's last request's sequence number.
    pub seq: u64,
}

impl Entry {
    /// What the entry keeps from the others: `max(granted, acked)`.
    pub fn reserved(&self) -> Share {
        self.granted.max(self.acked)
    }

    /// The hash field's value, as `lease.lua` writes it.
    pub fn encode(&self) -> String {
        let (g, a) = (self.granted, self.acked);
        format!(
            "{},{},{},{},{},{},{},{},{}",
            g.rate, g.burst, g.quota, a.rate, a.burst, a.quota, self.demand, self.expires, self.seq
        )
    }

    pub fn decode(s: &str) -> Option<Entry> {
        let v: Vec<u64> = s.split(',').map(|x| x.parse().ok()).collect::<Option<_>>()?;
        let [gr, gb, gq, ar, ab, aq, demand, expires, seq] = v[..] else { return None };
        Some(Entry {
            granted: Share { rate: gr, burst: gb, quota: gq },
            acked: Share { rate: ar, burst: ab, quota: aq },
            demand,
            expires,
            seq,
        })
    }
}

/// The hash field of a host's entry.
pub fn host_field(host: &str) -> String {
    format!("h:{host}")
}

/// The hash field of a cell's learning deadline.
pub const LEARN_FIELD: &str = "learn";

/// One (rule, key) cell: a Redis hash.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cell {
    /// Store clock: the cell grants no increases before this.
    pub learn_until: Micros,
    pub hosts: BTreeMap<String, Entry>,
}

impl Cell {
    /// The sum of every entry's reservation.
    pub fn reserved(&self) -> Share {
        self.hosts.values().fold(Share::ZERO, |s, e| add(s, e.reserved()))
    }

    /// Whether the store drops the cell (nothing to remember).
    pub fn is_empty_at(&self, now: Micros) -> bool {
        self.hosts.is_empty() && self.learn_until <= now
    }

    /// The cell from a hash's fields (HGETALL), as `lease.lua` reads it.
    pub fn from_fields<'a>(fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<Cell> {
        let mut cell = Cell::default();
        for (f, v) in fields {
            if f == LEARN_FIELD {
                cell.learn_until = v.parse().ok()?;
            } else if let Some(host) = f.strip_prefix("h:") {
                cell.hosts.insert(host.to_string(), Entry::decode(v)?);
            }
        }
        Some(cell)
    }
}

/// A rule's record in the store: its epoch and rule-wide learning deadline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    /// A random value written when the record was created; a host that sees
    /// it change knows the store lost its state.
    pub epoch: String,
    pub learn_until: Micros,
}

/// The record as it is after a call: a missing one (a new or flushed
/// store) is created with `candidate` as its epoch and learns for one lease,
/// since hosts may still enforce leases the store no longer knows.
pub fn open_meta(meta: Option<Meta>, candidate: &str, lease: Micros, now: Micros) -> Meta {
    meta.unwrap_or_else(|| Meta { epoch: candidate.to_string(), learn_until: now + lease })
}

/// The rule as the allocator uses it (what the script gets in ARGV).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub rate: u64,
    pub burst: u64,
    pub quota: u64,
    pub lease: Micros,
}

impl From<&GlobalRule> for Limits {
    fn from(r: &GlobalRule) -> Self {
        Limits { rate: r.rate, burst: r.burst, quota: r.quota_total(), lease: r.lease }
    }
}

/// One host's request for one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub host: String,
    /// Increases with every request the host sends (one per batch).
    pub seq: u64,
    /// What the host enforces for the key as it sends (zero: no lease).
    pub held: Share,
    /// Offered units per second (the host asks for L when it has not
    /// measured yet); 0 releases the lease.
    pub demand: u64,
}

/// The store's answer for one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    /// false: the request was stale and changed nothing; `grant` is then
    /// the stored one, for information only.
    pub fresh: bool,
    pub grant: Share,
    /// The host's fair share of the rate (what it will get once the
    /// others have given back).
    pub target: u64,
    /// Store clock: when the grant's lease ends there.
    pub expires: Micros,
    /// The cell is learning: the grant echoes what the host holds.
    pub learning: bool,
}

fn add(a: Share, b: Share) -> Share {
    Share { rate: a.rate + b.rate, burst: a.burst + b.burst, quota: a.quota + b.quota }
}

/// `floor(total * part / whole)` in the two steps `lease.lua` takes, so
/// that no product reaches 2^53: `part <= whole <= MAX_AMOUNT` and
/// `total <= MAX_AMOUNT`.
pub fn proportion(total: u64, part: u64, whole: u64) -> u64 {
    if whole == 0 {
        return 0;
    }
    let w = part * SHARE_ONE / whole;
    total * w / SHARE_ONE
}

/// A host's demand-weighted max-min fair share of `capacity`, given every
/// live host's demand (`demands`, the host's own included) and its own
/// (`mine`). When the demands fit, every host gets its demand plus a part
/// of the spare capacity in proportion to its demand (headroom for growth);
/// when they do not, water-filling: hosts below the level get their demand,
/// the rest the level. Rounded down: the shares sum to at most `capacity`.
pub fn fair_share(capacity: u64, demands: &[u64], mine: u64) -> u64 {
    if mine == 0 {
        return 0;
    }
    let total: u64 = demands.iter().sum();
    if total <= capacity {
        let w = mine * SHARE_ONE / total;
        return mine + (capacity - total) * w / SHARE_ONE;
    }
    let mut sorted: Vec<u64> = demands.iter().copied().filter(|d| *d > 0).collect();
    sorted.sort_unstable();
    let (mut rem, mut k) = (capacity, sorted.len() as u64);
    for d in sorted {
        if d * k > rem {
            break;
        }
        rem -= d;
        k -= 1;
    }
    // k >= 1: the demands do not fit, so not all of them were met.
    mine.min(rem / k.max(1))
}

/// One step of the allocator: the cell after `req`, and the reply.
pub fn allocate(
    limits: &Limits,
    meta: &Meta,
    mut cell: Cell,
    req: &Request,
    now: Micros,
) -> (Cell, Reply) {
    let held = Share {
        rate: req.held.rate.min(MAX_AMOUNT),
        burst: req.held.burst.min(MAX_AMOUNT),
        quota: req.held.quota.min(MAX_AMOUNT),
    };
    // 1. Leases that ended in the store.
    cell.hosts.retain(|_, e| e.expires > now);

    // 2. Stale: a later request of this host was already served.
    if let Some(e) = cell.hosts.get(&req.host) {
        if req.seq <= e.seq {
            let learning = meta.learn_until.max(cell.learn_until) > now;
            let reply =
                Reply { fresh: false, grant: e.granted, target: 0, expires: e.expires, learning };
            return (cell, reply);
        }
    }

    // 3. The host holds more than the store knows: state was lost.
    let mine = cell.hosts.get(&req.host).map(Entry::reserved).unwrap_or_default();
    if held.exceeds(&mine) {
        cell.learn_until = cell.learn_until.max(now + limits.lease);
    }
    let learning = meta.learn_until.max(cell.learn_until) > now;

    // 4. What the others keep.
    let others = cell
        .hosts
        .iter()
        .filter(|(h, _)| **h != req.host)
        .fold(Share::ZERO, |s, (_, e)| add(s, e.reserved()));
    let free = Share {
        rate: limits.rate.saturating_sub(others.rate),
        burst: limits.burst.saturating_sub(others.burst),
        quota: limits.quota.saturating_sub(others.quota),
    };

    // 5. The fair share.
    let demand = req.demand.min(MAX_AMOUNT);
    let mut demands: Vec<u64> =
        cell.hosts.iter().filter(|(h, _)| **h != req.host).map(|(_, e)| e.demand).collect();
    demands.push(demand);
    let target = fair_share(limits.rate, &demands, demand);

    // 6. The grant: never more than the others leave.
    let grant = if learning {
        Share {
            rate: held.rate.min(free.rate),
            burst: held.burst.min(free.burst),
            quota: held.quota.min(free.quota),
        }
    } else {
        let rate = target.min(free.rate);
        Share {
            rate,
            burst: proportion(limits.burst, rate, limits.rate).min(free.burst),
            quota: proportion(limits.quota, rate, limits.rate).min(free.quota),
        }
    };
    let expires = now + limits.lease;
    if grant.is_zero() && held.is_zero() && demand == 0 {
        // Released and acknowledged: nothing left to remember.
        cell.hosts.remove(&req.host);
    } else {
        let entry = Entry { granted: grant, acked: held, demand, expires, seq: req.seq };
        cell.hosts.insert(req.host.clone(), entry);
    }
    (cell, Reply { fresh: true, grant, target, expires, learning })
}

/// One key of a batch: (key, held, demand).
pub type Item = (String, Share, u64);

/// A batch's answer: the rule's epoch and one reply per item, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchReply {
    pub epoch: String,
    pub replies: Vec<Reply>,
}

/// One script call: one host's batch for one rule (what `lease.lua` gets
/// in KEYS and ARGV).
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    pub rule: &'a str,
    pub limits: Limits,
    /// The epoch to write if the rule's record is missing.
    pub candidate_epoch: &'a str,
    pub host: &'a str,
    pub seq: u64,
    pub items: &'a [Item],
}

/// A store made of [`allocate`]: what `lease.lua` does to Redis, in
/// memory (the simulator's Redis, the differential test's reference).
#[derive(Clone, Debug, Default)]
pub struct Memory {
    pub metas: BTreeMap<String, Meta>,
    pub cells: BTreeMap<(String, String), Cell>,
}

impl Memory {
    /// One script call: a batch of one host's items for one rule.
    pub fn run_batch(&mut self, call: &Call<'_>, now: Micros) -> BatchReply {
        let Call { rule, limits, candidate_epoch, host, seq, items } = *call;
        let meta = open_meta(self.metas.remove(rule), candidate_epoch, limits.lease, now);
        let mut replies = Vec::with_capacity(items.len());
        for (key, held, demand) in items {
            let id = (rule.to_string(), key.clone());
            let cell = self.cells.remove(&id).unwrap_or_default();
            let req = Request { host: host.to_string(), seq, held: *held, demand: *demand };
            let (cell, reply) = allocate(&limits, &meta, cell, &req, now);
            if !cell.is_empty_at(now) {
                self.cells.insert(id, cell);
            }
            replies.push(reply);
        }
        let epoch = meta.epoch.clone();
        self.metas.insert(rule.to_string(), meta);
        BatchReply { epoch, replies }
    }

    /// Creates the rule's record at `now` (a store up since then), as the
    /// first call would.
    pub fn bootstrap(&mut self, rule: &str, limits: Limits, epoch: &str, now: Micros) {
        let call = Call { rule, limits, candidate_epoch: epoch, host: "", seq: 0, items: &[] };
        self.run_batch(&call, now);
    }

    /// FLUSHALL.
    pub fn flush(&mut self) {
        self.metas.clear();
        self.cells.clear();
    }

    /// The cell as stored (empty when absent).
    pub fn cell(&self, rule: &str, key: &str) -> Cell {
        self.cells.get(&(rule.to_string(), key.to_string())).cloned().unwrap_or_default()
    }

    /// The sum of live reservations in a cell at `now`.
    pub fn reserved(&self, rule: &str, key: &str, now: Micros) -> Share {
        let cell = self.cell(rule, key);
        cell.hosts
            .values()
            .filter(|e| e.expires > now)
            .fold(Share::ZERO, |s, e| add(s, e.reserved()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIM: Limits = Limits { rate: 1000, burst: 200, quota: 0, lease: 10_000_000 };

    fn meta() -> Meta {
        Meta { epoch: "e".into(), learn_until: 0 }
    }

    fn req(host: &str, seq: u64, held: Share, demand: u64) -> Request {
        Request { host: host.into(), seq, held, demand }
    }

    #[test]
    fn fair_share_water_fills() {
        assert_eq!(fair_share(100, &[10, 200, 300], 10), 10);
        assert_eq!(fair_share(100, &[10, 200, 300], 200), 45);
        assert_eq!(fair_share(100, &[10, 200, 300], 300), 45);
        // Fits: demand plus spare in proportion (20 + 50 * 0.4, rounded down).
        assert_eq!(fair_share(100, &[20, 30], 20), 39);
        // 0.6 in 2^20 parts rounds down, so 29 of the spare 50, not 30.
        assert_eq!(fair_share(100, &[20, 30], 30), 59);
        assert_eq!(fair_share(100, &[0, 30], 0), 0);
        assert_eq!(fair_share(3, &[5, 5, 5, 5], 5), 0);
    }

    #[test]
    fn a_lower_grant_keeps_its_capacity_until_acknowledged() {
        let now = 1_000_000;
        let (cell, r) =
            allocate(&LIM, &meta(), Cell::default(), &req("a", 1, Share::ZERO, 5000), now);
        assert_eq!(r.grant, Share { rate: 1000, burst: 200, quota: 0 });
        // b asks: a still reserves everything, so b gets nothing yet.
        let (cell, r) = allocate(&LIM, &meta(), cell, &req("b", 1, Share::ZERO, 5000), now + 1);
        assert_eq!((r.grant.rate, r.target), (0, 500));
        // a refreshes without having applied anything new: lowered to 500,
        // but it still holds 1000, so b still gets nothing.
        let held_a = Share { rate: 1000, burst: 200, quota: 0 };
        let (cell, r) = allocate(&LIM, &meta(), cell, &req("a", 2, held_a, 5000), now + 2);
        assert_eq!(r.grant.rate, 500);
        let (cell, r) = allocate(&LIM, &meta(), cell, &req("b", 2, Share::ZERO, 5000), now + 3);
        assert_eq!(r.grant.rate, 0);
        // a acknowledges 500: b gets the rest.
        let held_a = Share { rate: 500, burst: 100, quota: 0 };
        let (cell, _) = allocate(&LIM, &meta(), cell, &req("a", 3, held_a, 5000), now + 4);
        let (cell, r) = allocate(&LIM, &meta(), cell, &req("b", 3, Share::ZERO, 5000), now + 5);
        assert_eq!(r.grant, Share { rate: 500, burst: 100, quota: 0 });
        assert!(cell.reserved().rate <= 1000 && cell.reserved().burst <= 200);
    }

    #[test]
    fn stale_requests_change_nothing() {
        let (cell, _) = allocate(&LIM, &meta(), Cell::default(), &req("a", 5, Share::ZERO, 10), 1);
        let (after, r) = allocate(&LIM, &meta(), cell.clone(), &req("a", 4, Share::ZERO, 900), 2);
        assert!(!r.fresh);
        assert_eq!(after, cell);
    }

    #[test]
    fn holding_more_than_stored_starts_learning() {
        let held = Share { rate: 600, burst: 120, quota: 0 };
        let (cell, r) = allocate(&LIM, &meta(), Cell::default(), &req("a", 1, held, 5000), 100);
        assert!(r.learning);
        assert_eq!(r.grant, held);
        assert_eq!(cell.learn_until, 100 + LIM.lease);
        // Another host gets no increase while the cell learns.
        let (_, r) = allocate(&LIM, &meta(), cell, &req("b", 1, Share::ZERO, 5000), 200);
        assert_eq!(r.grant, Share::ZERO);
    }

    #[test]
    fn release_then_ack_forgets_the_host() {
        let (cell, r) = allocate(&LIM, &meta(), Cell::default(), &req("a", 1, Share::ZERO, 100), 1);
        let (cell, _) = allocate(&LIM, &meta(), cell, &req("a", 2, r.grant, 0), 2);
        assert_eq!(cell.hosts["a"].reserved(), r.grant);
        let (cell, _) = allocate(&LIM, &meta(), cell, &req("a", 3, Share::ZERO, 0), 3);
        assert!(cell.hosts.is_empty());
    }

    #[test]
    fn a_new_store_learns_for_one_lease() {
        let mut m = Memory::default();
        let items = vec![("k".to_string(), Share::ZERO, 100)];
        let call = |epoch, seq| Call {
            rule: "r",
            limits: LIM,
            candidate_epoch: epoch,
            host: "a",
            seq,
            items: &items,
        };
        let r = m.run_batch(&call("e1", 1), 50);
        assert!(r.replies[0].learning && r.replies[0].grant.is_zero() && r.epoch == "e1");
        let r = m.run_batch(&call("e2", 2), 50 + LIM.lease);
        assert!(!r.replies[0].learning && r.replies[0].grant.rate == 1000 && r.epoch == "e1");
    }

    #[test]
    fn entries_round_trip() {
        let e = Entry {
            granted: Share { rate: 1, burst: 2, quota: 3 },
            acked: Share { rate: 4, burst: 5, quota: 6 },
            demand: 7,
            expires: 1_764_000_000_000_000,
            seq: 9,
        };
        assert_eq!(Entry::decode(&e.encode()), Some(e));
        assert_eq!(Entry::decode("1,2"), None);
    }

    proptest! {
        /// Whatever the hosts say (held within what they were granted, any
        /// demands, any order, stale retries), the sum of reservations
        /// stays within L, B and Q, and nobody is granted above its fair
        /// share.
        #[test]
        fn reservations_never_exceed_the_limits(
            steps in proptest::collection::vec((0usize..6, 0u64..3000, 0u64..3, 0u64..2_000_000), 1..200),
            rate in 1u64..5000, burst in 1u64..5000, quota in 0u64..5000,
        ) {
            let lim = Limits { rate, burst, quota, lease: 3_000_000 };
            let mut cell = Cell::default();
            let mut held: BTreeMap<String, Share> = BTreeMap::new();
            let mut seqs = [0u64; 6];
            let mut now = 10;
            for (h, demand, lag, dt) in steps {
                now += dt;
                let host = format!("h{h}");
                seqs[h] += 1;
                // A lagging host retries an old sequence number.
                let seq = seqs[h].saturating_sub(lag);
                // What the host holds: its last applied grant while its
                // lease lives (it expires earlier on the host).
                let mine = cell.hosts.get(&host).filter(|e| e.expires > now).map(|e| e.reserved());
                let h_held = held.get(&host).copied().filter(|_| mine.is_some()).unwrap_or_default();
                let (c, r) = allocate(&lim, &meta(), cell, &req(&host, seq, h_held, demand), now);
                cell = c;
                if r.fresh {
                    prop_assert!(r.grant.rate <= r.target.max(h_held.rate));
                    held.insert(host, r.grant);
                }
                let sum = cell.reserved();
                prop_assert!(sum.rate <= rate && sum.burst <= burst && sum.quota <= quota, "{sum:?}");
            }
        }
    }
}
