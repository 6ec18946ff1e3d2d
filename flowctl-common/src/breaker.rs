//! Circuit-breaker decisions for outbound connections (docs/algorithms.md
//! section 6), pure: the SRE adaptive-throttling probability and the
//! closed / open / half-open state machine. The kernel side (cgroup
//! `connect4`/`connect6` hooks enforcing, `sock_ops` callbacks measuring)
//! and the agent that connects them build on these.
//!
//! Which attempts count as SRE "requests": only those that reached the
//! network (the connect hook let them through). Attempts the breaker itself
//! refused are not requests: counting them (as Kratos does, kratos #2777,
//! go-zero #5551) keeps `requests` high with no accepts after the backend
//! heals, so throttling outlives the outage. Not counting them, recovery is
//! bounded by one window: once the failures have aged out of it, p is 0.

/// Targets one breaker object holds (cgroup hooks): breakers plus their
/// exempt targets.
pub const MAX_TARGETS: usize = 16;

/// Per-target counters the kernel keeps (per CPU), in this order.
pub mod counter {
    /// connect() calls to the target that the hook saw (TCP).
    pub const CALLS: u32 = 0;
    /// Refused by the breaker, failing at once.
    pub const REFUSED_LOCALLY: u32 = 1;
    /// Would have been refused (dry-run).
    pub const WOULD_REFUSE: u32 = 2;
    /// Handshakes started (sock_ops TCP_CONNECT) by connects the hook let
    /// through: the SRE requests.
    pub const ATTEMPTS: u32 = 3;
    /// Handshakes completed (ACTIVE_ESTABLISHED) before any SYN
    /// retransmission: the accepts.
    pub const SUCCESSES: u32 = 4;
    /// SYN_SENT -> CLOSE before a retransmission: refused by the peer (RST,
    /// ICMP unreachable) or abandoned by the caller.
    pub const REFUSED_BY_PEER: u32 = 5;
    /// The SYN's first retransmission timeout: the handshake is counted as
    /// failed then (it has taken at least the initial RTO, 1 s), not ~127 s
    /// later when the kernel gives up.
    pub const TIMEOUTS: u32 = 6;
    /// Half-open probes let through.
    pub const PROBES: u32 = 7;
    pub const COUNT: u32 = 8;
    pub const NAMES: [&str; COUNT as usize] = [
        "calls",
        "refused_locally",
        "would_refuse",
        "attempts",
        "successes",
        "refused_by_peer",
        "timeouts",
        "probes",
    ];
}

/// A downstream a breaker watches: prefix and port range, IPv4 or IPv6
/// (host-order words; IPv4 in word 0, matched by IPv4-mapped IPv6 too),
/// and optionally only for the processes of one cgroup v2 subtree.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Target {
    pub addr: [u32; 4],
    pub prefix_len: u8,
    /// 4 or 6; 0: unused slot.
    pub family: u8,
    /// `target_flags::*`.
    pub flags: u8,
    pub _pad: u8,
    pub port_lo: u16,
    pub port_hi: u16,
    /// Only connects by processes in this cgroup v2 (its id, the directory's
    /// inode) or below; 0: any process under the attach point.
    pub cgroup_id: u64,
    /// That cgroup's depth below the hierarchy's root.
    pub cgroup_level: u32,
    pub _pad2: u32,
}

pub mod target_flags {
    /// Never throttled (counted only), matched before other targets.
    pub const EXEMPT: u8 = 1;
    /// Count would-refusals, refuse nothing.
    pub const DRY_RUN: u8 = 2;
}

/// What the agent tells the hooks about one target.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Control {
    /// Refuse this share of new connections (ppm): SRE's p, or 1e6 while
    /// open (and, in half-open, for what is not a probe).
    pub drop_ppm: u32,
    /// errno a refused connect() fails with (positive; ECONNREFUSED = 111).
    pub errno: u32,
    /// Half-open: this many probes may go (0: not half-open).
    pub probes: u32,
    pub _pad: u32,
    /// Half-open round, packed by `probe_word`: epoch, probes admitted,
    /// probe successes, probe failures. The hooks update it by
    /// compare-and-swap only while its epoch is the socket's.
    pub probe_word: u64,
}

