//! Builds the XDP object with aya-build (nightly, -Z build-std=core,
//! bpf-linker) into OUT_DIR, where `src/object.rs` embeds it: `cargo build`
//! never runs a stale program. `cargo xtask setup` installs what this needs.
fn main() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../flowctl-ebpf");
    let package = aya_build::Package { name: "flowctl-ebpf", root_dir: root, ..Default::default() };
    if let Err(e) = aya_build::build_ebpf([package], aya_build::Toolchain::default()) {
        panic!(
            "building the XDP object failed: {e:#}\n\
             hint: run `cargo xtask setup` (installs the nightly's rust-src and bpf-linker 0.10.3)"
        );
    }
}
