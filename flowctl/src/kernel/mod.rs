//! What the running kernel can do (`features`), probed once per process,
//! and the rtnetlink pieces aya does not have (`tc`: removing the `clsact`
//! qdisc flowctl added, counting the filters on it).

pub mod features;
pub mod tc;
