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

/// A `[[list]]` as applied: what `status` shows of it (the prefixes are in
/// the kernel's trie; the profile's copy in the run directory names only
/// the file).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListState {
    pub name: String,
    pub prefixes: u64,
    /// Where it was read from; `None` when inline.
    pub file: Option<String>,
    /// The rules that name it.
    pub rules: Vec<String>,
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
    /// The applied profile's lists.
    #[serde(default)]
    pub lists: Vec<ListState>,
}

fn default_conn_entries() -> u32 {
    flowctl_common::DEFAULT_CONN_ENTRIES
}

fn default_quota_entries() -> u32 {
    flowctl_common::DEFAULT_QUOTA_ENTRIES
}

impl AttachState {
    /// A new attachment's state, nothing applied yet: the table shapes of
    /// `settings`, which the program is loaded with.
    pub fn fresh(
        id: AttachId,
        iface: &str,
        netns: Option<String>,
        mode: String,
        settings: &crate::profile::Settings,
        attached_at_unix: u64,
    ) -> Self {
        Self {
            layout_version: flowctl_common::LAYOUT_VERSION,
            iface: iface.to_string(),
            netns,
            id,
            mode,
            profile_path: String::new(),
            rules: Vec::new(),
            next_state_id: 0,
            attached_at_unix,
            key_table_entries: settings.key_table_entries,
            source_cache_entries: settings.source_cache_entries,
            quota_table_entries: settings.quota_table_entries,
            stats: settings.stats,
            connection_table_entries: settings.connection_table_entries,
            lists: Vec::new(),
        }
    }

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
