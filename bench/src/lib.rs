//! The reference XDP programs (bench/ebpf/src/main.rs), embedded.

pub fn bench_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/flowctl-bench-xdp"))
}
