//! Kernel features, probed at load instead of assumed from a version.
//!
//! Each feature is detected by trying it where that is cheap and reliable:
//! loading a two-instruction program with the flag or helper in question,
//! creating a one-entry map, or making the attachment itself on the loopback
//! device of a throwaway network namespace (a thread that `unshare`s its own
//! namespace, so nothing on the host ever sees it). Only what cannot be
//! tried is read from elsewhere, and each such case says so below.
//!
//! `REQUIREMENTS` is the one table of what each part of a profile needs;
//! `check_profile` rejects a profile whole, before anything is touched, when
//! a part of it needs what this kernel lacks; `flowctl doctor` renders both.
//! Probing runs once per process (`get`).

use crate::profile::RuleSet;
use serde::Serialize;
use std::{fmt, sync::OnceLock};

/// A kernel capability flowctl uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Feature {
    /// XDP attached through a bpf_link (pinnable; survives the agent).
    XdpLink,
    /// Loading BTF (the objects' type and function information).
    Btf,
    /// The kernel's own BTF at /sys/kernel/btf/vmlinux (informational).
    VmlinuxBtf,
    RingBuf,
    LruHash,
    LpmTrie,
    /// Multi-buffer XDP programs (`xdp.frags`, BPF_F_XDP_HAS_FRAGS).
    XdpFrags,
    /// TC programs attached through a TCX bpf_link.
    Tcx,
    /// cgroup sock_addr programs (connect4/connect6 hooks).
    CgroupSockAddr,
    SockOps,
    /// `bpf_set_retval` from a cgroup connect hook.
    SetRetval,
    /// `bpf_get_current_ancestor_cgroup_id` from a cgroup connect hook.
    AncestorCgroupId,
    /// A cgroup v2 hierarchy is mounted.
    Cgroup2,
}

impl Feature {
    pub const ALL: [Feature; 13] = [
        Feature::XdpLink,
        Feature::Btf,
        Feature::VmlinuxBtf,
        Feature::RingBuf,
        Feature::LruHash,
        Feature::LpmTrie,
        Feature::XdpFrags,
        Feature::Tcx,
        Feature::CgroupSockAddr,
        Feature::SockOps,
        Feature::SetRetval,
        Feature::AncestorCgroupId,
        Feature::Cgroup2,
    ];

    /// Its name in JSON and in FLOWCTL_DISABLE_FEATURES.
    pub fn key(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    }

    /// What it is, as messages name it.
    pub fn title(self) -> &'static str {
        match self {
            Feature::XdpLink => "bpf_link for XDP",
            Feature::Btf => "BTF loading",
            Feature::VmlinuxBtf => "kernel BTF (/sys/kernel/btf/vmlinux)",
            Feature::RingBuf => "ring buffer maps",
            Feature::LruHash => "LRU hash maps",
            Feature::LpmTrie => "LPM trie maps",
            Feature::XdpFrags => "multi-buffer XDP (xdp.frags)",
            Feature::Tcx => "TCX links for TC programs",
            Feature::CgroupSockAddr => "cgroup connect4/connect6 programs",
            Feature::SockOps => "sock_ops programs",
            Feature::SetRetval => "bpf_set_retval for cgroup connect hooks",
            Feature::AncestorCgroupId => {
                "bpf_get_current_ancestor_cgroup_id for cgroup connect hooks"
            }
            Feature::Cgroup2 => "a mounted cgroup v2 hierarchy",
        }
    }

    /// The mainline release that added it (None: not a kernel version
    /// question). Sources: the commits named in docs/design.md, "Kernel
    /// features".
    pub fn min_version(self) -> Option<(u32, u32)> {
        Some(match self {
            Feature::XdpLink => (5, 9),
            Feature::Btf => (4, 18),
            Feature::VmlinuxBtf => (5, 2),
            Feature::RingBuf => (5, 8),
            Feature::LruHash => (4, 10),
            Feature::LpmTrie => (4, 11),
            Feature::XdpFrags => (5, 18),
            Feature::Tcx => (6, 6),
            Feature::CgroupSockAddr => (4, 17),
            Feature::SockOps => (4, 13),
            Feature::SetRetval => (5, 18),
            Feature::AncestorCgroupId => (5, 7),
            Feature::Cgroup2 => return None,
        })
    }

    /// How `probe` decides (doctor prints it).
    pub fn how(self) -> &'static str {
        match self {
            Feature::XdpLink => "attach a trivial XDP program through BPF_LINK_CREATE to lo in a throwaway netns",
            Feature::Btf => "BPF_BTF_LOAD of a one-type BTF blob",
            Feature::VmlinuxBtf => "read /sys/kernel/btf/vmlinux's header (a file, nothing to try)",
            Feature::RingBuf | Feature::LruHash | Feature::LpmTrie => "create a small map of that type",
            Feature::XdpFrags => "load a trivial XDP program with BPF_F_XDP_HAS_FRAGS",
            Feature::Tcx => "attach a trivial TC program through a BPF_TCX_EGRESS link to lo in a throwaway netns",
            Feature::CgroupSockAddr | Feature::SockOps => "load a trivial program of that type",
            Feature::SetRetval | Feature::AncestorCgroupId => "load a connect4 program calling the helper (libbpf's helper probe)",
            Feature::Cgroup2 => "look for a cgroup2 line in /proc/self/mounts (a mount, not a kernel feature)",
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.title())
    }
}

