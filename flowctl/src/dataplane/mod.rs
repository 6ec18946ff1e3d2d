//! The pinned XDP data plane of an interface: everything user space writes
//! into or reads out of the kernel's maps, and the program's life (load or
//! adopt, attach, detach).
//!
//! Where a packet's rule gets written (the kernel reads these in this
//! order, docs/design.md "Data path"):
//!
//! - `apply` (apply.rs) compiles a profile's rules into the inactive slot:
//!   each rule's `RuleConfig` (`FLOWCTL_RULES`), the protocol, port and
//!   source-prefix bitmaps the classifier ANDs (`FLOWCTL_PROTO_BITS`,
//!   `FLOWCTL_PORT_BITS`, `FLOWCTL_RULE_SETS`, `FLOWCTL_SRC_TRIE`,
//!   `FLOWCTL_SRC_CLASSES`), zeroes the counters, debts, statistics and
//!   open-connection rings of records new to the set, then flips
//!   `GlobalRecord::active_slot` and bumps the generation.
//! - The rule's control record (`FLOWCTL_CONTROL`, read by the admission
//!   and BBR stages) changes through `Maps::update_control` (control.rs)
//!   only: `apply`'s fixed ratios, KLimiter's ratios and BBR's decision
//!   from the agent's loops.
//! - `heartbeat` stamps `GlobalRecord::heartbeat_ns`; past the grace period
//!   the adaptive stages fail open.
//!
//! The modules: `load` (the object and its XDP variant), `attach` (the
//! pinned link, detach and their errors), `multiprog` (the program as a
//! libxdp dispatcher's component instead of on its own link), `mode` (the
//! XDP mode both ask for), `maps` (the pinned maps opened
//! by path, typed reads), `apply` (rule sets), `control` (the control
//! records' write path), `egress` (KLimiter's TC egress counter),
//! `samples` (the `top --keys` ring), `kernel_log` (the program's kernel
//! events relayed into the log), `global_keys` (global rules' buckets,
//! grants and hot keys), `inspect` (what pins say without
//! `Maps`: layout, sizes, entries, kernel memory); `pins` and `state` say
//! where an attachment lives and what is recorded about it, `object`
//! embeds the programs.

mod apply;
mod attach;
pub mod batch;
mod control;
mod egress;
mod global_keys;
mod inspect;
mod kernel_log;
mod lease_filter;
mod load;
mod maps;
mod mode;
pub mod multiprog;
pub mod object;
pub mod own_tables;
pub mod pins;
mod samples;
pub mod state;

pub use apply::{apply, plan_states};
pub use attach::{attach, detach, replace_keeping_link, SeveredLink};
pub use egress::{set_egress, set_shapers, write_shapers, Egress};
pub use global_keys::GlobalKeys;
pub use inspect::{count_entries, map_memlock, pinned_layout, pinned_max_entries, pinned_memlock};
pub use kernel_log::KernelLog;
pub use load::{load, load_error, load_variant, loaded_xdp, XdpVariant};
pub use maps::{heartbeat, Maps};
pub use mode::Mode;
pub use samples::KeySamples;
