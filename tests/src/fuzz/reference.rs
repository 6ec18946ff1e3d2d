//! The reference classifier: docs/classification.md written out a second
//! time, on the host, from the document alone (not from the kernel parser).
//! It sees the whole frame, but judges only what the contract says the
//! parser reads: headers are taken in chain order, and the first header that
//! decides a class decides it.

use flowctl::profile;
use flowctl_common::{action, reason, tables::Source, XDP_DROP, XDP_PASS};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The parse window: every header the parser reads ends within it.
pub const WINDOW: usize = 1024;
/// VLAN tags parsed; a fifth is evasive.
pub const MAX_VLAN_TAGS: usize = 4;
/// IPv6 extension headers walked; a ninth is unparsed.
pub const MAX_EXT_HEADERS: usize = 8;

const ETH_IPV4: u16 = 0x0800;
const ETH_IPV6: u16 = 0x86dd;
const TPID_8021Q: u16 = 0x8100;
const TPID_8021AD: u16 = 0x88a8;

const P_ICMP: u8 = 1;
const P_TCP: u8 = 6;
const P_UDP: u8 = 17;
const P_ICMPV6: u8 = 58;

/// IPv6 extension header types the parser walks.
pub fn is_ext(nh: u8) -> bool {
    matches!(nh, 0 | 43 | 44 | 51 | 60)
}

/// One rule as the contract matches it.
#[derive(Clone, Debug)]
pub struct RefRule {
    pub name: String,
    pub proto: Option<u8>,
    /// A prefix or a list (`@name`): the address is in one of its prefixes.
    pub src: Option<Source>,
    /// The same, for the destination.
    pub dst: Option<Source>,
    pub ports: Option<(u16, u16)>,
    /// `action = "drop"` (the profile's word for limit): refused packets are dropped.
    pub enforcing: bool,
}

impl RefRule {
    fn addrs_match(&self, a: &Addrs) -> bool {
        self.src.as_ref().is_none_or(|c| c.contains(&a.src))
            && self.dst.as_ref().is_none_or(|c| c.contains(&a.dst))
    }
    fn proto_matches(&self, proto: u8) -> bool {
        self.proto.is_none_or(|p| p == proto)
    }
}

/// A packet's two addresses.
#[derive(Clone, Copy, Debug)]
pub struct Addrs {
    pub src: IpAddr,
    pub dst: IpAddr,
}

/// A profile as the reference sees it: rules in order and the two verdicts.
#[derive(Clone, Debug)]
pub struct RefProfile {
    pub rules: Vec<RefRule>,
    pub malformed_drop: bool,
    pub fragments_drop: bool,
}

impl RefProfile {
    pub fn parse(text: &str) -> Result<Self, String> {
        let set = profile::parse("fuzz.toml", text).map_err(|e| e.to_string())?;
        let rules = set
            .rules
            .iter()
            .map(|r| RefRule {
                name: r.name.clone(),
                proto: r.spec.proto,
                src: r.spec.src.clone(),
                dst: r.spec.dst.clone(),
                ports: r.spec.ports,
                enforcing: r.action == action::DROP,
            })
            .collect();
        Ok(Self {
            rules,
            malformed_drop: set.settings.malformed_verdict == XDP_DROP,
            fragments_drop: set.settings.fragment_verdict == XDP_DROP,
        })
    }
}

/// The class of a frame (docs/classification.md, "The classes").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Class {
    NonIp,
    Evasive(&'static str),
    Malformed(&'static str),
    /// L4 header beyond what the parser walks; `proto` when known; the rule
    /// it was matched to (by index), or None (unmatched).
    Unparsed {
        proto: Option<u8>,
        rule: Option<usize>,
        why: &'static str,
    },
    /// A later fragment that matched a rule without a port constraint.
    FragmentRule(usize),
    /// A later fragment only port rules could match: the `fragments` verdict.
    FragmentPolicy,
    Rule(usize),
    Unmatched,
}

impl Class {
    /// A short name of the class kind (for grouping failures).
    pub fn kind(&self) -> &'static str {
        match self {
            Class::NonIp => "non-ip",
            Class::Evasive(_) => "evasive",
            Class::Malformed(_) => "malformed",
            Class::Unparsed { rule: Some(_), .. } => "unparsed-rule",
            Class::Unparsed { rule: None, .. } => "unparsed-unmatched",
            Class::FragmentRule(_) => "fragment-rule",
            Class::FragmentPolicy => "fragment-policy",
            Class::Rule(_) => "rule",
            Class::Unmatched => "unmatched",
        }
    }

    /// The kind with the reason, for evasive, malformed and unparsed.
    pub fn reason(&self) -> String {
        match self {
            Class::Evasive(w) | Class::Malformed(w) => format!("{} ({w})", self.kind()),
            Class::Unparsed { why, proto: Some(p), .. } => {
                format!("{} ({why}, protocol {p})", self.kind())
            }
            Class::Unparsed { why, proto: None, .. } => format!("{} ({why})", self.kind()),
            c => c.kind().to_string(),
        }
    }

    pub fn describe(&self, p: &RefProfile) -> String {
        let name = |i: &usize| p.rules[*i].name.clone();
        match self {
            Class::NonIp => "non-ip".into(),
            Class::Evasive(w) => format!("evasive ({w})"),
            Class::Malformed(w) => format!("malformed ({w})"),
            Class::Unparsed { proto, rule, why } => format!(
                "unparsed ({why}; proto {}) -> {}",
                proto.map(|p| p.to_string()).unwrap_or("unknown".into()),
                rule.as_ref().map(name).unwrap_or("unmatched".into())
            ),
            Class::FragmentRule(i) => format!("later fragment -> rule {}", name(i)),
            Class::FragmentPolicy => "fragment policy".into(),
            Class::Rule(i) => format!("rule {}", name(i)),
            Class::Unmatched => "unmatched".into(),
        }
    }
}

