//! Global limits: one limit across every host attached to the same store,
//! as leases kept in Redis (docs/fleet.md, "Global limits"; the bounds are
//! derived in docs/design.md, "Global limits: the bounds").
//!
//! A rule with `scope = "global"` has a fleet-wide rate L, burst B and
//! quota Q per key. No packet waits on the network: each agent holds, for
//! the keys hot on it, a lease (a share of L, B and Q) that it writes into
//! the key's bucket in the BPF map; Redis only hands out the shares.
//!
//! What lives where:
//! - this file: the rule's spec ([`GlobalRule`]), a host's part of it
//!   ([`Share`]), a lease as the agent holds it ([`Grant`]), time and
//!   integer conventions;
//! - [`allocator`]: the allocation as a pure function of one (rule, key)
//!   cell, one host's request and the store's clock, and an in-memory store
//!   built on it (the reference for the Lua script, the simulator's Redis);
//! - `lease.lua`: the same algorithm run atomically in Redis;
//! - [`store`]: the async Redis side (connection, AUTH/TLS, script, epoch,
//!   heartbeats, round-trip time, health);
//! - [`host`]: the agent's side as a pure state machine (hot keys, demand,
//!   batches, local expiry) driving a [`host::GrantSink`];
//! - [`hostloop`]: the agent's lease loop around it without the I/O (the
//!   kernel's reports and counters in, grants out through a
//!   [`hostloop::KeyBackend`], the hold while a cut settles), run by the
//!   agent over the kernel's maps and by the simulator over a model of them;
//! - [`bucket`]: re-rating a GCRA bucket without minting tokens (what the
//!   real sink does to the map, and the simulator's fake map);
//! - [`sim`]: a simulated fleet on a virtual clock (the allocator as its
//!   store, [`hostloop`] on every host), and its report.
//!
//! Conventions shared by Rust and Lua (they must agree bit for bit):
//! - time is in microseconds (`u64`); the store's clock is Redis `TIME`, a
//!   host's clock is its own monotonic clock; they are never compared, only
//!   durations measured on each are;
//! - amounts (rates per second, bursts, quotas, demands) are integers in
//!   the rule's unit, at most [`MAX_AMOUNT`] (2^32 - 1), so that every
//!   product the allocator forms stays below 2^53 and is exact in Lua's
//!   doubles; proportions are fixed point in [`SHARE_ONE`] (2^20) parts and
//!   every division rounds down, so shares never sum above the total.

pub mod allocator;
pub mod bucket;
pub mod host;
pub mod hostloop;
pub mod sim;
pub mod store;

/// Microseconds.
pub type Micros = u64;

/// Largest rate, burst, quota or demand the allocator takes (2^32 - 1 in
/// the rule's unit): a byte rate up to about 34 Gbit/s per key fleet-wide.
pub const MAX_AMOUNT: u64 = u32::MAX as u64;

/// One in fixed point: a host's proportion of L is `rate * SHARE_ONE / L`,
/// rounded down.
pub const SHARE_ONE: u64 = 1 << 20;

/// One million: epsilon is in parts per million.
pub const PPM: u64 = 1_000_000;

/// What a host may admit for a key before it holds a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DefaultShare {
    /// Units per second.
    pub rate: u64,
    /// Bucket depth in units.
    pub burst: u64,
}

/// A global rule as the lease mechanism sees it (the profile's
/// `scope = "global"` rule, translated by the agent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GlobalRule {
    /// The rule's name: part of every Redis key name (inside the hash tag),
    /// so it must not contain `{` or `}`.
    pub name: String,
    /// L: units per second, fleet-wide, per key.
    pub rate: u64,
    /// B: bucket depth in units, fleet-wide, per key.
    pub burst: u64,
    /// Q: units per quota window, fleet-wide, per key (None: no quota).
    pub quota: Option<u64>,
    /// The quota's window W (0 without a quota).
    pub quota_window: Micros,
    /// How long a grant holds in the store after it was made.
    pub lease: Micros,
    /// How often a host refreshes its leases.
    pub refresh: Micros,
    /// Allowance of a host for a key it holds no lease for (None: nothing,
    /// the profile's `default_share = "none"`).
    pub default_share: Option<DefaultShare>,
    /// Largest clock-rate difference between any host and the store, in
    /// ppm: a host ends a lease after `lease * (1 - epsilon)` of its own
    /// clock, which is never later than the store's end.
    pub epsilon_ppm: u64,
}

/// Why a [`GlobalRule`] cannot be allocated.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RuleError {
    #[error("global rule {0:?}: a name must be non-empty and without '{{' or '}}' (it is a Redis hash tag)")]
    Name(String),
    #[error("global rule {rule:?}: {what} = {value} is out of range (at most {max}, rates and lengths at least 1)")]
    Range { rule: String, what: &'static str, value: u64, max: u64 },
    #[error("global rule {rule:?}: refresh ({refresh} us) must be shorter than the local lease ({local} us), or leases lapse between refreshes")]
    Refresh { rule: String, refresh: Micros, local: Micros },
}

impl GlobalRule {
    /// A rule with the defaults: lease 10 s, refresh 1 s, epsilon 1000 ppm
    /// (0.1%, far above what NTP-disciplined clocks drift), no quota, no
    /// default allowance.
    pub fn new(name: &str, rate: u64, burst: u64) -> Self {
        Self {
            name: name.to_string(),
            rate,
            burst,
            quota: None,
            quota_window: 0,
            lease: 10_000_000,
            refresh: 1_000_000,
            default_share: None,
            epsilon_ppm: 1_000,
        }
    }

