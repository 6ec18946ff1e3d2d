//! `flowctl status --fleet etcd://...`: the newest profile under a prefix
//! and each live agent's report against it (a report lives as long as its
//! agent keeps the lease alive).

use crate::fleet::etcd::{
    access::{request, Access},
    url::EtcdUrl,
    version::{Mirror, Version},
    watch::Report,
};
use anyhow::Result;
use etcd_client::GetOptions;
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Rollout {
    pub source: String,
    /// The store's revision when read.
    pub revision: i64,
    pub latest: Option<Version>,
    pub latest_hash: Option<String>,
    /// Why there is no latest profile.
    pub latest_error: Option<String>,
    pub agents: Vec<AgentRow>,
}

#[derive(Debug, Serialize)]
pub struct AgentRow {
    pub agent: String,
    pub applied: Option<Version>,
    pub profile_hash: Option<String>,
    pub state: AgentState,
    pub error: Option<String>,
    pub from_disk_copy: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentState {
    /// Enforces the newest profile.
    Current,
    /// Enforces an older one (still applying it, or it rejected newer).
    Behind,
    /// Its report does not parse.
    Unknown,
}

impl Rollout {
    /// Every agent current.
    pub fn complete(&self) -> bool {
        self.latest.is_some()
            && !self.agents.is_empty()
            && self.agents.iter().all(|a| a.state == AgentState::Current)
    }
}

/// An agent's state against the newest version and its hash.
pub fn assess(latest: Option<(Version, &str)>, r: &Report) -> AgentState {
    let applied = r.applied_generation.zip(r.applied_revision);
    match (latest, applied) {
        (Some((v, hash)), Some((g, rev)))
            if v == (Version { generation: g, revision: rev })
                && r.profile_hash.as_deref() == Some(hash) =>
        {
            AgentState::Current
        }
        _ => AgentState::Behind,
    }
}

pub async fn read(url: &EtcdUrl, access: &Access) -> Result<Rollout> {
    let mut client = access.connect(url).await?;
    let get = client.get(url.key(""), Some(GetOptions::new().with_prefix()));
    let resp = request(url, access, "reading the prefix", get).await?;
    let kvs = resp
        .kvs()
        .iter()
        .filter_map(|kv| Some((kv.key_str().ok()?, kv.value(), kv.mod_revision())));
    let mirror = Mirror::from_get(&url.profile_key(), &url.generation_key(), kvs);
    let latest = mirror.candidate(&url.label(&url.profile_key()));
    let (version, hash) = match &latest {
        Ok(c) => (Some(c.version), Some(c.hash.clone())),
        Err(_) => (None, None),
    };
    let agents_prefix = url.agents_prefix();
    let mut agents = Vec::new();
    for kv in resp.kvs() {
        let Ok(key) = kv.key_str() else { continue };
        let Some(name) = key.strip_prefix(&agents_prefix) else { continue };
        let row = match serde_json::from_slice::<Report>(kv.value()) {
            Ok(r) => AgentRow {
                agent: name.to_string(),
                applied: r
                    .applied_generation
                    .zip(r.applied_revision)
                    .map(|(generation, revision)| Version { generation, revision }),
                state: assess(version.zip(hash.as_deref()), &r),
                profile_hash: r.profile_hash,
                error: r.error,
                from_disk_copy: r.from_disk_copy,
            },
            Err(e) => AgentRow {
                agent: name.to_string(),
                applied: None,
                profile_hash: None,
                state: AgentState::Unknown,
                error: Some(format!("unreadable report: {e}")),
                from_disk_copy: false,
            },
        };
        agents.push(row);
    }
    agents.sort_by(|a, b| a.agent.cmp(&b.agent));
    Ok(Rollout {
        source: url.to_string(),
        revision: resp.header().map(|h| h.revision()).unwrap_or(0),
        latest: version,
        latest_hash: hash,
        latest_error: latest.err(),
        agents,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_is_current_only_with_the_newest_version_and_its_hash() {
        let v = Version { generation: 3, revision: 20 };
        let r = |g, rev, h: &str| Report {
            applied_generation: Some(g),
            applied_revision: Some(rev),
            profile_hash: Some(h.into()),
            ..Default::default()
        };
        assert_eq!(assess(Some((v, "abc")), &r(3, 20, "abc")), AgentState::Current);
        assert_eq!(assess(Some((v, "abc")), &r(2, 12, "old")), AgentState::Behind);
        assert_eq!(assess(Some((v, "abc")), &r(3, 20, "other")), AgentState::Behind);
        assert_eq!(assess(None, &r(3, 20, "abc")), AgentState::Behind);
        assert_eq!(assess(Some((v, "abc")), &Report::default()), AgentState::Behind);
    }
}
