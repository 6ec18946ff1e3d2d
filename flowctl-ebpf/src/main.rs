//! flowctl's XDP data plane.
//!
//! Per packet: parse (Ethernet, up to two VLAN tags, IPv4/IPv6 with options and
//! extension headers, TCP/UDP/ICMP), classify (per-source cache, else LPM trie,
//! ANDed with protocol and port bitmaps: first match in profile order), then run
//! the stages in the fixed order admission -> BBR -> quota -> token bucket, and
//! commit only when every stage admits. Every verdict is counted per rule and
//! every drop by reason. See docs/design.md for the maps and the contracts.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod accounting;
mod conntrack;
mod decision;
mod egress;
mod maps;
mod parse;
mod sampler;

use accounting::{counters, flowctl_account};
use decision::{outcome_code, packed, Decision, Outcome};
use maps::{
    packet, FLOWCTL_CONTROL, FLOWCTL_DEBT, FLOWCTL_GLOBAL, FLOWCTL_KEYS, FLOWCTL_PORT_BITS,
    FLOWCTL_PROTO_BITS, FLOWCTL_QUOTAS, FLOWCTL_RULES, FLOWCTL_RULE_SETS, FLOWCTL_SRC_CACHE,
    FLOWCTL_SRC_CLASSES, FLOWCTL_SRC_TRIE, FLOWCTL_ZERO_RING,
};
use parse::class;

use aya_ebpf::{
    bindings::xdp_action, helpers::bpf_ktime_get_ns, macros::xdp, maps::lpm_trie::Key,
    programs::XdpContext,
};
use core::intrinsics::{atomic_cxchg, AtomicOrdering};
use flowctl_common::{
    action, control_flags, frag, gcra, key_kind,
    keys::{bucket_key, debt_slot},
    matcher, reason, rule_set, tcp_flags, unit, unparsed,
    window::{self, Window},
    BucketKey, ControlRecord, GlobalRecord, PacketMeta, QuotaRing, RuleBitmap, RuleConfig,
    SrcEntry, SrcKey, TrieData, CAS_RETRIES, GLOBAL_COUNTER_INDEX, MAX_RULES, MAX_SRC_CLASSES,
    NO_CLASS, PORT_INDICES, PORT_NONE, PROTO_INDICES, RULE_SETS,
};

#[xdp]
pub fn flowctl_xdp(ctx: XdpContext) -> u32 {
    let len = (ctx.data_end() - ctx.data()) as u64;
    entry(&ctx, len)
}

/// The same program for interfaces whose frames may span several buffers
/// (an MTU above what one page holds, as on jumbo-frame links): the kernel
/// attaches only programs that declare multi-buffer support there
/// (`xdp.frags`, Linux 5.18+). Headers are parsed from the first buffer;
/// byte counts cover all of them. The loader picks this one where the
/// kernel has it.
#[xdp(frags)]
pub fn flowctl_xdp_frags(ctx: XdpContext) -> u32 {
    let len = unsafe { aya_ebpf::helpers::bpf_xdp_get_buff_len(ctx.ctx) };
    entry(&ctx, len)
}

/// Global functions, each verified once on its own: the parser (every
/// header layout is walked there and nowhere else), the decision (classify,
/// stages, counting), then, while `top --keys` watches, the sampler, and
/// for BBR rules the connection work. The parsed headers travel in a
/// per-CPU map (`FLOWCTL_PACKET`), not on the stack: the later functions
/// see them as plain memory, so the parser's paths never multiply theirs,
/// and no frame holds them. Siblings, so their stack frames do not add up
/// (the combined call-chain stack must stay under 512 bytes; 6.1 counts
/// global functions in it too).
#[inline(always)]
fn entry(ctx: &XdpContext, len: u64) -> u32 {
    let parsed = parse::flowctl_parse(ctx.ctx, len);
    let v = flowctl_decide(parsed, len);
    if v & packed::SAMPLE != 0 {
        sampler::flowctl_sample_key(packed::rule_at(v), packed::record(v), packed::code(v));
    }
    if v & packed::BBR_ON != 0 {
        let reply = v & packed::BBR_RESET != 0
            && packed::code(v) == outcome_code(Outcome::Drop(reason::BBR));
        let r = conntrack::flowctl_connection(
            ctx.ctx,
            packed::record(v),
            packed::code(v),
            reply as u32,
        );
        if reply {
            return r;
        }
    }
    packed::action(v)
}

