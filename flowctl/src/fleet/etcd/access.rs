//! How flowctl reaches etcd: endpoints, TLS (a CA, and a client certificate
//! and key for mutual TLS), user and password, the timeouts; and what an
//! etcd error means for the operator, with the fix.

use crate::fleet::etcd::url::EtcdUrl;
use anyhow::{anyhow, bail, Context, Result};
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use std::{path::PathBuf, time::Duration};

/// Every unary request (a Get, a Txn, a lease grant) must answer within
/// this; a watch is checked by its progress instead (`watch`).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The credentials and TLS material, as the command line gives them.
#[derive(Clone, Debug, Default)]
pub struct Access {
    pub user: Option<String>,
    pub password: Option<String>,
    /// The CA that signed the servers' certificates: TLS (https) when set.
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl Access {
    /// `--etcd-user NAME[:PASSWORD]`, `--etcd-password-file FILE` (its first
    /// line; keeps the password out of `ps`), `--etcd-ca`, `--etcd-cert`,
    /// `--etcd-key`.
    pub fn from_args(
        user: Option<String>,
        password_file: Option<PathBuf>,
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Result<Self> {
        let (user, mut password) = match user {
            Some(u) => match u.split_once(':') {
                Some((n, p)) => (Some(n.to_string()), Some(p.to_string())),
                None => (Some(u), None),
            },
            None => (None, None),
        };
        if let Some(f) = password_file {
            if user.is_none() {
                bail!("--etcd-password-file needs --etcd-user NAME");
            }
            let text = std::fs::read_to_string(&f)
                .with_context(|| format!("reading the etcd password from {}", f.display()))?;
            password = Some(text.lines().next().unwrap_or("").to_string());
        }
        if user.is_some() && password.is_none() {
            bail!("--etcd-user NAME needs a password: --etcd-user NAME:PASSWORD or --etcd-password-file FILE");
        }
        if cert.is_some() != key.is_some() {
            bail!("a client certificate needs both --etcd-cert and --etcd-key");
        }
        if cert.is_some() && ca.is_none() {
            bail!("--etcd-cert needs --etcd-ca (the CA of the servers' certificates): client certificates only go over TLS");
        }
        Ok(Self { user, password, ca, cert, key })
    }

    pub fn tls(&self) -> bool {
        self.ca.is_some()
    }

    fn options(&self) -> Result<ConnectOptions> {
        // HTTP/2 pings find a dead connection when nothing else flows; etcd
        // refuses pings more often than every 5 s (--grpc-keepalive-min-time).
        let mut o = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            .with_require_leader(true)
            .with_auto_token_refresh(true);
        if let (Some(u), Some(p)) = (&self.user, &self.password) {
            o = o.with_user(u, p);
        }
        if let Some(ca) = &self.ca {
            let read =
                |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(read(ca)?));
            if let (Some(c), Some(k)) = (&self.cert, &self.key) {
                tls = tls.identity(Identity::from_pem(read(c)?, read(k)?));
            }
            o = o.with_tls(tls);
        }
        Ok(o)
    }

    /// A client of `url`'s endpoints, authenticated when a user is given
    /// (which is the first request made, so a wrong password fails here).
    pub async fn connect(&self, url: &EtcdUrl) -> Result<Client> {
        let options = self.options()?;
        let uris = url.uris(self.tls());
        match tokio::time::timeout(REQUEST_TIMEOUT, Client::connect(uris, Some(options))).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(explain(url, self, e)),
            Err(_) => Err(unreachable(url, "no answer")),
        }
    }
}

/// Awaits one etcd request for at most [`REQUEST_TIMEOUT`], explaining
/// its error.
pub async fn request<T>(
    url: &EtcdUrl,
    access: &Access,
    what: &str,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(explain(url, access, e).context(what.to_string())),
        Err(_) => Err(unreachable(url, &format!("{what}: no answer within {REQUEST_TIMEOUT:?}"))),
    }
}

fn unreachable(url: &EtcdUrl, why: &str) -> anyhow::Error {
    anyhow!(
        "cannot reach etcd at {} ({why}): is it running, and is the address reachable from this host (or its --netns)?",
        url.endpoints.join(",")
    )
}

