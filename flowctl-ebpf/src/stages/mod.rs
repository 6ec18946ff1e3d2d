//! The stages a matched packet goes through, in a fixed order:
//!
//! 1. admission ([`admission`]): the share of new flows the agent's
//!    control loops (or a fixed `admission_ratio`) let in;
//! 2. BBR ([`bbr`]): new connections beyond what the service carries while
//!    it is overloaded;
//! 3. quota ([`quota`]): the key's sliding window;
//! 4. token bucket ([`bucket`]; an isolated rule's in its own table,
//!    [`isolated`]): the key's rate, and the rule's nested
//!    limits' ([`nested`]); for a global rule ([`global`]), at the rate of
//!    this host's lease; a flooded rule's keys without a bucket, by the
//!    flood sketch the agent lent it ([`sketch`]).
//!
//! The first stage that refuses decides, and the drop is charged to its
//! reason. The quota and the bucket commit only when every stage has
//! admitted: both look first, then the quota commits and the bucket swaps,
//! and a bucket that refuses at its swap rolls the quota's commit back, so
//! neither spends anything on a packet that is refused. (The BBR stage's
//! count of admitted SYNs is taken at its check; see `bbr`.)

mod admission;
pub mod bbr;
pub mod booking;
mod bucket;
pub mod global;
pub mod isolated;
pub mod nested;
mod quota;
mod sketch;
pub mod warm;

use crate::{
    classify::{self, Match},
    decision::{packed, Decision, Outcome},
};
use flowctl_common::{
    action, bucket_table, reason, tcp_flags, unit, GlobalRecord, PacketMeta, RuleConfig,
    BLOCK_INTERVAL_FP,
};
use quota::{NoQuota, Quota};

/// The decision on a parsed packet: its rule (`classify`), then the
/// rule's stages.
#[inline(always)]
pub fn enforce(global: &GlobalRecord, meta: &PacketMeta, now: u64) -> Decision {
    let (rule, entry_ptr, record) = match classify::first_rule(global, meta, now) {
        Match::Rule(rule, entry_ptr, record) => (rule, entry_ptr, record),
        Match::Unmatched(d) => return d,
    };
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

    // Stage 1: admission ratio.
    if admission::refuses(global, meta, record, now) {
        return verdict(rule, reason::ADMISSION);
    }
    // Stage 2: BBR, on new connections (a BBR rule's unit is `connections`,
    // so only SYNs get here). A global function: inline, its branches
    // multiplied the verifier's work on every later stage by a third.
    if rule.bbr != 0 && bbr::flowctl_bbr_refuses(record, agent_alive(global, now) as u32) != 0 {
        return verdict(rule, reason::BBR);
    }

    // Rules whose stages 3 and 4 run beside the decision, in a function the
    // entry point calls with its packed result (their frames stacked on
    // this one would pass 512 bytes): a rule with nested limits
    // (`nested`), and a global rule, at its lease's shares, save a hot
    // source key's admission, or its refusal once reported, decided here
    // (`global::fast`). One branch for both: each branch here is walked
    // once per path into it (a second cost 6.1 70k instructions).
    // A warm-up rule's ramp (`warm`) runs in the nested limits' place, and
    // so does an isolated rule's bucket (`isolated`): its own table's
    // function on this frame, with the debt's or the sketch's on top, would
    // pass 512 bytes too.
    let own = rule.bucket_table & bucket_table::OWN;
    if rule.global | rule.nested | rule.cold_factor | own != 0 {
        if rule.nested | rule.cold_factor | own != 0 {
            return Decision::of(rule, Outcome::Beside(packed::NESTED));
        }
        if let Some(d) = global::fast(rule, meta, record, entry_ptr, cost, now) {
            return d;
        }
        return Decision::of(rule, Outcome::Beside(packed::GLOBAL));
    }

    // A `block` rule: refused before its key is built. As a bucket that
    // never holds a token it would cost a key-table miss and a debt recall
    // per packet (docs/benchmarks.md, 1k).
    if rule.interval_fp == BLOCK_INTERVAL_FP {
        return verdict(rule, reason::RATE);
    }

    // Stage 3: quota. Checked now; committed (exactly, by compare-and-swap)
    // only once the bucket has admitted on a read, and rolled back if the
    // bucket's own compare-and-swap then refuses.
    if rule.quota_bucket_ns == 0 {
        // Most rules: the bucket alone (stage 4), with the quota steps
        // compiled away. A rule with `book_retransmits` (never with a
        // quota) has its SYN's verdict finished by `booking`.
        let mut d = bucket::admit(rule, meta, entry_ptr, record, cost, now, &mut NoQuota);
        d.book = rule.book_syns;
        return d;
    }
    let mut quota = Quota::of(rule, meta, record, now);
    if !quota.has_room(cost) {
        if quota.first_refusal_in_bucket() {
            quota::remember_window(rule.at, record, &quota::window_of(rule), now);
        }
        return verdict(rule, reason::QUOTA);
    }
    // Stage 4, with the quota's commit.
    bucket::admit(rule, meta, entry_ptr, record, cost, now, &mut quota)
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
pub(crate) fn agent_alive(global: &GlobalRecord, now: u64) -> bool {
    global.grace_ns == 0 || now.saturating_sub(global.heartbeat_ns) <= global.grace_ns
}
