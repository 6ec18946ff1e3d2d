//! Link flags for the BPF objects (the nested aya-build build only).
//!
//! bpf-linker asks LLVM for `--bpf-expand-memcpy-in-order` unless told
//! not to. That option also sets LLVM's store budget for `memset` to zero,
//! so every zeroed struct (a map key, the parsed packet's entry) became a
//! call to a byte-at-a-time `memset` loop: 41 iterations per packet in the
//! parser alone, measured at ~14 ns/packet with `perf` (docs/benchmarks.md,
//! 1k). Without it, LLVM writes small `memset`s and `memcpy`s as plain
//! stores.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("bpf") {
        println!("cargo:rustc-link-arg-bins=--disable-expand-memcpy-in-order");
    }
}
