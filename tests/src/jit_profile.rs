//! Instruction-level attribution of a path's time (docs/benchmarks.md,
//! "How to reproduce"): `perf` names a BPF program's functions in its
//! samples (JIT symbols, `net.core.bpf_jit_kallsyms`), but this machine's
//! `perf annotate` and `bpftool prog dump jited` are built without the
//! disassembler libraries and cannot show instructions. So the benchmark
//! dumps the program's JIT image itself (`BPF_OBJ_GET_INFO_BY_FD`:
//! `jited_prog_insns`, with each function's kernel address and length),
//! and `annotate` maps `perf script`'s sample addresses into it and
//! disassembles the hot functions with `objdump` (binutils).
//!
//! Files in the dump directory: `jit.bin` (the functions' images, one
//! after another) and `jit.syms` (per function: its kernel address, its
//! offset in `jit.bin`, its length and its symbol).

use anyhow::{bail, Context, Result};
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    os::fd::{AsRawFd, BorrowedFd},
    path::Path,
    process::Command,
};

/// The leading fields of the kernel's `struct bpf_prog_info` (uapi
/// linux/bpf.h) up to `jited_func_lens`; the kernel fills no more than the
/// size it is given.
#[repr(C)]
#[derive(Default)]
struct ProgInfo {
    prog_type: u32,
    id: u32,
    tag: [u8; 8],
    jited_prog_len: u32,
    xlated_prog_len: u32,
    jited_prog_insns: u64,
    xlated_prog_insns: u64,
    load_time: u64,
    created_by_uid: u32,
    nr_map_ids: u32,
    map_ids: u64,
    name: [u8; 16],
    ifindex: u32,
    gpl_compatible: u32,
    netns_dev: u64,
    netns_ino: u64,
    nr_jited_ksyms: u32,
    nr_jited_func_lens: u32,
    jited_ksyms: u64,
    jited_func_lens: u64,
}

const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

fn prog_info(fd: BorrowedFd<'_>, info: &mut ProgInfo) -> Result<()> {
    // union bpf_attr's `info` member: bpf_fd, info_len, info.
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<ProgInfo>() as u32,
        info: info as *mut ProgInfo as u64,
    };
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &attr as *const InfoAttr,
            size_of::<InfoAttr>(),
        )
    };
    if r < 0 {
        bail!("BPF_OBJ_GET_INFO_BY_FD: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// The kernel's symbols from `/proc/kallsyms`, by address.
fn kallsyms() -> Result<BTreeMap<u64, String>> {
    let text = std::fs::read_to_string("/proc/kallsyms").context("read /proc/kallsyms")?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let addr = u64::from_str_radix(f.next()?, 16).ok()?;
            let name = f.nth(1)?;
            Some((addr, name.to_string()))
        })
        .collect())
}

/// Writes the JIT image of the loaded program `fd` (all its functions) and
/// its symbol table into `dir`.
pub fn dump(fd: BorrowedFd<'_>, dir: &Path) -> Result<()> {
    let mut info = ProgInfo::default();
    prog_info(fd, &mut info)?;
    if info.jited_prog_len == 0 {
        bail!("the program has no JIT image (is net.core.bpf_jit_enable on, and are you root?)");
    }
    let mut image = vec![0u8; info.jited_prog_len as usize];
    let mut addrs = vec![0u64; info.nr_jited_ksyms as usize];
    let mut lens = vec![0u32; info.nr_jited_func_lens as usize];
    let mut want = ProgInfo {
        jited_prog_len: image.len() as u32,
        jited_prog_insns: image.as_mut_ptr() as u64,
        nr_jited_ksyms: addrs.len() as u32,
        jited_ksyms: addrs.as_mut_ptr() as u64,
        nr_jited_func_lens: lens.len() as u32,
        jited_func_lens: lens.as_mut_ptr() as u64,
        ..Default::default()
    };
    prog_info(fd, &mut want)?;
    if addrs.iter().all(|a| *a == 0) {
        bail!("the kernel hid the JIT addresses: run as root with kernel.kptr_restrict below 2");
    }
    let names = kallsyms()?;
    let mut syms = String::new();
    let mut offset = 0u64;
    for (addr, len) in addrs.iter().zip(&lens) {
        let name = names.get(addr).map(String::as_str).unwrap_or("?");
        let _ = writeln!(syms, "{addr:x} {offset} {len} {name}");
        offset += *len as u64;
    }
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("jit.bin"), &image)?;
    std::fs::write(dir.join("jit.syms"), syms)?;
    Ok(())
}

/// One function of a dump.
struct Function {
    addr: u64,
    offset: u64,
    len: u64,
    name: String,
}

fn read_syms(dir: &Path) -> Result<Vec<Function>> {
    let text = std::fs::read_to_string(dir.join("jit.syms")).context("read jit.syms")?;
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Ok(Function {
                addr: u64::from_str_radix(f[0], 16)?,
                offset: f[1].parse()?,
                len: f[2].parse()?,
                name: f[3].to_string(),
            })
        })
        .collect()
}

