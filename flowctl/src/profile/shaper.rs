//! The `[[shaper]]` section: a downstream target whose traffic this host
//! sends at a steady rate (the TC egress shaper, docs/algorithms.md
//! section 7), validated into the kernel's `ShaperConfig`.

use super::{
    error::{Ctx, ProfileError},
    primitives::{addr_words, duration, keyword, name, parse_prefix, ports, protocol, rate},
    raw::RawShaper,
};
use flowctl_common::{
    gcra,
    rate::Dimension,
    shaper::{flags, ShaperConfig, MAX_SHAPERS},
};
use toml::Spanned;

/// Default horizon: the longest a packet is held before it is dropped
/// instead (fq's own default is 10 s, far past what a sender waiting on
/// its writes should see).
pub const DEFAULT_HORIZON_NS: u64 = 2_000_000_000;
/// The longest horizon: fq's horizon is a u32 of microseconds (71 min);
/// a minute is already far past any sensible queueing delay.
pub const MAX_HORIZON_NS: u64 = 60_000_000_000;

/// One validated `[[shaper]]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Shaper {
    pub name: String,
    pub line: usize,
    /// As written, for display.
    pub dst_text: String,
    pub rate_text: String,
    pub config: ShaperConfig,
}

impl Shaper {
    pub fn dry_run(&self) -> bool {
        self.config.flags & flags::DRY_RUN != 0
    }
    pub fn per_flow(&self) -> bool {
        self.config.flags & flags::PER_FLOW != 0
    }
}

/// Validates every `[[shaper]]`: at most `MAX_SHAPERS`, unique names.
pub fn shapers(cx: &Ctx, raw: &[Spanned<RawShaper>]) -> Result<Vec<Shaper>, ProfileError> {
    if raw.len() > MAX_SHAPERS {
        return Err(cx.err(
            raw[MAX_SHAPERS].span(),
            format!("{} shapers: at most {MAX_SHAPERS}", raw.len()),
        ));
    }
    let mut out: Vec<Shaper> = Vec::new();
    for s in raw {
        let shaper = shaper(cx, s)?;
        if out.iter().any(|o| o.name == shaper.name) {
            return Err(cx.err(s.span(), format!("duplicate shaper name `{}`", shaper.name)));
        }
        out.push(shaper);
    }
    Ok(out)
}

fn shaper(cx: &Ctx, raw: &Spanned<RawShaper>) -> Result<Shaper, ProfileError> {
    let s = raw.get_ref();
    let name = name(
        cx,
        &s.name,
        64,
        "shaper names are 1-64 characters of letters, digits, '-', '_' or '.'",
    )?;
    let Some(dst) = &s.dst else {
        return Err(cx.err(raw.span(), format!("shaper `{name}` needs `dst`, the downstream's address or prefix (e.g. \"10.0.0.5\" or \"10.0.0.0/24\")")));
    };
    let prefix = parse_prefix(dst.get_ref()).map_err(|m| cx.err(dst.span(), m))?;
    let max = if prefix.addr.is_ipv4() { 32 } else { 128 };
    let prefix_len = match prefix.len {
        Some((n, _)) if n <= max => n,
        Some((n, _)) => {
            return Err(cx.err(dst.span(), format!("prefix length /{n} is longer than /{max}")))
        }
        None => max,
    };
    let (addr, family) = addr_words(&prefix.addr);
    let proto = match &s.proto {
        None => 0,
        Some(p) => match protocol(cx, p)? {
            None => 0,
            Some(n @ (6 | 17)) => n,
            Some(_) => return Err(cx.err(p.span(), "a shaper's proto is tcp, udp or any")),
        },
    };
    let (port_lo, port_hi) = match &s.dport {
        None => (0, u16::MAX),
        Some(p) if proto == 0 => {
            return Err(cx.err(p.span(), "`dport` needs proto = \"tcp\" or \"udp\""))
        }
        Some(p) => ports(cx, p)?,
    };
    let Some(rate_s) = &s.rate else {
        return Err(cx.err(raw.span(), format!("shaper `{name}` needs a `rate`: packets (\"1000/s\") or bytes (\"10Mbit/s\") per second")));
    };
    let r = rate(cx, rate_s)?;
    let interval_fp = gcra::interval_fp(r.num as u64, r.den as u64);
    let mut fl = if r.dim == Dimension::Bytes { flags::BYTES } else { 0 };
    if let Some(p) = &s.per {
        fl |= keyword(
            cx,
            p,
            "per",
            &[("aggregate", 0), ("flow", flags::PER_FLOW)],
            "use \"aggregate\" (one rate for everything to the target) or \"flow\" (the rate for each connection)",
        )?;
    }
    if let Some(a) = &s.action {
        fl |= keyword(
            cx,
            a,
            "action",
            &[("shape", 0), ("dry-run", flags::DRY_RUN)],
            "use \"shape\" or \"dry-run\" (count what would be delayed or dropped, touch nothing)",
        )?;
    }
    let horizon_ns = match &s.horizon {
        None => DEFAULT_HORIZON_NS,
        Some(h) => {
            let ns = duration(cx, h, "horizon")?;
            if !(1_000_000..=MAX_HORIZON_NS).contains(&ns) {
                return Err(cx.err(h.span(), "horizon must be between 1ms and 60s"));
            }
            ns
        }
    };
    Ok(Shaper {
        name,
        line: cx.line(&raw.span()),
        dst_text: dst.get_ref().clone(),
        rate_text: rate_s.get_ref().clone(),
        config: ShaperConfig {
            addr,
            prefix_len,
            family,
            proto,
            flags: fl,
            port_lo,
            port_hi,
            interval_fp,
            horizon_ns,
        },
    })
}

