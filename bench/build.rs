//! Builds the reference programs for the BPF target (see flowctl/build.rs).
fn main() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/ebpf");
    let package =
        aya_build::Package { name: "flowctl-bench-ebpf", root_dir: root, ..Default::default() };
    if let Err(e) = aya_build::build_ebpf([package], aya_build::Toolchain::default()) {
        panic!("building the bench XDP object failed: {e:#}\nhint: run `cargo xtask setup`");
    }
}