/// Attributes sample addresses (hex, one per line, as `perf script -F ip`
/// prints them; samples anywhere else are counted as outside) to the
/// dump's functions and instructions: per function, its share of all
/// samples; then each function with at least `min_share` of them,
/// disassembled, every instruction with its sample count, a call's target
/// named where the kernel has a symbol for it.
pub fn annotate(dir: &Path, samples: &str, min_share: f64) -> Result<String> {
    let funcs = read_syms(dir)?;
    let image = std::fs::read(dir.join("jit.bin")).context("read jit.bin")?;
    let mut at: BTreeMap<u64, u64> = BTreeMap::new(); // offset in jit.bin -> samples
    let (mut total, mut per_func) = (0u64, vec![0u64; funcs.len()]);
    for ip in samples.lines().filter_map(|l| u64::from_str_radix(l.trim(), 16).ok()) {
        total += 1;
        if let Some(i) = funcs.iter().position(|f| ip >= f.addr && ip < f.addr + f.len) {
            per_func[i] += 1;
            *at.entry(funcs[i].offset + ip - funcs[i].addr).or_default() += 1;
        }
    }
    if total == 0 {
        bail!("no sample addresses on standard input (pipe `perf script -F ip` in)");
    }
    // The program's own functions by the dump's names: the kernel drops
    // their symbols when the benchmark unloads the program.
    let mut names = kallsyms()?;
    names.extend(funcs.iter().map(|f| (f.addr, f.name.clone())));
    let mut out = String::new();
    let _ = writeln!(out, "{total} samples; the program's functions:");
    let mut order: Vec<usize> = (0..funcs.len()).filter(|i| per_func[*i] > 0).collect();
    order.sort_by_key(|i| std::cmp::Reverse(per_func[*i]));
    for &i in &order {
        let share = per_func[i] as f64 / total as f64;
        let _ = writeln!(out, "  {:>6.2}%  {}", 100.0 * share, funcs[i].name);
    }
    for &i in order.iter().filter(|i| per_func[**i] as f64 / total as f64 >= min_share) {
        let f = &funcs[i];
        let _ = writeln!(out, "\n{} ({} bytes):", f.name, f.len);
        let end = (f.offset + f.len).min(image.len() as u64);
        let asm = Command::new("objdump")
            .args(["-D", "-b", "binary", "-mi386:x86-64", "--no-show-raw-insn"])
            .arg(format!("--start-address={}", f.offset))
            .arg(format!("--stop-address={end}"))
            .arg(dir.join("jit.bin"))
            .output()
            .context("run objdump (binutils)")?;
        for line in String::from_utf8_lossy(&asm.stdout).lines() {
            let Some((off, insn)) = line.trim().split_once(":\t") else { continue };
            let Ok(off) = u64::from_str_radix(off, 16) else { continue };
            let count = at.get(&off).copied().unwrap_or(0);
            let mut insn = insn.trim().to_string();
            // objdump resolves a relative call against offset 0 of the
            // file; the kernel's target is the same distance from the
            // instruction's own address.
            if let Some(t) = insn
                .strip_prefix("call")
                .and_then(|t| u64::from_str_radix(t.trim().trim_start_matches("0x"), 16).ok())
            {
                let target = t.wrapping_add(f.addr).wrapping_sub(f.offset);
                if let Some((a, name)) = names.range(..=target).next_back() {
                    let _ = write!(insn, "    <{name}+{:#x}>", target - a);
                }
            }
            let _ = writeln!(out, "{count:>6} {:>5x}  {insn}", off - f.offset);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dump of one three-instruction function, and samples on two of its
    /// instructions and one outside it.
    #[test]
    fn annotate_counts_samples_per_function_and_instruction() {
        let dir = std::env::temp_dir().join(format!("flowctl-jit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // push %rbp; call (to itself + 6); ret
        std::fs::write(dir.join("jit.bin"), [0x55, 0xe8, 0, 0, 0, 0, 0xc3]).unwrap();
        std::fs::write(dir.join("jit.syms"), "ffffffffc0001000 0 7 bpf_prog_test_f\n").unwrap();
        let samples = "ffffffffc0001006\nffffffffc0001006\nffffffffc0001000\nffffffff81000000\n";
        let report = annotate(&dir, samples, 0.0).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(report.starts_with("4 samples;"), "{report}");
        assert!(report.contains(" 75.00%  bpf_prog_test_f"), "{report}");
        let counts: Vec<(u64, String)> = report
            .lines()
            .skip_while(|l| !l.starts_with("bpf_prog_test_f ("))
            .skip(1)
            .map(|l| {
                let mut f = l.split_whitespace();
                (f.next().unwrap().parse().unwrap(), f.nth(1).unwrap().to_string())
            })
            .collect();
        assert_eq!(
            counts,
            [(1, "push".to_string()), (0, "call".to_string()), (2, "ret".to_string())],
            "{report}"
        );
        assert!(report.contains("<bpf_prog_test_f+0x6>"), "the call is named: {report}");
    }
}
