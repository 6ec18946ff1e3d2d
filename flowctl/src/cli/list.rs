//! `flowctl list update`: one list of the profile in force read again and
//! applied by the interface's agent (docs/lists.md).

use crate::{
    agent::{
        preflight::require_root,
        socket::{self, Request},
    },
    cli::enter,
    dataplane::{
        self,
        pins::{run_file, AttachId},
        state::AttachState,
        Maps,
    },
    profile,
};
use anyhow::{anyhow, bail, Context, Result};
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
    let req = Request::ListUpdate {
        name: name.to_string(),
        file: file.as_ref().map(|f| f.display().to_string()),
    };
    // A list of millions takes seconds to write, and updates queue.
    let wait = std::time::Duration::from_secs(300);
    match socket::call_within(&socket::socket_path(&id), &req, wait)? {
        Some(r) if r.ok => {
            out!("{}", r.message);
            Ok(())
        }
        Some(r) => bail!("{}", r.message),
        None => agentless(&id, iface, name, file.as_deref()),
    }
}

/// No agent: into the kept data plane directly, holding the lock so an
/// agent cannot start halfway. The profile is the one applied (its copy in
/// the run directory, read as from where it was applied, so its relative
/// list paths resolve as they did; its other lists are read again too).
fn agentless(id: &AttachId, iface: &str, name: &str, file: Option<&Path>) -> Result<()> {
    let _lock = super::apply::agentless_lock(id, iface)?;
    let Some(mut state) = AttachState::load(id)? else {
        bail!("nothing is attached to {iface}: use `flowctl attach {iface} --profile PROFILE`");
    };
    let copy = id.run_dir().join(run_file::PROFILE);
    let text = std::fs::read_to_string(&copy)
        .with_context(|| format!("reading the applied profile's copy {}", copy.display()))?;
    let set = match file {
        Some(_) => profile::parse_for_list_update(&state.profile_path, &text, name)?,
        None => profile::parse(&state.profile_path, &text)?,
    };
    let set = profile::list::replace(&set, name, file)
        .map_err(|e| anyhow!("{e} (nothing was applied)"))?;
    crate::agent::preflight::attachment(&state, &set)?;
    let mut maps = Maps::open(id)?;
    dataplane::apply(&mut maps, &mut state, &set)?;
    state.save()?;
    let n =
        set.lists.iter().find(|l| l.prefixes.name == name).map_or(0, |l| l.prefixes.prefixes.len());
    out!(
        "list `{name}`: {n} prefixes, applied to the kept data plane on {iface} (no agent running)"
    );
    Ok(())
}
