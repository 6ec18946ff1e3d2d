//! Builds the XDP object with aya-build (nightly, -Z build-std=core,
//! bpf-linker) into OUT_DIR, where `src/object.rs` embeds it: `cargo build`
//! never runs a stale program. `cargo xtask setup` installs what this needs.
fn main() {
    flowctl_build_support::build_ebpf(
        "flowctl-ebpf",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../flowctl-ebpf"),
        "run `cargo xtask setup` (installs the nightly's rust-src and bpf-linker 0.10.3)",
    );
}
