//! `flowctl apply`: a hot reload, all or nothing, through the running agent
//! or, with none, straight into a kept data plane.

use crate::{
    agent::{
        breakers::CgroupPoint,
        preflight::{self, require_root},
        socket::{self, Request},
    },
    cli::enter,
    dataplane::{
        self,
        pins::{self, AttachId},
        state::AttachState,
        Maps,
    },
    profile,
    system::lock::phase,
};
use anyhow::{bail, Result};
use std::path::Path;

pub fn apply(iface: &str, path: &Path, netns: &Option<String>) -> Result<()> {
    // Validate first: a bad profile is rejected whole, before anything is touched.
    let set = profile::load(path)?;
    require_root()?;
    preflight::kernel(&set, path)?;
    enter(netns)?;
    let id = AttachId::of(iface)?;
    let abs = std::fs::canonicalize(path)?;
    if let Some(resp) = socket::call(&id, &Request::Apply { profile: abs.display().to_string() })? {
        if resp.ok {
            out!("{}", resp.message);
            return Ok(());
        }
        bail!("{}", resp.message);
    }
    // No agent: apply to the kept data plane directly, holding the lock so an
    // agent cannot start halfway.
    preflight::agentless_apply(&set, path, iface)?;
    let _lock = agentless_lock(&id, iface)?;
    let Some(mut state) = AttachState::load(&id)? else {
        bail!(
            "nothing is attached to {iface}: use `flowctl attach {iface} --profile {}`",
            path.display()
        );
    };
    preflight::attachment(&state, &set)?;
    let mut maps = Maps::open(&id)?;
    dataplane::apply(&mut maps, &mut state, &set)?;
    state.record_profile(path)?;
    out!("applied {} rules to the kept data plane on {iface} (no agent running)", set.rules.len());
    Ok(())
}

/// The attachment's lock for a write without an agent (noted as
/// applying), waiting for an agent on its way out (or a detach, another
/// apply) to let it go.
pub(crate) fn agentless_lock(id: &AttachId, iface: &str) -> Result<crate::system::lock::FileLock> {
    let lock = match pins::lock_attachment(id)? {
        Some(l) => l,
        None => match pins::lock_holder(id) {
            Some(h) if phase::is_transient(&h.phase) => {
                crate::system::log::status(format_args!(
                    "waiting for the lock of {iface} ({h}) to be let go"
                ));
                let Some(l) = pins::wait_for_lock(id, crate::agent::STOP_WAIT)? else {
                    bail!("the lock of {iface} ({h}) was not let go in time; nothing was applied");
                };
                l
            }
            _ => bail!(
                "an agent holds the lock for {iface} but does not answer on its socket; try again"
            ),
        },
    };
    lock.note(phase::APPLYING);
    Ok(lock)
}

/// `apply --cgroup`: to the agent holding that cgroup's breakers (a
/// breakers-only agent, or an interface agent whose profile has breakers).
pub fn apply_cgroup(cgroup: &Path, path: &Path) -> Result<()> {
    profile::load(path)?;
    require_root()?;
    let point = CgroupPoint::resolve(Some(cgroup))?;
    let abs = std::fs::canonicalize(path)?;
    let sock = point.socket_path();
    match socket::call_at(&sock, &Request::Apply { profile: abs.display().to_string() })? {
        Some(resp) if resp.ok => {
            out!("{}", resp.message);
            Ok(())
        }
        Some(resp) => bail!("{}", resp.message),
        None => bail!(
            "no agent holds the breakers of cgroup {}: breakers live with their agent; start one with `flowctl attach --cgroup {} --profile {}`",
            point.path.display(),
            cgroup.display(),
            path.display()
        ),
    }
}
