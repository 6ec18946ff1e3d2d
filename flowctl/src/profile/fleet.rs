//! The `[fleet]` section: the Redis the global rules keep their leases in
//! (docs/fleet.md), how long a lease lasts and how often it is renewed.

use super::{
    error::{Ctx, ProfileError},
    model::{Fleet, DEFAULT_LEASE_NS, DEFAULT_REFRESH_NS},
    primitives::duration,
    raw::RawFleet,
};
use std::path::PathBuf;
use toml::Spanned;

/// Validates `[fleet]`.
pub fn fleet(cx: &Ctx, raw: &Spanned<RawFleet>) -> Result<Fleet, ProfileError> {
    let f = raw.get_ref();
    let url = f.redis.get_ref();
    let tls = url.starts_with("rediss://");
    if !(tls || url.starts_with("redis://")) || url.split("://").nth(1).is_none_or(str::is_empty) {
        return Err(cx.err(
            f.redis.span(),
            format!("redis = `{url}`: use redis://HOST:PORT (or rediss:// for TLS)"),
        ));
    }
    if url.contains('@') {
        return Err(cx.err(f.redis.span(), "no credentials in the URL: profiles get copied and shown; use redis_user and redis_password_file"));
    }
    for (name, v) in
        [("redis_ca", &f.redis_ca), ("redis_cert", &f.redis_cert), ("redis_key", &f.redis_key)]
    {
        if let (Some(v), false) = (v, tls) {
            return Err(cx.err(v.span(), format!("{name} needs a rediss:// URL (TLS)")));
        }
    }
    let redis_client_cert = match (&f.redis_cert, &f.redis_key) {
        (Some(c), Some(k)) => Some((PathBuf::from(c.get_ref()), PathBuf::from(k.get_ref()))),
        (None, None) => None,
        (Some(c), None) => return Err(cx.err(c.span(), "redis_cert needs its redis_key")),
        (None, Some(k)) => return Err(cx.err(k.span(), "redis_key needs its redis_cert")),
    };
    let lease_ns = match &f.lease {
        Some(v) => duration(cx, v, "lease")?,
        None => DEFAULT_LEASE_NS,
    };
    let refresh_ns = match &f.refresh {
        Some(v) => duration(cx, v, "refresh")?,
        None => DEFAULT_REFRESH_NS,
    };
    if !(1_000_000_000..=300_000_000_000).contains(&lease_ns) {
        let span = f.lease.as_ref().map(|v| v.span()).unwrap_or(raw.span());
        return Err(cx.err(span, "lease must be between 1s and 5min"));
    }
    // A lease is renewed at least twice before it ends, so one lost renewal
    // does not cost a host its grants.
    if refresh_ns < 100_000_000 || refresh_ns * 2 > lease_ns {
        let span = f.refresh.as_ref().map(|v| v.span()).unwrap_or(raw.span());
        return Err(cx.err(span, "refresh must be at least 100ms and at most half the lease"));
    }
    let host = f.host.as_ref().map(|h| h.get_ref().clone());
    if let Some(h) = &f.host {
        let ok = !h.get_ref().is_empty()
            && h.get_ref().len() <= 64
            && h.get_ref().chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !ok {
            return Err(cx.err(h.span(), "host names are 1-64 letters, digits, '-', '_' or '.'"));
        }
    }
    Ok(Fleet {
        redis: url.clone(),
        redis_user: f.redis_user.as_ref().map(|u| u.get_ref().clone()),
        redis_password_file: f.redis_password_file.as_ref().map(|p| PathBuf::from(p.get_ref())),
        redis_ca: f.redis_ca.as_ref().map(|p| PathBuf::from(p.get_ref())),
        redis_client_cert,
        lease_ns,
        refresh_ns,
        host,
    })
}

#[cfg(test)]
mod tests {
    use crate::profile::{parse, tests::err};

    const FLEET: &str = "[fleet]\nredis = \"redis://10.0.0.1:6379\"\n";

    fn global_rule(extra: &str) -> String {
        format!("{FLEET}[[rule]]\nname = \"g\"\nproto = \"udp\"\nrate = \"1000/s\"\nburst = 200\nkey = \"src\"\nscope = \"global\"\n{extra}")
    }

