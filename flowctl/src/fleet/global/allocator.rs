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
//!
//! Quotas add one thing: what a host has already admitted in its quota
//! window (`used`, reported with each request) stays reserved until it has
//! left every window (`used_for` after the report, which the host derives
//! from its kernel's ring, at most `quota_window`), even when the host's
//! lease ends first (the entry lingers with only that). So a quota
//! moved from one host to another is never spent twice in one window
//! (docs/design.md, "Global quotas").

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
    /// Quota units the host had admitted in its window when it last asked.
    pub used: u64,
    /// Store clock: `used` has left every quota window.
    pub used_until: Micros,
}

impl Entry {
    /// What the entry keeps from the others at `now`: `max(granted, acked)`
    /// while its lease lives, and the quota it used while that is still in
    /// a window (also after the lease ended).
    pub fn reserved(&self, now: Micros) -> Share {
        let used = if self.used_until > now { self.used } else { 0 };
        let mut r = if self.expires > now { self.granted.max(self.acked) } else { Share::ZERO };
        r.quota = r.quota.max(used);
        r
    }

    /// Whether the store still needs the entry at `now`.
    pub fn lives(&self, now: Micros) -> bool {
        self.expires > now || (self.used > 0 && self.used_until > now)
    }

    /// The hash field's value, as `lease.lua` writes it.
    pub fn encode(&self) -> String {
        let (g, a) = (self.granted, self.acked);
        format!(
            "{},{},{},{},{},{},{},{},{},{},{}",
            g.rate,
            g.burst,
            g.quota,
            a.rate,
            a.burst,
            a.quota,
            self.demand,
            self.expires,
            self.seq,
            self.used,
            self.used_until
        )
    }