/// What the kernel must do with a frame: the verdict and the counters it
/// moves (each by one).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Expect {
    /// The rule (index) whose record's `offered_pkts` moves; None: the global record.
    pub record: Option<usize>,
    pub non_ip: bool,
    pub malformed: bool,
    pub fragment: bool,
    pub unparsed: bool,
    pub evasive_drop: bool,
    pub malformed_drop: bool,
    pub fragment_drop: bool,
    pub verdict: u32,
}

impl Expect {
    /// The global-record drop counters compared, by reason index.
    pub const DROP_REASONS: [usize; 3] = [reason::EVASIVE, reason::MALFORMED, reason::FRAGMENT];
}

/// The expected verdict and counters of a class. Rules' rates are huge in
/// the fuzzer's profiles, so a matched packet always passes.
pub fn expect(class: &Class, p: &RefProfile) -> Expect {
    let mut e = Expect { verdict: XDP_PASS, ..Default::default() };
    match class {
        Class::NonIp => e.non_ip = true,
        Class::Evasive(_) => {
            e.evasive_drop = true;
            e.verdict = XDP_DROP;
        }
        Class::Malformed(_) => {
            e.malformed = true;
            if p.malformed_drop {
                e.malformed_drop = true;
                e.verdict = XDP_DROP;
            }
        }
        Class::Unparsed { rule, .. } => {
            e.unparsed = true;
            e.record = *rule;
        }
        Class::FragmentRule(i) | Class::Rule(i) => e.record = Some(*i),
        Class::FragmentPolicy => {
            e.fragment = true;
            if p.fragments_drop {
                e.fragment_drop = true;
                e.verdict = XDP_DROP;
            }
        }
        Class::Unmatched => {}
    }
    e
}

fn be16(f: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([f[at], f[at + 1]])
}

/// The minimal L4 header the contract reads for `proto` (TCP, UDP, and
/// ICMP or ICMPv6 in either family), or None: no L4 header is read.
fn min_l4(proto: u8, _v6: bool) -> Option<usize> {
    match proto {
        P_TCP => Some(20),
        P_UDP => Some(8),
        P_ICMP | P_ICMPV6 => Some(4),
        _ => None,
    }
}

/// Classifies one frame under a profile.
pub fn classify(f: &[u8], p: &RefProfile) -> Class {
    // 1. Ethernet and up to 4 tags.
    if f.len() < 14 {
        return Class::Malformed("cut in the Ethernet header");
    }
    let mut et = be16(f, 12);
    let mut l3 = 14;
    let mut tags = 0;
    while et == TPID_8021Q || et == TPID_8021AD {
        if tags == MAX_VLAN_TAGS {
            return Class::Evasive("fifth VLAN tag");
        }
        if f.len() < l3 + 4 {
            return Class::Malformed("cut in a VLAN tag");
        }
        et = be16(f, l3 + 2);
        l3 += 4;
        tags += 1;
    }
    match et {
        ETH_IPV4 => ipv4(f, l3, p),
        ETH_IPV6 => ipv6(f, l3, p),
        _ => Class::NonIp,
    }
}

