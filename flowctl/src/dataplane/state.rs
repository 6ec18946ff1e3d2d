//! What is recorded about an attachment in its run directory (`state.json`):
//! each rule's persistent identity across applies and the shapes of the tables
//! the program was loaded with, so a restarted agent adopts the same maps.
use super::pins::{run_file, AttachId};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::{fs, path::PathBuf};

/// One rule's persistent identity across applies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleState {
    pub name: String,
    pub fingerprint: String,
    pub state_id: u32,
    pub record: u32,
}

/// What the agent (or an agent-less apply) records about an attachment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachState {
    pub layout_version: u32,
    pub iface: String,
    pub netns: Option<String>,
    pub id: AttachId,
    /// "native" or "generic".
    pub mode: String,
    pub profile_path: String,
    pub rules: Vec<RuleState>,
    pub next_state_id: u32,
    pub attached_at_unix: u64,
    pub key_table_entries: u32,
    pub source_cache_entries: u32,
    /// Absent in state written before quotas existed: the default then.
    #[serde(default = "default_quota_entries")]
    pub quota_table_entries: u32,
    /// Shape of the statistics rings the program was loaded with.
    #[serde(default)]
    pub stats: crate::profile::StatsSettings,
    #[serde(default = "default_conn_entries")]
    pub connection_table_entries: u32,
}

fn default_conn_entries() -> u32 {
    flowctl_common::DEFAULT_CONN_ENTRIES
}

fn default_quota_entries() -> u32 {
    flowctl_common::DEFAULT_QUOTA_ENTRIES
}

impl AttachState {
    pub fn path(id: &AttachId) -> PathBuf {
        id.run_dir().join(run_file::STATE)
    }

    pub fn load(id: &AttachId) -> Result<Option<Self>> {
        let p = Self::path(id);
        match fs::read(&p) {
            Ok(b) => Ok(Some(
                serde_json::from_slice(&b).with_context(|| format!("parsing {}", p.display()))?,
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }

    /// Written to a temporary file and renamed, so readers never see half.
    pub fn save(&self) -> Result<()> {
        let dir = self.id.run_dir();
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let tmp = dir.join(format!("{}.tmp", run_file::STATE));
        fs::write(&tmp, serde_json::to_vec_pretty(self)?)?;
        fs::rename(&tmp, Self::path(&self.id))?;
        Ok(())
    }

    /// After a rule set was applied: remembers its file (for `status`) and
    /// keeps a copy of it (for `top`, `explain` and a restarted agent), then
    /// saves the state.
    pub fn record_profile(&mut self, path: &std::path::Path) -> Result<()> {
        let abs = fs::canonicalize(path).unwrap_or(path.to_path_buf());
        self.profile_path = abs.display().to_string();
        fs::create_dir_all(self.id.run_dir())?;
        fs::copy(path, self.id.run_dir().join(run_file::PROFILE))
            .context("saving the active profile")?;
        self.save()
    }
}
