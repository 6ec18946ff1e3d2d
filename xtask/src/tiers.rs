//! What the test tiers run and what a run of one records: the kernel
//! tier, the VM's XDP gate and end-to-end subset, and the summary's rows.
//! Shared by the host runner (matrix.rs) and the VM runner (vm.rs).

use crate::tee;
use std::{path::PathBuf, time::Duration};

/// The kernel tier: every test of these binaries runs in each VM.
pub const KERNEL_TIER: &[&str] = &["kernel", "breaker", "cgroup"];

/// The kernel tier's gate in a VM, run first: a small test that loads the
/// XDP program. Where it fails (the program does not verify on that kernel),
/// the other tests that load it would fail the same way, each after a
/// verification of up to a minute and a half under TCG (28 of them: past
/// the VM's timeout); they are reported not run, the gate as failed, and
/// the tests that do not need the XDP program (breakers, CPU readers) run.
pub const XDP_GATE: &str = "non_ip_always_passes";

/// A test of the end-to-end subset.
pub struct E2e {
    pub name: &'static str,
    /// It loads the XDP program (not run where the gate fails).
    pub xdp: bool,
}

/// The end-to-end subset that runs in each VM: the tests that exercise what
/// differs between kernels, at a cost TCG can carry. The rest of e2e runs
/// on the host only (CLI error paths, `top`'s terminal, metrics, quotas: the
/// same user-space code over the same programs).
pub const E2E_SUBSET: &[E2e] = &[
    // attach: the XDP program loaded, verified and attached by the agent in
    // native mode on veth, enforcing a limit; explain; detach on SIGINT.
    E2e { name: "udp_limit_holds_within_bounds_then_detaches", xdp: true },
    // apply: a hot reload through the agent's control socket, all or nothing.
    E2e { name: "apply_through_the_agent_is_all_or_nothing", xdp: true },
    // SIGKILL/restart: a kept data plane outlives its agent, a restarted one
    // re-adopts the pinned maps (bpffs, pins, map ids on this kernel).
    E2e { name: "keep_survives_sigkill_and_restart_adopts_state", xdp: true },
    // BBR: the SYN stage's XDP_TX RST on veth, the fail-open grace, re-adoption.
    E2e { name: "bbr_refuses_connections_beyond_the_limit_and_fails_open", xdp: true },
    // KLimiter egress: the TC egress counter, attached with TCX (6.6+) or a
    // clsact qdisc (6.1), as the baseline's level.
    E2e { name: "klimiter_holds_an_egress_level_by_cutting_low_priority_first", xdp: true },
    // detach with an agent running: the agent stops before its egress
    // filters go, and nothing is left in /run or bpffs (6.1 has no TCX, so
    // the clsact path is the one exercised there).
    E2e { name: "detach_stops_the_agent_before_its_egress_filters_go", xdp: true },
    // Breakers: the cgroup connect4 and sock_ops programs, bpf_set_retval
    // (5.18+), on the VMs' pure cgroup v2 hierarchy; no XDP. State mode
    // covers both hooks (local refusals with the configured errno, handshake
    // timeouts and probes seen by sock_ops). The SRE-mode test
    // (breaker_sre_fails_fast_at_the_predicted_share_and_recovers) is left
    // to the host: ~150 s per VM (a quarter of the subset's time) for the
    // same hooks, and its predicted refusal shares need request volumes a
    // Python client under TCG does not reliably make.
    E2e { name: "breaker_state_opens_on_timeouts_probes_and_closes", xdp: false },
    // attach --multiprog: flowctl and xdp-filter in one libxdp dispatcher
    // (extension programs, which the host kernel refuses: the VMs are where
    // it runs), through libxdp's rebuilds, a restart and detach.
    E2e { name: "flowctl_and_xdp_filter_share_an_interface", xdp: true },
    // The egress shaper with fq (the host kernel has no fq: the VMs are
    // where it runs at all), a TCP and a UDP sender paced to their rates.
    // About a minute per kernel; where TCG starves the sender it reports
    // the lower bound unchecked rather than failing.
    E2e { name: "shaper_paces_tcp_and_udp_senders", xdp: true },
];

/// End-to-end tests the VMs run under `--full` only: none today (the
/// shaper's moved into the default subset, so CI runs it).
pub const E2E_FULL_VM: &[E2e] = &[];

/// One line of the summary.
pub struct Row {
    pub tier: String,
    pub counts: tee::Counts,
    /// Why the row failed beyond its failed tests (exit status, no result line, timeout).
    pub problem: Option<String>,
    /// Wall time of the tier's binary.
    pub secs: Option<f64>,
    /// Not run, and why (not a failure by itself).
    pub skipped: Option<String>,
    /// Anything else to say.
    pub note: Option<String>,
}

impl Row {
    pub fn new(
        tier: &str,
        counts: tee::Counts,
        problem: Option<String>,
        secs: Option<f64>,
    ) -> Self {
        Row { tier: tier.to_string(), counts, problem, secs, skipped: None, note: None }
    }

    pub fn failed(&self) -> bool {
        self.problem.is_some() || self.counts.failed > 0
    }
}

/// One kernel's rows and wall time.
pub struct KernelRun {
    pub kernel: String,
    pub rows: Vec<Row>,
    pub wall: Duration,
    /// For a VM: seconds from launch to the guest script's start, as the guest saw them.
    pub boot_s: Option<f64>,
    /// For a failed VM: the console's tail, printed after the summary.
    pub console_tail: Option<String>,
}

/// A test executable of flowctl-tests, by its target name.
pub struct TestBin {
    pub name: String,
    pub path: PathBuf,
}