#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_decide(parsed: u32, len: u64) -> u64 {
    run(parsed, len)
}

/// Kratos' test for one new connection: refuse while the agent says the
/// rule is overloaded and more than max(1, maxInFlight) connections are in
/// flight: the agent's last sum plus the SYNs admitted since. Open (0) when
/// the agent is not alive.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_bbr_refuses(record: u32, alive: u32) -> u32 {
    let Some(ctl) = FLOWCTL_CONTROL.get_ptr_mut(record) else { return 0 };
    let ctl = unsafe { &mut *ctl };
    if alive == 0 || ctl.flags & control_flags::BBR_ACTIVE == 0 {
        return 0;
    }
    if ctl.bbr_overloaded != 0 {
        // The agent's last sum, plus SYNs admitted since, minus connections
        // completed since (a signed count; see `ControlRecord::bbr_admitted`).
        let delta = unsafe { core::ptr::read_volatile(&ctl.bbr_admitted) } as i32 as i64;
        let in_flight = ctl.bbr_inflight as i64 + delta;
        if in_flight > 1 && in_flight > ctl.bbr_max_inflight as i64 {
            return 1;
        }
    }
    // Admitted (if the later stages agree): counted until the agent's next
    // tick sums the connections itself.
    unsafe {
        core::intrinsics::atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(
            &mut ctl.bbr_admitted,
            1,
        )
    };
    0
}

#[inline(always)]
fn run(parsed: u32, wire_len: u64) -> u64 {
    let Some(global) = FLOWCTL_GLOBAL.get(0) else {
        return xdp_action::XDP_PASS as u64;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    if parsed == class::NOT_IP {
        if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
            c.non_ip_pkts += 1;
        }
        return flowctl_account(GLOBAL_COUNTER_INDEX, outcome_code(Outcome::Pass), wire_len, 0, now)
            as u64;
    }
    if parsed == class::EVASIVE {
        return flowctl_account(
            GLOBAL_COUNTER_INDEX,
            outcome_code(Outcome::Drop(reason::EVASIVE)),
            wire_len,
            0,
            now,
        ) as u64;
    }
    let meta = match packet() {
        Some(m) if parsed == class::IP => m,
        _ => {
            // Counted whatever the verdict, so a pass policy still shows them.
            if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
                c.malformed_pkts += 1;
            }
            let d = Decision::unmatched(if global.malformed_verdict == xdp_action::XDP_DROP {
                Outcome::Drop(reason::MALFORMED)
            } else {
                Outcome::Pass
            });
            return flowctl_account(d.record, outcome_code(d.outcome), wire_len, 0, now) as u64;
        }
    };
    let d = enforce(global, meta, now);
    let code = outcome_code(d.outcome);
    let tcp = if meta.proto == 6 { meta.tcp_flags as u32 } else { 0 };
    let action = flowctl_account(d.record, code, meta.len as u64, tcp, now);
    // The rule's BBR flags go along as they are (no branch here: every
    // branch at the end of the decision is walked once per path into it).
    packed::pack(action, code, d.record, d.rule_at, global.key_sample_every != 0)
        | (d.bbr as u64 & 3) << 61
}

