//! The data path's compare-and-swap: sequentially consistent, of a u64 in
//! map memory (a bucket's TAT, a window's count, a flow's word), which the
//! BPF backend emits as `BPF_CMPXCHG` (Linux 5.12+). One spelling for the
//! seventeen places that take a token or move a state by it.

use core::intrinsics::{atomic_cxchg, AtomicOrdering};

/// Stores `new` at `ptr` if it holds `old`; returns what it held and whether
/// it stored.
///
/// # Safety
/// `ptr` points at a live, aligned u64 (a map value the program looked up).
#[inline(always)]
pub unsafe fn cxchg(ptr: *mut u64, old: u64, new: u64) -> (u64, bool) {
    unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(ptr, old, new)
    }
}
