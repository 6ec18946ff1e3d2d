//! Compiles rule match specs into the kernel's classification tables, and
//! answers "which rule?" on the host with the same tables and the same
//! [`first_match`](crate::matcher::first_match) the kernel uses.

use crate::{
    matcher::{first_match, AddrSets},
    rule_set, trie_tag, RuleBitmap, TrieData, MAX_SRC_CLASSES, PORT_INDICES, PORT_NONE,
    PROTO_INDICES, RULE_SETS, TRIE_TAG_BITS,
};
use std::{net::IpAddr, sync::Arc};

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

/// A named set of prefixes: a profile's `[[list]]`. Cloning shares the
/// prefixes (a list of a million is read once and held once).
#[derive(Clone)]
pub struct PrefixList {
    pub name: String,
    pub prefixes: Arc<[Cidr]>,
}

impl PrefixList {
    /// True when some prefix of the list contains `addr` (a linear scan:
    /// for host-side checks; the kernel asks its trie).
    pub fn contains(&self, addr: &IpAddr) -> bool {
        self.prefixes.iter().any(|c| c.contains(addr))
    }
}

/// Only the name: a rule's bucket state survives a change of its list's
/// contents (`Rule::state_fingerprint` is built from this), and a million
/// prefixes do not belong in a log line.
impl std::fmt::Debug for PrefixList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "@{}", self.name)
    }
}

impl PartialEq for PrefixList {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && (Arc::ptr_eq(&self.prefixes, &other.prefixes) || self.prefixes == other.prefixes)
    }
}
impl Eq for PrefixList {}

impl std::hash::Hash for PrefixList {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
        self.prefixes.len().hash(state);
    }
}

/// Where a rule's packets come from: one prefix, or every prefix of a list.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    Prefix(Cidr),
    List(PrefixList),
}

impl Source {
    pub fn contains(&self, addr: &IpAddr) -> bool {
        match self {
            Source::Prefix(c) => c.contains(addr),
            Source::List(l) => l.contains(addr),
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Prefix(c) => c.fmt(f),
            // The name only: readers of an applied profile's copy do not
            // read the list's file (its count is in `status`).
            Source::List(l) => write!(f, "@{}", l.name),
        }
    }
}

/// What a rule matches on. `None` means any.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MatchSpec {
    pub proto: Option<u8>,
    pub src: Option<Source>,
    /// Where the packet goes: a prefix or a list, as `src`.
    pub dst: Option<Source>,
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
    /// The source entries, then the destination entries when
    /// `has_dst`, each sorted by family, address, then length (an entry's
    /// covering entries come before it): sorted by key data as a whole.
    pub trie: Vec<TrieEntry>,
    /// Distinct source and destination bitmaps (at most `MAX_SRC_CLASSES`
    /// together).
    pub classes: Vec<RuleBitmap>,
    /// Some rule names a destination: the kernel looks the destination up
    /// too (`GlobalRecord::dst_slots`). Without one it does not, and the
    /// trie holds no destination entries.
    pub has_dst: bool,
    /// `FLOWCTL_RULE_SETS` of this slot: rules by property, for packets
    /// whose ports are unknown ([`crate::matcher::first_unparsed`]).
    pub sets: [RuleBitmap; RULE_SETS],
}

/// Why a set of rules does not fit the kernel's source tables.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    #[error("the rules' sources and destinations make {0} distinct address classes, more than the kernel's {MAX_SRC_CLASSES}: lists that overlap each other and the rules' prefixes in many different ways; merge lists or rules")]
    TooManyClasses(usize),
}

/// Which address of a packet a trie entry is for: its source or its
/// destination (bit 2 of the tag byte, `TrieData`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Src,
    Dst,
}

/// The trie key data of `addr` as the packet's source or destination in
/// `slot`.
pub fn trie_data_for(dir: Direction, slot: u8, addr: &IpAddr) -> TrieData {
    let mut d: TrieData = [0; 17];
    d[0] = trie_tag(dir == Direction::Dst, slot, addr.is_ipv6());
    match addr {
        IpAddr::V4(a) => d[1..5].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => d[1..17].copy_from_slice(&a.octets()),
    }
    d
}