/// The agent's deadline (one `u64` in its own map, so pushing it forward
/// never rewrites a control record the hooks are updating): monotonic time
/// after which the hooks refuse nothing, so a hung agent's last word expires.
pub const DEADLINE_INDEX: u32 = 0;

/// The probe word: epoch (16 bits) | admitted | succeeded | failed.
pub mod probe_word {
    #[inline(always)]
    pub fn pack(epoch: u32, admitted: u32, ok: u32, failed: u32) -> u64 {
        ((epoch as u64 & 0xffff) << 48)
            | ((admitted as u64 & 0xffff) << 32)
            | ((ok as u64 & 0xffff) << 16)
            | (failed as u64 & 0xffff)
    }
    #[inline(always)]
    pub fn epoch(w: u64) -> u32 {
        (w >> 48) as u32
    }
    #[inline(always)]
    pub fn admitted(w: u64) -> u32 {
        ((w >> 32) & 0xffff) as u32
    }
    #[inline(always)]
    pub fn ok(w: u64) -> u32 {
        ((w >> 16) & 0xffff) as u32
    }
    #[inline(always)]
    pub fn failed(w: u64) -> u32 {
        (w & 0xffff) as u32
    }
    pub const ADMITTED_ONE: u64 = 1 << 32;
    pub const OK_ONE: u64 = 1 << 16;
    pub const FAILED_ONE: u64 = 1;
}

/// What the connect hook remembers about a socket it let through, keyed by
/// the socket cookie (which the sock_ops program reads too): whose outcome
/// it is and whether it is a probe of which half-open round.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockMark {
    pub slot: u32,
    /// The probe word's epoch when admitted.
    pub epoch: u32,
    pub probe: u8,
    /// The outcome is counted (a retransmission timeout came first).
    pub decided: u8,
    pub _pad: [u8; 6],
}

/// Sockets remembered between connect() and their handshake's outcome
/// (LRU: a socket that never reports is evicted, not leaked).
pub const SOCK_MARKS: u32 = 16384;

/// Google SRE client-side throttling over one window:
/// `p = max(0, (requests - K * accepts) / (requests + 1))`, 0 under
/// `min_requests`, capped so probes always get through. Integer math in
/// parts per million (K in thousandths), usable in the kernel too.
#[inline(always)]
pub fn sre_drop_ppm(
    requests: u64,
    accepts: u64,
    k_milli: u64,
    min_requests: u64,
    cap_ppm: u32,
) -> u32 {
    if requests < min_requests {
        return 0;
    }
    let r = requests.saturating_mul(1000);
    let ka = accepts.saturating_mul(k_milli);
    if ka >= r {
        return 0;
    }
    // (r - ka) / 1000 / (requests + 1), in ppm.
    let p = (r - ka).saturating_mul(1000) / (requests + 1);
    (p.min(cap_ppm as u64)) as u32
}

/// What one window bucket holds: the outcomes the kernel counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct Outcomes {
    /// Handshakes that went out (SRE requests).
    pub requests: u64,
    /// Handshakes completed (SRE accepts).
    pub accepts: u64,
    pub refused_by_peer: u64,
    pub timeouts: u64,
    /// Refused by the breaker (not requests: see the module docs).
    pub refused_locally: u64,
    pub would_refuse: u64,
}

impl Outcomes {
    pub fn failures(&self) -> u64 {
        self.refused_by_peer + self.timeouts
    }

    fn add(&mut self, o: &Outcomes) {
        self.requests += o.requests;
        self.accepts += o.accepts;
        self.refused_by_peer += o.refused_by_peer;
        self.timeouts += o.timeouts;
        self.refused_locally += o.refused_locally;
        self.would_refuse += o.would_refuse;
    }
}

/// Buckets a window may have.
pub const MAX_WINDOW_BUCKETS: usize = 100;

/// A rolling window: `buckets` buckets of `bucket_ns`, each tagged with its
/// epoch (`stats::epoch_of`, the statistics rings' math) and reset lazily
/// when a later epoch lands on its slot. It spans the current bucket and the
/// `buckets - 1` before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub bucket_ns: u64,
    pub buckets: u32,
    ring: [(u64, Outcomes); MAX_WINDOW_BUCKETS],
}