    #[test]
    fn a_global_rule_keeps_the_fleet_limit_and_gets_a_default_share() {
        let set = parse("p.toml", &global_rule("")).unwrap();
        let r = &set.rules[0];
        let share = r.global.as_ref().unwrap().share.as_ref().unwrap();
        // 1% of 1000/s with 1% of the burst.
        assert_eq!(share.interval_fp, r.interval_fp * 100);
        assert_eq!((share.burst, r.burst), (2, 200));
        let f = set.fleet.unwrap();
        assert_eq!((f.lease_ns, f.refresh_ns), (5_000_000_000, 1_000_000_000));
        let none = parse("p.toml", &global_rule("default_share = \"none\"\n")).unwrap();
        assert_eq!(none.rules[0].global.as_ref().unwrap().share, None);
        let five = parse("p.toml", &global_rule("default_share = \"5/s\"\n")).unwrap();
        assert_eq!(five.rules[0].global.as_ref().unwrap().share.as_ref().unwrap().burst, 5);
        assert_eq!(
            crate::cli::format::limit_text(&five.rules[0]),
            "1000/s packets burst 200 per src, fleet-wide (before a lease: 5/s)"
        );
    }

    #[test]
    fn a_global_quota_is_fleet_wide_and_the_default_share_gets_its_proportion() {
        let q = "quota = 6000\nquota_window = \"1min\"\n";
        let set = parse("p.toml", &global_rule(q)).unwrap();
        let r = &set.rules[0];
        assert_eq!(r.quota_limit, 6000);
        // 1% of the rate, so 1% of the quota.
        assert_eq!(r.global.as_ref().unwrap().share.as_ref().unwrap().quota, 60);
        let five = parse("p.toml", &global_rule(&format!("{q}default_share = \"5/s\"\n"))).unwrap();
        // 5/s of 1000/s: 30 of 6000.
        assert_eq!(five.rules[0].global.as_ref().unwrap().share.as_ref().unwrap().quota, 30);
    }

    #[test]
    fn bad_global_rules_and_fleets_are_refused_with_their_place() {
        let no_fleet = global_rule("").replace(FLEET, "");
        let e = err(&no_fleet);
        assert!(e.msg.contains("needs a [fleet] section"), "{e}");
        assert_eq!(e.line, 7, "points at scope: {e}");
        let e = err(&global_rule("").replace("1000/s", "30/min"));
        assert!(e.msg.contains("1 to 4294967295 units per second"), "{e}");
        let e = err(&global_rule("default_share = \"2000/s\"\n"));
        assert!(e.msg.contains("above the rule's rate"), "{e}");
        let e = err(&global_rule("")
            .replace("rate = \"1000/s\"\nburst = 200\n", "quota = 100\nquota_window = \"1min\"\n"));
        assert!(e.msg.contains("a global rule needs a `rate`"), "{e}");
        assert_eq!(e.line, 6, "points at the quota: {e}");
        let e = err(&global_rule("").replace("scope = \"global\"\n", "scope = \"fleet\"\n"));
        assert!(e.msg.contains("unknown scope `fleet`"), "{e}");
        let e = err(&format!(
            "{FLEET}[[rule]]\nname = \"l\"\nrate = \"1/s\"\ndefault_share = \"none\"\n"
        ));
        assert!(e.msg.contains("belongs to scope"), "{e}");
        let e = err(&global_rule("").replace("redis://10.0.0.1", "redis://u:pw@10.0.0.1"));
        assert!(e.msg.contains("no credentials in the URL"), "{e}");
        let e = err(&global_rule("").replace("redis://10", "http://10"));
        assert!(e.msg.contains("use redis://HOST:PORT"), "{e}");
        let e = err(&global_rule("").replace(FLEET, &format!("{FLEET}refresh = \"4s\"\n")));
        assert!(e.msg.contains("at most half the lease"), "{e}");
        let e = err(&global_rule("").replace(FLEET, &format!("{FLEET}redis_cert = \"c.pem\"\n")));
        assert!(e.msg.contains("redis_cert needs a rediss:// URL"), "{e}");
        let tls = FLEET.replace("redis://", "rediss://");
        let e = err(&global_rule("").replace(FLEET, &format!("{tls}redis_cert = \"c.pem\"\n")));
        assert!(e.msg.contains("redis_cert needs its redis_key"), "{e}");
        assert_eq!(e.line, 3, "points at redis_cert: {e}");
        let set = parse(
            "p.toml",
            &global_rule("").replace(
                FLEET,
                &format!(
                    "{tls}redis_ca = \"ca.pem\"\nredis_cert = \"c.pem\"\nredis_key = \"k.pem\"\n"
                ),
            ),
        )
        .unwrap();
        assert_eq!(set.fleet.unwrap().redis_client_cert, Some(("c.pem".into(), "k.pem".into())));
    }
}