/// The part of a profile that needs a feature.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// `[[rule]]`s: the XDP data plane on an interface.
    Rules,
    /// KLimiter baselines with `source = { kind = "egress", .. }`: the TC
    /// egress counter.
    EgressBaselines,
    /// `[[breaker]]`s: the cgroup connect and sock_ops programs.
    Breakers,
}

impl Part {
    pub const ALL: [Part; 3] = [Part::Rules, Part::EgressBaselines, Part::Breakers];

    pub fn title(self) -> &'static str {
        match self {
            Part::Rules => "[[rule]]s (XDP data plane)",
            Part::EgressBaselines => "egress baselines (TC egress counter)",
            Part::Breakers => "[[breaker]]s (cgroup connect hooks)",
        }
    }

    /// Whether `set` has this part.
    pub fn in_profile(self, set: &RuleSet) -> bool {
        match self {
            Part::Rules => !set.rules.is_empty(),
            Part::EgressBaselines => set
                .baselines
                .iter()
                .any(|b| matches!(b.source, crate::profile::klimiter::LevelSource::Egress { .. })),
            Part::Breakers => !set.breakers.is_empty(),
        }
    }
}

/// Whether a part cannot run without the feature, or runs degraded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Need {
    Required,
    /// Used when present; the text says what happens without it.
    Preferred(&'static str),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Requirement {
    pub feature: Feature,
    pub part: Part,
    pub need: Need,
    /// What the part uses it for.
    pub why: &'static str,
}

/// Every feature each part of a profile uses: the one place that says so.
pub const REQUIREMENTS: &[Requirement] = &[
    Requirement { feature: Feature::XdpLink, part: Part::Rules, need: Need::Required, why: "the pinned XDP link the data plane lives in (and --keep)" },
    Requirement { feature: Feature::Btf, part: Part::Rules, need: Need::Required, why: "the XDP object's function information (its global functions are verified on their own)" },
    Requirement { feature: Feature::RingBuf, part: Part::Rules, need: Need::Required, why: "the key-sampling ring of `top --keys`, created with the data plane" },
    Requirement { feature: Feature::LruHash, part: Part::Rules, need: Need::Required, why: "the per-key bucket, quota, source-cache and connection tables" },
    Requirement { feature: Feature::LpmTrie, part: Part::Rules, need: Need::Required, why: "the source-prefix classifier" },
    Requirement {
        feature: Feature::XdpFrags,
        part: Part::Rules,
        need: Need::Preferred("the single-buffer program is loaded; native XDP then refuses interfaces whose MTU does not fit one page (about 3500 bytes on veth)"),
        why: "attaching to jumbo-frame interfaces",
    },
    Requirement {
        feature: Feature::Tcx,
        part: Part::EgressBaselines,
        need: Need::Preferred("a clsact qdisc (added if absent, removed on exit if flowctl added it) and a netlink cls_bpf filter"),
        why: "attaching the egress counter",
    },
    Requirement { feature: Feature::CgroupSockAddr, part: Part::Breakers, need: Need::Required, why: "the connect4/connect6 hooks that refuse connects" },
    Requirement { feature: Feature::SockOps, part: Part::Breakers, need: Need::Required, why: "counting connection outcomes" },
    Requirement { feature: Feature::SetRetval, part: Part::Breakers, need: Need::Required, why: "choosing the errno a refused connect() returns" },
    Requirement { feature: Feature::AncestorCgroupId, part: Part::Breakers, need: Need::Required, why: "breakers scoped to a cgroup below the attach point" },
    Requirement { feature: Feature::LruHash, part: Part::Breakers, need: Need::Required, why: "the socket marks of admitted connects" },
    Requirement { feature: Feature::Cgroup2, part: Part::Breakers, need: Need::Required, why: "the hooks attach to a cgroup v2 directory" },
];