impl Window {
    pub fn new(span_ns: u64, buckets: u32) -> Self {
        let buckets = buckets.clamp(1, MAX_WINDOW_BUCKETS as u32);
        Self {
            bucket_ns: (span_ns / buckets as u64).max(1),
            buckets,
            ring: [(0, Outcomes::default()); MAX_WINDOW_BUCKETS],
        }
    }

    pub fn span_ns(&self) -> u64 {
        self.bucket_ns * self.buckets as u64
    }

    pub fn add(&mut self, now_ns: u64, o: &Outcomes) {
        let epoch = crate::stats::epoch_of(now_ns, self.bucket_ns);
        let slot = &mut self.ring[(epoch % self.buckets as u64) as usize];
        if slot.0 != epoch {
            *slot = (epoch, Outcomes::default());
        }
        slot.1.add(o);
    }

    pub fn sum(&self, now_ns: u64) -> Outcomes {
        let epoch = crate::stats::epoch_of(now_ns, self.bucket_ns);
        let mut total = Outcomes::default();
        for (e, o) in &self.ring[..self.buckets as usize] {
            if *e <= epoch && epoch - *e < self.buckets as u64 {
                total.add(o);
            }
        }
        total
    }

    pub fn clear(&mut self) {
        self.ring = [(0, Outcomes::default()); MAX_WINDOW_BUCKETS];
    }
}

/// Breaker state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Closed,
    /// Refusing everything since `since_ns`.
    Open {
        since_ns: u64,
    },
    /// Letting `probes` attempts through; they decide.
    HalfOpen {
        admitted: u32,
        succeeded: u32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateConfig {
    /// Open when failures / requests over the window exceed this (ppm)...
    pub failure_ppm: u32,
    /// ...with at least this many requests.
    pub min_requests: u64,
    /// Open for this long before half-open.
    pub sleep_ns: u64,
    /// Probes admitted in half-open; that many successes close it.
    pub probes: u32,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self { failure_ppm: 500_000, min_requests: 20, sleep_ns: 5_000_000_000, probes: 3 }
    }
}

/// What a breaker says to one new attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Go, stamped with the breaker's epoch; `probe` when it is one of the
    /// half-open probes.
    Yes {
        epoch: u32,
        probe: bool,
    },
    No,
}

/// The closed / open / half-open machine. Every state change bumps the
/// epoch; attempts carry the epoch they started in, and an outcome only
/// counts as a probe result when its attempt was admitted as a probe of the
/// current half-open epoch: a slow connect that began before the breaker
/// opened (or an earlier half-open round) cannot close it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Machine {
    pub state: State,
    pub epoch: u32,
    pub cfg: StateConfig,
}

impl Machine {
    pub fn new(cfg: StateConfig) -> Self {
        Self { state: State::Closed, epoch: 0, cfg }
    }

