//! First-match rule selection over bitmaps.
//!
//! The agent compiles a profile into lookups that each return a
//! [`RuleBitmap`]: by L4 protocol, by destination port, by source prefix
//! (an LPM trie whose entry for a prefix holds every rule whose CIDR contains
//! it) and, when some rule names one, by destination prefix (the same trie).
//! A rule matches when it is in all of them; the first rule in profile order
//! is the lowest set bit of their intersection. The cost is a few word ANDs
//! whatever the number of rules. The kernel and `flowctl explain` both call
//! [`first_match`].

use crate::{RuleBitmap, BITMAP_WORDS};

/// Index of the lowest set bit, by binary search (BPF has no ctz instruction).
#[inline(always)]
pub fn lowest_bit(mut x: u64) -> u32 {
    let mut n = 0;
    if x & 0xffff_ffff == 0 {
        n += 32;
        x >>= 32;
    }
    if x & 0xffff == 0 {
        n += 16;
        x >>= 16;
    }
    if x & 0xff == 0 {
        n += 8;
        x >>= 8;
    }
    if x & 0xf == 0 {
        n += 4;
        x >>= 4;
    }
    if x & 0x3 == 0 {
        n += 2;
        x >>= 2;
    }
    if x & 0x1 == 0 {
        n += 1;
    }
    n
}

/// The rules whose address constraints a packet meets: those of its
/// source's class and of its destination's class. A profile without
/// destination rules passes the source's set twice ([`AddrSets::source`]):
/// ANDing a set with itself changes nothing, and the kernel then neither
/// looks the destination up nor copies a bitmap onto its small stack.
#[derive(Clone, Copy)]
pub struct AddrSets<'a> {
    pub src: &'a RuleBitmap,
    pub dst: &'a RuleBitmap,
}

impl<'a> AddrSets<'a> {
    /// Only the source constrains (no rule of the profile names a destination).
    #[inline(always)]
    pub fn source(src: &'a RuleBitmap) -> Self {
        Self { src, dst: src }
    }

    #[inline(always)]
    fn word(&self, i: usize) -> u64 {
        self.src.words[i] & self.dst.words[i]
    }
}

/// The first rule (lowest index) in all the sets.
#[inline(always)]
pub fn first_match(addrs: AddrSets, proto: &RuleBitmap, port: &RuleBitmap) -> Option<u32> {
    let mut i = 0;
    while i < BITMAP_WORDS {
        let w = addrs.word(i) & proto.words[i] & port.words[i];
        if w != 0 {
            return Some(i as u32 * 64 + lowest_bit(w));
        }
        i += 1;
    }
    None
}

/// True when any rule is in all the sets (used for the fragment policy: a
/// non-first fragment that some port-constrained rule might have matched).
#[inline(always)]
pub fn intersects(addrs: AddrSets, proto: &RuleBitmap) -> bool {
    let mut i = 0;
    while i < BITMAP_WORDS {
        if addrs.word(i) & proto.words[i] != 0 {
            return true;
        }
        i += 1;
    }
    false
}

/// The rule for a packet whose ports the parser could not reach
/// (docs/classification.md, "unparsed"): the first rule that could apply
/// (source matches; protocol too when `proto` is known) and either
/// certainly applies (no port constraint, and a known protocol or none
/// required: `no_port`, `any_proto`) or enforces (`enforcing`). A pass or
/// dry-run rule with a port constraint is passed over, since it might not
/// apply; an enforcing one is taken, since it might.
#[inline(always)]
pub fn first_unparsed(
    addrs: AddrSets,
    proto: Option<&RuleBitmap>,
    no_port: &RuleBitmap,
    any_proto: &RuleBitmap,
    enforcing: &RuleBitmap,
) -> Option<u32> {
    let mut i = 0;
    while i < BITMAP_WORDS {
        let w = match proto {
            Some(p) => addrs.word(i) & p.words[i] & (no_port.words[i] | enforcing.words[i]),
            None => addrs.word(i) & ((any_proto.words[i] & no_port.words[i]) | enforcing.words[i]),
        };
        if w != 0 {
            return Some(i as u32 * 64 + lowest_bit(w));
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lowest_bit_every_position() {
        for i in 0..64 {
            assert_eq!(lowest_bit(1u64 << i), i);
            assert_eq!(lowest_bit(u64::MAX << i), i);
        }
    }

    proptest! {
        #[test]
        fn first_match_is_lowest_common(a: [u64; 4], d: [u64; 4], b: [u64; 4], c: [u64; 4]) {
            let [a, d, b, c] = [a, d, b, c].map(|words| RuleBitmap { words });
            let expect = (0..256).find(|&i| a.contains(i) && d.contains(i) && b.contains(i) && c.contains(i));
            let got = first_match(AddrSets { src: &a, dst: &d }, &b, &c);
            prop_assert_eq!(got.map(|x| x as usize), expect);
            // Without destinations the source set alone constrains.
            let expect = (0..256).find(|&i| a.contains(i) && b.contains(i) && c.contains(i));
            prop_assert_eq!(first_match(AddrSets::source(&a), &b, &c).map(|x| x as usize), expect);
        }

        /// The unparsed rule, rule by rule as docs/classification.md says:
        /// the first candidate (source, and protocol when known) that
        /// certainly applies or enforces.
        #[test]
        fn first_unparsed_is_the_first_possible_limit(
            src: [u64; 4], proto: [u64; 4], no_port: [u64; 4], any_proto: [u64; 4], enforcing: [u64; 4], known: bool,
        ) {
            let [src, proto, no_port, any_proto, enforcing] =
                [src, proto, no_port, any_proto, enforcing].map(|words| RuleBitmap { words });
            let expect = (0..256).find(|&i| {
                let candidate = src.contains(i) && (!known || proto.contains(i));
                let certain = no_port.contains(i) && (known || any_proto.contains(i));
                candidate && (certain || enforcing.contains(i))
            });
            let got = first_unparsed(AddrSets::source(&src), known.then_some(&proto), &no_port, &any_proto, &enforcing);
            prop_assert_eq!(got.map(|x| x as usize), expect);
        }
    }
}