/// One probe's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Probe {
    pub feature: Feature,
    pub available: bool,
    /// Why not, or where (cgroup2's mount), when there is something to say.
    pub detail: Option<String>,
}

/// The running kernel: its release and every probe.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Features {
    /// `uname -r`.
    pub release: String,
    pub probes: Vec<Probe>,
}

impl Features {
    pub fn has(&self, f: Feature) -> bool {
        self.probes.iter().any(|p| p.feature == f && p.available)
    }

    pub fn probe(&self, f: Feature) -> Option<&Probe> {
        self.probes.iter().find(|p| p.feature == f)
    }

    /// Required features a part lacks here.
    pub fn missing_for(&self, part: Part) -> Vec<&'static Requirement> {
        REQUIREMENTS
            .iter()
            .filter(|r| r.part == part && r.need == Need::Required && !self.has(r.feature))
            .collect()
    }

    /// Preferred features a part will run without here (degraded).
    pub fn degraded_for(&self, part: Part) -> Vec<&'static Requirement> {
        REQUIREMENTS
            .iter()
            .filter(|r| {
                r.part == part && matches!(r.need, Need::Preferred(_)) && !self.has(r.feature)
            })
            .collect()
    }

    /// Rejects `set` whole when a part of it needs what this kernel lacks;
    /// parts the profile does not have are not asked about.
    pub fn check_profile(&self, set: &RuleSet) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        for part in Part::ALL {
            if part.in_profile(set) {
                for r in self.missing_for(part) {
                    problems.push(missing_message(r, &self.release));
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("{} (nothing was attached or changed)", problems.join("; "))
        }
    }
}

/// "the profile's [[breaker]]s need bpf_set_retval for cgroup connect hooks
/// (Linux 5.18+; to choose the errno ...); this kernel is 5.15.0: remove
/// them or upgrade".
pub fn missing_message(r: &Requirement, release: &str) -> String {
    let since = match r.feature.min_version() {
        Some((a, b)) => format!("Linux {a}.{b}+, "),
        None => String::new(),
    };
    let fix = match r.feature {
        Feature::Cgroup2 => {
            "mount one (`mount -t cgroup2 none /sys/fs/cgroup/unified`) or remove them".to_string()
        }
        f if f.min_version().is_some() => "remove them or upgrade the kernel".to_string(),
        _ => "remove them".to_string(),
    };
    format!(
        "the profile's {} need {} ({since}for {}); this kernel is {release}: {fix}",
        r.part.title(),
        r.feature.title(),
        r.why
    )
}

/// The running kernel's features, probed on first use.
pub fn get() -> &'static Features {
    static CACHE: OnceLock<Features> = OnceLock::new();
    CACHE.get_or_init(probe_all)
}

/// `check_profile` against the running kernel.
pub fn check_profile(set: &RuleSet) -> anyhow::Result<()> {
    get().check_profile(set)
}