#[inline(always)]
fn enforce(global: &GlobalRecord, meta: &PacketMeta, now: u64) -> Decision {
    let slot = global.active_slot & 1;
    let generation = global.generation as u32;

    // 1. The source's class: from the per-source cache when it was computed
    // for this generation, else from the LPM trie.
    let src_key = SrcKey::of(meta);
    let mut entry_ptr: *mut SrcEntry = match FLOWCTL_SRC_CACHE.get_ptr_mut(&src_key) {
        Some(p) => p,
        None => core::ptr::null_mut(),
    };
    let cached = !entry_ptr.is_null() && unsafe { (*entry_ptr).generation } == generation;
    let class = if cached { unsafe { (*entry_ptr).class } } else { trie_class(slot, meta) };
    let Some(src_bits) = FLOWCTL_SRC_CLASSES.get(slot * MAX_SRC_CLASSES as u32 + class) else {
        // NO_CLASS (no profile applied yet): nothing matches.
        return Decision::unmatched(Outcome::Pass);
    };

    let proto_idx = slot * PROTO_INDICES as u32 + meta.proto as u32;
    let Some(proto_bits) = FLOWCTL_PROTO_BITS.get(proto_idx) else {
        return Decision::unmatched(Outcome::Pass);
    };
    let port = if meta.frag == frag::LATER
        || meta.unparsed != unparsed::NO
        || (meta.proto != 6 && meta.proto != 17)
    {
        PORT_NONE
    } else {
        meta.dport as u32
    };
    let Some(port_bits) = FLOWCTL_PORT_BITS.get(slot * PORT_INDICES as u32 + port) else {
        return Decision::unmatched(Outcome::Pass);
    };
    let matched = if meta.unparsed == unparsed::NO {
        matcher::first_match(src_bits, proto_bits, port_bits)
    } else {
        unparsed_match(slot, meta, src_bits, proto_bits, port_bits)
    };
    let Some(rule_idx) = matched else {
        // A non-first fragment that a port rule might have matched gets the
        // fragment verdict; anything else without a rule passes.
        if meta.frag == frag::LATER && matcher::intersects(src_bits, proto_bits) {
            if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
                c.fragment_pkts += 1;
            }
            if global.fragment_verdict == xdp_action::XDP_DROP {
                return Decision::unmatched(Outcome::Drop(reason::FRAGMENT));
            }
        }
        return Decision::unmatched(Outcome::Pass);
    };
    let Some(rule) = FLOWCTL_RULES.get(slot * MAX_RULES as u32 + rule_idx) else {
        return Decision::unmatched(Outcome::Pass);
    };
    let record = rule.record;

    // Refresh the cache entry when it was stale or missing.
    if entry_ptr.is_null() {
        let e = SrcEntry { tat: 0, generation, owner_state: 0, class, _pad: 0 };
        if FLOWCTL_SRC_CACHE.insert(&src_key, &e, 0).is_ok() {
            if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
                c.source_inserts += 1;
            }
            entry_ptr = FLOWCTL_SRC_CACHE.get_ptr_mut(&src_key).unwrap_or(core::ptr::null_mut());
        }
    } else if !cached {
        unsafe {
            (*entry_ptr).class = class;
            (*entry_ptr).generation = generation;
        }
    }

    if rule.action == action::PASS {
        return Decision::of(rule, Outcome::Pass);
    }
    // Only what the rule's unit counts spends tokens: for `connections`, a
    // TCP SYN without ACK; other packets of the rule pass.
    let cost = match rule.unit {
        unit::BYTES => meta.len as u64,
        unit::CONNECTIONS => {
            if meta.proto != 6
                || meta.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK) != tcp_flags::SYN
            {
                return Decision::of(rule, Outcome::Pass);
            }
            1
        }
        _ => 1,
    };

    // Stage 1: admission ratio (written by the agent's control loops), on
    // new TCP connections and on every UDP/other packet: an established TCP
    // connection is never cut by a ratio.
    if let Some(ctl) = FLOWCTL_CONTROL.get(record) {
        if ctl.flags & control_flags::ADMISSION_ACTIVE != 0
            && (meta.proto != 6
                || meta.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN)
            && agent_alive(global, now)
            && !admitted_by_ratio(global, meta, ctl)
        {
            return verdict(rule, reason::ADMISSION);
        }
    }
    // Stage 2: BBR, on new connections (a BBR rule's unit is `connections`,
    // so only SYNs get here). A global function: inline, its branches
    // multiplied the verifier's work on every later stage by a third.
    if rule.bbr != 0 && flowctl_bbr_refuses(record, agent_alive(global, now) as u32) != 0 {
        return verdict(rule, reason::BBR);
    }

    // Stage 3: quota. Checked now; committed (exactly, by compare-and-swap)
    // only once the bucket has admitted on a read, and rolled back if the
    // bucket's own compare-and-swap then refuses.
    if rule.quota_bucket_ns == 0 {
        // Most rules: the bucket alone, with the quota steps compiled away.
        return bucket_stages(rule, meta, entry_ptr, record, cost, now, &mut NoQuota);
    }
    let mut quota = Quota::of(rule, meta, record, now);
    if !quota.has_room(cost) {
        return verdict(rule, reason::QUOTA);
    }
    bucket_stages(rule, meta, entry_ptr, record, cost, now, &mut quota)
}

