//! Throwaway certificates for the TLS tests of both stores (etcd and
//! Redis): a CA, a server certificate for given IP addresses and a client
//! certificate, made with `openssl`.

use crate::{lab::sh, tempfile::TempDir};

/// A throwaway CA, a server certificate for the given IP addresses and a
/// client certificate, made with `openssl` (EC P-256, valid a day), in a
/// directory removed on drop.
pub struct Pki {
    dir: TempDir,
}

impl Pki {
    pub fn new(server_ips: &[&str]) -> Self {
        let dir = TempDir::new("flowctl-pki-");
        let d = dir.path().to_string();
        let f = |n: &str| format!("{d}/{n}");
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let mut ca = vec!["openssl", "req", "-x509"];
        ca.extend_from_slice(&ec);
        let (ca_key, ca_crt) = (f("ca.key"), f("ca.crt"));
        ca.extend_from_slice(&[
            "-keyout",
            &ca_key,
            "-out",
            &ca_crt,
            "-days",
            "1",
            "-subj",
            "/CN=flowctl-test-ca",
        ]);
        sh(&ca);
        let sans: Vec<String> = server_ips.iter().map(|ip| format!("IP:{ip}")).collect();
        for (name, ext) in [
            ("server", format!("subjectAltName={}\nextendedKeyUsage=serverAuth\n", sans.join(","))),
            ("client", "extendedKeyUsage=clientAuth\n".to_string()),
        ] {
            let (key, csr, crt, extf) = (
                f(&format!("{name}.key")),
                f(&format!("{name}.csr")),
                f(&format!("{name}.crt")),
                f(&format!("{name}.ext")),
            );
            std::fs::write(&extf, ext).expect("extensions file");
            let mut req = vec!["openssl", "req"];
            req.extend_from_slice(&ec);
            let subj = format!("/CN=flowctl-test-{name}");
            req.extend_from_slice(&["-keyout", &key, "-out", &csr, "-subj", &subj]);
            sh(&req);
            sh(&[
                "openssl",
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &ca_crt,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-out",
                &crt,
                "-days",
                "1",
                "-extfile",
                &extf,
            ]);
        }
        Self { dir }
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &std::path::Path {
        std::path::Path::new(self.dir.path())
    }

    /// A file of the set: `ca.crt`, `server.crt`, `client.crt`, `client.key`...
    pub fn file(&self, name: &str) -> String {
        format!("{}/{name}", self.dir.path())
    }
}