fn release() -> String {
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return "unknown".into();
    }
    unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().into_owned()
}

fn probe_all() -> Features {
    use aya::{maps::MapType, programs::ProgramType, sys::BpfHelper};
    let yes = |feature| Probe { feature, available: true, detail: None };
    let from = |feature, r: Result<bool, String>| match r {
        Ok(available) => Probe { feature, available, detail: None },
        Err(e) => Probe { feature, available: false, detail: Some(e) },
    };
    let map = |t| aya::sys::is_map_supported(t).map_err(|e| e.to_string());
    let prog = |t| aya::sys::is_program_supported(t).map_err(|e| e.to_string());
    let helper = |h| {
        aya::sys::is_helper_supported(ProgramType::CgroupSockAddr, h).map_err(|e| e.to_string())
    };
    let (xdp_link, tcx) = in_throwaway_netns(|| (probe_xdp_link(), probe_tcx()))
        .unwrap_or_else(|e| (Err(e.clone()), Err(e)));
    let mut probes = vec![
        from(Feature::XdpLink, xdp_link),
        from(Feature::Btf, probe_btf_load()),
        from(Feature::VmlinuxBtf, probe_vmlinux_btf()),
        from(Feature::RingBuf, map(MapType::RingBuf)),
        from(Feature::LruHash, map(MapType::LruHash)),
        from(Feature::LpmTrie, map(MapType::LpmTrie)),
        from(Feature::XdpFrags, probe_xdp_frags()),
        from(Feature::Tcx, tcx),
        from(Feature::CgroupSockAddr, prog(ProgramType::CgroupSockAddr)),
        from(Feature::SockOps, prog(ProgramType::SockOps)),
        from(Feature::SetRetval, helper(BpfHelper::BPF_FUNC_set_retval)),
        from(Feature::AncestorCgroupId, helper(BpfHelper::BPF_FUNC_get_current_ancestor_cgroup_id)),
    ];
    probes.push(match crate::system::cgroup::cgroup2_mount() {
        Ok(p) => Probe { detail: Some(p.display().to_string()), ..yes(Feature::Cgroup2) },
        Err(_) => Probe {
            feature: Feature::Cgroup2,
            available: false,
            detail: Some("no cgroup2 line in /proc/self/mounts".into()),
        },
    });
    disable_from_env(&mut probes, std::env::var("FLOWCTL_DISABLE_FEATURES").ok().as_deref());
    Features { release: release(), probes }
}

/// `FLOWCTL_DISABLE_FEATURES=tcx,set_retval` makes flowctl act as on a
/// kernel without them (the names are the JSON ones: `doctor --json`): how
/// the tests run the fallbacks and the rejections on a kernel that has
/// everything. A feature can only be taken away, never added.
fn disable_from_env(probes: &mut [Probe], var: Option<&str>) {
    let Some(var) = var else { return };
    for name in var.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match probes.iter_mut().find(|p| p.feature.key() == name) {
            Some(p) => {
                p.available = false;
                p.detail = Some("disabled by FLOWCTL_DISABLE_FEATURES".into());
            }
            None => tracing::warn!("FLOWCTL_DISABLE_FEATURES: no feature `{name}`"),
        }
    }
}

// ---- the raw probes: bpf(2) with just the attributes each needs ----

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
const BPF_TCX_EGRESS: u32 = 47;
const BPF_F_XDP_HAS_FRAGS: u32 = 1 << 5;
const XDP_FLAGS_SKB_MODE: u32 = 2;

/// The head of `union bpf_attr` for BPF_PROG_LOAD (the kernel zero-fills
/// what a shorter attribute leaves out).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

fn sys_bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, size_of::<T>() as u32) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(rc as i32) })
    }
}