fn ipv4(f: &[u8], l3: usize, p: &RefProfile) -> Class {
    if f.len() < l3 + 20 {
        return Class::Malformed("IPv4 header cut");
    }
    if f[l3] >> 4 != 4 {
        return Class::Malformed("IPv4 version");
    }
    let ihl = (f[l3] & 0xf) as usize * 4;
    if ihl < 20 {
        return Class::Malformed("IHL < 5");
    }
    if l3 + ihl > f.len() {
        return Class::Malformed("IPv4 options cut");
    }
    let tl = be16(f, l3 + 2) as usize;
    if tl < ihl {
        return Class::Malformed("total length < header");
    }
    let end = l3 + tl;
    if end > f.len() {
        return Class::Malformed("total length beyond the frame");
    }
    let frag = be16(f, l3 + 6);
    let (mf, offset) = (frag & 0x2000 != 0, frag & 0x1fff);
    let proto = f[l3 + 9];
    let src = Addrs {
        src: IpAddr::V4(Ipv4Addr::new(f[l3 + 12], f[l3 + 13], f[l3 + 14], f[l3 + 15])),
        dst: IpAddr::V4(Ipv4Addr::new(f[l3 + 16], f[l3 + 17], f[l3 + 18], f[l3 + 19])),
    };
    let l4 = l3 + ihl;
    if offset != 0 {
        if proto == P_TCP && (offset == 1 || offset == 2) {
            return Class::Evasive("IPv4 TCP fragment overlapping the TCP header (offset 1 or 2)");
        }
        return later_fragment(p, &src, proto);
    }
    let first = mf;
    l4_class(f, p, src, proto, l4, end, first, false)
}

/// The L4 step shared by both families: `at` is where the L4 header
/// starts, `first` whether the packet is a first fragment.
#[allow(clippy::too_many_arguments)]
fn l4_class(
    f: &[u8],
    p: &RefProfile,
    src: Addrs,
    proto: u8,
    at: usize,
    end: usize,
    first: bool,
    v6: bool,
) -> Class {
    let Some(min) = min_l4(proto, v6) else {
        return match_rule(p, &src, proto, None);
    };
    if at + min > end {
        return match first {
            true if v6 => Class::Evasive("IPv6 first fragment without its whole L4 header"),
            true => Class::Evasive("IPv4 tiny first fragment"),
            false => Class::Malformed("L4 header beyond the packet's end"),
        };
    }
    if at + min > WINDOW {
        return unparsed(p, &src, Some(proto), "L4 header past the parse window");
    }
    if proto == P_TCP && f[at + 12] >> 4 < 5 {
        return Class::Malformed("TCP data offset < 5");
    }
    let dport = matches!(proto, P_TCP | P_UDP).then(|| be16(f, at + 2));
    match_rule(p, &src, proto, dport)
}

fn ipv6(f: &[u8], l3: usize, p: &RefProfile) -> Class {
    if f.len() < l3 + 40 {
        return Class::Malformed("IPv6 header cut");
    }
    if f[l3] >> 4 != 6 {
        return Class::Malformed("IPv6 version");
    }
    let plen = be16(f, l3 + 4) as usize;
    let mut nh = f[l3 + 6];
    let end = if plen == 0 && nh == 0 { f.len() } else { l3 + 40 + plen };
    if end > f.len() {
        return Class::Malformed("payload length beyond the frame");
    }
    let mut a = [0u8; 16];
    a.copy_from_slice(&f[l3 + 8..l3 + 24]);
    let mut d = [0u8; 16];
    d.copy_from_slice(&f[l3 + 24..l3 + 40]);
    let src = Addrs { src: IpAddr::V6(Ipv6Addr::from(a)), dst: IpAddr::V6(Ipv6Addr::from(d)) };
    let mut at = l3 + 40;
    let mut n = 0;
    // Inside a first fragment (offset 0, M = 1): the chain must be whole.
    let mut first = false;
    while is_ext(nh) {
        if n == MAX_EXT_HEADERS {
            return unparsed(p, &src, None, "ninth extension header");
        }
        // An extension header is read as its next-header and length bytes
        // (the fragment header: all its 8 bytes); the rest is skipped by
        // its length.
        let read = if nh == 44 { 8 } else { 2 };
        if at + read > end {
            return match first {
                true => Class::Evasive("IPv6 first fragment: header chain past the end"),
                false => Class::Malformed("extension header beyond the packet's end"),
            };
        }
        if at + read > WINDOW {
            return unparsed(p, &src, None, "extension header past the parse window");
        }
        let len = match nh {
            44 => 8,
            51 => (f[at + 1] as usize + 2) * 4,
            _ => (f[at + 1] as usize + 1) * 8,
        };
        if at + len > end {
            return match first {
                true => Class::Evasive("IPv6 first fragment: header chain past the end"),
                false => Class::Malformed("extension header beyond the packet's end"),
            };
        }
        if nh == 44 {
            let fo = be16(f, at + 2);
            let (offset, more) = (fo >> 3, fo & 1 != 0);
            if offset != 0 {
                return later_fragment(p, &src, f[at]);
            }
            if more {
                first = true;
            }
        }
        nh = f[at];
        at += len;
        n += 1;
    }
    l4_class(f, p, src, nh, at, end, first, true)
}

