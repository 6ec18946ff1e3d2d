//! Stage 1: the admission ratio a rule's control record holds (set by the
//! agent's control loops, KLimiter's, or a fixed `admission_ratio`; see
//! docs/design.md, "Control records"), applied to new TCP connections and
//! to every UDP or other packet: an established TCP connection is never cut
//! by a ratio. Open while the agent is not alive.

use super::agent_alive;
use crate::maps::FLOWCTL_CONTROL;
use flowctl_common::{control_flags, tcp_flags, ControlRecord, GlobalRecord, PacketMeta};

/// Whether the ratio refuses this packet of `record`'s rule.
#[inline(always)]
pub fn refuses(global: &GlobalRecord, meta: &PacketMeta, record: u32, now: u64) -> bool {
    if let Some(ctl) = FLOWCTL_CONTROL.get(record) {
        if ctl.flags & control_flags::ADMISSION_ACTIVE != 0
            && (meta.proto != 6
                || meta.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN)
            && agent_alive(global, now)
            && !admitted_by_ratio(global, meta, ctl)
        {
            return true;
        }
    }
    false
}

/// Whether the ratio lets this packet in: per flow (a seeded hash of the
/// 5-tuple, so a flow is wholly in or out) or per packet (a random draw).
#[inline(always)]
fn admitted_by_ratio(global: &GlobalRecord, meta: &PacketMeta, ctl: &ControlRecord) -> bool {
    if ctl.admission_ppm >= 1_000_000 {
        return true;
    }
    let h = if ctl.flags & control_flags::ADMISSION_PER_FLOW != 0 {
        flow_hash(global.hash_seed, meta)
    } else {
        unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() as u64 }
    };
    // Scale 32 hash bits to [0, 1e6) by multiply-shift (no 128-bit modulo in BPF).
    ((h & 0xffff_ffff) * 1_000_000) >> 32 < ctl.admission_ppm as u64
}

/// A seeded mix of the 5-tuple (splitmix64 finaliser per word).
#[inline(always)]
fn flow_hash(seed: u64, m: &PacketMeta) -> u64 {
    let mut h = seed;
    let words = [
        m.src[0] as u64 | (m.src[1] as u64) << 32,
        m.src[2] as u64 | (m.src[3] as u64) << 32,
        m.dst[0] as u64 | (m.dst[1] as u64) << 32,
        m.dst[2] as u64 | (m.dst[3] as u64) << 32,
        m.sport as u64 | (m.dport as u64) << 16 | (m.proto as u64) << 32,
    ];
    let mut i = 0;
    while i < words.len() {
        h ^= words[i];
        h = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
        i += 1;
    }
    h
}
