//! Stage 2: BBR (Kratos' limiter, algorithms.md section 4; docs/design.md,
//! "BBR at L4") on a BBR rule's new connections. The agent publishes in
//! the rule's control record whether the service is overloaded, the
//! connections in flight at its last tick and maxInFlight; the kernel adds
//! the SYNs it admitted since (`ControlRecord::bbr_admitted`, taken back
//! off by `conntrack` as connections complete). A SYN this stage admits is
//! counted there at once, even when the quota or the bucket then refuses
//! it: the count runs high by such SYNs until the agent's next write
//! replaces it (a stricter test, never a looser one).

use crate::maps::FLOWCTL_CONTROL;
use core::intrinsics::AtomicOrdering;
use flowctl_common::control_flags;

/// Kratos' test for one new connection: refuse while the agent says the
/// rule is overloaded and more than max(1, maxInFlight) connections are in
/// flight: the agent's last sum plus the SYNs admitted since. Open (0) when
/// the agent is not alive.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_bbr_refuses(record: u32, alive: u32) -> u32 {
    let Some(ctl) = FLOWCTL_CONTROL.get_ptr_mut(record) else { return 0 };
    let ctl = unsafe { &mut *ctl };
    if alive == 0 || ctl.flags & control_flags::BBR_ACTIVE == 0 {
        return 0;
    }
    if ctl.bbr_overloaded != 0 {
        // The agent's last sum, plus SYNs admitted since, minus connections
        // completed since (a signed count; see `ControlRecord::bbr_admitted`).
        let delta = unsafe { core::ptr::read_volatile(&ctl.bbr_admitted) } as i32 as i64;
        let in_flight = ctl.bbr_inflight as i64 + delta;
        if in_flight > 1 && in_flight > ctl.bbr_max_inflight as i64 {
            return 1;
        }
    }
    // Admitted (if the later stages agree): counted until the agent's next
    // tick sums the connections itself.
    unsafe {
        core::intrinsics::atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(
            &mut ctl.bbr_admitted,
            1,
        )
    };
    0
}
