//! flowctl's XDP data plane.
//!
//! Per packet: parse (Ethernet, up to four VLAN tags, IPv4/IPv6 with options
//! and extension headers, TCP/UDP/ICMP), classify (per-source cache, else
//! LPM trie, ANDed with protocol and port bitmaps: first match in profile
//! order), then run the stages in the fixed order admission -> BBR -> quota
//! -> token bucket, and commit only when every stage admits. Every verdict
//! is counted per rule and every drop by reason. See docs/design.md for the
//! maps and the contracts, and its "Verifier budget" for why the work is
//! split into global functions the way it is.
//!
//! | module | what it owns | global functions |
//! |---|---|---|
//! | this one | the entry points, the decision's top level | `flowctl_decide` |
//! | `parse` | header parsing (the common layout inline, `fast`; the rest in its functions); the RST reply's rewrite | `flowctl_parse`, `flowctl_parse_ip`, `flowctl_parse_l4` |
//! | `classify` | the first matching rule, the source cache | - |
//! | `stages` | admission -> BBR -> quota -> token bucket; beside the decision, a global rule's bucket, a booked SYN's end, a rule's nested limits or warm-up ramp | `flowctl_bbr_refuses`, `flowctl_recall_debt`, `flowctl_remember_debt`, `flowctl_global_decide`, `flowctl_take_report`, `flowctl_book_decide`, `flowctl_nested_decide`, `flowctl_nested_admit`, `flowctl_nested_quota`, `flowctl_limit_try`, `flowctl_limit_take`, `flowctl_limit_give_back`, `flowctl_warm_admit` |
//! | `accounting` | counters per rule and reason, statistics rings | `flowctl_account` |
//! | `sampler` | `top --keys` samples | `flowctl_sample_key` |
//! | `conntrack` | BBR connection tracking, the RST reply | `flowctl_connection`, `flowctl_connection_in_place` |
//! | `decision` | what a decision is, and its packed form | - |
//! | `maps` | every map and load-time constant of the object | - |
//! | `events` | rare events for the agent's log (aya-log), pruned at load unless asked for | `flowctl_events` |
//! | `egress` | the TC egress counter (its own program) | - |
//! | `shaper` | the TC egress shaper, EDT for `fq` (its own program) | - |
//! | `outbound` | the headers both TC egress programs read | - |
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod accounting;
mod atomic;
mod classify;
mod conntrack;
mod decision;
mod egress;
mod events;
mod maps;
mod outbound;
mod parse;
mod sampler;
mod shaper;
mod stages;

use accounting::{counters, flowctl_account};
use aya_ebpf::{
    bindings::xdp_action, helpers::bpf_ktime_get_ns, macros::xdp, programs::XdpContext,
};
use decision::{outcome_code, packed, Decision, Outcome};
use flowctl_common::{reason, GLOBAL_COUNTER_INDEX};
use maps::{packet, FLOWCTL_FAST_PARSE, FLOWCTL_GLOBAL};
use parse::class;

#[xdp]
pub fn flowctl_xdp(ctx: XdpContext) -> u32 {
    let len = (ctx.data_end() - ctx.data()) as u64;
    entry::<true>(&ctx, len)
}

/// The same program for interfaces whose frames may span several buffers
/// (an MTU above what one page holds, as on jumbo-frame links): the kernel
/// attaches only programs that declare multi-buffer support there
/// (`xdp.frags`, Linux 5.18+). Headers are parsed from the first buffer;
/// byte counts cover all of them. The loader picks this one where the
/// kernel has it.
#[xdp(frags)]
pub fn flowctl_xdp_frags(ctx: XdpContext) -> u32 {
    let len = unsafe { aya_ebpf::helpers::bpf_xdp_get_buff_len(ctx.ctx) };
    entry::<true>(&ctx, len)
}

/// The same program as one component of an XDP dispatcher (libxdp's
/// multi-program protocol, `attach --multiprog`; docs/coexistence.md): loaded
/// as an extension (`freplace`) of one of the dispatcher's slot functions,
/// whose signature, `int progN(struct xdp_md *)`, this one matches. What
/// it returns goes back to the dispatcher, which runs the next component
/// only on the verdicts this one's run config chains on (`XDP_PASS`).
#[unsafe(no_mangle)]
#[unsafe(link_section = "freplace/flowctl_xdp_multiprog")]
pub fn flowctl_xdp_multiprog(ctx: *mut aya_ebpf::bindings::xdp_md) -> u32 {
    let ctx = XdpContext::new(ctx);
    let len = (ctx.data_end() - ctx.data()) as u64;
    entry::<false>(&ctx, len)
}