/// What the bucket stage needs of the quota stage: commit after the bucket's
/// look, roll back if the bucket's swap then refuses.
trait QuotaStage {
    fn commit(&mut self, cost: u64) -> QuotaCommit;
    fn rollback(&mut self, cost: u64);
}

/// Rules without a quota.
struct NoQuota;

impl QuotaStage for NoQuota {
    #[inline(always)]
    fn commit(&mut self, _cost: u64) -> QuotaCommit {
        QuotaCommit::Done
    }
    #[inline(always)]
    fn rollback(&mut self, _cost: u64) {}
}

/// Stage 4 (and the commit of stage 3): look at the bucket, commit the
/// quota, then create or swap the bucket.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn bucket_stages<Q: QuotaStage>(
    rule: &RuleConfig,
    meta: &PacketMeta,
    entry_ptr: *mut SrcEntry,
    record: u32,
    cost: u64,
    now: u64,
    quota: &mut Q,
) -> Decision {
    // Stage 4, look: the bucket's verdict on a read, before anything commits.
    let inc = gcra::increment_ns(rule.interval_fp, cost);
    let mut tat_ptr: *mut u64 = core::ptr::null_mut();
    let mut create: Option<u64> = None;
    if rule.has_bucket != 0 {
        match bucket_tat(rule, meta, entry_ptr, now) {
            BucketRef::Ptr(p) => {
                let old = unsafe { core::ptr::read_volatile(p) };
                if gcra::admit(old, now, inc, rule.burst_ns).is_none() {
                    return refuse_rate(rule, meta, record, p, old);
                }
                tat_ptr = p;
            }
            BucketRef::Missing => {
                let key = bucket_key(meta, rule);
                let Some(first) =
                    gcra::admit(initial_tat(record, &key, now), now, inc, rule.burst_ns)
                else {
                    // Costlier than the whole bucket, or still in debt:
                    // refused without creating state.
                    return verdict(rule, reason::RATE);
                };
                create = Some(unmarked(first));
            }
        }
    }

    // Stage 3, commit: the quota (one compare-and-swap, exact).
    match quota.commit(cost) {
        QuotaCommit::Done => {}
        QuotaCommit::Full => return verdict(rule, reason::QUOTA),
        QuotaCommit::Contended => return verdict(rule, reason::CONTENDED),
    }

    // Stage 4, commit: create the bucket charged, or swap its TAT.
    if let Some(first) = create {
        let key = bucket_key(meta, rule);
        // BPF_NOEXIST: if another CPU created the key first, use its bucket.
        if FLOWCTL_KEYS.insert(&key, &first, 1 /* BPF_NOEXIST */).is_ok() {
            if let Some(c) = counters(record) {
                c.key_inserts += 1;
            }
            return Decision::of(rule, Outcome::Pass);
        }
        match FLOWCTL_KEYS.get_ptr_mut(&key) {
            Some(p) => tat_ptr = p,
            None => {
                // The table refused the insert: admit (the quota has counted
                // it) and say so.
                if let Some(c) = counters(record) {
                    c.insert_failures += 1;
                }
            }
        }
    }
    if tat_ptr.is_null() {
        return Decision::of(rule, Outcome::Pass);
    }
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(tat_ptr) };
        let Some(new) = gcra::admit(old, now, inc, rule.burst_ns) else {
            // Another CPU took the last token between the look and the swap.
            quota.rollback(cost);
            return refuse_rate(rule, meta, record, tat_ptr, old);
        };
        // Admitting moves the TAT: clear the mark by rounding up to even.
        let new = unmarked(new);
        let (_, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                tat_ptr, old, new,
            )
        };
        if ok {
            return Decision::of(rule, Outcome::Pass);
        }
        tries += 1;
    }
    quota.rollback(cost);
    verdict(rule, reason::CONTENDED)
}

