//! The agent's control socket protocol: one JSON request line, one JSON
//! response line, over `/run/flowctl/<id>/agent.sock`.

use crate::dataplane::pins::{run_file, AttachId};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::PathBuf,
    time::Duration,
};

#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    Apply {
        profile: String,
    },
    /// `flowctl list update`: list `name` read again, from `file` (an
    /// absolute path) or else the file the profile names, and applied.
    ListUpdate {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        file: Option<String>,
    },
    /// The heaviest keys of a rule (`top --keys`); starts key sampling,
    /// which stops again when nobody has asked for 10 s.
    Keys {
        rule: String,
        top: usize,
    },
}

#[derive(Serialize, Deserialize, Debug)]
pub struct Response {
    pub ok: bool,
    pub message: String,
    /// A structured answer, when the request has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

impl Response {
    pub fn ok(m: impl Into<String>) -> Self {
        Self { ok: true, message: m.into(), data: None }
    }
    pub fn err(m: impl Into<String>) -> Self {
        Self { ok: false, message: m.into(), data: None }
    }
}

pub fn socket_path(id: &AttachId) -> PathBuf {
    id.run_dir().join(run_file::SOCKET)
}

/// Sends a request to the running agent; `Ok(None)` when no agent listens.
pub fn call(id: &AttachId, req: &Request) -> Result<Option<Response>> {
    call_at(&socket_path(id), req)
}

/// The same, at a socket path (a cgroup attachment's).
pub fn call_at(sock: &std::path::Path, req: &Request) -> Result<Option<Response>> {
    call_within(sock, req, Duration::from_secs(30))
}

/// A call that may take longer than most: `wait` for the answer (a list
/// update of millions of prefixes, queued behind another).
pub fn call_within(
    sock: &std::path::Path,
    req: &Request,
    wait: Duration,
) -> Result<Option<Response>> {
    let Ok(mut s) = UnixStream::connect(sock) else { return Ok(None) };
    s.set_read_timeout(Some(wait))?;
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    let mut resp = String::new();
    BufReader::new(s).read_line(&mut resp).context("reading the agent's answer")?;
    Ok(Some(serde_json::from_str(&resp).context("parsing the agent's answer")?))
}