    /// A hash field's value; one of nine numbers (written before quotas
    /// were split, during a rolling upgrade) has nothing used.
    pub fn decode(s: &str) -> Option<Entry> {
        let v: Vec<u64> = s.split(',').map(|x| x.parse().ok()).collect::<Option<_>>()?;
        let (used, used_until) = match v.len() {
            9 => (0, 0),
            11 => (v[9], v[10]),
            _ => return None,
        };
        let [gr, gb, gq, ar, ab, aq, demand, expires, seq] = v[..9] else { return None };
        Some(Entry {
            granted: Share { rate: gr, burst: gb, quota: gq },
            acked: Share { rate: ar, burst: ab, quota: aq },
            demand,
            expires,
            seq,
            used,
            used_until,
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
    /// The sum of every entry's reservation at `now`.
    pub fn reserved(&self, now: Micros) -> Share {
        self.hosts.values().fold(Share::ZERO, |s, e| add(s, e.reserved(now)))
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
    /// How long a host's reported `used` stays reserved: the quota window,
    /// lengthened by the clock-rate bound (0 without a quota).
    pub quota_window: Micros,
}

impl From<&GlobalRule> for Limits {
    fn from(r: &GlobalRule) -> Self {
        Limits {
            rate: r.rate,
            burst: r.burst,
            quota: r.quota_total(),
            lease: r.lease,
            quota_window: r.store_quota_window(),
        }
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
    /// Quota units the host has admitted in its current window (0 without
    /// a quota).
    pub used: u64,
    /// How long until all of `used` has left the window, on the store's
    /// clock (the host lengthens its own figure by epsilon); capped at
    /// `Limits::quota_window`.
    pub used_for: Micros,
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
/// A grant the host's bucket can use as it is: a rate share comes with at
/// least one unit of burst (a GCRA bucket shallower than one unit admits
/// nothing), counted here against B like any other burst; where none is
/// free the rate goes too, left to the hosts that can use it. So the kernel
/// enforces exactly what the store reserves, and the bursts sum to at most
/// B (docs/design.md, "Global limits: the bounds").
pub fn usable(s: Share) -> Share {
    if s.rate > 0 && s.burst == 0 {
        Share { rate: 0, ..s }
    } else {
        s
    }
}

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
    let used = req.used.min(MAX_AMOUNT);
    // 1. Leases that ended in the store (an entry whose used quota is still
    // in a window lingers with only that).
    cell.hosts.retain(|_, e| e.lives(now));

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
    let mine = cell.hosts.get(&req.host).map(|e| e.reserved(now)).unwrap_or_default();
    if held.exceeds(&mine) {
        cell.learn_until = cell.learn_until.max(now + limits.lease);
    }
    let learning = meta.learn_until.max(cell.learn_until) > now;

    // 4. What the others keep.
    let others = cell
        .hosts
        .iter()
        .filter(|(h, _)| **h != req.host)
        .fold(Share::ZERO, |s, (_, e)| add(s, e.reserved(now)));
    let free = Share {
        rate: limits.rate.saturating_sub(others.rate),
        burst: limits.burst.saturating_sub(others.burst),
        quota: limits.quota.saturating_sub(others.quota),
    };

    // 5. The fair share.
    let demand = req.demand.min(MAX_AMOUNT);
    // Only live leases compete (a lingering entry asks for nothing).
    let mut demands: Vec<u64> = cell
        .hosts
        .iter()
        .filter(|(h, e)| **h != req.host && e.expires > now)
        .map(|(_, e)| e.demand)
        .collect();
    demands.push(demand);
    let target = fair_share(limits.rate, &demands, demand);

    // 6. The grant: never more than the others leave.
    let grant = usable(if learning {
        Share {
            rate: held.rate.min(free.rate),
            burst: held.burst.min(free.burst),
            quota: held.quota.min(free.quota),
        }
    } else {
        let rate = target.min(free.rate);
        Share {
            rate,
            burst: proportion(limits.burst, rate, limits.rate).max(rate.min(1)).min(free.burst),
            quota: proportion(limits.quota, rate, limits.rate).min(free.quota),
        }
    });
    let expires = now + limits.lease;
    if grant.is_zero() && held.is_zero() && demand == 0 && used == 0 {
        // Released and acknowledged: nothing left to remember.
        cell.hosts.remove(&req.host);
    } else {
        let used_until = if used > 0 { now + req.used_for.min(limits.quota_window) } else { 0 };
        let entry =
            Entry { granted: grant, acked: held, demand, expires, seq: req.seq, used, used_until };
        cell.hosts.insert(req.host.clone(), entry);
    }
    (cell, Reply { fresh: true, grant, target, expires, learning })
}

/// One key of a batch, as a host asks for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub key: String,
    /// What the host enforces for the key now (zero: no lease).
    pub held: Share,
    /// Offered units per second; 0 releases the lease.
    pub demand: u64,
    /// Quota units admitted in the host's current window.
    pub used: u64,
    /// How long they stay in it (`Request::used_for`).
    pub used_for: Micros,
}

impl Item {
    pub fn new(key: &str, held: Share, demand: u64) -> Self {
        Item { key: key.to_string(), held, demand, used: 0, used_for: 0 }
    }
}

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
        for it in items {
            let id = (rule.to_string(), it.key.clone());
            let cell = self.cells.remove(&id).unwrap_or_default();
            let req = Request {
                host: host.to_string(),
                seq,
                held: it.held,
                demand: it.demand,
                used: it.used,
                used_for: it.used_for,
            };
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
        cell.reserved(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIM: Limits =
        Limits { rate: 1000, burst: 200, quota: 0, lease: 10_000_000, quota_window: 0 };

    fn meta() -> Meta {
        Meta { epoch: "e".into(), learn_until: 0 }
    }

    fn req(host: &str, seq: u64, held: Share, demand: u64) -> Request {
        Request { host: host.into(), seq, held, demand, used: 0, used_for: 0 }
    }

    #[test]
    fn a_rate_share_comes_with_a_unit_of_burst_or_not_at_all() {
        // 3/s of 1390/s with B = 279 is 0.6 units of burst: one unit, counted.
        let lim = Limits { rate: 1390, burst: 279, quota: 0, lease: 10_000_000, quota_window: 0 };
        let t = 1_000_000;
        let all = Share { rate: 1390, burst: 279, quota: 0 };
        let (cell, r) =
            allocate(&lim, &meta(), Cell::default(), &req("big", 1, Share::ZERO, 5000), t);
        assert_eq!(r.grant, all);
        let (cell, r) = allocate(&lim, &meta(), cell, &req("small", 1, Share::ZERO, 3), t + 1);
        assert_eq!((r.grant, r.target), (Share::ZERO, 3), "big holds it all yet");
        // big gives back to its fair share, and says so.
        let (cell, r) = allocate(&lim, &meta(), cell, &req("big", 2, all, 5000), t + 2);
        assert_eq!((r.grant.rate, r.grant.burst), (1387, 278), "{r:?}");
        let (cell, _) = allocate(&lim, &meta(), cell, &req("big", 3, r.grant, 5000), t + 3);
        let (cell, r) = allocate(&lim, &meta(), cell, &req("small", 2, Share::ZERO, 3), t + 4);
        assert_eq!(r.grant, Share { rate: 3, burst: 1, quota: 0 }, "the unit of burst, not 0");
        assert_eq!(cell.reserved(t + 4).burst, 279, "and counted: the bursts sum to B");
        assert_eq!(
            usable(Share { rate: 5, burst: 0, quota: 7 }),
            Share { rate: 0, burst: 0, quota: 7 }
        );
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
        assert!(cell.reserved(now + 5).rate <= 1000 && cell.reserved(now + 5).burst <= 200);
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
        assert_eq!(cell.hosts["a"].reserved(2), r.grant);
        let (cell, _) = allocate(&LIM, &meta(), cell, &req("a", 3, Share::ZERO, 0), 3);
        assert!(cell.hosts.is_empty());
    }

    #[test]
    fn a_new_store_learns_for_one_lease() {
        let mut m = Memory::default();
        let items = vec![Item::new("k", Share::ZERO, 100)];
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
            used: 10,
            used_until: 1_764_000_060_000_000,
        };
        assert_eq!(Entry::decode(&e.encode()), Some(e));
        assert_eq!(Entry::decode("1,2"), None);
        // Written by an agent from before quotas were split: nothing used.
        let old = Entry::decode("1,2,3,4,5,6,7,8,9").unwrap();
        assert_eq!((old.seq, old.used, old.used_until), (9, 0, 0));
    }

    const QLIM: Limits =
        Limits { rate: 1000, burst: 200, quota: 600, lease: 10_000_000, quota_window: 60_000_000 };

    /// A request whose used quota stays a whole window.
    fn ask(host: &str, seq: u64, held: Share, demand: u64, used: u64) -> Request {
        Request { host: host.into(), seq, held, demand, used, used_for: u64::MAX }
    }

    #[test]
    fn quota_shares_follow_the_rate_and_used_quota_stays_reserved() {
        let z = Share::ZERO;
        let (cell, r) = allocate(&QLIM, &meta(), Cell::default(), &ask("a", 1, z, 5000, 0), 0);
        assert_eq!(r.grant, Share { rate: 1000, burst: 200, quota: 600 });
        // a spends 500 of its 600, then its traffic moves to b: a releases.
        let (cell, r) = allocate(&QLIM, &meta(), cell, &ask("a", 2, r.grant, 0, 500), 1_000_000);
        assert_eq!(r.grant, z);
        let (cell, _) = allocate(&QLIM, &meta(), cell, &ask("a", 3, z, 0, 500), 1_100_000);
        // The release is acknowledged, but the 500 a admitted are still in
        // the window: b gets the rate and burst, and only 100 of the quota.
        assert_eq!(cell.hosts["a"].reserved(1_100_000), Share { rate: 0, burst: 0, quota: 500 });
        let (cell, r) = allocate(&QLIM, &meta(), cell, &ask("b", 1, z, 5000, 0), 1_200_000);
        assert_eq!(r.grant, Share { rate: 1000, burst: 200, quota: 100 });
        // Past a's lease, its used quota still lingers...
        let later = 1_100_000 + QLIM.lease + 1;
        let (cell, r) = allocate(&QLIM, &meta(), cell, &ask("b", 2, r.grant, 5000, 100), later);
        assert_eq!(r.grant.quota, 100);
        // ...until it has left the window (b's own lease ended meanwhile).
        let gone = 1_100_000 + QLIM.quota_window;
        let (cell, r) = allocate(&QLIM, &meta(), cell, &ask("b", 3, z, 5000, 100), gone);
        assert_eq!(r.grant.quota, 600);
        assert!(!cell.hosts.contains_key("a"));
    }

    #[test]
    fn used_above_the_held_share_is_not_lost_state() {
        // A host whose share was cut reports more used than it now holds:
        // that is not a sign of a store that forgot, so no learning.
        let z = Share::ZERO;
        let (cell, _) = allocate(&QLIM, &meta(), Cell::default(), &ask("a", 1, z, 5000, 0), 0);
        let cut = Share { rate: 500, burst: 100, quota: 300 };
        let (cell, r) = allocate(&QLIM, &meta(), cell, &ask("a", 2, cut, 10, 590), 1_000);
        assert!(!r.learning);
        assert!(cell.hosts["a"].reserved(1_000).quota >= 590);
    }

    proptest! {
        /// Hosts spend quota within their shares and move traffic at
        /// random; every window of the quota's length admits at most Q
        /// fleet-wide, counting what each host admitted when.
        #[test]
        fn quota_spent_in_any_window_stays_within_q(
            steps in proptest::collection::vec((0usize..4, 0u64..2000, 0u64..400_000, 0u64..700), 1..300),
        ) {
            let lim = Limits { rate: 1000, burst: 100, quota: 700, lease: 2_000_000, quota_window: 3_000_000 };
            let w = lim.quota_window;
            let mut cell = Cell::default();
            // Per host: its enforced share (with its local expiry) and the
            // admissions in its window, (time, units).
            let mut share: BTreeMap<usize, (Share, Micros)> = BTreeMap::new();
            let mut spent: Vec<(usize, Micros, u64)> = Vec::new();
            let mut seqs = [0u64; 4];
            let mut now = 10;
            for (h, demand, dt, want) in steps {
                now += dt;
                // The host spends what its share allows in its window.
                let (held, until) = share.get(&h).copied().unwrap_or_default();
                let held = if until > now { held } else { Share::ZERO };
                let used: u64 = spent.iter().filter(|(x, t, _)| *x == h && *t + w > now).map(|s| s.2).sum();
                let take = want.min(held.quota.saturating_sub(used));
                if take > 0 {
                    spent.push((h, now, take));
                }
                let used = used + take;
                seqs[h] += 1;
                let host = format!("h{h}");
                // As tight as a host can say it: the newest unit leaves last.
                let used_for = spent
                    .iter()
                    .filter(|(x, t, _)| *x == h && *t + w > now)
                    .map(|(_, t, _)| *t + w - now)
                    .max()
                    .unwrap_or(0);
                let req = Request { used_for, ..ask(&host, seqs[h], held, demand, used) };
                let (c, r) = allocate(&lim, &meta(), cell, &req, now);
                cell = c;
                // The local lease ends before the store's (sent at `now`).
                share.insert(h, (r.grant, now + lim.lease - 1));
                let in_window: u64 = spent.iter().filter(|(_, t, _)| *t + w > now).map(|s| s.2).sum();
                prop_assert!(in_window <= lim.quota, "{in_window} in one window");
                prop_assert!(cell.reserved(now).quota <= lim.quota);
            }
        }
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
            let lim = Limits { rate, burst, quota, lease: 3_000_000, quota_window: 5_000_000 };
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
                let mine = cell.hosts.get(&host).filter(|e| e.expires > now).map(|e| e.reserved(now));
                let h_held = held.get(&host).copied().filter(|_| mine.is_some()).unwrap_or_default();
                let (c, r) = allocate(&lim, &meta(), cell, &req(&host, seq, h_held, demand), now);
                cell = c;
                if r.fresh {
                    prop_assert!(r.grant.rate <= r.target.max(h_held.rate));
                    held.insert(host, r.grant);
                }
                let sum = cell.reserved(now);
                prop_assert!(sum.rate <= rate && sum.burst <= burst && sum.quota <= quota, "{sum:?}");
            }
        }
    }
}
