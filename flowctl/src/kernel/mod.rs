//! What the running kernel can do (`features`), probed once per process,
//! and the rtnetlink requests aya does not make (`rtnl`, the socket; `tc`:
//! the `clsact` qdisc flowctl added, the filters on it, the shaper's root
//! `fq`; `xdp`: the program an interface runs, replaced only if unchanged).

pub mod features;
pub mod rtnl;
pub mod tc;
pub mod xdp;
