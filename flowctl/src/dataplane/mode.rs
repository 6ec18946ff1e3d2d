//! The XDP mode an attachment asks for: what `attach` does on its own link
//! and `multiprog::join` does with a new dispatcher.

/// How to treat the interface's XDP mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Native (driver) mode, falling back to generic with a warning.
    Auto,
    Native,
    /// Generic (skb) mode.
    Skb,
}