#[cfg(test)]
mod tests {
    use crate::profile::parse;

    const RULE: &str = "[[rule]]\nname = \"r\"\nrate = \"1/s\"\n";

    fn err(text: &str) -> crate::profile::ProfileError {
        parse("p.toml", text).expect_err("must be rejected")
    }

    #[test]
    fn shapers_validate_with_line_and_reason() {
        let ok = parse(
            "p",
            &format!("{RULE}[[shaper]]\nname = \"db\"\ndst = \"10.0.0.5\"\nproto = \"tcp\"\ndport = 5432\nrate = \"10Mbit/s\"\nper = \"flow\"\nhorizon = \"500ms\"\n"),
        )
        .unwrap();
        let s = &ok.shapers[0];
        assert_eq!((s.config.family, s.config.prefix_len, s.config.proto), (4, 32, 6));
        assert_eq!((s.config.port_lo, s.config.port_hi), (5432, 5432));
        assert_eq!(s.config.horizon_ns, 500_000_000);
        assert!(s.per_flow() && !s.dry_run());
        assert_ne!(s.config.flags & flowctl_common::shaper::flags::BYTES, 0);
        for (extra, line, needle) in [
            ("[[shaper]]\nname = \"a\"\nrate = \"1/s\"\n", 4, "needs `dst`"),
            ("[[shaper]]\nname = \"a\"\ndst = \"10.0.0.1\"\n", 4, "needs a `rate`"),
            ("[[shaper]]\nname = \"a\"\ndst = \"10.0.0.1/40\"\nrate = \"1/s\"\n", 6, "longer than /32"),
            ("[[shaper]]\nname = \"a\"\ndst = \"nope\"\nrate = \"1/s\"\n", 6, "not an IP address"),
            ("[[shaper]]\nname = \"a\"\ndst = \"10.0.0.1\"\ndport = 80\nrate = \"1/s\"\n", 7, "needs proto"),
            ("[[shaper]]\nname = \"a\"\ndst = \"10.0.0.1\"\nproto = \"icmp\"\nrate = \"1/s\"\n", 7, "tcp, udp or any"),
            ("[[shaper]]\nname = \"a\"\ndst = \"10.0.0.1\"\nrate = \"1/s\"\nper = \"host\"\n", 8, "unknown per"),
            ("[[shaper]]\nname = \"a\"\ndst = \"10.0.0.1\"\nrate = \"1/s\"\nhorizon = \"2min\"\n", 8, "between 1ms and 60s"),
            ("[[shaper]]\nname = \"a\"\ndst = \"10.0.0.1\"\nrate = \"1/s\"\n[[shaper]]\nname = \"a\"\ndst = \"10.0.0.2\"\nrate = \"1/s\"\n", 8, "duplicate shaper"),
            ("[[shaper]]\nname = \"a\"\ndst = \"10.0.0.1\"\nrate = \"1/s\"\nburst = 3\n", 8, "unknown field"),
        ] {
            let text = format!("{RULE}{extra}");
            let e = err(&text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn a_profile_of_shapers_alone_is_valid() {
        let p = parse("p", "[[shaper]]\nname = \"a\"\ndst = \"fd00::/64\"\nrate = \"100/s\"\naction = \"dry-run\"\n").unwrap();
        assert!(p.rules.is_empty() && p.shapers[0].dry_run());
        assert_eq!(p.shapers[0].config.family, 6);
    }
}
