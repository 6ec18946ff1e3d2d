//! `flowctl publish etcd://.../PREFIX FILE`: validate here, then one etcd
//! transaction for every agent of the prefix (`fleet::etcd::publish`).

use crate::{
    fleet::etcd::{publish, Access, EtcdUrl},
    profile,
};
use anyhow::{bail, Context, Result};
use std::path::Path;

pub fn publish(url: &str, path: &Path, access: Access) -> Result<()> {
    let url: EtcdUrl = url.parse()?;
    // The text validated is the text written: read once.
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the profile {}", path.display()))?;
    let set = profile::parse_for_fleet(&path.display().to_string(), &text)?;
    if set.rules.is_empty() {
        bail!("{}: the profile has no [[rule]]; agents follow etcd on an interface and would reject it (nothing was published)", path.display());
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let p = rt.block_on(publish::publish(&url, &access, &text))?;
    out!(
        "published {} to {}: generation {} at revision {} ({} rules, profile {})",
        path.display(),
        url,
        p.generation,
        p.revision,
        set.rules.len(),
        crate::fleet::etcd::version::profile_hash(&text)
    );
    Ok(())
}
