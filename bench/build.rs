//! Builds the reference programs for the BPF target (see flowctl/build.rs).
fn main() {
    flowctl_build_support::build_ebpf(
        "flowctl-bench-ebpf",
        concat!(env!("CARGO_MANIFEST_DIR"), "/ebpf"),
        "run `cargo xtask setup`",
    );
}
