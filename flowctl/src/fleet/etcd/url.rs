//! `etcd://HOST:PORT[,HOST:PORT...]/PREFIX`: where a fleet's profile lives,
//! and the keys under the prefix (docs/fleet.md, "Profiles from etcd").
//!
//! Under `PREFIX`: `PREFIX/profile` holds the profile's TOML text,
//! `PREFIX/generation` a decimal counter that every publish bumps in the
//! same transaction, and `PREFIX/agents/ID` each agent's report, tied to a
//! lease it keeps alive. `agents/` sorts before `generation` and `profile`,
//! so the watch covers exactly the range [`generation`, `profile`] and no
//! agent's report wakes another agent.

use std::fmt;

/// The etcd client port (IANA, and etcd's default).
pub const DEFAULT_PORT: u16 = 2379;

pub const PROFILE: &str = "profile";
pub const GENERATION: &str = "generation";
pub const AGENTS: &str = "agents/";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdUrl {
    /// `host:port` each (IPv6 hosts in brackets), in the order given.
    pub endpoints: Vec<String>,
    /// Starts with `/`, never ends with one.
    pub prefix: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{url}: {problem} (the form is etcd://HOST:PORT[,HOST:PORT...]/PREFIX, e.g. etcd://10.0.0.5:2379/flowctl/web)")]
pub struct UrlError {
    url: String,
    problem: String,
}

/// Whether a `--profile` argument names etcd rather than a file.
pub fn is_etcd(s: &str) -> bool {
    s.starts_with("etcd://")
}

impl std::str::FromStr for EtcdUrl {
    type Err = UrlError;

    fn from_str(s: &str) -> Result<Self, UrlError> {
        let err = |p: &str| UrlError { url: s.to_string(), problem: p.to_string() };
        let rest = s.strip_prefix("etcd://").ok_or_else(|| err("not an etcd:// address"))?;
        let (hosts, prefix) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => return Err(err("no key prefix after the endpoints")),
        };
        let mut endpoints = Vec::new();
        for h in hosts.split(',') {
            endpoints.push(endpoint(h).map_err(|p| err(&p))?);
        }
        let prefix = prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return Err(err("the key prefix is empty"));
        }
        if prefix.contains("//") {
            return Err(err("the key prefix has an empty segment (`//`)"));
        }
        Ok(Self { endpoints, prefix: prefix.to_string() })
    }
}

/// One `host[:port]`, checked: a host, and a port that is a number.
fn endpoint(h: &str) -> Result<String, String> {
    if h.is_empty() {
        return Err("an empty endpoint".into());
    }
    // `[v6]:port`, `[v6]`, `host:port`, `host`.
    let (host, port) = if let Some(r) = h.strip_prefix('[') {
        let (host, after) =
            r.split_once(']').ok_or_else(|| format!("endpoint `{h}`: unclosed `[`"))?;
        (format!("[{host}]"), after.strip_prefix(':'))
    } else {
        match h.split_once(':') {
            Some((host, port)) => (host.to_string(), Some(port)),
            None => (h.to_string(), None),
        }
    };
    if host.is_empty() || host == "[]" {
        return Err(format!("endpoint `{h}` has no host"));
    }
    let port = match port {
        Some(p) => {
            p.parse::<u16>().map_err(|_| format!("endpoint `{h}`: port `{p}` is not a number"))?
        }
        None => DEFAULT_PORT,
    };
    Ok(format!("{host}:{port}"))
}

impl EtcdUrl {
    /// `PREFIX/LEAF`.
    pub fn key(&self, leaf: &str) -> String {
        format!("{}/{leaf}", self.prefix)
    }

    pub fn profile_key(&self) -> String {
        self.key(PROFILE)
    }

    pub fn generation_key(&self) -> String {
        self.key(GENERATION)
    }

    pub fn agents_prefix(&self) -> String {
        self.key(AGENTS)
    }

    /// The end of the watched range [`generation`, `profile`]: etcd's
    /// range end is exclusive, so the key just after `profile`.
    pub fn watch_range_end(&self) -> Vec<u8> {
        let mut k = self.profile_key().into_bytes();
        k.push(0);
        k
    }

    /// How errors name a key: `etcd://ENDPOINTS/KEY`, like a file name.
    pub fn label(&self, key: &str) -> String {
        format!("etcd://{}{key}", self.endpoints.join(","))
    }

    /// The gRPC endpoints: https when TLS is configured.
    pub fn uris(&self, tls: bool) -> Vec<String> {
        let scheme = if tls { "https" } else { "http" };
        self.endpoints.iter().map(|e| format!("{scheme}://{e}")).collect()
    }
}

impl fmt::Display for EtcdUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "etcd://{}{}", self.endpoints.join(","), self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<EtcdUrl, UrlError> {
        s.parse()
    }

    #[test]
    fn endpoints_and_prefix() {
        let u = parse("etcd://h1:2379,h2:2380/flowctl/web").unwrap();
        assert_eq!(u.endpoints, ["h1:2379", "h2:2380"]);
        assert_eq!(u.prefix, "/flowctl/web");
        assert_eq!(u.profile_key(), "/flowctl/web/profile");
        assert_eq!(u.generation_key(), "/flowctl/web/generation");
        assert_eq!(u.agents_prefix(), "/flowctl/web/agents/");
        assert_eq!(u.label(&u.profile_key()), "etcd://h1:2379,h2:2380/flowctl/web/profile");
        assert_eq!(u.uris(false), ["http://h1:2379", "http://h2:2380"]);
        assert_eq!(u.uris(true)[1], "https://h2:2380");
        assert_eq!(u.to_string(), "etcd://h1:2379,h2:2380/flowctl/web");
        // Default port, a trailing slash, IPv6.
        let u = parse("etcd://10.0.0.5/web/").unwrap();
        assert_eq!((u.endpoints[0].as_str(), u.prefix.as_str()), ("10.0.0.5:2379", "/web"));
        let u = parse("etcd://[fd00::1]:2379,[fd00::2]/p").unwrap();
        assert_eq!(u.endpoints, ["[fd00::1]:2379", "[fd00::2]:2379"]);
    }

    #[test]
    fn the_watched_range_holds_generation_and_profile_but_no_agent() {
        let u = parse("etcd://h/p").unwrap();
        let (start, end) = (u.generation_key().into_bytes(), u.watch_range_end());
        let inside = |k: &str| start.as_slice() <= k.as_bytes() && k.as_bytes() < end.as_slice();
        assert!(inside(&u.generation_key()) && inside(&u.profile_key()));
        assert!(!inside(&format!("{}zz", u.agents_prefix())));
        assert!(!inside(&u.key("profilex")) && !inside(&u.key("zzz")));
    }

    #[test]
    fn malformed_urls_say_what_is_wrong() {
        for (s, needle) in [
            ("http://h:2379/p", "not an etcd://"),
            ("etcd://h:2379", "no key prefix"),
            ("etcd://h:2379/", "prefix is empty"),
            ("etcd://h:port/p", "not a number"),
            ("etcd://h1,,h2/p", "empty endpoint"),
            ("etcd://:2379/p", "no host"),
            ("etcd://[fd00::1/p", "unclosed"),
            ("etcd://h/a//b", "empty segment"),
        ] {
            let e = parse(s).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains("the form is"), "{s}: {e}");
        }
        assert!(is_etcd("etcd://h/p") && !is_etcd("rules.toml"));
    }
}
