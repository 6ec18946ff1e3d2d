//! A real web server and a real HTTP load generator for the end-to-end
//! tests: nginx (Debian `nginx-light`) in the lab's protected namespace,
//! serving a fixed answer from its own temporary directory, and wrk
//! (Debian `wrk`) in the client namespace. Both are installed by
//! `cargo xtask setup`.

use crate::{lab::Lab, server::Server};
use std::{process::Command, time::Duration};

/// nginx listening on `lab.ip_srv:port`, one process (`master_process
/// off`), so killing the PID the test holds leaves no worker behind; its
/// pid file, logs and temporary paths all live in its own directory.
pub struct Nginx {
    server: Server,
}

impl Nginx {
    pub fn start(lab: &Lab, port: u16) -> Self {
        let conf = format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {{dir}}/nginx.pid;\nerror_log {{dir}}/error.log warn;\n\
events {{ worker_connections 4096; }}\n\
http {{\n  access_log off;\n  client_body_temp_path {{dir}}/body;\n  proxy_temp_path {{dir}}/proxy;\n  fastcgi_temp_path {{dir}}/fastcgi;\n  uwsgi_temp_path {{dir}}/uwsgi;\n  scgi_temp_path {{dir}}/scgi;\n\
  server {{\n    listen {}:{port} backlog=4096;\n    location / {{ return 200 \"ok\\n\"; }}\n  }}\n}}\n",
            lab.ip_srv
        );
        let addr = format!("{}:{port}", lab.ip_srv);
        let ns = lab.ns_srv.clone();
        // The configuration names the server's directory, which exists only
        // once `Server::start` made it: a shell writes the file there first.
        let script = format!("cat > {{dir}}/nginx.conf <<'EOF'\n{conf}EOF\nexec nginx -e {{dir}}/error.log -c {{dir}}/nginx.conf");
        let server = Server::start(
            "nginx",
            Some(&lab.ns_srv),
            "sh",
            &["-c", &script],
            move |_| {
                let addr = addr.clone();
                Lab::in_ns(&ns, move || {
                    std::net::TcpStream::connect_timeout(
                        &addr.parse().unwrap(),
                        Duration::from_millis(200),
                    )
                    .is_ok()
                })
            },
            Duration::from_secs(if crate::need::in_vm() { 60 } else { 10 }),
        );
        Self { server }
    }

    /// nginx's own error log (empty when all went well).
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.server.dir().join("error.log")).unwrap_or_default()
    }
}

/// What one wrk run reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WrkRun {
    /// Requests answered.
    pub requests: u64,
    /// The run's length as wrk measured it.
    pub secs: f64,
    /// Socket errors: connect, read, write, timeout.
    pub errors: [u64; 4],
    /// Responses other than 2xx or 3xx.
    pub non_2xx: u64,
}

impl WrkRun {
    pub fn rate(&self) -> f64 {
        self.requests as f64 / self.secs
    }
}

/// wrk from the client namespace against `http://lab.ip_srv:port/`:
/// `connections` connections on one thread for `secs` seconds, each
/// request with `Connection: close`, so every request is a new TCP
/// connection (a connection-rate limit's real client).
pub fn wrk_closing(lab: &Lab, port: u16, connections: u32, secs: u32) -> WrkRun {
    let url = format!("http://{}:{port}/", lab.ip_srv);
    let out = Command::new("ip")
        .args(["netns", "exec", &lab.ns_cli, "wrk", "-t1"])
        .arg(format!("-c{connections}"))
        .arg(format!("-d{secs}s"))
        .args(["--timeout", "10s", "-H", "Connection: close", &url])
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "wrk: {text}{}", String::from_utf8_lossy(&out.stderr));
    parse_wrk(&text).unwrap_or_else(|| panic!("wrk's summary not understood:\n{text}"))
}

/// Reads wrk 4's summary: "N requests in 10.00s, ...", the optional
/// "Socket errors: connect A, read B, write C, timeout D" and
/// "Non-2xx or 3xx responses: N".
pub fn parse_wrk(text: &str) -> Option<WrkRun> {
    let mut run = None;
    let mut errors = [0; 4];
    let mut non_2xx = 0;
    for line in text.lines().map(str::trim) {
        if let Some((n, rest)) = line.split_once(" requests in ") {
            let dur = rest.split(',').next()?.trim();
            run = Some((n.trim().parse().ok()?, duration_secs(dur)?));
        } else if let Some(rest) = line.strip_prefix("Socket errors:") {
            for (slot, part) in errors.iter_mut().zip(rest.split(',')) {
                *slot = part.split_whitespace().nth(1)?.parse().ok()?;
            }
        } else if let Some(rest) = line.strip_prefix("Non-2xx or 3xx responses:") {
            non_2xx = rest.trim().parse().ok()?;
        }
    }
    let (requests, secs) = run?;
    Some(WrkRun { requests, secs, errors, non_2xx })
}

/// wrk's durations: "850.00ms", "10.00s", "1.00m".
fn duration_secs(s: &str) -> Option<f64> {
    let (num, scale) = if let Some(v) = s.strip_suffix("ms") {
        (v, 1e-3)
    } else if let Some(v) = s.strip_suffix("us") {
        (v, 1e-6)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('m') {
        (v, 60.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|v| v * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrk_summaries() {
        let text = "Running 15s test @ http://10.201.241.1:7500/\n  1 threads and 50 connections\n  Thread Stats   Avg      Stdev     Max   +/- Stdev\n    Latency     1.02s   410.12ms   3.01s    70.00%\n    Req/Sec    52.10     20.33   101.00     68.00%\n  702 requests in 15.02s, 110.44KB read\n  Socket errors: connect 0, read 3, write 0, timeout 7\nRequests/sec:     46.74\nTransfer/sec:      7.35KB\n";
        let r = parse_wrk(text).unwrap();
        assert_eq!(r, WrkRun { requests: 702, secs: 15.02, errors: [0, 3, 0, 7], non_2xx: 0 });
        assert!((r.rate() - 46.74).abs() < 0.01);
        let short = "  12 requests in 850.00ms, 1.0KB read\n  Non-2xx or 3xx responses: 2\n";
        assert_eq!(
            parse_wrk(short),
            Some(WrkRun { requests: 12, secs: 0.85, errors: [0; 4], non_2xx: 2 })
        );
        assert_eq!(parse_wrk("nothing here"), None);
    }
}