/// `r0 = verdict; exit`: a program every verifier accepts.
fn load_trivial(
    prog_type: u32,
    expected_attach_type: u32,
    prog_flags: u32,
    verdict: i32,
) -> std::io::Result<std::os::fd::OwnedFd> {
    let insns: [u64; 2] = [
        // BPF_ALU64 | BPF_MOV | BPF_K (0xb7), dst r0, imm verdict.
        0xb7 | ((verdict as u32 as u64) << 32),
        // BPF_JMP | BPF_EXIT.
        0x95,
    ];
    let license = b"GPL\0";
    let mut attr = ProgLoadAttr {
        prog_type,
        insn_cnt: 2,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_flags,
        expected_attach_type,
        ..Default::default()
    };
    sys_bpf(BPF_PROG_LOAD, &mut attr)
}

/// Kernels before 5.18 reject the unknown `prog_flags` bit with EINVAL.
fn probe_xdp_frags() -> Result<bool, String> {
    match load_trivial(BPF_PROG_TYPE_XDP, BPF_XDP, BPF_F_XDP_HAS_FRAGS, 2) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(format!("loading the probe program: {e}")),
    }
}

fn link_create(
    prog_type: u32,
    expected_attach_type: u32,
    attach_type: u32,
    flags: u32,
) -> Result<bool, String> {
    use std::os::fd::AsRawFd;
    let prog = load_trivial(
        prog_type,
        expected_attach_type,
        0,
        if prog_type == BPF_PROG_TYPE_XDP { 2 } else { 0 },
    )
    .map_err(|e| format!("loading the probe program: {e}"))?;
    // lo is ifindex 1 in every network namespace.
    let mut attr =
        LinkCreateAttr { prog_fd: prog.as_raw_fd() as u32, target_ifindex: 1, attach_type, flags };
    match sys_bpf(BPF_LINK_CREATE, &mut attr) {
        // Dropping the link's fd detaches it.
        Ok(_link) => Ok(true),
        // An attach type the kernel does not know (or cannot link).
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)) => {
            Ok(false)
        }
        Err(e) => Err(format!("BPF_LINK_CREATE: {e}")),
    }
}

/// Before 5.9 BPF_LINK_CREATE does not take BPF_XDP (EINVAL).
fn probe_xdp_link() -> Result<bool, String> {
    link_create(BPF_PROG_TYPE_XDP, BPF_XDP, BPF_XDP, XDP_FLAGS_SKB_MODE)
}

/// Before 6.6 there is no BPF_TCX_EGRESS attach type (EINVAL).
fn probe_tcx() -> Result<bool, String> {
    link_create(BPF_PROG_TYPE_SCHED_CLS, 0, BPF_TCX_EGRESS, 0)
}

