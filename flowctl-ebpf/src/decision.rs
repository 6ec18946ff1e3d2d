//! What the decision produces: a [`Decision`] (the counter record, the
//! outcome and the deciding rule), whichever stage or classification step
//! reached it, and the one register `flowctl_decide` hands back to the entry
//! point ([`packed`]).

use flowctl_common::{RuleConfig, GLOBAL_COUNTER_INDEX};

/// A packet's verdict, counted in one place (`accounting::flowctl_account`)
/// whatever stage decided it: one copy of the counting code keeps the
/// verifier's work small.
#[derive(Clone, Copy)]
pub struct Decision {
    pub record: u32,
    pub outcome: Outcome,
    /// Index of the deciding rule in `FLOWCTL_RULES` (u32::MAX: none).
    pub rule_at: u32,
    /// The deciding rule's `bbr_flags` (0: none).
    pub bbr: u8,
    /// 1: a SYN its rule's bucket judged, of a rule with
    /// `book_retransmits`: the booking stage finishes the decision.
    pub book: u8,
}

impl Decision {
    #[inline(always)]
    pub fn unmatched(outcome: Outcome) -> Self {
        Self { record: GLOBAL_COUNTER_INDEX, outcome, rule_at: u32::MAX, bbr: 0, book: 0 }
    }

    #[inline(always)]
    pub fn of(rule: &RuleConfig, outcome: Outcome) -> Self {
        Self { record: rule.record, outcome, rule_at: rule.at, bbr: rule.bbr, book: 0 }
    }
}

#[derive(Clone, Copy)]
pub enum Outcome {
    Pass,
    Drop(usize),
    WouldDrop,
    /// A stage beside the decision decides, called from the entry point
    /// (nothing is counted before it): `packed::GLOBAL`, a global rule's
    /// bucket (`flowctl_global_decide`), or `packed::NESTED`, the buckets
    /// of a rule with nested limits (`flowctl_nested_decide`).
    Beside(u64),
}

/// An outcome as one scalar for `flowctl_account`: 0 pass, 1 would-drop,
/// 2 + reason for a drop.
#[inline(always)]
pub fn outcome_code(o: Outcome) -> u32 {
    match o {
        Outcome::Pass => 0,
        Outcome::WouldDrop => 1,
        Outcome::Drop(why) => 2 + why as u32,
        Outcome::Beside(_) => 0xff,
    }
}

/// What `flowctl_decide` returns, in one register: the XDP action (bits
/// 0-7), the outcome code (8-15), the counter record (16-31), the rule's
/// table index (32-47, 0xffff: none), "the nested limits' stage decides"
/// (58), "the booking stage finishes" (59),
/// "a global rule's bucket decides" (60), the rule's BBR flags (61-62) and "sample this packet" (63).
pub mod packed {
    pub const SAMPLE: u64 = 1 << 63;
    /// Not decided yet: the entry point calls the global stage, which
    /// decides, counts and packs the result again.
    pub const GLOBAL: u64 = 1 << 60;
    /// Not decided yet: the entry point calls the nested limits' stage
    /// (`stages::nested`), which decides, counts and packs it again.
    pub const NESTED: u64 = 1 << 58;
    /// Judged by the bucket (its outcome code in bits 8-15), not counted
    /// yet: the entry point calls the booking stage, which finishes the
    /// decision, counts and packs it again.
    pub const BOOK: u64 = 1 << 59;
    /// The deciding rule's `bbr_flags` sit in bits 61 (ON: track its
    /// connections) and 62 (RESET: answer its refused SYNs with a RST).
    pub const BBR_ON: u64 = (flowctl_common::bbr_flags::ON as u64) << 61;
    pub const BBR_RESET: u64 = (flowctl_common::bbr_flags::RESET as u64) << 61;

    #[inline(always)]
    pub fn pack(action: u32, code: u32, record: u32, rule_at: u32, sample: bool) -> u64 {
        (action as u64 & 0xff)
            | (code as u64 & 0xff) << 8
            | (record as u64 & 0xffff) << 16
            | (rule_at as u64 & 0xffff) << 32
            | (sample as u64) << 63
    }
    #[inline(always)]
    pub fn action(v: u64) -> u32 {
        (v & 0xff) as u32
    }
    #[inline(always)]
    pub fn code(v: u64) -> u32 {
        (v >> 8 & 0xff) as u32
    }
    #[inline(always)]
    pub fn record(v: u64) -> u32 {
        (v >> 16 & 0xffff) as u32
    }
    /// The outcome a code stands for (`outcome_code`'s inverse, for the
    /// stages that finish a decision).
    #[inline(always)]
    pub fn outcome(code: u32) -> super::Outcome {
        match code {
            0 => super::Outcome::Pass,
            1 => super::Outcome::WouldDrop,
            c => super::Outcome::Drop(c.saturating_sub(2) as usize),
        }
    }
    #[inline(always)]
    pub fn rule_at(v: u64) -> u32 {
        (v >> 32 & 0xffff) as u32
    }
}
