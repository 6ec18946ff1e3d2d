//! Human rates and sizes: `"10Mbit/s"`, `"60/min"`, `"5kpps"`, `"64KiB"`.
//!
//! Rates are exact rationals (`num` units per `den` seconds) so "60/min" and
//! "1bit/s" lose nothing before they become a GCRA interval.

/// The dimension a rate or size was written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dimension {
    /// Plain counts: packets or connections.
    Count,
    /// Bytes (bit values are converted to bytes).
    Bytes,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// Units per `den` seconds.
    pub num: u128,
    pub den: u128,
    pub dim: Dimension,
}

impl Rate {
    /// Units per second, rounded down (for defaults and display).
    pub fn per_second(&self) -> u128 {
        self.num / self.den
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    #[error("empty value")]
    Empty,
    #[error("`{0}` is not a number")]
    Number(String),
    #[error("unknown unit `{0}` (use e.g. 100/s, 5kpps, 60/min, 10Mbit/s, 1MB/s)")]
    Unit(String),
    #[error("unknown period `{0}` (use s, min or h)")]
    Period(String),
    #[error("must be greater than zero")]
    Zero,
    #[error("too large")]
    TooLarge,
}

/// A decimal number with an optional SI/IEC multiplier, as a rational.
fn parse_scaled(s: &str) -> Result<(u128, u128, &str), RateError> {
    let end = s.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_')).unwrap_or(s.len());
    let (digits, rest) = s.split_at(end);
    let digits = digits.replace('_', "");
    if digits.is_empty() {
        return Err(RateError::Number(s.to_string()));
    }
    let (int, frac) = match digits.split_once('.') {
        Some((i, f)) => (i, f),
        None => (digits.as_str(), ""),
    };
    if frac.contains('.') || frac.len() > 9 || (int.is_empty() && frac.is_empty()) {
        return Err(RateError::Number(s.to_string()));
    }
    let mut num: u128 = 0;
    for c in int.chars().chain(frac.chars()) {
        num = num
            .checked_mul(10)
            .and_then(|n| n.checked_add(c as u128 - '0' as u128))
            .ok_or(RateError::TooLarge)?;
    }
    let den = 10u128.pow(frac.len() as u32);
    let rest = rest.trim_start();
    let (mult, rest): (u128, &str) = if let Some(r) = rest.strip_prefix("Ki") {
        (1 << 10, r)
    } else if let Some(r) = rest.strip_prefix("Mi") {
        (1 << 20, r)
    } else if let Some(r) = rest.strip_prefix("Gi") {
        (1 << 30, r)
    } else if let Some(r) = rest.strip_prefix('k').or_else(|| rest.strip_prefix('K')) {
        (1_000, r)
    } else if let Some(r) = rest.strip_prefix('M') {
        (1_000_000, r)
    } else if let Some(r) = rest.strip_prefix('G') {
        (1_000_000_000, r)
    } else {
        (1, rest)
    };
    Ok((num.checked_mul(mult).ok_or(RateError::TooLarge)?, den, rest))
}

/// Splits a unit word into (dimension, bytes per unit as num/den).
fn unit_word(u: &str) -> Result<(Dimension, u128, u128), RateError> {
    match u.trim() {
        "" | "p" | "pkt" | "pkts" | "packet" | "packets" | "conn" | "conns" | "connections" => {
            Ok((Dimension::Count, 1, 1))
        }
        "bit" | "bits" | "b" => Ok((Dimension::Bytes, 1, 8)),
        "B" | "byte" | "bytes" => Ok((Dimension::Bytes, 1, 1)),
        other => Err(RateError::Unit(other.to_string())),
    }
}

/// Parses a rate: `<number>[k|M|G|Ki|Mi|Gi][unit]/<period>` or the shorthands
/// `<number>pps` and `<number>bps` (bits per second).
pub fn parse_rate(s: &str) -> Result<Rate, RateError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(RateError::Empty);
    }
    let (num, den, rest) = parse_scaled(s)?;
    let (unit, period) = if let Some(u) = rest.strip_suffix("pps") {
        if !u.trim().is_empty() {
            return Err(RateError::Unit(rest.to_string()));
        }
        ("", "s")
    } else if let Some(u) = rest.strip_suffix("bps") {
        if !u.trim().is_empty() {
            return Err(RateError::Unit(rest.to_string()));
        }
        ("bit", "s")
    } else {
        rest.split_once('/').ok_or_else(|| RateError::Period(rest.to_string()))?
    };
    let (dim, unum, uden) = unit_word(unit)?;
    let seconds: u128 = match period.trim() {
        "s" | "sec" | "second" => 1,
        "m" | "min" | "minute" => 60,
        "h" | "hour" => 3600,
        other => return Err(RateError::Period(other.to_string())),
    };
    if num == 0 {
        return Err(RateError::Zero);
    }
    Ok(Rate { num: num * unum, den: den * uden * seconds, dim })
}

