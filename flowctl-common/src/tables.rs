//! Compiles rule match specs into the kernel's classification tables, and
//! answers "which rule?" on the host with the same tables and the same
//! [`first_match`](crate::matcher::first_match) the kernel uses.

use crate::{
    matcher::first_match, rule_set, RuleBitmap, TrieData, PORT_INDICES, PORT_NONE, PROTO_INDICES,
    RULE_SETS, TRIE_TAG_BITS,
};
use std::net::IpAddr;

/// A source prefix with its host bits clear.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    pub fn max_len(addr: &IpAddr) -> u8 {
        if addr.is_ipv4() {
            32
        } else {
            128
        }
    }

    fn bits(addr: &IpAddr) -> u128 {
        match addr {
            IpAddr::V4(a) => (u32::from(*a) as u128) << 96,
            IpAddr::V6(a) => u128::from(*a),
        }
    }

    /// True when `addr` lies in this prefix (same family only).
    pub fn contains(&self, addr: &IpAddr) -> bool {
        if self.addr.is_ipv4() != addr.is_ipv4() {
            return false;
        }
        let mask = if self.len == 0 { 0 } else { u128::MAX << (128 - self.len as u32) };
        Self::bits(&self.addr) & mask == Self::bits(addr) & mask
    }

    /// True when every address of `other` lies in this prefix.
    pub fn covers(&self, other: &Cidr) -> bool {
        self.len <= other.len && self.contains(&other.addr)
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// What a rule matches on. `None` means any.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MatchSpec {
    pub proto: Option<u8>,
    pub src: Option<Cidr>,
    /// Inclusive destination port range.
    pub ports: Option<(u16, u16)>,
    /// The rule limits (action `drop`): it is taken for packets it might
    /// match whose ports are unknown (docs/classification.md, "unparsed").
    pub enforcing: bool,
}

/// One LPM trie entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrieEntry {
    /// Prefix length in bits, tag byte included.
    pub prefix_len: u32,
    pub data: TrieData,
    /// The trie's value: an index into `Tables::classes`.
    pub class: u32,
}

/// The classification tables of one slot.
#[derive(Clone, Debug)]
pub struct Tables {
    pub slot: u8,
    pub proto: Vec<RuleBitmap>,
    pub port: Vec<RuleBitmap>,
    pub trie: Vec<TrieEntry>,
    /// Distinct source bitmaps (at most `MAX_SRC_CLASSES`).
    pub classes: Vec<RuleBitmap>,
    /// `FLOWCTL_RULE_SETS` of this slot: rules by property, for packets
    /// whose ports are unknown ([`crate::matcher::first_unparsed`]).
    pub sets: [RuleBitmap; RULE_SETS],
}

/// The trie key data of `addr` in `slot`.
pub fn trie_data(slot: u8, addr: &IpAddr) -> TrieData {
    let mut d: TrieData = [0; 17];
    match addr {
        IpAddr::V4(a) => {
            d[0] = slot << 1;
            d[1..5].copy_from_slice(&a.octets());
        }
        IpAddr::V6(a) => {
            d[0] = (slot << 1) | 1;
            d[1..17].copy_from_slice(&a.octets());
        }
    }
    d
}

/// Builds the tables for `specs` (index = rule number, profile order).
pub fn compile(specs: &[MatchSpec], slot: u8) -> Tables {
    let mut proto = vec![RuleBitmap::EMPTY; PROTO_INDICES];
    let mut port = vec![RuleBitmap::EMPTY; PORT_INDICES];
    let mut sets = [RuleBitmap::EMPTY; RULE_SETS];
    for (i, s) in specs.iter().enumerate() {
        if s.enforcing {
            sets[rule_set::ENFORCING].set(i);
        }
        if s.proto.is_none() {
            sets[rule_set::ANY_PROTO].set(i);
        }
        match s.proto {
            Some(p) => proto[p as usize].set(i),
            None => proto.iter_mut().for_each(|b| b.set(i)),
        }
        match s.ports {
            Some((lo, hi)) => (lo..=hi).for_each(|p| port[p as usize].set(i)),
            None => port.iter_mut().for_each(|b| b.set(i)),
        }
    }
    // Every distinct prefix, plus both default routes so every address finds
    // an entry: its bitmap holds the rules whose prefix covers it. For the
    // longest stored prefix P that contains an address A, "rules containing A"
    // equals "rules covering P" (any rule prefix containing A is itself stored
    // and no longer than P).
    let mut prefixes: Vec<Cidr> = vec![
        Cidr { addr: IpAddr::V4(0.into()), len: 0 },
        Cidr { addr: IpAddr::V6(0u128.into()), len: 0 },
    ];
    for s in specs {
        if let Some(c) = s.src {
            if !prefixes.contains(&c) {
                prefixes.push(c);
            }
        }
    }
    let mut classes: Vec<RuleBitmap> = Vec::new();
    let trie = prefixes
        .iter()
        .map(|p| {
            let mut bits = RuleBitmap::EMPTY;
            for (i, s) in specs.iter().enumerate() {
                if s.src.is_none_or(|c| c.covers(p)) {
                    bits.set(i);
                }
            }
            let class = match classes.iter().position(|c| *c == bits) {
                Some(i) => i,
                None => {
                    classes.push(bits);
                    classes.len() - 1
                }
            };
            TrieEntry {
                prefix_len: TRIE_TAG_BITS + p.len as u32,
                data: trie_data(slot, &p.addr),
                class: class as u32,
            }
        })
        .collect();
    Tables { slot, proto, port, trie, classes, sets }
}

