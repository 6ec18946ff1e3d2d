//! The value parsers every section shares: names, keywords, addresses and
//! prefixes, ports, protocols, durations, rates and amounts. Two layers:
//! `parse_*` read text and say what is wrong in words (callers may prefix
//! them, as exempt targets do); the others read a spanned TOML value and
//! return the [`ProfileError`] that points at it.

use super::{
    error::{Ctx, ProfileError},
    model::PROTOCOLS,
    raw::{RawAmount, RawPorts, RawProto},
};
use flowctl_common::{
    rate::{parse_amount, parse_duration_ns, parse_rate, Dimension, Rate},
    tables::Cidr,
};
use std::net::IpAddr;
use toml::Spanned;

// ---- names and keywords ----

/// A name (trimmed): 1 to `max_len` letters, digits, `-`, `_` or `.`;
/// otherwise `msg`, which says so in the section's words.
pub fn name(
    cx: &Ctx,
    v: &Spanned<String>,
    max_len: usize,
    msg: &str,
) -> Result<String, ProfileError> {
    let name = v.get_ref().trim();
    if name.is_empty()
        || name.len() > max_len
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(cx.err(v.span(), msg));
    }
    Ok(name.to_string())
}

/// One of the words of `table`, exactly as written; otherwise "unknown
/// `what` `word`: `hint`".
pub fn keyword<T: Copy>(
    cx: &Ctx,
    v: &Spanned<String>,
    what: &str,
    table: &[(&str, T)],
    hint: &str,
) -> Result<T, ProfileError> {
    let word = v.get_ref().as_str();
    match table.iter().find(|(w, _)| *w == word) {
        Some((_, t)) => Ok(*t),
        None => Err(cx.err(v.span(), format!("unknown {what} `{word}`: {hint}"))),
    }
}

/// `proto`: a name of [`PROTOCOLS`] in any case, `any` (`None`) or a number.
pub fn protocol(cx: &Ctx, v: &Spanned<RawProto>) -> Result<Option<u8>, ProfileError> {
    let word = match v.get_ref() {
        RawProto::Name(w) => w.to_ascii_lowercase(),
        RawProto::Number(n) => {
            return u8::try_from(*n)
                .map(Some)
                .map_err(|_| cx.err(v.span(), format!("protocol number {n} is outside 0-255")))
        }
    };
    if word == "any" {
        return Ok(None);
    }
    if let Some((_, n)) = PROTOCOLS.iter().find(|(w, _)| *w == word) {
        return Ok(Some(*n));
    }
    match word.parse::<u8>() {
        Ok(n) => Ok(Some(n)),
        Err(_) => Err(cx.err(
            v.span(),
            format!("unknown protocol `{word}`: use tcp, udp, icmp, icmpv6, any or a number"),
        )),
    }
}

// ---- addresses and prefixes ----

/// `addr` or `addr/len` as written, the length not yet checked against the
/// address family.
pub struct Prefix<'a> {
    pub addr: IpAddr,
    /// The length and its text, when one is written.
    pub len: Option<(u8, &'a str)>,
}

/// Reads `addr` or `addr/len`.
pub fn parse_prefix(s: &str) -> Result<Prefix<'_>, String> {
    let (a, l) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let addr: IpAddr = a.trim().parse().map_err(|_| format!("`{a}` is not an IP address"))?;
    let len = match l {
        // Digits only: `u8::from_str` would take a sign (`/+8`).
        Some(l) if !l.trim().is_empty() && l.trim().bytes().all(|b| b.is_ascii_digit()) => {
            Some((l.trim().parse::<u8>().map_err(|_| format!("bad prefix length `{l}`"))?, l))
        }
        Some(l) => return Err(format!("bad prefix length `{l}`")),
        None => None,
    };
    Ok(Prefix { addr, len })
}

/// A prefix, IPv4 or IPv6, with its host bits clear (`10.0.0.0/8`); a
/// bare address is a host prefix.
pub fn parse_cidr(s: &str) -> Result<Cidr, String> {
    let Prefix { addr, len } = parse_prefix(s)?;
    if let IpAddr::V6(v6) = addr {
        if let Some(v4) = v6.to_ipv4_mapped() {
            // Packets are matched by their own family: an IPv4 packet never
            // carries this form.
            return Err(format!(
                "`{s}` is an IPv4-mapped IPv6 address, which no IPv4 packet matches: write {v4}"
            ));
        }
    }
    let max = Cidr::max_len(&addr);
    let len = len.map_or(max, |(n, _)| n);
    if len > max {
        return Err(format!("prefix length /{len} is longer than /{max}"));
    }
    let masked = Cidr { addr: mask(&addr, len), len };
    if masked.addr != addr {
        return Err(format!("host bits set in `{s}`: did you mean {masked}?"));
    }
    Ok(Cidr { addr, len })
}