/// A token-bucket refusal. Bit 0 of a TAT marks "debt already remembered": a
/// key that keeps being refused pays for the debt slot once, not per packet.
/// The mark makes the TAT 1 ns later, never earlier.
#[inline(always)]
fn refuse_rate(
    rule: &RuleConfig,
    meta: &PacketMeta,
    record: u32,
    tat_ptr: *mut u64,
    old: u64,
) -> Decision {
    if old & DEBT_MARK == 0 {
        remember_debt(rule, meta, record, old);
        unsafe {
            let _ = atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                tat_ptr,
                old,
                old | DEBT_MARK,
            );
        }
    }
    verdict(rule, reason::RATE)
}

enum QuotaCommit {
    Done,
    Full,
    Contended,
}

/// The quota stage of one packet: its key's window ring and epoch, and
/// whether this packet has committed to it yet (so retries of the bucket's
/// compare-and-swap never count it twice).
struct Quota {
    ring: *mut QuotaRing,
    window: Window,
    epoch: u64,
    limit: u64,
    /// The K full buckets' sum, from `has_room` (past buckets no longer change).
    past: u64,
    committed: bool,
}

impl Quota {
    /// The ring for this packet's key, created empty when missing. A table
    /// that refuses the insert leaves the quota unenforced for this packet
    /// (counted as an insert failure), like the key table.
    #[inline(always)]
    fn of(rule: &RuleConfig, meta: &PacketMeta, record: u32, now: u64) -> Self {
        let window = Window { bucket_ns: rule.quota_bucket_ns, buckets: rule.quota_buckets };
        let key = bucket_key(meta, rule);
        let mut ring = FLOWCTL_QUOTAS.get_ptr_mut(&key).unwrap_or(core::ptr::null_mut());
        if ring.is_null() {
            if let Some(zero) = FLOWCTL_ZERO_RING.get(0) {
                let _ = FLOWCTL_QUOTAS.insert(&key, zero, 1 /* BPF_NOEXIST */);
            }
            ring = FLOWCTL_QUOTAS.get_ptr_mut(&key).unwrap_or(core::ptr::null_mut());
            if ring.is_null() {
                if let Some(c) = counters(record) {
                    c.insert_failures += 1;
                }
            }
        }
        Self {
            ring,
            window,
            epoch: window.epoch(now),
            limit: rule.quota_limit as u64,
            past: 0,
            committed: false,
        }
    }

    #[inline(always)]
    fn word(&self, i: u32) -> u64 {
        unsafe {
            match (*self.ring).words.get(i as usize) {
                Some(w) => core::ptr::read_volatile(w),
                None => 0,
            }
        }
    }

    #[inline(always)]
    fn current(&self) -> Option<*mut u64> {
        let i = window::slot(self.epoch, self.window.slots());
        unsafe { (*self.ring).words.get_mut(i as usize).map(|w| w as *mut u64) }
    }

    #[inline(always)]
    fn has_room(&mut self, cost: u64) -> bool {
        if self.ring.is_null() {
            return true;
        }
        let sum = window::ring_sum(|i| self.word(i as u32), self.epoch, self.window.buckets);
        let current = match self.current() {
            Some(p) => window::count_in(unsafe { core::ptr::read_volatile(p) }, self.epoch) as u64,
            None => 0,
        };
        self.past = sum.saturating_sub(current);
        window::quota_admits(sum, cost, self.limit)
    }
}