    /// What the default allowances of `hosts` hosts add up to, as a
    /// fraction of the limit L: the rate the fleet may admit above `L*t + B`
    /// while every host waits for its first lease of one key (docs/design.md,
    /// "The default allowance"). 0 with `default_share = "none"`. At 1 or
    /// more the allowances alone pass the whole limit, which a fleet grown
    /// past `L / default_share` hosts reaches without any profile change.
    pub fn default_allowance_ratio(&self, hosts: u64) -> f64 {
        let share = self.default_share.map_or(0, |d| d.rate);
        hosts as f64 * share as f64 / self.rate.max(1) as f64
    }

    pub fn validate(&self) -> Result<(), RuleError> {
        if self.name.is_empty() || self.name.contains(['{', '}']) {
            return Err(RuleError::Name(self.name.clone()));
        }
        let range = |what, value: u64, max: u64| match (1..=max).contains(&value) {
            true => Ok(()),
            false => Err(RuleError::Range { rule: self.name.clone(), what, value, max }),
        };
        range("rate", self.rate, MAX_AMOUNT)?;
        range("burst", self.burst, MAX_AMOUNT)?;
        if let Some(q) = self.quota {
            range("quota", q, MAX_AMOUNT)?;
            // A day at most, like the lease: `now + window` stays far from 2^53.
            range("quota window (us)", self.quota_window, 86_400_000_000)?;
        }
        // An hour is plenty; the cap keeps `now + lease` far from 2^53.
        range("lease (us)", self.lease, 3_600_000_000)?;
        if self.epsilon_ppm >= PPM / 10 {
            let (rule, value) = (self.name.clone(), self.epsilon_ppm);
            return Err(RuleError::Range { rule, what: "epsilon (ppm)", value, max: PPM / 10 - 1 });
        }
        if self.refresh == 0 || self.refresh >= self.local_lease() {
            return Err(RuleError::Refresh {
                rule: self.name.clone(),
                refresh: self.refresh,
                local: self.local_lease(),
            });
        }
        Ok(())
    }

    /// How long a grant holds on the agent, from when its request was sent:
    /// `lease * (1 - epsilon)`, rounded down.
    pub fn local_lease(&self) -> Micros {
        ((self.lease as u128 * (PPM - self.epsilon_ppm.min(PPM)) as u128) / PPM as u128) as u64
    }

    /// Q as the allocator splits it (0 without a quota).
    pub fn quota_total(&self) -> u64 {
        self.quota.unwrap_or(0)
    }

    /// A duration `d` measured on a host's clock, as long as it can be on
    /// the store's: `d * (1 + epsilon)`, rounded up (the counterpart of
    /// [`local_lease`](Self::local_lease)'s shortening).
    pub fn on_store_clock(&self, d: Micros) -> Micros {
        d + ((d as u128 * self.epsilon_ppm as u128).div_ceil(PPM as u128)) as u64
    }

    /// How long the store keeps a host's reported used quota reserved, at
    /// most: W on the store's clock (0 without a quota).
    pub fn store_quota_window(&self) -> Micros {
        match self.quota {
            Some(_) => self.on_store_clock(self.quota_window),
            None => 0,
        }
    }
}

/// One host's part of a key's L, B and Q.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Share {
    /// Units per second.
    pub rate: u64,
    /// Bucket depth in units.
    pub burst: u64,
    /// Units per quota window (0 without a quota).
    pub quota: u64,
}

impl Share {
    pub const ZERO: Share = Share { rate: 0, burst: 0, quota: 0 };

    /// Component by component.
    pub fn max(self, o: Share) -> Share {
        Share {
            rate: self.rate.max(o.rate),
            burst: self.burst.max(o.burst),
            quota: self.quota.max(o.quota),
        }
    }

    /// Whether any component is above `o`'s.
    pub fn exceeds(&self, o: &Share) -> bool {
        self.rate > o.rate || self.burst > o.burst || self.quota > o.quota
    }

    pub fn is_zero(&self) -> bool {
        *self == Share::ZERO
    }
}

/// A lease as an agent holds it: the share it enforces for one key until
/// `expires` on its own clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub share: Share,
    /// Host clock: when the request was sent plus [`GlobalRule::local_lease`].
    pub expires: Micros,
    /// Granted while the store was in learning mode (an echo, no increase).
    pub learning: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_allowances_are_measured_against_the_limit() {
        let mut r = GlobalRule::new("web", 1000, 100);
        assert_eq!(r.default_allowance_ratio(500), 0.0, "\"none\" costs nothing");
        r.default_share = Some(DefaultShare { rate: 10, burst: 1 });
        assert_eq!(r.default_allowance_ratio(1), 0.01);
        assert_eq!(r.default_allowance_ratio(50), 0.5);
        // 1% each: at 100 hosts the allowances alone are the whole limit.
        assert_eq!(r.default_allowance_ratio(100), 1.0);
        assert_eq!(r.default_allowance_ratio(0), 0.0);
    }

    #[test]
    fn rules_validate() {
        let ok = GlobalRule::new("web", 1000, 100);
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(ok.local_lease(), 9_990_000);
        // The lengthening, rounded up: 1000 ppm of 10 s, and of 1 us.
        assert_eq!(ok.on_store_clock(10_000_000), 10_010_000);
        assert_eq!(ok.on_store_clock(1), 2);
        let bad = |f: fn(&mut GlobalRule)| {
            let mut r = ok.clone();
            f(&mut r);
            r.validate().unwrap_err().to_string()
        };
        assert!(bad(|r| r.name = "a{b}".into()).contains("hash tag"));
        assert!(bad(|r| r.rate = 0).contains("rate = 0"));
        assert!(bad(|r| r.burst = MAX_AMOUNT + 1).contains("burst"));
        assert!(bad(|r| r.epsilon_ppm = 100_000).contains("epsilon"));
        assert!(bad(|r| r.refresh = r.lease).contains("refresh"));
    }
}