/// A prefix as a sortable key: family, address bits (IPv4 in the top 32),
/// length. In this order a prefix comes after every prefix that covers it,
/// and the prefixes between the two are covered too.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct PrefixKey {
    v6: bool,
    bits: u128,
    len: u8,
}

impl PrefixKey {
    fn of(c: &Cidr) -> Self {
        let bits = Cidr::bits(&c.addr);
        let bits = if c.len == 0 { 0 } else { bits & (u128::MAX << (128 - c.len as u32)) };
        Self { v6: c.addr.is_ipv6(), bits, len: c.len }
    }

    fn covers(&self, other: &PrefixKey) -> bool {
        self.v6 == other.v6
            && self.len <= other.len
            && (self.len == 0 || (self.bits ^ other.bits) >> (128 - self.len as u32) == 0)
    }

    fn cidr(&self) -> Cidr {
        let addr = if self.v6 {
            IpAddr::V6(self.bits.into())
        } else {
            IpAddr::V4(((self.bits >> 96) as u32).into())
        };
        Cidr { addr, len: self.len }
    }
}

/// Builds the tables for `specs` (index = rule number, profile order).
pub fn compile(specs: &[MatchSpec], slot: u8) -> Result<Tables, CompileError> {
    compile_keeping(specs, slot, &[])
}

/// As [`compile`], a bitmap found in `previous` (the classes the slot
/// held) keeping its index there, so an entry whose rules did not change
/// keeps its class and need not be written again.
pub fn compile_keeping(
    specs: &[MatchSpec],
    slot: u8,
    previous: &[RuleBitmap],
) -> Result<Tables, CompileError> {
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
    let has_dst = specs.iter().any(|s| s.dst.is_some());
    let mut entries = prefix_entries(specs, |s| &s.src);
    let src_entries = entries.len();
    if has_dst {
        entries.extend(prefix_entries(specs, |s| &s.dst));
    }
    let classes = number_classes(entries.iter().map(|(_, b)| *b), previous)?;
    let class_of: std::collections::HashMap<RuleBitmap, u32> =
        classes.iter().enumerate().rev().map(|(i, b)| (*b, i as u32)).collect();
    let trie = entries
        .iter()
        .enumerate()
        .map(|(i, (key, bits))| {
            let c = key.cidr();
            let dir = if i < src_entries { Direction::Src } else { Direction::Dst };
            TrieEntry {
                prefix_len: TRIE_TAG_BITS + c.len as u32,
                data: trie_data_for(dir, slot, &c.addr),
                class: class_of[bits],
            }
        })
        .collect();
    Ok(Tables { slot, proto, port, trie, classes, sets, has_dst })
}

