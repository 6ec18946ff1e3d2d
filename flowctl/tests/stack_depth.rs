//! The XDP program's combined call-chain stack, computed from the embedded
//! object the way the verifier accounts it, without root or a kernel.
//!
//! The verifier gives each function the depth of its deepest stack access
//! and refuses a program whose frames along any chain of BPF-to-BPF calls
//! add up to more than 512 bytes (`MAX_BPF_STACK`). Linux 6.1 rounds every
//! frame up to 32 bytes (at least 32, even an empty one) and counts global
//! functions in the chain too; that is how it refused the program before
//! the parser became its own function ("combined stack size of 3 calls is
//! 544"). This test applies 6.1's accounting, the strictest of the matrix,
//! and keeps a margin for later work.

use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionIndex, SymbolKind};
use std::collections::{BTreeMap, BTreeSet};

/// Bytes of the 512 left free on the worst chain, for features to come.
/// 64 until 2026-12-06, when the debt's recall learned to fill a quota
/// window's ring (a slot pointer and its word kept across the debt's
/// lookup): its frame went from 72 to 120 bytes, 96 to 128 in 6.1's
/// rounding (docs/design.md, "Verifier budget").
const MARGIN: u32 = 32;
const MAX_BPF_STACK: u32 = 512;

struct Func {
    name: String,
    section: SectionIndex,
    start: u64,
    size: u64,
    depth: u32,
    /// (section, address) of each BPF-to-BPF call's target.
    calls: Vec<(SectionIndex, u64)>,
}

fn functions(elf: &object::File) -> Vec<Func> {
    let mut out = Vec::new();
    for sym in elf.symbols() {
        if sym.kind() != SymbolKind::Text || sym.size() == 0 {
            continue;
        }
        let Some(section) = sym.section_index() else { continue };
        let sec = elf.section_by_index(section).unwrap();
        let data = sec.data().unwrap();
        let relocs: BTreeMap<u64, _> = sec.relocations().collect();
        let (start, size) = (sym.address() - sec.address(), sym.size());
        let code = &data[start as usize..(start + size) as usize];
        let mut depth = 0u32;
        let mut calls = Vec::new();
        for (i, insn) in code.chunks_exact(8).enumerate() {
            let (op, dst, src) = (insn[0], insn[1] & 0x0f, insn[1] >> 4);
            let off = i16::from_le_bytes([insn[2], insn[3]]) as i32;
            let imm = i32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]);
            let class = op & 0x07;
            let mem = op & 0xe0 == 0x60; // BPF_MEM mode
                                         // Loads from and stores to the frame pointer's memory.
            let fp_off = match class {
                0x01 if mem && src == 10 => Some(off),        // LDX
                0x02 | 0x03 if mem && dst == 10 => Some(off), // ST, STX
                _ => None,
            };
            // A pointer into the frame handed on (to a helper, say):
            // `rX = r10` followed by `rX += imm`.
            let fp_arith = (op == 0x07 && dst != 10 && i > 0 && {
                let p = &code[(i - 1) * 8..i * 8];
                p[0] == 0xbf && p[1] & 0x0f == dst && p[1] >> 4 == 10
            })
            .then_some(imm);
            for o in [fp_off, fp_arith].into_iter().flatten() {
                if o < 0 {
                    depth = depth.max((-o) as u32);
                }
            }
            if op == 0x85 && src == 1 {
                // BPF_PSEUDO_CALL: to a symbol by relocation, else relative.
                let at = start + i as u64 * 8;
                let target = match relocs.get(&at).map(|r| r.target()) {
                    Some(RelocationTarget::Symbol(s)) => {
                        let s = elf.symbol_by_index(s).unwrap();
                        let base = s.address()
                            - elf.section_by_index(s.section_index().unwrap()).unwrap().address();
                        let t = if s.kind() == SymbolKind::Section {
                            base + ((imm as i64 + 1) * 8) as u64
                        } else {
                            base
                        };
                        (s.section_index().unwrap(), t)
                    }
                    _ => (section, (at as i64 + (imm as i64 + 1) * 8) as u64),
                };
                calls.push(target);
            }
        }
        out.push(Func {
            name: sym.name().unwrap().to_string(),
            section,
            start,
            size,
            depth,
            calls,
        });
    }
    out
}

/// 6.1's frame size: the depth rounded up to 32, at least 32.
fn frame(depth: u32) -> u32 {
    depth.max(1).div_ceil(32) * 32
}