/// Parses a size or count: `100`, `1500B`, `64KiB`, `1M`. Returns the value
/// rounded down and its dimension (`Count` when no byte unit is written).
pub fn parse_amount(s: &str) -> Result<(u64, Dimension), RateError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(RateError::Empty);
    }
    let (num, den, rest) = parse_scaled(s)?;
    let (dim, unum, uden) = unit_word(rest)?;
    let v = num * unum / (den * uden);
    if v == 0 {
        return Err(RateError::Zero);
    }
    Ok((u64::try_from(v).map_err(|_| RateError::TooLarge)?, dim))
}

/// Parses a duration: `500ms`, `3s`, `1min`.
pub fn parse_duration_ns(s: &str) -> Result<u64, RateError> {
    let s = s.trim();
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(end);
    let n: u64 = n.parse().map_err(|_| RateError::Number(s.to_string()))?;
    let mult = match unit.trim() {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" | "" => 1_000_000_000,
        "min" | "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        other => return Err(RateError::Period(other.to_string())),
    };
    n.checked_mul(mult).ok_or(RateError::TooLarge)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> (u128, u128, Dimension) {
        let x = parse_rate(s).unwrap();
        (x.num, x.den, x.dim)
    }

    #[test]
    fn rates() {
        assert_eq!(r("100/s"), (100, 1, Dimension::Count));
        assert_eq!(r("60/min"), (60, 60, Dimension::Count));
        assert_eq!(r("5kpps"), (5000, 1, Dimension::Count));
        assert_eq!(r("1.5k/s"), (15000, 10, Dimension::Count));
        assert_eq!(r("10Mbit/s"), (10_000_000, 8, Dimension::Bytes));
        assert_eq!(r("1MB/s"), (1_000_000, 1, Dimension::Bytes));
        assert_eq!(r("1MiB/s"), (1 << 20, 1, Dimension::Bytes));
        assert_eq!(r("100Mbps"), (100_000_000, 8, Dimension::Bytes));
        assert_eq!(r("3600/h"), (3600, 3600, Dimension::Count));
        assert_eq!(r("20 conn/s"), (20, 1, Dimension::Count));
    }

    #[test]
    fn rate_errors() {
        assert_eq!(parse_rate(""), Err(RateError::Empty));
        assert_eq!(parse_rate("0/s"), Err(RateError::Zero));
        assert!(matches!(parse_rate("ten/s"), Err(RateError::Number(_))));
        assert!(matches!(parse_rate("10/fortnight"), Err(RateError::Period(_))));
        assert!(matches!(parse_rate("10furlongs/s"), Err(RateError::Unit(_))));
        assert!(matches!(parse_rate("10"), Err(RateError::Period(_))));
        assert!(matches!(parse_rate("1.2.3/s"), Err(RateError::Number(_))));
    }

    #[test]
    fn amounts_and_durations() {
        assert_eq!(parse_amount("100"), Ok((100, Dimension::Count)));
        assert_eq!(parse_amount("64KiB"), Ok((65536, Dimension::Bytes)));
        assert_eq!(parse_amount("1500B"), Ok((1500, Dimension::Bytes)));
        assert_eq!(parse_amount("1Mbit"), Ok((125_000, Dimension::Bytes)));
        assert_eq!(parse_amount("0"), Err(RateError::Zero));
        assert_eq!(parse_duration_ns("3s"), Ok(3_000_000_000));
        assert_eq!(parse_duration_ns("250ms"), Ok(250_000_000));
        assert_eq!(parse_duration_ns("1h"), Ok(3_600_000_000_000));
    }
}
