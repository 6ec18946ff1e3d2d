//! The command line: one module per verb, `top`, and the text they print
//! (`format`).

pub mod apply;
pub mod check;
pub mod detach;
pub mod doctor;
pub mod explain;
pub mod format;
pub mod publish;
pub mod rollout;
pub mod simulate;
pub mod status;
pub mod top;

use anyhow::Result;

/// Enters `--netns NAME` first, when given.
pub fn enter(netns: &Option<String>) -> Result<()> {
    if let Some(ns) = netns {
        crate::system::netns::enter_netns(ns)?;
    }
    Ok(())
}
