//! `flowctl status --fleet etcd://.../PREFIX`: the rollout of a profile
//! across the agents that follow it (`fleet::etcd::rollout`). True when
//! every agent enforces the newest profile.

use crate::fleet::etcd::{rollout, Access, EtcdUrl};
use anyhow::Result;

pub fn show(url: &str, access: Access, json: bool) -> Result<bool> {
    let url: EtcdUrl = url.parse()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let r = rt.block_on(rollout::read(&url, &access))?;
    if json {
        out!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(r.complete());
    }
    match (&r.latest, &r.latest_hash) {
        (Some(v), Some(h)) => {
            out!("{}: newest profile {v}, hash {h} (store at revision {})", r.source, r.revision)
        }
        _ => out!("{}: {}", r.source, r.latest_error.as_deref().unwrap_or("no profile")),
    }
    if r.agents.is_empty() {
        out!("  no agent reports (agents report under {} while they run)", url.agents_prefix());
    } else {
        out!("  {:<36} {:>10} {:>9} {:<16} state", "agent", "generation", "revision", "hash");
    }
    let current = r.agents.iter().filter(|a| a.state == rollout::AgentState::Current).count();
    for a in &r.agents {
        let (g, rev) = a
            .applied
            .map(|v| (v.generation.to_string(), v.revision.to_string()))
            .unwrap_or_default();
        let mut state = format!("{:?}", a.state).to_lowercase();
        if a.from_disk_copy {
            state.push_str(" (from its disk copy)");
        }
        out!(
            "  {:<36} {:>10} {:>9} {:<16} {state}",
            a.agent,
            g,
            rev,
            a.profile_hash.as_deref().unwrap_or("-")
        );
        if let Some(e) = &a.error {
            out!("    error: {e}");
        }
    }
    if !r.agents.is_empty() {
        out!("  {current} of {} agents current", r.agents.len());
    }
    Ok(r.complete())
}

/// What `flowctl status` prints of an agent that follows etcd.
pub fn agent_lines(p: &crate::fleet::etcd::follower::Published) -> Vec<String> {
    use crate::fleet::etcd::watch::Store;
    let applied = p.applied.map(|v| v.to_string()).unwrap_or_else(|| "nothing".into());
    let mut v = vec![format!(
        "etcd {}: applied {applied}, profile {}{}",
        p.source,
        p.profile_hash.as_deref().unwrap_or("-"),
        if p.from_disk_copy { " (from the disk copy)" } else { "" }
    )];
    if let Some(l) = p.latest.filter(|l| Some(*l) != p.applied) {
        v.push(format!("  newest in etcd: {l}"));
    }
    v.push(match &p.store {
        Store::Connecting => "  store: connecting".to_string(),
        Store::Watching { .. } => "  store: watching".to_string(),
        Store::Unreachable { error, .. } => {
            format!("  store: unreachable ({error}); the last good profile keeps enforcing")
        }
    });
    if let Some(e) = &p.error {
        v.push(format!("  error: {e}"));
    }
    v
}
