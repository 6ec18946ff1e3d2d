//! Classification: the first rule of the profile, in file order, that
//! matches a parsed packet (docs/classification.md). The source's class
//! comes from the per-source cache when it was computed for the live
//! profile's generation, else from the LPM trie (and is cached); the class,
//! protocol and port bitmaps ANDed give the candidates, whatever the rule
//! count. When the live slot's rules name destinations, the destination's
//! class (the same trie, not cached) is ANDed in too.

use crate::{
    accounting::counters,
    decision::{Decision, Outcome},
    maps::{
        DST_MEMO_ENTRIES, FLOWCTL_CONTROL, FLOWCTL_DST_MEMO, FLOWCTL_PORT_BITS, FLOWCTL_PROTO_BITS,
        FLOWCTL_RULES, FLOWCTL_RULE_SETS, FLOWCTL_SRC_CACHE, FLOWCTL_SRC_CLASSES, FLOWCTL_SRC_TRIE,
    },
};
use aya_ebpf::{bindings::xdp_action, maps::lpm_trie::Key};
use flowctl_common::{
    bucket_table, control_flags, frag,
    matcher::{self, AddrSets},
    reason, rule_set, trie_tag, unparsed, GlobalBucket, GlobalRecord, PacketMeta, RuleBitmap,
    RuleConfig, SrcEntry, SrcKey, TrieData, GLOBAL_COUNTER_INDEX, MAX_RULES, MAX_SRC_CLASSES,
    NO_CLASS, PORT_INDICES, PORT_NONE, PROTO_INDICES, RULE_SETS, TRIE_KEY_BITS,
};

/// What classification found for a packet.
pub enum Match {
    /// The deciding rule, the source's cache entry (null when the cache
    /// holds none) and the rule's counter record.
    Rule(&'static RuleConfig, *mut SrcEntry, u32),
    /// No rule applies: the decision on the unmatched packet.
    Unmatched(Decision),
}

/// The rule that applies to `meta` in the live slot of the profile, with
/// the source's cache entry refreshed when it was stale or missing.
#[inline(always)]
pub fn first_rule(global: &GlobalRecord, meta: &PacketMeta, now: u64) -> Match {
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
    let class = if cached { unsafe { (*entry_ptr).class } } else { trie_class(slot, meta, false) };
    let Some(src_bits) = FLOWCTL_SRC_CLASSES.get(slot * MAX_SRC_CLASSES as u32 + class) else {
        // NO_CLASS (no profile applied yet): nothing matches.
        return Match::Unmatched(Decision::unmatched(Outcome::Pass));
    };
    // 1b. The destination's class, only when a rule of the slot names one:
    // a profile without destinations pays one bit test. The two sets are
    // ANDed word by word in the matcher, not copied (the stack is small).
    let addr_bits = if (global.dst_slots >> slot) & 1 != 0 {
        let dst_class = dst_class(slot, generation, meta);
        let Some(dst_bits) = FLOWCTL_SRC_CLASSES.get(slot * MAX_SRC_CLASSES as u32 + dst_class)
        else {
            return Match::Unmatched(Decision::unmatched(Outcome::Pass));
        };
        AddrSets { src: src_bits, dst: dst_bits }
    } else {
        AddrSets::source(src_bits)
    };

    let proto_idx = slot * PROTO_INDICES as u32 + meta.proto as u32;
    let Some(proto_bits) = FLOWCTL_PROTO_BITS.get(proto_idx) else {
        return Match::Unmatched(Decision::unmatched(Outcome::Pass));
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
        return Match::Unmatched(Decision::unmatched(Outcome::Pass));
    };
    let matched = if meta.unparsed == unparsed::NO {
        matcher::first_match(addr_bits, proto_bits, port_bits)
    } else {
        unparsed_match(slot, meta, addr_bits, proto_bits, port_bits)
    };
    let Some(rule_idx) = matched else {
        // A non-first fragment that a port rule might have matched gets the
        // fragment verdict; anything else without a rule passes.
        if meta.frag == frag::LATER && matcher::intersects(addr_bits, proto_bits) {
            if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
                c.fragment_pkts += 1;
            }
            if global.fragment_verdict == xdp_action::XDP_DROP {
                return Match::Unmatched(Decision::unmatched(Outcome::Drop(reason::FRAGMENT)));
            }
        }
        return Match::Unmatched(Decision::unmatched(Outcome::Pass));
    };
    let Some(rule) = FLOWCTL_RULES.get(slot * MAX_RULES as u32 + rule_idx) else {
        return Match::Unmatched(Decision::unmatched(Outcome::Pass));
    };
    let record = rule.record;