/// The trie entries of one direction (`side` picks the rules' source or
/// destination), with their bitmaps. Every prefix any rule or list names is a
/// candidate entry, plus both default routes so every address finds one;
/// an entry's bitmap holds the rules whose source covers it. For the
/// longest entry P that contains an address A, "rules whose source
/// contains A" equals "rules whose source covers P": any prefix of a
/// source that contains A is a candidate itself and no longer than P. (The
/// same holds of destinations: "source" reads "the side" throughout.)
///
/// One sorted pass computes this: each candidate's bitmap is its nearest
/// covering candidate's plus the rules that name the candidate itself. A
/// candidate whose bitmap equals its nearest covering entry's is left out
/// (the lookup then finds that entry, with the same answer), so a list
/// that repeats itself or nests costs no entries.
fn prefix_entries(
    specs: &[MatchSpec],
    side: impl Fn(&MatchSpec) -> &Option<Source>,
) -> Vec<(PrefixKey, RuleBitmap)> {
    let mut any = RuleBitmap::EMPTY;
    let mut named: Vec<(PrefixKey, RuleBitmap)> = Vec::new();
    // Rules naming the same list share one pass over it.
    let mut lists: Vec<(&PrefixList, RuleBitmap)> = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        match side(s) {
            None => any.set(i),
            Some(Source::Prefix(c)) => {
                let mut b = RuleBitmap::EMPTY;
                b.set(i);
                named.push((PrefixKey::of(c), b));
            }
            Some(Source::List(l)) => match lists.iter_mut().find(|(o, _)| *o == l) {
                Some((_, b)) => b.set(i),
                None => {
                    let mut b = RuleBitmap::EMPTY;
                    b.set(i);
                    lists.push((l, b));
                }
            },
        }
    }
    for (l, b) in &lists {
        named.extend(l.prefixes.iter().map(|c| (PrefixKey::of(c), *b)));
    }
    for v6 in [false, true] {
        named.push((PrefixKey { v6, bits: 0, len: 0 }, any));
    }
    named.sort_unstable_by_key(|(k, _)| *k);

    // The entries and their bitmaps, then the bitmaps numbered.
    let mut entries: Vec<(PrefixKey, RuleBitmap)> = Vec::new();
    // The covering chain of the current candidate: (prefix, its bitmap).
    let mut chain: Vec<(PrefixKey, RuleBitmap)> = Vec::new();
    let mut i = 0;
    while i < named.len() {
        let key = named[i].0;
        let mut direct = RuleBitmap::EMPTY;
        while i < named.len() && named[i].0 == key {
            direct = direct.union(&named[i].1);
            i += 1;
        }
        while chain.last().is_some_and(|(k, _)| !k.covers(&key)) {
            chain.pop();
        }
        let parent = chain.last().map(|(_, b)| *b);
        let bits = parent.map_or(direct, |p| p.union(&direct));
        if parent == Some(bits) {
            continue;
        }
        chain.push((key, bits));
        entries.push((key, bits));
    }
    entries
}

/// The class table for `bitmaps`: each distinct bitmap once, at its index
/// in `previous` when it was there, else at an index `previous` does not
/// use any more, else appended; in first-seen order otherwise, so the
/// numbering is deterministic.
fn number_classes(
    bitmaps: impl Iterator<Item = RuleBitmap>,
    previous: &[RuleBitmap],
) -> Result<Vec<RuleBitmap>, CompileError> {
    let mut wanted: Vec<RuleBitmap> = Vec::new();
    let mut seen: std::collections::HashSet<RuleBitmap> = Default::default();
    for b in bitmaps {
        if seen.insert(b) {
            wanted.push(b);
        }
    }
    if wanted.len() > MAX_SRC_CLASSES {
        return Err(CompileError::TooManyClasses(wanted.len()));
    }
    // Previous indices of bitmaps still wanted (the first, if twice).
    let mut placed: std::collections::HashSet<RuleBitmap> = Default::default();
    let mut classes: Vec<Option<RuleBitmap>> = previous[..previous.len().min(MAX_SRC_CLASSES)]
        .iter()
        .map(|b| (seen.contains(b) && placed.insert(*b)).then_some(*b))
        .collect();
    let mut free: Vec<usize> = (0..classes.len()).filter(|i| classes[*i].is_none()).collect();
    free.reverse();
    for b in wanted.into_iter().filter(|b| !placed.contains(b)) {
        match free.pop() {
            Some(i) => classes[i] = Some(b),
            None => classes.push(Some(b)),
        }
    }
    // An index nothing uses keeps a bitmap no trie entry names.
    Ok(classes.into_iter().map(|c| c.unwrap_or(RuleBitmap::EMPTY)).collect())
}

impl Tables {
    /// The source bitmap the kernel's LPM lookup would return for `addr`.
    pub fn src_bits(&self, addr: &IpAddr) -> RuleBitmap {
        self.bits(Direction::Src, addr)
    }

    /// The rules that `addr` as the packet's destination allows: every
    /// rule when no rule names a destination (the kernel then looks
    /// nothing up).
    pub fn dst_bits(&self, addr: &IpAddr) -> RuleBitmap {
        if self.has_dst {
            self.bits(Direction::Dst, addr)
        } else {
            RuleBitmap::FULL
        }
    }