/// Global functions, each verified once on its own: the parser (every
/// header layout but the common one, which `parse::fast` reads inline, is
/// walked there and nowhere else), the decision (classify,
/// stages, counting), a global rule's bucket (which decides and counts for
/// the decision, beside it rather than inside it), then, while `top --keys` watches, the sampler, and
/// for BBR rules the connection work. The parsed headers travel in a
/// per-CPU map (`FLOWCTL_PACKET`), not on the stack: the later functions
/// see them as plain memory, so the parser's paths never multiply theirs,
/// and no frame holds them. Siblings, so their stack frames do not add up
/// (the combined call-chain stack must stay under 512 bytes; 6.1 counts
/// global functions in it too).
///
/// `RESIZE`: whether the program may change the frame's size (the RST
/// reply's trim); not as a dispatcher's component (`flowctl_xdp_multiprog`).
#[inline(always)]
fn entry<const RESIZE: bool>(ctx: &XdpContext, len: u64) -> u32 {
    // The common layout without the parser's calls (two for IPv4, three
    // for IPv6; `parse::fast`).
    let parsed = if FLOWCTL_FAST_PARSE.load() != 0 && parse::fast(ctx, len) {
        class::IP
    } else {
        parse::flowctl_parse(ctx.ctx, len)
    };
    let mut v = flowctl_decide(parsed, len);
    if v & packed::GLOBAL != 0 {
        v = stages::global::flowctl_global_decide(v);
    }
    if v & packed::NESTED != 0 {
        v = stages::nested::flowctl_nested_decide(v);
    }
    if v & packed::BOOK != 0 {
        v = stages::booking::flowctl_book_decide(v);
    }
    if v & packed::SAMPLE != 0 {
        sampler::flowctl_sample_key(packed::rule_at(v), packed::record(v), packed::code(v));
    }
    if events::on() {
        events::flowctl_events(ctx.ctx, parsed, len, packed::record(v));
    }
    if v & packed::BBR_ON != 0 {
        let reply = v & packed::BBR_RESET != 0
            && packed::code(v) == outcome_code(Outcome::Drop(reason::BBR));
        let connection = if RESIZE {
            conntrack::flowctl_connection
        } else {
            conntrack::flowctl_connection_in_place
        };
        let r = connection(ctx.ctx, packed::record(v), packed::code(v), reply as u32);
        if reply {
            return r;
        }
    }
    packed::action(v)
}

/// The decision on the packet `flowctl_parse` left in `FLOWCTL_PACKET`
/// (`parsed`: its class), counted, in `packed` form.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_decide(parsed: u32, len: u64) -> u64 {
    decide(parsed, len)
}

/// The decision's top level: frames the parser did not class as IP are
/// counted against the global record; an IP packet gets its rule and that
/// rule's stages (`stages::enforce`, which classifies first); either way
/// the verdict is counted once (`flowctl_account`) and packed, except where
/// a stage beside it decides (a global rule's bucket, a booking rule's SYN).
#[inline(always)]
fn decide(parsed: u32, wire_len: u64) -> u64 {
    let Some(global) = FLOWCTL_GLOBAL.get(0) else {
        return xdp_action::XDP_PASS as u64;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    if parsed == class::NOT_IP {
        if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
            c.non_ip_pkts += 1;
        }
        return flowctl_account(GLOBAL_COUNTER_INDEX, outcome_code(Outcome::Pass), wire_len, 0, now)
            as u64;
    }
    if parsed == class::EVASIVE {
        return flowctl_account(
            GLOBAL_COUNTER_INDEX,
            outcome_code(Outcome::Drop(reason::EVASIVE)),
            wire_len,
            0,
            now,
        ) as u64;
    }
    let meta = match packet() {
        Some(m) if parsed == class::IP => m,
        _ => {
            // Counted whatever the verdict, so a pass policy still shows them.
            if let Some(c) = counters(GLOBAL_COUNTER_INDEX) {
                c.malformed_pkts += 1;
            }
            let d = Decision::unmatched(if global.malformed_verdict == xdp_action::XDP_DROP {
                Outcome::Drop(reason::MALFORMED)
            } else {
                Outcome::Pass
            });
            return flowctl_account(d.record, outcome_code(d.outcome), wire_len, 0, now) as u64;
        }
    };
    let d = stages::enforce(global, meta, now);
    let sample = global.key_sample_every != 0;
    if let Outcome::Beside(stage) = d.outcome {
        return packed::pack(0, 0, d.record, d.rule_at, sample) | stage | (d.bbr as u64 & 3) << 61;
    }
    let code = outcome_code(d.outcome);
    if d.book != 0 {
        // The booking stage finishes (and counts) the bucket's verdict.
        return packed::pack(0, code, d.record, d.rule_at, sample)
            | packed::BOOK
            | (d.bbr as u64 & 3) << 61;
    }
    let tcp = if meta.proto == 6 { meta.tcp_flags as u32 } else { 0 };
    let action = flowctl_account(d.record, code, meta.len as u64, tcp, now);
    // The rule's BBR flags go along as they are (no branch here: every
    // branch at the end of the decision is walked once per path into it).
    packed::pack(action, code, d.record, d.rule_at, sample) | (d.bbr as u64 & 3) << 61
}

flowctl_common::bpf_object_boilerplate!();