/// [`parse_cidr`] of a spanned value.
pub fn cidr(cx: &Ctx, v: &Spanned<String>) -> Result<Cidr, ProfileError> {
    parse_cidr(v.get_ref()).map_err(|m| cx.err(v.span(), m))
}

fn mask(addr: &IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let m = if len == 0 { 0 } else { u32::MAX << (32 - len as u32) };
            IpAddr::V4((u32::from(*a) & m).into())
        }
        IpAddr::V6(a) => {
            let m = if len == 0 { 0 } else { u128::MAX << (128 - len as u32) };
            IpAddr::V6((u128::from(*a) & m).into())
        }
    }
}

/// An address as the kernel's address words (host order; IPv4 in word 0)
/// and its family (4 or 6).
pub fn addr_words(a: &IpAddr) -> ([u32; 4], u8) {
    match a {
        IpAddr::V4(v) => ([u32::from(*v), 0, 0, 0], 4),
        IpAddr::V6(v) => {
            let o = v.octets();
            let w = |i: usize| u32::from_be_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], 6)
        }
    }
}

// ---- ports ----

/// A port (`443`) or range (`"8000-8100"`).
pub fn parse_ports(p: &RawPorts) -> Result<(u16, u16), String> {
    match p {
        RawPorts::One(n) => port_pair(*n, *n),
        RawPorts::Range(s) => parse_port_text(s),
    }
}

/// `443` or `8000-8100` as text.
pub fn parse_port_text(s: &str) -> Result<(u16, u16), String> {
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let bad = || format!("bad port range `{s}`: use \"8000-8100\"");
    port_pair(
        a.trim().parse::<i64>().map_err(|_| bad())?,
        b.trim().parse::<i64>().map_err(|_| bad())?,
    )
}

fn port_pair(lo: i64, hi: i64) -> Result<(u16, u16), String> {
    if !(0..=65535).contains(&lo) || !(0..=65535).contains(&hi) {
        return Err("ports are 0 to 65535".into());
    }
    if lo > hi {
        return Err(format!("reversed port range {lo}-{hi}: write {hi}-{lo}"));
    }
    Ok((lo as u16, hi as u16))
}

/// [`parse_ports`] of a spanned value.
pub fn ports(cx: &Ctx, v: &Spanned<RawPorts>) -> Result<(u16, u16), ProfileError> {
    parse_ports(v.get_ref()).map_err(|m| cx.err(v.span(), m))
}

// ---- durations, rates, amounts ----

/// A duration (`"10s"`, `"100ms"`, `"1min"`) in nanoseconds; otherwise
/// "bad `what`: ...".
pub fn duration(cx: &Ctx, v: &Spanned<String>, what: &str) -> Result<u64, ProfileError> {
    parse_duration_ns(v.get_ref()).map_err(|e| cx.err(v.span(), format!("bad {what}: {e}")))
}

/// A rate (`"100/s"`, `"10Mbit/s"`).
pub fn rate(cx: &Ctx, v: &Spanned<String>) -> Result<Rate, ProfileError> {
    parse_rate(v.get_ref())
        .map_err(|e| cx.err(v.span(), format!("bad rate `{}`: {e}", v.get_ref())))
}

/// A positive count (`20`) or an amount with a unit (`"64KiB"`), with its
/// dimension; `what` names it in errors.
pub fn amount(
    cx: &Ctx,
    v: &Spanned<RawAmount>,
    what: &str,
) -> Result<(u64, Dimension), ProfileError> {
    match v.get_ref() {
        RawAmount::Int(n) if *n <= 0 => {
            Err(cx.err(v.span(), format!("{what} must be greater than zero")))
        }
        RawAmount::Int(n) => Ok((*n as u64, Dimension::Count)),
        RawAmount::Text(t) => {
            parse_amount(t).map_err(|e| cx.err(v.span(), format!("bad {what} `{t}`: {e}")))
        }
    }
}
