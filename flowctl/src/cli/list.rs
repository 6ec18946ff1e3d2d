//! `flowctl list update`: one list of the profile in force read again and
//! applied by the interface's agent (docs/lists.md).

use crate::{
    agent::{
        preflight::require_root,
        socket::{self, Request},
    },
    cli::enter,
    dataplane::pins::AttachId,
    profile,
};
use anyhow::{bail, Context, Result};
use std::path::Path;

pub fn update(iface: &str, name: &str, file: Option<&Path>, netns: &Option<String>) -> Result<()> {
    // A bad file is refused here, at its line, before the agent is asked
    // (which reads it again: the agent applies what it read itself).
    let file = match file {
        Some(f) => {
            profile::list::read_file(f, &format!("list `{name}`"))?;
            Some(std::fs::canonicalize(f).with_context(|| format!("resolving {}", f.display()))?)
        }
        None => None,
    };
    require_root()?;
    enter(netns)?;
    let id = AttachId::of(iface)?;
    let req =
        Request::ListUpdate { name: name.to_string(), file: file.map(|f| f.display().to_string()) };
    // A list of millions takes seconds to write, and updates queue.
    let wait = std::time::Duration::from_secs(300);
    match socket::call_within(&socket::socket_path(&id), &req, wait)? {
        Some(r) if r.ok => {
            out!("{}", r.message);
            Ok(())
        }
        Some(r) => bail!("{}", r.message),
        None => bail!(
            "no agent runs for {iface}: lists are updated by the agent (`flowctl attach {iface} --profile PROFILE`); without one, `flowctl apply {iface} PROFILE` applies the profile with every list file read again"
        ),
    }
}
