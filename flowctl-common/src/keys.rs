//! Bucket-key construction: which bucket of a rule a packet spends from.

use crate::{key_kind, BucketKey, PacketMeta, RuleConfig};

/// Keep the top `len` bits of a host-order address (v4 in word 0).
#[inline(always)]
pub fn mask_prefix(addr: &[u32; 4], family: u8, len: u8) -> [u32; 4] {
    let mut out = [0u32; 4];
    let words = if family == 4 { 1 } else { 4 };
    let mut left = len as u32;
    let mut i = 0;
    while i < words {
        if left >= 32 {
            out[i] = addr[i];
            left -= 32;
        } else if left > 0 {
            out[i] = addr[i] & (u32::MAX << (32 - left));
            left = 0;
        }
        i += 1;
    }
    out
}

/// Whether host-order address `a` is in prefix `p`/`len` (IPv4 in word 0).
#[inline(always)]
pub fn in_prefix(a: &[u32; 4], p: &[u32; 4], len: u8, family: u8) -> bool {
    let words = if family == 4 { 1 } else { 4 };
    let mut left = len as u32;
    let mut i = 0;
    while i < words {
        let m = if left >= 32 {
            u32::MAX
        } else if left == 0 {
            0
        } else {
            u32::MAX << (32 - left)
        };
        if a[i] & m != p[i] & m {
            return false;
        }
        left = left.saturating_sub(32);
        i += 1;
    }
    true
}

/// The flow of `meta` (its 5-tuple) under the rule state `state_id`: the
/// key of a refused SYN's booking (`booking`), whatever the rule's key kind.
#[inline(always)]
pub fn flow_key(meta: &PacketMeta, state_id: u32) -> BucketKey {
    BucketKey {
        state_id,
        family: meta.family,
        proto: meta.proto,
        sport: meta.sport,
        dport: meta.dport,
        _pad: 0,
        src: meta.src,
        dst: meta.dst,
    }
}

/// The bucket key of `meta` under a source-keyed (`key_kind::SRC`) rule of
/// state `state_id`: [`bucket_key`]'s, without its branches on the kind
/// (the inline fast path of global rules, `stages::global::fast`).
#[inline(always)]
pub fn source_key(meta: &PacketMeta, state_id: u32) -> BucketKey {
    BucketKey {
        state_id,
        family: meta.family,
        proto: 0,
        sport: 0,
        dport: 0,
        _pad: 0,
        src: meta.src,
        dst: [0; 4],
    }
}

/// The bucket key of `meta` under `rule`. Fields the key kind does not use stay
/// zero, so all packets that share a bucket build the same key. Every field is
/// computed on its own (no `..Default::default()`): zero-filling a 44-byte
/// struct makes LLVM call memset, which the BPF verifier cannot load here.
#[inline(always)]
pub fn bucket_key(meta: &PacketMeta, rule: &RuleConfig) -> BucketKey {
    let kind = rule.key_kind;
    let by_src = matches!(
        kind,
        key_kind::SRC | key_kind::SRC_PREFIX | key_kind::SRC_DPORT | key_kind::FIVE_TUPLE
    );
    let five = kind == key_kind::FIVE_TUPLE;
    let src = match kind {
        key_kind::SRC | key_kind::SRC_DPORT | key_kind::FIVE_TUPLE => meta.src,
        key_kind::SRC_PREFIX => {
            let len = if meta.family == 4 { rule.prefix_v4 } else { rule.prefix_v6 };
            mask_prefix(&meta.src, meta.family, len)
        }
        _ => [0; 4],
    };
    BucketKey {
        state_id: rule.state_id,
        family: if by_src { meta.family } else { 0 },
        proto: if five { meta.proto } else { 0 },
        sport: if five { meta.sport } else { 0 },
        dport: if matches!(kind, key_kind::DPORT | key_kind::SRC_DPORT | key_kind::FIVE_TUPLE) {
            meta.dport
        } else {
            0
        },
        _pad: 0,
        src,
        dst: if five { meta.dst } else { [0; 4] },
    }
}