    fn to(&mut self, s: State) {
        self.state = s;
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// Time passes: open turns half-open after the sleep.
    pub fn tick(&mut self, now_ns: u64) {
        if let State::Open { since_ns } = self.state {
            if now_ns.saturating_sub(since_ns) >= self.cfg.sleep_ns {
                self.to(State::HalfOpen { admitted: 0, succeeded: 0 });
            }
        }
    }

    /// The window's counts (closed state only): open when failing too much.
    pub fn observe_window(&mut self, requests: u64, failures: u64, now_ns: u64) {
        if self.state == State::Closed
            && requests >= self.cfg.min_requests
            && failures.saturating_mul(1_000_000)
                > requests.saturating_mul(self.cfg.failure_ppm as u64)
        {
            self.to(State::Open { since_ns: now_ns });
        }
    }

    /// The current half-open round starts over with no probe taken (its
    /// probes were kept somewhere that is gone); same epoch.
    pub fn restart_round(&mut self) {
        if let State::HalfOpen { .. } = self.state {
            self.state = State::HalfOpen { admitted: 0, succeeded: 0 };
        }
    }

    /// A new attempt.
    pub fn admit(&mut self, now_ns: u64) -> Admit {
        self.tick(now_ns);
        match &mut self.state {
            State::Closed => Admit::Yes { epoch: self.epoch, probe: false },
            State::Open { .. } => Admit::No,
            State::HalfOpen { admitted, .. } => {
                if *admitted < self.cfg.probes {
                    *admitted += 1;
                    Admit::Yes { epoch: self.epoch, probe: true }
                } else {
                    Admit::No
                }
            }
        }
    }

    /// The outcome of an attempt admitted in `epoch` (as a probe or not).
    pub fn outcome(&mut self, epoch: u32, probe: bool, success: bool, now_ns: u64) {
        let State::HalfOpen { succeeded, .. } = &mut self.state else { return };
        if !probe || epoch != self.epoch {
            return; // not one of this round's probes
        }
        if !success {
            self.to(State::Open { since_ns: now_ns });
            return;
        }
        *succeeded += 1;
        if *succeeded >= self.cfg.probes {
            self.to(State::Closed);
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    unsafe impl aya::Pod for super::Target {}
    unsafe impl aya::Pod for super::Control {}
    unsafe impl aya::Pod for super::SockMark {}
}

const _: () = assert!(size_of::<Target>() == 40);
const _: () = assert!(size_of::<Control>() == 24);
const _: () = assert!(size_of::<SockMark>() == 16);

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn sre_formula() {
        // 1000 requests, 200 accepts, K = 2: (1000 - 400) / 1001.
        assert_eq!(sre_drop_ppm(1000, 200, 2000, 100, 1_000_000), 599_400);
        assert_eq!(
            sre_drop_ppm(1000, 500, 2000, 100, 1_000_000),
            0,
            "K x accepts covers the requests"
        );
        assert_eq!(
            sre_drop_ppm(99, 0, 2000, 100, 1_000_000),
            0,
            "under the minimum: no throttling"
        );
        assert_eq!(
            sre_drop_ppm(1000, 0, 2000, 100, 900_000),
            900_000,
            "capped: probes still get through"
        );
        assert_eq!(sre_drop_ppm(1000, 0, 1500, 100, 1_000_000), 999_000);
    }

    /// Recovery: a backend down for 10 s then healthy; clients try 100
    /// connects per 300 ms bucket; window 10 buckets (3 s), K = 2, cap 0.9.
    /// Returns how long after the backend healed p stays above 1%.
    fn recovery_ms(count_local_rejections: bool) -> u64 {
        let mut window: std::collections::VecDeque<(u64, u64)> = std::collections::VecDeque::new();
        let mut p = 0u32;
        let mut seed = 1u64;
        let mut healed_at = None;
        for bucket in 0..200u64 {
            let t_ms = bucket * 300;
            let healthy = t_ms >= 10_000;
            let (mut req, mut acc) = (0, 0);
            for _ in 0..100 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let refused_locally = ((seed >> 33) % 1_000_000) < p as u64;
                if refused_locally {
                    if count_local_rejections {
                        req += 1;
                    }
                    continue;
                }
                req += 1;
                acc += healthy as u64;
            }
            window.push_back((req, acc));
            if window.len() > 10 {
                window.pop_front();
            }
            let (r, a) = window.iter().fold((0, 0), |(r, a), (x, y)| (r + x, a + y));
            p = sre_drop_ppm(r, a, 2000, 100, 900_000);
            if healthy && p <= 10_000 && healed_at.is_none() {
                healed_at = Some(t_ms - 10_000);
            }
        }
        healed_at.unwrap_or(u64::MAX)
    }

    #[test]
    fn recovery_is_bounded_by_one_window_when_local_refusals_do_not_count() {
        let ours = recovery_ms(false);
        let kratos = recovery_ms(true);
        assert!(ours <= 3_000, "within one 3 s window: {ours} ms");
        assert!(kratos > ours, "counting local refusals recovers later: {kratos} ms vs {ours} ms");
    }

    #[test]
    fn window_forgets_what_is_older_than_its_span() {
        let mut w = Window::new(3 * S, 10); // 300 ms buckets
        let one = Outcomes { requests: 1, accepts: 1, ..Default::default() };
        for i in 0..30u64 {
            w.add(i * 100_000_000, &one); // 10 per second for 3 s
        }
        assert_eq!(w.sum(2_950_000_000).requests, 30);
        // 1 s later: buckets wholly before (now - 2.7 s) are gone.
        let s = w.sum(3_950_000_000);
        assert!(s.requests < 30 && s.requests >= 18, "{}", s.requests);
        assert_eq!(w.sum(10 * S), Outcomes::default(), "an idle window empties");
        w.add(10 * S, &one);
        assert_eq!(w.sum(10 * S).requests, 1, "a reused slot starts from zero");
    }

    #[test]
    fn probe_word_round_trips() {
        let w = probe_word::pack(0x1_2345, 3, 2, 1);
        assert_eq!(
            (
                probe_word::epoch(w),
                probe_word::admitted(w),
                probe_word::ok(w),
                probe_word::failed(w)
            ),
            (0x2345, 3, 2, 1)
        );
        assert_eq!(probe_word::admitted(w + probe_word::ADMITTED_ONE), 4);
    }

    #[test]
    fn state_machine_opens_sleeps_probes_and_closes() {
        let mut m = Machine::new(StateConfig {
            failure_ppm: 500_000,
            min_requests: 20,
            sleep_ns: 5 * S,
            probes: 2,
        });
        m.observe_window(10, 10, 0);
        assert_eq!(m.state, State::Closed, "under the minimum");
        m.observe_window(40, 25, S);
        assert!(matches!(m.state, State::Open { .. }));
        assert_eq!(m.admit(2 * S), Admit::No);
        // Half-open after the sleep: two probes, then refusals.
        let a1 = m.admit(6 * S);
        let a2 = m.admit(6 * S);
        assert!(
            matches!(a1, Admit::Yes { probe: true, .. })
                && matches!(a2, Admit::Yes { probe: true, .. })
        );
        assert_eq!(m.admit(6 * S), Admit::No);
        let Admit::Yes { epoch, .. } = a1 else { unreachable!() };
        m.outcome(epoch, true, true, 7 * S);
        m.outcome(epoch, true, true, 7 * S);
        assert_eq!(m.state, State::Closed);
        assert!(matches!(m.admit(8 * S), Admit::Yes { probe: false, .. }));
    }

    #[test]
    fn a_failed_probe_reopens() {
        let mut m = Machine::new(StateConfig { sleep_ns: S, probes: 3, ..Default::default() });
        m.observe_window(100, 100, 0);
        let Admit::Yes { epoch, probe } = m.admit(2 * S) else { panic!() };
        m.outcome(epoch, probe, false, 2 * S);
        assert!(matches!(m.state, State::Open { since_ns } if since_ns == 2 * S));
    }

    #[test]
    fn an_attempt_from_before_the_state_change_is_not_a_probe() {
        let mut m = Machine::new(StateConfig { sleep_ns: S, probes: 1, ..Default::default() });
        // A slow connect admitted while closed...
        let Admit::Yes { epoch: old, probe } = m.admit(0) else { panic!() };
        assert!(!probe);
        m.observe_window(100, 100, 0);
        // ...finishes successfully during half-open: it must not close it.
        m.tick(2 * S);
        assert!(matches!(m.state, State::HalfOpen { .. }));
        m.outcome(old, probe, true, 2 * S);
        assert!(matches!(m.state, State::HalfOpen { .. }), "an old attempt is not a probe");
        // Nor does a probe of an earlier half-open round.
        let Admit::Yes { epoch: round1, .. } = m.admit(2 * S) else { panic!() };
        m.outcome(round1, true, false, 2 * S); // reopens
        m.tick(4 * S); // half-open again, new epoch
        m.outcome(round1, true, true, 4 * S);
        assert!(
            matches!(m.state, State::HalfOpen { .. }),
            "a stale probe does not close the new round"
        );
        let Admit::Yes { epoch, .. } = m.admit(4 * S) else { panic!() };
        m.outcome(epoch, true, true, 4 * S);
        assert_eq!(m.state, State::Closed);
    }
}