impl QuotaStage for Quota {
    /// Adds the packet to the current bucket if the window still has room:
    /// the check and the increment are one compare-and-swap on the current
    /// slot (past buckets no longer change).
    #[inline(always)]
    fn commit(&mut self, cost: u64) -> QuotaCommit {
        if self.ring.is_null() || self.committed {
            return QuotaCommit::Done;
        }
        let Some(cur) = self.current() else { return QuotaCommit::Done };
        let past = self.past;
        let mut tries = 0;
        while tries < CAS_RETRIES {
            let old = unsafe { core::ptr::read_volatile(cur) };
            let sum = past + window::count_in(old, self.epoch) as u64;
            if !window::quota_admits(sum, cost, self.limit) {
                return QuotaCommit::Full;
            }
            let new = window::bumped(old, self.epoch, cost as u32);
            let (_, ok) = unsafe {
                atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                    cur, old, new,
                )
            };
            if ok {
                self.committed = true;
                return QuotaCommit::Done;
            }
            tries += 1;
        }
        QuotaCommit::Contended
    }

    /// Takes this packet's count back out after a later stage refused it.
    /// One attempt: if another CPU changed the slot meanwhile, the count
    /// stays (the window under-admits by this packet until the bucket ages
    /// out; never over-admits).
    #[inline(always)]
    fn rollback(&mut self, cost: u64) {
        if !self.committed {
            return;
        }
        let Some(cur) = self.current() else { return };
        let old = unsafe { core::ptr::read_volatile(cur) };
        let (e, c) = window::unpack(old);
        if e == self.epoch as u32 && (c as u64) >= cost {
            unsafe {
                let _ = atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                    cur,
                    old,
                    window::pack(self.epoch, c - cost as u32),
                );
            }
        }
        self.committed = false;
    }
}

/// Drop (or, in dry-run, count a would-drop and pass) for `why`.
#[inline(always)]
fn verdict(rule: &RuleConfig, why: usize) -> Decision {
    let outcome =
        if rule.action == action::DRY_RUN { Outcome::WouldDrop } else { Outcome::Drop(why) };
    Decision::of(rule, outcome)
}

/// Adaptive stages fail open when the agent's heartbeat is older than the
/// grace period (0 disables the check).
#[inline(always)]
fn agent_alive(global: &GlobalRecord, now: u64) -> bool {
    global.grace_ns == 0 || now.saturating_sub(global.heartbeat_ns) <= global.grace_ns
}

#[inline(always)]
fn admitted_by_ratio(global: &GlobalRecord, meta: &PacketMeta, ctl: &ControlRecord) -> bool {
    if ctl.admission_ppm >= 1_000_000 {
        return true;
    }
    let h = if ctl.flags & control_flags::ADMISSION_PER_FLOW != 0 {
        flow_hash(global.hash_seed, meta)
    } else {
        unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() as u64 }
    };
    // Scale 32 hash bits to [0, 1e6) by multiply-shift (no 128-bit modulo in BPF).
    ((h & 0xffff_ffff) * 1_000_000) >> 32 < ctl.admission_ppm as u64
}

/// A seeded mix of the 5-tuple (splitmix64 finaliser per word).
#[inline(always)]
fn flow_hash(seed: u64, m: &PacketMeta) -> u64 {
    let mut h = seed;
    let words = [
        m.src[0] as u64 | (m.src[1] as u64) << 32,
        m.src[2] as u64 | (m.src[3] as u64) << 32,
        m.dst[0] as u64 | (m.dst[1] as u64) << 32,
        m.dst[2] as u64 | (m.dst[3] as u64) << 32,
        m.sport as u64 | (m.dport as u64) << 16 | (m.proto as u64) << 32,
    ];
    let mut i = 0;
    while i < words.len() {
        h ^= words[i];
        h = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
        i += 1;
    }
    h
}

enum BucketRef {
    Ptr(*mut u64),
    /// No bucket yet for this key: the caller creates it, charged. (The key
    /// is rebuilt there: moving it through the enum makes LLVM call memcpy.)
    Missing,
}

