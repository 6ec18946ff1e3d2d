//! `top --keys`: about one in `key_sample_every` matched packets' keys, sent
//! to the `FLOWCTL_KEY_SAMPLES` ring buffer for the agent while it asks.

use crate::maps::{packet, FLOWCTL_GLOBAL, FLOWCTL_KEY_SAMPLES, FLOWCTL_RULES};
use flowctl_common::{keys::bucket_key, KeySample};

/// Sends about one in `every` matched packets' keys to the sampling ring
/// (`top --keys`); called only while sampling is on. A global function,
/// verified once on its own, taking scalars only and reading the headers
/// from `FLOWCTL_PACKET` (headers passed by pointer from the decision kept
/// every field live to the end of every path there, which stopped the
/// verifier's state pruning and nearly tripled its work).
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_sample_key(rule_at: u32, record: u32, code: u32) -> u32 {
    let Some(global) = FLOWCTL_GLOBAL.get(0) else { return 0 };
    let every = global.key_sample_every;
    let r = unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() };
    if r.checked_rem(every).unwrap_or(1) != 0 {
        return 0;
    }
    let Some(rule) = FLOWCTL_RULES.get(rule_at) else { return 0 };
    let Some(meta) = packet() else { return 0 };
    let dropped = (code != 0) as u32;
    if let Some(mut entry) = FLOWCTL_KEY_SAMPLES.reserve::<KeySample>(0) {
        let s = entry.as_mut_ptr();
        unsafe {
            (*s).record = record;
            (*s).len = meta.len;
            (*s).dropped = dropped;
            (*s).key = bucket_key(meta, rule);
        }
        entry.submit(0);
        return 1;
    }
    0
}