/// Runs `f` on a thread in a network namespace of its own (its lo is the
/// only device); the namespace goes when the thread ends.
fn in_throwaway_netns<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    std::thread::spawn(move || {
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(format!(
                "creating a throwaway network namespace: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(f())
    })
    .join()
    .map_err(|_| "the probe thread panicked".to_string())?
}

/// A BTF blob with one type (`int`, 32 bits).
fn probe_btf_load() -> Result<bool, String> {
    #[repr(C)]
    #[derive(Default)]
    struct BtfLoadAttr {
        btf: u64,
        btf_log_buf: u64,
        btf_size: u32,
        btf_log_size: u32,
        btf_log_level: u32,
    }
    let mut blob = Vec::new();
    let u16le = |b: &mut Vec<u8>, v: u16| b.extend_from_slice(&v.to_le_bytes());
    let u32le = |b: &mut Vec<u8>, v: u32| b.extend_from_slice(&v.to_le_bytes());
    let strings = b"\0int\0";
    // Header: magic, version 1, flags 0, hdr_len 24, types at 0 (16
    // bytes), strings at 16.
    u16le(&mut blob, 0xeb9f);
    blob.extend_from_slice(&[1, 0]);
    for v in [24u32, 0, 16, 16, strings.len() as u32] {
        u32le(&mut blob, v);
    }
    // BTF_KIND_INT (1) named "int", size 4, encoding: 32 bits, signed.
    for v in [1u32, 1 << 24, 4, (1 << 24) | 32] {
        u32le(&mut blob, v);
    }
    blob.extend_from_slice(strings);
    let mut attr = BtfLoadAttr {
        btf: blob.as_ptr() as u64,
        btf_size: blob.len() as u32,
        ..Default::default()
    };
    match sys_bpf(BPF_BTF_LOAD, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(format!("BPF_BTF_LOAD: {e}")),
    }
}

fn probe_vmlinux_btf() -> Result<bool, String> {
    use std::io::Read;
    let mut magic = [0u8; 2];
    match std::fs::File::open("/sys/kernel/btf/vmlinux").and_then(|mut f| f.read_exact(&mut magic))
    {
        Ok(()) => Ok(u16::from_le_bytes(magic) == 0xeb9f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(format!("/sys/kernel/btf/vmlinux: {e}")),
    }
}

#[cfg(test)]
impl Features {
    /// A kernel that has every feature but `missing` (for tests of what
    /// depends on the probes).
    pub fn with_missing(release: &str, missing: &[Feature]) -> Self {
        Features {
            release: release.into(),
            probes: Feature::ALL
                .iter()
                .map(|&feature| Probe {
                    feature,
                    available: !missing.contains(&feature),
                    detail: None,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(missing: &[Feature]) -> Features {
        Features::with_missing("5.15.0", missing)
    }

    #[test]
    fn every_feature_is_named_once_and_the_table_names_only_known_parts() {
        for (i, f) in Feature::ALL.iter().enumerate() {
            assert!(!Feature::ALL[..i].contains(f), "{f:?} twice");
            assert!(!f.title().is_empty() && !f.how().is_empty());
        }
        // Every part has something it requires; every required feature
        // but cgroup2 has a version to name.
        for part in Part::ALL {
            assert!(REQUIREMENTS.iter().any(|r| r.part == part), "{part:?}");
        }
        for r in REQUIREMENTS.iter().filter(|r| r.need == Need::Required) {
            assert!(r.feature.min_version().is_some() || r.feature == Feature::Cgroup2, "{r:?}");
        }
    }

    #[test]
    fn the_environment_can_take_features_away() {
        let mut probes = kernel(&[]).probes;
        disable_from_env(&mut probes, Some("tcx, set_retval,bogus"));
        let off: Vec<Feature> = probes.iter().filter(|p| !p.available).map(|p| p.feature).collect();
        assert_eq!(off, vec![Feature::Tcx, Feature::SetRetval]);
        assert_eq!(Feature::XdpFrags.key(), "xdp_frags");
    }

    #[test]
    fn a_profile_is_checked_only_for_the_parts_it_has() {
        let rules_only = crate::profile::parse(
            "r.toml",
            "[[rule]]\nname = \"a\"\nproto = \"udp\"\nrate = \"10/s\"\nburst = 1\n",
        )
        .unwrap();
        let old = kernel(&[Feature::SetRetval, Feature::Tcx, Feature::XdpFrags]);
        // No breakers: the missing helper is not asked about; TCX and frags
        // only degrade.
        old.check_profile(&rules_only).unwrap();
        assert_eq!(old.degraded_for(Part::Rules).len(), 1);
        assert_eq!(old.degraded_for(Part::EgressBaselines)[0].feature, Feature::Tcx);
    }

    #[test]
    fn a_missing_requirement_names_the_feature_and_the_version_that_has_it() {
        let set = crate::profile::parse(
            "b.toml",
            "[[breaker]]\nname = \"db\"\ntarget = \"192.0.2.10\"\nport = 5432\n",
        )
        .unwrap();
        let err = kernel(&[Feature::SetRetval]).check_profile(&set).unwrap_err().to_string();
        assert!(err.contains("bpf_set_retval"), "{err}");
        assert!(err.contains("Linux 5.18+"), "{err}");
        assert!(err.contains("this kernel is 5.15.0"), "{err}");
        assert!(err.contains("[[breaker]]"), "{err}");
        kernel(&[]).check_profile(&set).unwrap();
        let m = missing_message(
            REQUIREMENTS.iter().find(|r| r.feature == Feature::Cgroup2).unwrap(),
            "6.1.0",
        );
        assert!(m.contains("mount") && !m.contains("Linux"), "{m}");
    }
}