    fn bits(&self, dir: Direction, addr: &IpAddr) -> RuleBitmap {
        let want = trie_data_for(dir, self.slot, addr);
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
    pub fn classify(
        &self,
        src: &IpAddr,
        dst: &IpAddr,
        proto: u8,
        dport: Option<u16>,
    ) -> Option<u32> {
        let port = dport.map(u32::from).unwrap_or(PORT_NONE);
        let (src, dst) = (self.src_bits(src), self.dst_bits(dst));
        let addrs = AddrSets { src: &src, dst: &dst };
        first_match(addrs, &self.proto[proto as usize], &self.port[port as usize])
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
    fn linear(
        specs: &[MatchSpec],
        src: &IpAddr,
        dst: &IpAddr,
        proto: u8,
        dport: Option<u16>,
    ) -> Option<u32> {
        specs
            .iter()
            .position(|s| {
                s.proto.is_none_or(|p| p == proto)
                    && s.src.as_ref().is_none_or(|c| c.contains(src))
                    && s.dst.as_ref().is_none_or(|c| c.contains(dst))
                    && match (s.ports, dport) {
                        (None, _) => true,
                        (Some((lo, hi)), Some(p)) => lo <= p && p <= hi,
                        (Some(_), None) => false,
                    }
            })
            .map(|i| i as u32)
    }

    /// A destination for tables without destination rules (any will do).
    fn any_dst() -> IpAddr {
        "198.51.100.1".parse().unwrap()
    }

    #[test]
    fn first_match_in_profile_order() {
        let specs = vec![
            MatchSpec {
                proto: Some(6),
                src: Some(Source::Prefix(cidr("10.1.0.0/16"))),
                dst: None,
                ports: Some((22, 22)),
                enforcing: true,
            },
            MatchSpec {
                proto: None,
                src: Some(Source::Prefix(cidr("10.0.0.0/8"))),
                dst: None,
                ports: None,
                enforcing: true,
            },
            MatchSpec {
                proto: Some(17),
                src: None,
                dst: None,
                ports: Some((53, 53)),
                enforcing: true,
            },
            MatchSpec {
                proto: None,
                src: Some(Source::Prefix(cidr("2001:db8::/32"))),
                dst: None,
                ports: Some((80, 90)),
                enforcing: true,
            },
        ];
        let t = compile(&specs, 1).unwrap();
        assert!(t.classes.len() <= t.trie.len());
        let a = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(t.classify(&a("10.1.2.3"), &any_dst(), 6, Some(22)), Some(0));
        assert_eq!(t.classify(&a("10.1.2.3"), &any_dst(), 6, Some(23)), Some(1));
        assert_eq!(t.classify(&a("10.1.2.3"), &any_dst(), 17, Some(53)), Some(1));
        assert_eq!(t.classify(&a("192.0.2.1"), &any_dst(), 17, Some(53)), Some(2));
        assert_eq!(t.classify(&a("192.0.2.1"), &any_dst(), 6, Some(53)), None);
        assert_eq!(t.classify(&a("2001:db8::1"), &any_dst(), 6, Some(85)), Some(3));
        assert_eq!(t.classify(&a("2001:db8::1"), &any_dst(), 6, None), None);
        assert_eq!(t.classify(&a("2001:db9::1"), &any_dst(), 6, Some(85)), None);
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

    /// Two lists the specs may name, drawn once per case: prefixes that
    /// nest, repeat and overlap the rules' own.
    fn arb_lists() -> impl Strategy<Value = [PrefixList; 2]> {
        (proptest::collection::vec(arb_cidr(), 0..30), proptest::collection::vec(arb_cidr(), 0..30))
            .prop_map(|(a, b)| {
                [
                    PrefixList { name: "a".into(), prefixes: a.into() },
                    PrefixList { name: "b".into(), prefixes: b.into() },
                ]
            })
    }

    /// A spec, and which list (if any) names its source and its
    /// destination.
    type ArbSpec = (MatchSpec, Option<usize>, Option<usize>);

    fn arb_spec() -> impl Strategy<Value = ArbSpec> {
        (
            proptest::option::of(prop_oneof![Just(6u8), Just(17u8), Just(1u8)]),
            proptest::option::of(arb_cidr()),
            proptest::option::weighted(0.3, arb_cidr()),
            proptest::option::of((0u16..200, 0u16..50).prop_map(|(a, w)| (a, a + w))),
            proptest::option::of(0usize..2),
            proptest::option::weighted(0.2, 0usize..2),
        )
            .prop_map(|(proto, src, dst, ports, src_list, dst_list)| {
                let spec = MatchSpec {
                    proto,
                    src: src.map(Source::Prefix),
                    dst: dst.map(Source::Prefix),
                    ports,
                    enforcing: true,
                };
                (spec, src_list, dst_list)
            })
    }

    fn with_lists(specs: Vec<ArbSpec>, lists: &[PrefixList; 2]) -> Vec<MatchSpec> {
        specs
            .into_iter()
            .map(|(mut s, src, dst)| {
                if let Some(l) = src {
                    s.src = Some(Source::List(lists[l].clone()));
                }
                if let Some(l) = dst {
                    s.dst = Some(Source::List(lists[l].clone()));
                }
                s
            })
            .collect()
    }

    #[test]
    fn destinations_match_with_sources_and_cost_nothing_when_unused() {
        let list = PrefixList {
            name: "vips".into(),
            prefixes: ["203.0.113.0/28", "2001:db8:f::/64"].map(cidr).into(),
        };
        let specs = vec![
            MatchSpec {
                proto: Some(6),
                src: Some(Source::Prefix(cidr("10.0.0.0/8"))),
                dst: Some(Source::List(list.clone())),
                ports: None,
                enforcing: true,
            },
            MatchSpec {
                proto: None,
                src: None,
                dst: Some(Source::Prefix(cidr("203.0.113.8/29"))),
                ports: None,
                enforcing: true,
            },
            MatchSpec { proto: None, src: None, dst: None, ports: Some((53, 53)), enforcing: true },
        ];
        let t = compile(&specs, 1).unwrap();
        assert!(t.has_dst);
        let a = |s: &str| s.parse::<IpAddr>().unwrap();
        for (src, dst, proto, port, rule) in [
            ("10.1.1.1", "203.0.113.9", 6, Some(80), Some(0)),
            ("10.1.1.1", "203.0.113.9", 17, Some(80), Some(1)),
            ("192.0.2.1", "203.0.113.9", 6, Some(80), Some(1)),
            ("192.0.2.1", "203.0.113.1", 6, Some(80), None),
            ("192.0.2.1", "203.0.113.1", 17, Some(53), Some(2)),
            ("10.1.1.1", "198.51.100.1", 6, Some(53), Some(2)),
            ("10.1.1.1", "198.51.100.1", 6, Some(80), None),
            ("2001:db8::1", "2001:db8:f::9", 6, Some(80), None),
        ] {
            assert_eq!(t.classify(&a(src), &a(dst), proto, port), rule, "{src} -> {dst}");
        }
        // Each side's entries carry their side's tag; sorted as a whole.
        let sides: Vec<u8> = t.trie.iter().map(|e| e.data[0] >> 2).collect();
        assert!(sides.windows(2).all(|w| w[0] <= w[1]));
        assert!(t.trie.iter().all(|e| crate::trie_slot(e.data[0]) == 1));
        // Without destinations: no destination entries, every rule allowed.
        let plain: Vec<MatchSpec> =
            specs.iter().map(|s| MatchSpec { dst: None, ..s.clone() }).collect();
        let p = compile(&plain, 0).unwrap();
        assert!(!p.has_dst);
        assert!(p.trie.iter().all(|e| e.data[0] >> 2 == 0));
        assert_eq!(p.dst_bits(&a("203.0.113.9")), RuleBitmap::FULL);
    }

    #[test]
    fn a_list_costs_one_entry_per_prefix_it_adds() {
        let list = PrefixList {
            name: "block".into(),
            prefixes: [
                "192.0.2.0/24",
                "192.0.2.7/32",
                "192.0.2.0/24",
                "2001:db8::/48",
                "198.51.100.9/32",
            ]
            .map(cidr)
            .into(),
        };
        let specs = vec![
            MatchSpec {
                proto: None,
                src: Some(Source::List(list.clone())),
                dst: None,
                ports: None,
                enforcing: true,
            },
            MatchSpec { proto: None, src: None, dst: None, ports: None, enforcing: true },
        ];
        let t = compile(&specs, 0).unwrap();
        // The two default routes, the /24 (its /32 and duplicate add nothing),
        // the /48 and the /32 elsewhere.
        assert_eq!(t.trie.len(), 5);
        assert_eq!(t.classes.len(), 2);
        let a = |s: &str| s.parse::<IpAddr>().unwrap();
        for (addr, rule) in [
            ("192.0.2.7", 0),
            ("192.0.2.200", 0),
            ("198.51.100.9", 0),
            ("198.51.100.10", 1),
            ("2001:db8::5", 0),
            ("2001:db9::", 1),
        ] {
            assert_eq!(t.classify(&a(addr), &any_dst(), 6, Some(80)), Some(rule), "{addr}");
        }
    }

    #[test]
    fn classes_beyond_the_kernel_table_are_refused() {
        // 13 rules, each with a list: address 10.0.n.m is in list b when
        // bit b of n*256+m is set, so the 8,192 addresses make as many
        // distinct rule sets (the empty one being the default routes').
        let specs: Vec<MatchSpec> = (0..13u32)
            .map(|bit| {
                let prefixes: Vec<Cidr> = (0..(1u32 << 13))
                    .filter(|n| n & (1 << bit) != 0)
                    .map(|n| Cidr { addr: IpAddr::V4((0x0a00_0000 | n).into()), len: 32 })
                    .collect();
                MatchSpec {
                    proto: None,
                    src: Some(Source::List(PrefixList {
                        name: format!("l{bit}"),
                        prefixes: prefixes.into(),
                    })),
                    dst: None,
                    ports: None,
                    enforcing: true,
                }
            })
            .collect();
        assert_eq!(compile(&specs, 0).unwrap_err(), CompileError::TooManyClasses(8192));
    }

    proptest! {
        #[test]
        fn tables_agree_with_linear_scan(
            specs in proptest::collection::vec(arb_spec(), 1..40),
            lists in arb_lists(),
            probes in proptest::collection::vec((arb_cidr(), arb_cidr(), prop_oneof![Just(6u8), Just(17u8), Just(1u8), Just(47u8)], proptest::option::of(0u16..260)), 1..40),
        ) {
            let specs = with_lists(specs, &lists);
            let t = compile(&specs, 0).unwrap();
            // Probes inside the lists' prefixes too, on either side, where
            // lists decide.
            let v4: Cidr = cidr("10.1.2.3/32");
            let v6: Cidr = cidr("2001::5/128");
            let other = |c: &Cidr| if c.addr.is_ipv4() { v4 } else { v6 };
            let inside: Vec<_> = lists
                .iter()
                .flat_map(|l| l.prefixes.iter())
                .flat_map(|c| [(*c, other(c), 6u8, Some(80u16)), (other(c), *c, 6u8, Some(80u16))])
                .collect();
            // A packet's two addresses are of one family.
            let probes: Vec<_> = probes
                .into_iter()
                .chain(inside)
                .filter(|(s, d, _, _)| s.addr.is_ipv4() == d.addr.is_ipv4())
                .collect();
            for (s, d, proto, port) in &probes {
                prop_assert_eq!(
                    t.classify(&s.addr, &d.addr, *proto, *port),
                    linear(&specs, &s.addr, &d.addr, *proto, *port)
                );
            }
            // Numbered against another numbering: the same answers, and
            // every bitmap both have keeps its old index.
            let mut previous = t.classes.clone();
            previous.reverse();
            previous.push(RuleBitmap::EMPTY);
            let k = compile_keeping(&specs, 0, &previous).unwrap();
            for (s, d, proto, port) in &probes {
                prop_assert_eq!(
                    k.classify(&s.addr, &d.addr, *proto, *port),
                    t.classify(&s.addr, &d.addr, *proto, *port)
                );
            }
            for (i, b) in k.classes.iter().enumerate() {
                if let Some(p) = previous.iter().position(|x| x == b) {
                    if k.trie.iter().any(|e| e.class as usize == i) {
                        prop_assert_eq!(p, i);
                    }
                }
            }
            // Sorted so a covering entry comes first, with no entry twice.
            prop_assert!(t.trie.windows(2).all(|w| w[0].data != w[1].data || w[0].prefix_len != w[1].prefix_len));
        }
    }
}