/// The deepest chain from `f`: (bytes, names).
fn worst_chain(funcs: &[Func], f: usize, seen: &mut Vec<usize>) -> (u32, Vec<String>) {
    assert!(!seen.contains(&f), "recursion through {}", funcs[f].name);
    seen.push(f);
    let mut best = (0, Vec::new());
    for &(sec, addr) in &funcs[f].calls {
        let callee = funcs
            .iter()
            .position(|g| g.section == sec && g.start <= addr && addr < g.start + g.size)
            .unwrap_or_else(|| panic!("{} calls an address no function holds", funcs[f].name));
        let c = worst_chain(funcs, callee, seen);
        if c.0 > best.0 {
            best = c;
        }
    }
    seen.pop();
    let mut names = vec![format!("{} ({} B)", funcs[f].name, funcs[f].depth)];
    names.extend(best.1);
    (frame(funcs[f].depth) + best.0, names)
}

#[test]
fn xdp_call_chains_fit_the_stack_with_margin() {
    let elf = object::File::parse(flowctl::dataplane::object::xdp_object())
        .expect("the embedded XDP object parses");
    let funcs = functions(&elf);
    for f in funcs.iter().filter(|f| f.name.starts_with("flowctl_")) {
        println!("  {}: {} bytes of stack", f.name, f.depth);
    }
    for entry in [flowctl_common::XDP_PROGRAM, flowctl_common::XDP_PROGRAM_FRAGS] {
        let f = funcs
            .iter()
            .position(|f| f.name == entry)
            .unwrap_or_else(|| panic!("{entry} missing from the object"));
        let (bytes, chain) = worst_chain(&funcs, f, &mut Vec::new());
        println!(
            "{entry}: worst call chain {bytes} of {MAX_BPF_STACK} bytes (6.1's accounting): {}",
            chain.join(" -> ")
        );
        assert!(
            bytes + MARGIN <= MAX_BPF_STACK,
            "{entry}: the call chain {} takes {bytes} bytes of stack; keep {MARGIN} of {MAX_BPF_STACK} free",
            chain.join(" -> ")
        );
    }
}

#[test]
fn frames_round_as_6_1_does() {
    assert_eq!(frame(0), 32);
    assert_eq!(frame(48), 64);
    assert_eq!(frame(424), 448);
}

/// Every BPF-to-BPF call reachable from `f`, as (caller, callee) names.
fn reachable(funcs: &[Func], f: usize, edges: &mut BTreeSet<(String, String)>) {
    for &(sec, addr) in &funcs[f].calls {
        let callee = funcs
            .iter()
            .position(|g| g.section == sec && g.start <= addr && addr < g.start + g.size)
            .unwrap_or_else(|| panic!("{} calls an address no function holds", funcs[f].name));
        if edges.insert((funcs[f].name.clone(), funcs[callee].name.clone())) {
            reachable(funcs, callee, edges);
        }
    }
}

/// A zeroed key or struct must be plain stores, not a call to the object's
/// byte-at-a-time `memset`: with bpf-linker's default
/// (`--bpf-expand-memcpy-in-order`) LLVM called it for every one, which
/// cost the admitted path about a fifth of its time and 6.1 157k verifier
/// instructions (flowctl-ebpf/build.rs turns the default off). The one
/// call left is the event log's copy of a variable length, pruned unless
/// events are asked for.
#[test]
fn the_packet_path_calls_no_memory_builtin() {
    let elf = object::File::parse(flowctl::dataplane::object::xdp_object())
        .expect("the embedded XDP object parses");
    let funcs = functions(&elf);
    for entry in [flowctl_common::XDP_PROGRAM, flowctl_common::XDP_PROGRAM_FRAGS] {
        let f = funcs.iter().position(|f| f.name == entry).expect("entry point");
        let mut calls = BTreeSet::new();
        reachable(&funcs, f, &mut calls);
        assert!(
            calls.iter().any(|(_, callee)| callee == "flowctl_decide"),
            "the walk follows calls"
        );
        let builtins: Vec<_> = calls
            .iter()
            .filter(|(caller, callee)| {
                matches!(callee.as_str(), "memset" | "memcpy" | "memmove" | "memcmp" | "bcmp")
                    && !(callee.as_str() == "memcpy" && caller.as_str() == "flowctl_events")
            })
            .collect();
        assert!(
            builtins.is_empty(),
            "{entry}: calls to memory builtins (caller, callee): {builtins:?}"
        );
    }
}