/// Class 5: a later fragment (no ports).
fn later_fragment(p: &RefProfile, src: &Addrs, proto: u8) -> Class {
    let mut port_rule = false;
    for (i, r) in p.rules.iter().enumerate() {
        if r.addrs_match(src) && r.proto_matches(proto) {
            if r.ports.is_none() {
                return Class::FragmentRule(i);
            }
            port_rule = true;
        }
    }
    if port_rule {
        Class::FragmentPolicy
    } else {
        Class::Unmatched
    }
}

/// Class 4: matched against the rules that could apply.
fn unparsed(p: &RefProfile, src: &Addrs, proto: Option<u8>, why: &'static str) -> Class {
    let rule = p.rules.iter().position(|r| {
        let candidate = r.addrs_match(src) && proto.is_none_or(|pr| r.proto_matches(pr));
        let certain = r.ports.is_none() && (proto.is_some() || r.proto.is_none());
        candidate && (certain || r.enforcing)
    });
    Class::Unparsed { proto, rule, why }
}

/// Classes 6 and 7: first match by addresses, protocol and (TCP, UDP) port.
fn match_rule(p: &RefProfile, src: &Addrs, proto: u8, dport: Option<u16>) -> Class {
    let hit = p.rules.iter().position(|r| {
        r.addrs_match(src)
            && r.proto_matches(proto)
            && match r.ports {
                None => true,
                Some((lo, hi)) => dport.is_some_and(|d| lo <= d && d <= hi),
            }
    });
    match hit {
        Some(i) => Class::Rule(i),
        None => Class::Unmatched,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DNS: &str =
        "[[rule]]\nname = \"dns\"\nproto = \"udp\"\ndport = 53\nrate = \"1000000000/s\"\n";

    /// The regression frames name their class; the reference must give it
    /// (no root needed: the kernel side is tests/tests/fuzz.rs).
    #[test]
    fn regression_frames_have_the_class_they_name() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-regressions");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "hex") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let frame = crate::fuzz::run::from_hex(&text).unwrap();
            let prof =
                RefProfile::parse(&std::fs::read_to_string(path.with_extension("toml")).unwrap())
                    .unwrap();
            let want = crate::fuzz::run::hex_comment(&text, "class").expect("a # class: line");
            let got = classify(&frame, &prof);
            assert_eq!(got.kind(), want, "{}: {}", path.display(), got.describe(&prof));
            n += 1;
        }
        assert!(n >= 5);
    }

    #[test]
    fn unparsed_takes_enforcing_port_rules_and_certain_ones_only() {
        let text = "[[rule]]\nname = \"dry\"\nproto = \"udp\"\ndport = 53\naction = \"dry-run\"\nrate = \"1/s\"\n\
                    [[rule]]\nname = \"pass\"\nproto = \"udp\"\ndport = 53\naction = \"pass\"\n\
                    [[rule]]\nname = \"tcp-any\"\nproto = \"tcp\"\naction = \"pass\"\n\
                    [[rule]]\nname = \"lim\"\nproto = \"udp\"\ndport = 53\nrate = \"1/s\"\n";
        let p = RefProfile::parse(text).unwrap();
        let src = Addrs { src: "fd00::1".parse().unwrap(), dst: "fd00::2".parse().unwrap() };
        // UDP known: dry and pass skipped (might not apply), tcp-any no candidate, lim taken.
        assert_eq!(unparsed(&p, &src, Some(17), "").kind(), "unparsed-rule");
        assert!(matches!(unparsed(&p, &src, Some(17), ""), Class::Unparsed { rule: Some(3), .. }));
        // TCP known: tcp-any certainly applies.
        assert!(matches!(unparsed(&p, &src, Some(6), ""), Class::Unparsed { rule: Some(2), .. }));
        // Unknown: tcp-any is a candidate but not certain (it has a protocol), and passes: skipped; lim taken.
        assert!(matches!(unparsed(&p, &src, None, ""), Class::Unparsed { rule: Some(3), .. }));
        let p =
            RefProfile::parse(DNS.replace("rate = \"1000000000/s\"", "action = \"pass\"").as_str())
                .unwrap();
        assert!(matches!(unparsed(&p, &src, None, ""), Class::Unparsed { rule: None, .. }));
    }

    #[test]
    fn later_fragments_take_portless_rules_else_the_policy() {
        let p = RefProfile::parse(&format!(
            "{DNS}[[rule]]\nname = \"udp-all\"\nproto = \"udp\"\nrate = \"1/s\"\n"
        ))
        .unwrap();
        let src = Addrs { src: "10.0.0.1".parse().unwrap(), dst: "10.99.0.1".parse().unwrap() };
        assert_eq!(later_fragment(&p, &src, 17), Class::FragmentRule(1));
        let p = RefProfile::parse(DNS).unwrap();
        assert_eq!(later_fragment(&p, &src, 17), Class::FragmentPolicy);
        assert_eq!(later_fragment(&p, &src, 6), Class::Unmatched);
    }
}