/// A seeded 64-bit hash of a bucket key: one multiply-xorshift fold per
/// 8-byte word of its fields. The lease filter (`grant::filter_slot`, fixed
/// seed) and the debt table (`debt::locate`, the load's random
/// `hash_seed`) index by it, in the kernel and in user space alike.
#[inline(always)]
pub fn key_hash(seed: u64, key: &BucketKey) -> u64 {
    let words = [
        key.state_id as u64 | (key.family as u64) << 32 | (key.proto as u64) << 40,
        key.sport as u64 | (key.dport as u64) << 16,
        key.src[0] as u64 | (key.src[1] as u64) << 32,
        key.src[2] as u64 | (key.src[3] as u64) << 32,
        key.dst[0] as u64 | (key.dst[1] as u64) << 32,
        key.dst[2] as u64 | (key.dst[3] as u64) << 32,
    ];
    let mut h = seed;
    let mut i = 0;
    while i < words.len() {
        h = (h ^ words[i]).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 29;
        i += 1;
    }
    h
}

#[cfg(test)]
mod prefix_tests {
    use super::in_prefix;

    #[test]
    fn prefixes_match_v4_and_v6() {
        assert!(in_prefix(&[0x0a01_0203, 0, 0, 0], &[0x0a01_0000, 0, 0, 0], 16, 4));
        assert!(!in_prefix(&[0x0a02_0203, 0, 0, 0], &[0x0a01_0000, 0, 0, 0], 16, 4));
        assert!(in_prefix(&[1, 2, 3, 4], &[9, 9, 9, 9], 0, 6), "/0 matches all");
        assert!(in_prefix(&[1, 2, 3, 4], &[1, 2, 0, 0], 64, 6));
        assert!(!in_prefix(&[1, 2, 3, 4], &[1, 2, 3, 5], 128, 6));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(src: u32, dport: u16) -> PacketMeta {
        PacketMeta {
            src: [src, 0, 0, 0],
            dst: [0x0a000001, 0, 0, 0],
            sport: 999,
            dport,
            family: 4,
            proto: 6,
            ..Default::default()
        }
    }

    #[test]
    fn a_source_key_is_the_src_kind_s_bucket_key() {
        let r = RuleConfig { state_id: 9, key_kind: key_kind::SRC, ..Default::default() };
        for family in [4, 6] {
            let meta = PacketMeta {
                family,
                proto: 6,
                sport: 1234,
                dport: 80,
                src: [1, 2, 3, 4],
                dst: [5, 6, 7, 8],
                ..Default::default()
            };
            assert_eq!(source_key(&meta, 9), bucket_key(&meta, &r));
        }
    }

    #[test]
    fn prefixes_mask_host_bits() {
        assert_eq!(mask_prefix(&[0xc0a80117, 0, 0, 0], 4, 24), [0xc0a80100, 0, 0, 0]);
        assert_eq!(mask_prefix(&[0xc0a80117, 0, 0, 0], 4, 0), [0; 4]);
        let v6 = [0x20010db8, 0x12345678, 0x9abcdef0, 0x11111111];
        assert_eq!(mask_prefix(&v6, 6, 64), [0x20010db8, 0x12345678, 0, 0]);
        assert_eq!(mask_prefix(&v6, 6, 48), [0x20010db8, 0x12340000, 0, 0]);
        assert_eq!(mask_prefix(&v6, 6, 128), v6);
    }

    #[test]
    fn keys_share_exactly_what_they_should() {
        let mut r = RuleConfig {
            state_id: 7,
            key_kind: key_kind::SRC_PREFIX,
            prefix_v4: 24,
            ..Default::default()
        };
        assert_eq!(bucket_key(&meta(0x0a000105, 80), &r), bucket_key(&meta(0x0a0001fe, 443), &r));
        assert_ne!(bucket_key(&meta(0x0a000105, 80), &r), bucket_key(&meta(0x0a000205, 80), &r));
        r.key_kind = key_kind::SRC_DPORT;
        assert_ne!(bucket_key(&meta(0x0a000105, 80), &r), bucket_key(&meta(0x0a000105, 443), &r));
        r.key_kind = key_kind::RULE;
        assert_eq!(bucket_key(&meta(1, 1), &r), bucket_key(&meta(2, 2), &r));
        let other = RuleConfig { state_id: 8, ..r };
        assert_ne!(bucket_key(&meta(1, 1), &r), bucket_key(&meta(1, 1), &other));
        r.key_kind = key_kind::DPORT;
        assert_eq!(bucket_key(&meta(1, 80), &r), bucket_key(&meta(2, 80), &r));
        r.key_kind = key_kind::FIVE_TUPLE;
        let mut m = meta(1, 80);
        let a = bucket_key(&m, &r);
        m.sport = 1000;
        assert_ne!(a, bucket_key(&m, &r));
    }
}
