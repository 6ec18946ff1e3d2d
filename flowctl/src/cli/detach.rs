//! `flowctl detach IFACE`: idempotent; what a killed agent left goes too.

use crate::{
    agent::preflight::require_root,
    cli::enter,
    dataplane::{
        self,
        pins::{self, AttachId},
    },
};
use anyhow::Result;

pub fn detach(iface: &str, netns: &Option<String>) -> Result<()> {
    require_root()?;
    enter(netns)?;
    let id = AttachId::of(iface)?;
    if pins::agent_running(&id) {
        eprintln!("note: an agent is running for {iface}; it will exit when it notices (or stop it with Ctrl-C)");
    }
    // Egress filters a killed agent left (kernels without TCX) go too.
    drop(dataplane::Egress::for_attachment(&id));
    if dataplane::detach(&id)? {
        out!("detached from {iface}");
    } else {
        out!("nothing attached to {iface}");
    }
    Ok(())
}