/// Where the rule's bucket for this packet lives. A source-keyed rule keeps its
/// bucket in the source's cache entry when it owns it (one map touch per
/// packet); every other bucket lives in the shared key table.
#[inline(always)]
fn bucket_tat(rule: &RuleConfig, meta: &PacketMeta, entry: *mut SrcEntry, now: u64) -> BucketRef {
    if rule.key_kind == key_kind::SRC && !entry.is_null() {
        let owner = unsafe { (*entry).owner_state };
        if owner == rule.state_id {
            return BucketRef::Ptr(unsafe { &mut (*entry).tat as *mut u64 });
        }
        if owner == 0 {
            // Claim the entry, starting from the key's remembered debt (a full
            // bucket when there is none). Two CPUs may race here; both store
            // the same values.
            let start = initial_tat(rule.record, &bucket_key(meta, rule), now);
            unsafe {
                (*entry).tat = start;
                (*entry).owner_state = rule.state_id;
            }
            return BucketRef::Ptr(unsafe { &mut (*entry).tat as *mut u64 });
        }
    }
    let key = bucket_key(meta, rule);
    match FLOWCTL_KEYS.get_ptr_mut(&key) {
        Some(p) => BucketRef::Ptr(p),
        None => BucketRef::Missing,
    }
}

/// Bit 0 of a stored TAT: this bucket's current debt is in `FLOWCTL_DEBT`.
const DEBT_MARK: u64 = 1;

/// A TAT with the debt mark clear, rounded up (later, so never more lenient).
#[inline(always)]
fn unmarked(tat: u64) -> u64 {
    tat.saturating_add(1) & !DEBT_MARK
}

/// Where a bucket starts: the debt remembered for its key's slot when that is
/// still in the future, else 0 (a full bucket).
#[inline(always)]
fn initial_tat(record: u32, key: &BucketKey, now: u64) -> u64 {
    match FLOWCTL_DEBT.get(debt_slot(record, key)) {
        Some(d) if *d > now => *d,
        _ => 0,
    }
}

/// Remember a refused bucket's TAT, so the key cannot shed its debt by being
/// evicted. Racing CPUs may lose a larger value; the slot then holds a debt
/// that ends sooner, never one that was not owed.
#[inline(always)]
fn remember_debt(rule: &RuleConfig, meta: &PacketMeta, record: u32, tat: u64) {
    let slot = debt_slot(record, &bucket_key(meta, rule));
    if let Some(d) = FLOWCTL_DEBT.get_ptr_mut(slot) {
        unsafe {
            if tat > *d {
                *d = tat;
            }
        }
    }
}

/// The rule for a packet whose ports the parser could not reach: every
/// rule that could apply is a candidate (docs/classification.md). Counted
/// in the global `unparsed_pkts`.
#[inline(always)]
fn unparsed_match(
    slot: u32,
    meta: &PacketMeta,
    src: &RuleBitmap,
    proto: &RuleBitmap,
    no_port: &RuleBitmap,
) -> Option<u32> {
    if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
        c.unparsed_pkts += 1;
    }
    let base = slot * RULE_SETS as u32;
    let enforcing = FLOWCTL_RULE_SETS.get(base + rule_set::ENFORCING as u32)?;
    let any_proto = FLOWCTL_RULE_SETS.get(base + rule_set::ANY_PROTO as u32)?;
    let proto = if meta.unparsed == unparsed::PORTS { Some(proto) } else { None };
    matcher::first_unparsed(src, proto, no_port, any_proto, enforcing)
}

/// The source's class from the LPM trie of `slot`.
#[inline(always)]
fn trie_class(slot: u32, meta: &PacketMeta) -> u32 {
    let mut data: TrieData = [0; 17];
    data[0] = ((slot as u8) << 1) | (meta.family == 6) as u8;
    let words = if meta.family == 6 { 4 } else { 1 };
    let mut i = 0;
    while i < words {
        let b = meta.src[i].to_be_bytes();
        data[1 + i * 4] = b[0];
        data[2 + i * 4] = b[1];
        data[3 + i * 4] = b[2];
        data[4 + i * 4] = b[3];
        i += 1;
    }
    let key = Key::new(8 + 128, data);
    match FLOWCTL_SRC_TRIE.get(&key) {
        Some(c) => *c,
        None => NO_CLASS,
    }
}

flowctl_common::bpf_object_boilerplate!();
