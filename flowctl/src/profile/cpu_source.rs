//! `settings.cpu_source`: where the CPU signal (`crate::controllers::cpu`)
//! reads usage from.
use std::path::PathBuf;

/// Which source a signal comes from, as the profile names it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CpuSource {
    Host,
    Cgroup(String),
    File(PathBuf),
}

impl CpuSource {
    /// `host`, `cgroup:/path` or `file:/path`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "host" {
            return Ok(Self::Host);
        }
        if let Some(p) = s.strip_prefix("cgroup:") {
            if p.is_empty() || !p.starts_with('/') {
                return Err(format!("`{s}`: the cgroup path starts with / and is relative to the cgroup mount, e.g. \"cgroup:/system.slice/nginx.service\""));
            }
            return Ok(Self::Cgroup(p.to_string()));
        }
        if let Some(p) = s.strip_prefix("file:") {
            if p.is_empty() {
                return Err(format!("`{s}`: name the file, e.g. \"file:/run/cpu\""));
            }
            return Ok(Self::File(PathBuf::from(p)));
        }
        Err(format!("unknown cpu source `{s}`: use \"host\", \"cgroup:/path\" or \"file:/path\""))
    }

    /// The code kept in the agent record (`flowctl_common::AgentRecord`).
    pub fn code(&self) -> u32 {
        match self {
            Self::Host => 1,
            Self::Cgroup(_) => 2,
            Self::File(_) => 3,
        }
    }

    pub fn name_of(code: u32) -> &'static str {
        match code {
            1 => "host",
            2 => "cgroup",
            3 => "file",
            _ => "none",
        }
    }
}