/// An etcd error as the operator's problem and its fix.
pub fn explain(url: &EtcdUrl, access: &Access, e: etcd_client::Error) -> anyhow::Error {
    use tonic::Code;
    let user = access.user.as_deref().unwrap_or("");
    match &e {
        etcd_client::Error::GRpcStatus(s) => {
            let m = s.message();
            if m.contains("authentication failed") {
                anyhow!("etcd at {} refused user `{user}`: wrong user name or password ({m}); check --etcd-user and --etcd-password-file", url.endpoints.join(","))
            } else if m.contains("user name is empty") || m.contains("invalid auth token") {
                anyhow!("etcd at {} requires authentication ({m}): give --etcd-user NAME with --etcd-password-file FILE", url.endpoints.join(","))
            } else if s.code() == Code::PermissionDenied || m.contains("permission denied") {
                anyhow!("etcd at {} denied user `{user}` ({m}): grant its role read access to {} (and write access to {} for reports and publishing)", url.endpoints.join(","), url.prefix, url.key(""))
            } else if m.contains("no leader") {
                anyhow!(
                    "etcd at {} has no leader ({m}): the cluster has lost its quorum",
                    url.endpoints.join(",")
                )
            } else if s.code() == Code::Unavailable || s.code() == Code::DeadlineExceeded {
                unreachable(url, m)
            } else {
                anyhow!(
                    "etcd at {}: {m} ({:?}){}{}",
                    url.endpoints.join(","),
                    s.code(),
                    causes(s),
                    tls_hint(access)
                )
            }
        }
        etcd_client::Error::TransportError(t) => {
            unreachable(url, &format!("{t}{}{}", causes(t), tls_hint(access)))
        }
        other => anyhow!("etcd at {}: {other}", url.endpoints.join(",")),
    }
}

/// The chain under an error (a TLS alert under a transport error), as
/// `: a: b`.
fn causes(e: &dyn std::error::Error) -> String {
    let mut out = String::new();
    let mut next = e.source();
    while let Some(c) = next {
        out.push_str(&format!(": {c}"));
        next = c.source();
    }
    out
}

/// An error that is no answer from etcd is often TLS set up on one side
/// only: what to check.
fn tls_hint(access: &Access) -> &'static str {
    match (access.tls(), access.cert.is_some()) {
        (false, _) => " (if etcd serves TLS: --etcd-ca FILE, and --etcd-cert/--etcd-key if it asks for client certificates)",
        (true, false) => " (if etcd asks for client certificates: --etcd-cert FILE --etcd-key FILE)",
        (true, true) => " (check that --etcd-ca signed etcd's certificate, that it names this address, and that etcd trusts the client certificate's CA)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_from_the_command_line() {
        let a = Access::from_args(Some("root:pw".into()), None, None, None, None).unwrap();
        assert_eq!((a.user.as_deref(), a.password.as_deref()), (Some("root"), Some("pw")));
        assert!(!a.tls());
        let f = std::env::temp_dir().join(format!("flowctl-pw-test-{}", std::process::id()));
        std::fs::write(&f, "s3cret\n").unwrap();
        let a = Access::from_args(Some("app".into()), Some(f.clone()), None, None, None).unwrap();
        assert_eq!(a.password.as_deref(), Some("s3cret"), "the first line, without its newline");
        std::fs::remove_file(&f).unwrap();
        for (args, needle) in [
            ((Some("app"), None, None, None, None), "needs a password"),
            ((None, Some("f"), None, None, None), "needs --etcd-user"),
            ((None, None, Some("ca"), Some("c"), None), "both --etcd-cert and --etcd-key"),
            ((None, None, None, Some("c"), Some("k")), "needs --etcd-ca"),
        ] {
            let p = |s: Option<&str>| s.map(PathBuf::from);
            let e = Access::from_args(
                args.0.map(String::from),
                p(args.1),
                p(args.2),
                p(args.3),
                p(args.4),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(needle), "{e}");
        }
        let a = Access::from_args(None, None, Some("ca".into()), None, None).unwrap();
        assert!(a.tls());
    }

    #[test]
    fn errors_say_how_to_fix_them() {
        let url: EtcdUrl = "etcd://h:2379/p".parse().unwrap();
        let a = Access { user: Some("root".into()), ..Default::default() };
        let e = |s: tonic::Status| explain(&url, &a, etcd_client::Error::GRpcStatus(s)).to_string();
        let m = e(tonic::Status::invalid_argument(
            "etcdserver: authentication failed, invalid user ID or password",
        ));
        assert!(m.contains("refused user `root`") && m.contains("--etcd-password-file"), "{m}");
        let m = e(tonic::Status::invalid_argument("etcdserver: user name is empty"));
        assert!(m.contains("requires authentication"), "{m}");
        let m = e(tonic::Status::permission_denied("etcdserver: permission denied"));
        assert!(m.contains("grant its role"), "{m}");
        let m = e(tonic::Status::unavailable("connection refused"));
        assert!(m.contains("cannot reach etcd at h:2379"), "{m}");
    }
}
