//! Types and pure integer algorithms shared by the XDP programs and user space.
//!
//! Everything here compiles for `bpfel-unknown-none` (no_std, no floats, no
//! allocation) and for the host, so the kernel and the tests run the same code.
//! The `user` feature adds what only user space needs: `aya::Pod` impls, rate
//! parsing and the profile-to-table compiler.
#![cfg_attr(target_arch = "bpf", no_std)]

/// Agent-side only (128-bit arithmetic the BPF target does not need).
#[cfg(not(target_arch = "bpf"))]
pub mod bbr;
pub mod booking;
pub mod breaker;
pub mod consts;
pub mod debt;
pub mod gcra;
pub mod grant;
pub mod keys;
pub mod matcher;
pub mod shaper;
pub mod sketch;
pub mod stats;
pub mod types;
pub mod warm;
pub mod window;

#[cfg(feature = "user")]
pub mod rate;
#[cfg(feature = "user")]
pub mod tables;

pub use consts::*;
pub use stats::StatsBucket;
pub use types::*;

/// The panic handler and license section every flowctl BPF object needs
/// (the verifier rejects a reachable panic, so the handler is never entered).
#[macro_export]
macro_rules! bpf_object_boilerplate {
    () => {
        #[cfg(not(test))]
        #[panic_handler]
        fn panic(_info: &core::panic::PanicInfo) -> ! {
            loop {}
        }

        /// GPL-compatible, so GPL-only helpers are available.
        #[link_section = "license"]
        #[no_mangle]
        static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
    };
}