    // Refresh the cache entry when it was stale or missing; a missing one
    // is not added while a rule is flooded (`control_flags::FLOOD`), nor
    // for an isolated rule (`bucket_table::OWN`), whose new sources would
    // otherwise evict other rules' sources and the buckets they hold.
    if entry_ptr.is_null() {
        if rule.bucket_table != bucket_table::OWN && !flooded(global, now) {
            let e = SrcEntry {
                generation,
                owner_state: 0,
                class,
                _pad: 0,
                bucket: GlobalBucket::default(),
            };
            if FLOWCTL_SRC_CACHE.insert(&src_key, &e, 0).is_ok() {
                if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
                    c.source_inserts += 1;
                }
                entry_ptr =
                    FLOWCTL_SRC_CACHE.get_ptr_mut(&src_key).unwrap_or(core::ptr::null_mut());
            }
        }
    } else if !cached {
        unsafe {
            (*entry_ptr).class = class;
            (*entry_ptr).generation = generation;
        }
    }
    Match::Rule(rule, entry_ptr, record)
}

/// Whether the agent has flagged a flood (and is alive to take the flag
/// back): new sources are then classified from the trie on every packet
/// and get no cache entry, so a flood of spoofed sources cannot evict the
/// entries of the sources already known, nor the buckets source-keyed
/// rules keep in them. Their buckets are made in the key table meanwhile.
#[inline(always)]
fn flooded(global: &GlobalRecord, now: u64) -> bool {
    match FLOWCTL_CONTROL.get(GLOBAL_COUNTER_INDEX) {
        Some(c) => c.flags & control_flags::FLOOD != 0 && crate::stages::agent_alive(global, now),
        None => false,
    }
}

/// The rule for a packet whose ports the parser could not reach: every
/// rule that could apply is a candidate (docs/classification.md). Counted
/// in the global `unparsed_pkts`.
#[inline(always)]
fn unparsed_match(
    slot: u32,
    meta: &PacketMeta,
    addrs: AddrSets,
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
    matcher::first_unparsed(addrs, proto, no_port, any_proto, enforcing)
}

/// The destination's class, from this CPU's memo when it holds the
/// address for this generation, else from the trie (and memoised). A
/// function of its own (a BPF-to-BPF call) so that a profile without
/// destination rules does not carry this in the common path. Only the
/// generation, the memo's index and `meta` live across the trie lookup, and
/// the address is read again after it: held in registers, its four words
/// were spilled around the key's bytes (120 bytes of stack, past the call
/// chain's budget).
#[inline(never)]
fn dst_class(slot: u32, generation: u32, meta: &PacketMeta) -> u32 {
    let d = &meta.dst;
    let mix = d[0] ^ d[1] ^ d[2] ^ d[3];
    let index = (mix ^ (mix >> 8) ^ (mix >> 16) ^ (mix >> 24)) & (DST_MEMO_ENTRIES - 1);
    if let Some(m) = FLOWCTL_DST_MEMO.get(index) {
        if m.generation == generation
            && m.family == meta.family as u32
            && m.addr[0] == d[0]
            && m.addr[1] == d[1]
            && m.addr[2] == d[2]
            && m.addr[3] == d[3]
        {
            return m.class;
        }
    }
    let class = trie_class(slot, meta, true);
    if let Some(m) = FLOWCTL_DST_MEMO.get_ptr_mut(index) {
        let m = unsafe { &mut *m };
        let mut i = 0;
        while i < 4 {
            m.addr[i] = unsafe { core::ptr::read_volatile(&meta.dst[i]) };
            i += 1;
        }
        m.family = unsafe { core::ptr::read_volatile(&meta.family) } as u32;
        m.generation = generation;
        m.class = class;
    }
    class
}

/// The source's (or with `dst`, the destination's) class from the LPM
/// trie of `slot` (key layout: `flowctl_common::tables::trie_data_for`).
#[inline(always)]
fn trie_class(slot: u32, meta: &PacketMeta, dst: bool) -> u32 {
    // Built in place: a separate data array copied into the key doubled
    // the stack this takes.
    let mut key: Key<TrieData> = Key::new(TRIE_KEY_BITS, [0; 17]);
    key.data[0] = trie_tag(dst, slot as u8, meta.family == 6);
    let addr = if dst { &meta.dst } else { &meta.src };
    let words = if meta.family == 6 { 4 } else { 1 };
    let mut i = 0;
    while i < words {
        let b = addr[i].to_be_bytes();
        key.data[1 + i * 4] = b[0];
        key.data[2 + i * 4] = b[1];
        key.data[3 + i * 4] = b[2];
        key.data[4 + i * 4] = b[3];
        i += 1;
    }
    match FLOWCTL_SRC_TRIE.get(&key) {
        Some(c) => *c,
        None => NO_CLASS,
    }
}
