//! The command line: one module per verb, `top`, and the text they print
//! (`format`).

pub mod apply;
pub mod check;
pub mod detach;
pub mod doctor;
pub mod explain;
pub mod format;
pub mod generate;
pub mod list;
pub mod publish;
pub mod rollout;
pub mod simulate;
pub mod status;
pub mod top;

use crate::dataplane::pins::AttachId;
use anyhow::Result;

/// Enters `--netns NAME` first, when given.
pub fn enter(netns: &Option<String>) -> Result<()> {
    if let Some(ns) = netns {
        crate::system::netns::enter_netns(ns)?;
    }
    Ok(())
}

/// Which attachments a reading verb (`status`, `top`, `top --keys`) shows:
/// every one; those of `--netns NAME`; or one interface, named there as
/// `attach`, `apply` and `detach` name it (the namespace entered, the
/// interface's attachment id looked up in it). An interface without
/// `--netns` matches by name in any namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Only {
    /// The namespace's inode (`--netns`).
    netns_ino: Option<u64>,
    /// The attachment of the interface in that namespace.
    id: Option<AttachId>,
    iface: Option<String>,
}

impl Only {
    /// Every attachment.
    pub fn all() -> Self {
        Self::default()
    }

    /// Enters `netns` (when given) and resolves `iface` in it.
    pub fn resolve(iface: Option<&str>, netns: &Option<String>) -> Result<Self> {
        let iface = iface.map(str::to_string);
        if netns.is_none() {
            return Ok(Self { iface, ..Self::default() });
        }
        enter(netns)?;
        let netns_ino = Some(crate::system::netns::current_netns_ino()?);
        let id = iface.as_deref().map(AttachId::of).transpose()?;
        Ok(Self { netns_ino, id, iface })
    }

    /// Whether the attachment `id`, of interface `iface`, is shown.
    pub fn shows(&self, id: &AttachId, iface: &str) -> bool {
        if let Some(want) = &self.id {
            return want == id;
        }
        self.netns_ino.is_none_or(|n| n == id.netns_ino)
            && self.iface.as_deref().is_none_or(|i| i == iface)
    }

    /// Every attachment, nothing narrower (cgroups' breakers, which belong
    /// to no interface and no namespace, are shown only then).
    pub fn is_all(&self) -> bool {
        *self == Self::default()
    }

    /// The interface asked for, if one was.
    pub fn iface(&self) -> Option<&str> {
        self.iface.as_deref()
    }

    /// " on IFACE", " in netns NAME": what was asked for, for messages.
    pub fn describe(&self, netns: &Option<String>) -> String {
        let mut s = String::new();
        if let Some(i) = &self.iface {
            s.push_str(&format!(" on {i}"));
        }
        if let Some(n) = netns {
            s.push_str(&format!(" in netns {n}"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_narrows_by_namespace_interface_or_both() {
        let a = AttachId { netns_ino: 10, ifindex: 2 };
        let b = AttachId { netns_ino: 11, ifindex: 2 };
        assert!(Only::all().shows(&a, "veth0") && Only::all().is_all());
        let by_name = Only::resolve(Some("veth0"), &None).unwrap();
        assert!(by_name.shows(&a, "veth0") && by_name.shows(&b, "veth0"));
        assert!(!by_name.shows(&a, "veth1") && !by_name.is_all());
        let ns = Only { netns_ino: Some(10), ..Only::default() };
        assert!(ns.shows(&a, "veth0") && ns.shows(&a, "lo") && !ns.shows(&b, "veth0"));
        let one = Only { netns_ino: Some(11), id: Some(b), iface: Some("veth0".into()) };
        assert!(one.shows(&b, "veth0") && !one.shows(&a, "veth0"));
        assert_eq!(one.describe(&Some("lab".into())), " on veth0 in netns lab");
        assert_eq!(Only::all().describe(&None), "");
    }
}