impl Tables {
    /// The source bitmap the kernel's LPM lookup would return for `addr`.
    pub fn src_bits(&self, addr: &IpAddr) -> RuleBitmap {
        let want = trie_data(self.slot, addr);
        let mut best: Option<&TrieEntry> = None;
        for e in &self.trie {
            let plen = e.prefix_len as usize;
            let full = plen / 8;
            let rem = plen % 8;
            let mut ok = e.data[..full] == want[..full];
            if ok && rem != 0 {
                let m = 0xffu8 << (8 - rem);
                ok = e.data[full] & m == want[full] & m;
            }
            if ok && best.is_none_or(|b| b.prefix_len < e.prefix_len) {
                best = Some(e);
            }
        }
        best.map(|e| self.classes[e.class as usize]).unwrap_or(RuleBitmap::EMPTY)
    }

    /// The rule the kernel picks for a packet; `dport = None` for packets
    /// without ports (ICMP, other protocols, non-first fragments).
    pub fn classify(&self, src: &IpAddr, proto: u8, dport: Option<u16>) -> Option<u32> {
        let port = dport.map(u32::from).unwrap_or(PORT_NONE);
        first_match(&self.src_bits(src), &self.proto[proto as usize], &self.port[port as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cidr(s: &str) -> Cidr {
        let (a, l) = s.split_once('/').unwrap();
        Cidr { addr: a.parse().unwrap(), len: l.parse().unwrap() }
    }

    /// The obvious linear first-match the tables must agree with.
    fn linear(specs: &[MatchSpec], src: &IpAddr, proto: u8, dport: Option<u16>) -> Option<u32> {
        specs
            .iter()
            .position(|s| {
                s.proto.is_none_or(|p| p == proto)
                    && s.src.is_none_or(|c| c.contains(src))
                    && match (s.ports, dport) {
                        (None, _) => true,
                        (Some((lo, hi)), Some(p)) => lo <= p && p <= hi,
                        (Some(_), None) => false,
                    }
            })
            .map(|i| i as u32)
    }

    #[test]
    fn first_match_in_profile_order() {
        let specs = vec![
            MatchSpec {
                proto: Some(6),
                src: Some(cidr("10.1.0.0/16")),
                ports: Some((22, 22)),
                enforcing: true,
            },
            MatchSpec { proto: None, src: Some(cidr("10.0.0.0/8")), ports: None, enforcing: true },
            MatchSpec { proto: Some(17), src: None, ports: Some((53, 53)), enforcing: true },
            MatchSpec {
                proto: None,
                src: Some(cidr("2001:db8::/32")),
                ports: Some((80, 90)),
                enforcing: true,
            },
        ];
        let t = compile(&specs, 1);
        assert!(t.classes.len() <= t.trie.len());
        let a = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(t.classify(&a("10.1.2.3"), 6, Some(22)), Some(0));
        assert_eq!(t.classify(&a("10.1.2.3"), 6, Some(23)), Some(1));
        assert_eq!(t.classify(&a("10.1.2.3"), 17, Some(53)), Some(1));
        assert_eq!(t.classify(&a("192.0.2.1"), 17, Some(53)), Some(2));
        assert_eq!(t.classify(&a("192.0.2.1"), 6, Some(53)), None);
        assert_eq!(t.classify(&a("2001:db8::1"), 6, Some(85)), Some(3));
        assert_eq!(t.classify(&a("2001:db8::1"), 6, None), None);
        assert_eq!(t.classify(&a("2001:db9::1"), 6, Some(85)), None);
    }

    fn arb_cidr() -> impl Strategy<Value = Cidr> {
        prop_oneof![
            (any::<u32>(), 0u8..=32).prop_map(|(a, l)| {
                let m = if l == 0 { 0 } else { u32::MAX << (32 - l) };
                Cidr { addr: IpAddr::V4((a & m & 0x0a0f_ffff | 0x0a00_0000 & m).into()), len: l }
            }),
            (any::<u128>(), 0u8..=128).prop_map(|(a, l)| {
                let m = if l == 0 { 0 } else { u128::MAX << (128 - l as u32) };
                Cidr { addr: IpAddr::V6(((a & m) | (0x2001u128 << 112) & m).into()), len: l }
            }),
        ]
    }

    fn arb_spec() -> impl Strategy<Value = MatchSpec> {
        (
            proptest::option::of(prop_oneof![Just(6u8), Just(17u8), Just(1u8)]),
            proptest::option::of(arb_cidr()),
            proptest::option::of((0u16..200, 0u16..50).prop_map(|(a, w)| (a, a + w))),
        )
            .prop_map(|(proto, src, ports)| MatchSpec {
                proto,
                src,
                ports,
                enforcing: true,
            })
    }

    proptest! {
        #[test]
        fn tables_agree_with_linear_scan(
            specs in proptest::collection::vec(arb_spec(), 1..40),
            probes in proptest::collection::vec((arb_cidr(), prop_oneof![Just(6u8), Just(17u8), Just(1u8), Just(47u8)], proptest::option::of(0u16..260)), 1..40),
        ) {
            let t = compile(&specs, 0);
            for (c, proto, port) in probes {
                prop_assert_eq!(t.classify(&c.addr, proto, port), linear(&specs, &c.addr, proto, port));
            }
        }
    }
}
