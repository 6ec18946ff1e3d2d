//! The real XDP program, loaded (not attached) under a unique pin directory,
//! with a profile applied, for `BPF_PROG_TEST_RUN`.

use aya::{
    programs::{TestRun, TestRunOptions, Xdp},
    Ebpf,
};
use flowctl::{
    dataplane::{self, pins::AttachId, state::AttachState, Maps},
    profile,
};
use flowctl_common::{RuleCounters, GLOBAL_COUNTER_INDEX};
use std::time::Duration;

pub struct TestPlane {
    pub ebpf: Ebpf,
    pub id: AttachId,
    pub maps: Maps,
    pub state: AttachState,
    kernel_log: Option<(aya_log::EbpfLogger<KernelEvents>, KernelEvents)>,
}

/// What `TestPlane::kernel_events` collects the records into.
#[derive(Clone, Default)]
struct KernelEvents(std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>);

impl log::Log for KernelEvents {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        self.0.lock().unwrap().push((r.target().to_string(), r.args().to_string()));
    }
    fn flush(&self) {}
}

impl TestPlane {
    /// Loads the program and applies `profile_text` (panics with context).
    pub fn new(profile_text: &str) -> Self {
        Self::new_with(profile_text, |_| {})
    }

    /// As `new`, with the parsed settings changed by `tweak` before loading
    /// (for what profiles cannot say, like the benchmarks' statistics off).
    pub fn new_with(profile_text: &str, tweak: impl FnOnce(&mut profile::Settings)) -> Self {
        Self::new_variant(profile_text, tweak, dataplane::XdpVariant::for_kernel())
    }

    /// As `new_with`, with the XDP variant chosen (the benchmark needs the
    /// single-buffer one: it tail-calls into it from a single-buffer program).
    pub fn new_variant(
        profile_text: &str,
        tweak: impl FnOnce(&mut profile::Settings),
        variant: dataplane::XdpVariant,
    ) -> Self {
        dataplane::pins::ensure_bpffs().expect("bpffs");
        remove_orphaned_test_pins();
        let mut set = profile::parse("test.toml", profile_text).expect("test profile");
        tweak(&mut set.settings);
        // netns inode 1 never exists, so these pins cannot collide with a real attachment.
        let ifindex = test_ifindex(std::process::id(), next());
        let id = AttachId { netns_ino: 1, ifindex };
        let _ = dataplane::detach(&id);
        let ebpf =
            dataplane::load_variant(&id, &set.settings, variant).expect("load the XDP program");
        let mut maps = Maps::open(&id).expect("open pinned maps");
        let mut state = AttachState::fresh(id, "test", None, "test".into(), &set.settings, 0);
        dataplane::apply(&mut maps, &mut state, &set).expect("apply");
        dataplane::write_shapers(&mut maps, &set.shapers).expect("write the shapers");
        Self { ebpf, id, maps, state, kernel_log: None }
    }

    /// The TC egress shaper's verdict on `frame` sent with `skb->tstamp`
    /// = `tstamp`, and the `tstamp` it left (BPF_PROG_TEST_RUN with a
    /// `__sk_buff` context in and out; the program is loaded on first use).
    pub fn shape(&mut self, frame: &[u8], tstamp: u64) -> (u32, u64) {
        /// `struct __sk_buff` up to and including `hwtstamp` (192 bytes);
        /// `tstamp` at 152 (include/uapi/linux/bpf.h).
        const SKB_CTX: usize = 192;
        const TSTAMP: usize = 152;
        let prog: &mut aya::programs::SchedClassifier = self
            .ebpf
            .program_mut(flowctl_common::SHAPER_PROGRAM)
            .expect("the shaper program")
            .try_into()
            .unwrap();
        if prog.fd().is_err() {
            prog.load().expect("load the shaper");
        }
        let mut ctx_in = [0u8; SKB_CTX];
        ctx_in[TSTAMP..TSTAMP + 8].copy_from_slice(&tstamp.to_ne_bytes());
        let mut ctx_out = [0u8; SKB_CTX];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.ctx_in = Some(&ctx_in);
        opts.ctx_out = Some(&mut ctx_out);
        opts.repeat = 1;
        let r = prog.test_run(opts).expect("BPF_PROG_TEST_RUN of the shaper");
        let out = u64::from_ne_bytes(ctx_out[TSTAMP..TSTAMP + 8].try_into().unwrap());
        (r.return_value, out)
    }

    pub fn apply(&mut self, profile_text: &str) {
        let set = profile::parse("test.toml", profile_text).expect("test profile");
        dataplane::apply(&mut self.maps, &mut self.state, &set).expect("apply");
    }

    /// The loaded XDP program (the variant `new` chose for this kernel).
    pub fn prog(&self) -> &Xdp {
        self.ebpf.program(self.prog_name()).unwrap().try_into().unwrap()
    }

    pub fn prog_name(&self) -> &'static str {
        dataplane::loaded_xdp(&self.ebpf).expect("a loaded XDP program")
    }

    /// The program's verdict for one frame.
    pub fn run(&self, frame: &[u8]) -> u32 {
        self.run_repeat(frame, 1).0
    }

    /// Verdict and kernel-reported mean duration per run.
    pub fn run_repeat(&self, frame: &[u8], repeat: u32) -> (u32, Duration) {
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.repeat = repeat;
        let r = self.prog().test_run(opts).expect("BPF_PROG_TEST_RUN");
        (r.return_value, r.duration)
    }

    /// The program's verdict and the frame as it left (XDP_TX replies).
    pub fn run_out(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let mut out = vec![0u8; frame.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        opts.repeat = 1;
        let r = self.prog().test_run(opts).expect("BPF_PROG_TEST_RUN");
        out.truncate(r.data_size_out as usize);
        (r.return_value, out)
    }

    /// The record of rule `name`.
    pub fn record(&self, rule: &str) -> u32 {
        self.state
            .rules
            .iter()
            .find(|r| r.name == rule)
            .unwrap_or_else(|| panic!("no rule {rule}"))
            .record
    }

    /// Makes the kernel see a live agent (fresh heartbeat) or a dead one.
    pub fn set_heartbeat(&mut self, alive: bool) {
        let mut g = self.maps.global().unwrap();
        g.heartbeat_ns = if alive { flowctl::system::clock::monotonic_ns() } else { 1 };
        g.grace_ns = 3_000_000_000;
        self.maps.global.set(0, g, 0).unwrap();
    }

    pub fn counters(&self, rule: &str) -> RuleCounters {
        let rec = self.record(rule);
        self.maps.counters(rec).unwrap()
    }

    pub fn unmatched(&self) -> RuleCounters {
        self.maps.counters(GLOBAL_COUNTER_INDEX).unwrap()
    }

    /// A rule's statistics ring summed over the last few buckets, the
    /// current one included (tests run well inside one ring span).
    pub fn ring(&self, rule: &str) -> flowctl_common::stats::StatsSum {
        self.ring_of(self.record(rule))
    }

    /// The unmatched traffic's ring, as `ring`.
    pub fn unmatched_ring(&self) -> flowctl_common::stats::StatsSum {
        self.ring_of(GLOBAL_COUNTER_INDEX)
    }

    fn ring_of(&self, rec: u32) -> flowctl_common::stats::StatsSum {
        let shape = self.state.stats;
        let cur = flowctl_common::stats::epoch_of(
            flowctl::system::clock::monotonic_ns(),
            shape.bucket_ns,
        );
        let back = (shape.buckets as u64 - 1).min(cur - 1);
        self.maps.stats_epochs(rec, &shape, cur - back..cur + 1).unwrap()
    }

    /// The kernel events (aya-log records: target, message) the program
    /// wrote since the last call; the plane must have been loaded with
    /// `kernel_events` on.
    pub fn kernel_events(&mut self) -> Vec<(String, String)> {
        if self.kernel_log.is_none() {
            let into = KernelEvents::default();
            let logger = aya_log::EbpfLogger::init_with_logger(&mut self.ebpf, into.clone())
                .expect("the object's kernel-event ring");
            self.kernel_log = Some((logger, into));
        }
        let (logger, into) = self.kernel_log.as_mut().expect("set above");
        logger.flush();
        std::mem::take(&mut *into.0.lock().unwrap())
    }

    /// Every key sample the kernel has written since the last call.
    pub fn key_samples(&self) -> Vec<flowctl_common::KeySample> {
        dataplane::KeySamples::open(&self.id).unwrap().drain(usize::MAX)
    }

    /// One of the plane's pinned maps (`map_names::*`), untyped.
    pub fn pinned(&self, name: &str) -> aya::maps::MapData {
        aya::maps::MapData::from_pin(self.id.pin_dir().join(name)).unwrap()
    }

    /// One of the plane's pinned LRU hash tables, typed, to read what the
    /// kernel keeps per key.
    pub fn lru_table<K: aya::Pod, V: aya::Pod>(
        &self,
        name: &str,
    ) -> aya::maps::HashMap<aya::maps::MapData, K, V> {
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(self.pinned(name))).unwrap()
    }

    pub fn verified_insns(&self) -> u32 {
        self.prog().info().unwrap().verified_instruction_count().unwrap_or(0)
    }
}

/// Pins the calling thread to one CPU (BPF_PROG_TEST_RUN runs on the caller's).
pub fn pin_to_cpu(cpu: usize) {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Two threads, pinned to CPUs 0 and 1, each running `frame` through the
/// program `calls` times with `repeat` repetitions per call.
pub fn hammer_on_two_cpus(
    plane: &std::sync::Arc<TestPlane>,
    frame: &[u8],
    calls: usize,
    repeat: u32,
) {
    let handles: Vec<_> = (0..2)
        .map(|cpu| {
            let (p, frame) = (plane.clone(), frame.to_vec());
            std::thread::spawn(move || {
                pin_to_cpu(cpu);
                for _ in 0..calls {
                    p.run_repeat(&frame, repeat);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("hammer thread");
    }
}

/// Test planes pin under netns inode 1 (never a real namespace) with an
/// ifindex that encodes the pid (`1_000_000 + pid % 100_000 * 10 + n`). A run
/// that was killed leaves its pins (and their preallocated maps) behind:
/// remove those whose process is gone.
fn remove_orphaned_test_pins() {
    let Ok(rd) = std::fs::read_dir(dataplane::pins::ifaces_root()) else { return };
    let me = std::process::id() % 100_000;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(ifindex) = name.strip_prefix("1-").and_then(|i| i.parse::<u32>().ok()) else {
            continue;
        };
        if ifindex < 1_000_000 {
            continue;
        }
        let pid = (ifindex - 1_000_000) / PLANES_PER_PROCESS;
        let alive = pid == me || std::path::Path::new(&format!("/proc/{pid}")).exists();
        if !alive {
            let _ = dataplane::detach(&AttachId { netns_ino: 1, ifindex });
        }
    }
}

/// Planes one process may hold at once, each under its own pin directory.
/// It was 10, and the benchmark holds more: its eleventh plane took the
/// first one's id, and `new_variant`'s detach of a stale id removed the
/// live plane's pins (section 3 then read no memory at all).
const PLANES_PER_PROCESS: u32 = 1000;

/// The test plane's interface index: the process (its pid, mod 100,000)
/// and its `n`th plane, 1,000,000 up so no real interface has it.
fn test_ifindex(pid: u32, n: u32) -> u32 {
    1_000_000 + (pid % 100_000) * PLANES_PER_PROCESS + n % PLANES_PER_PROCESS
}

fn next() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed) % PLANES_PER_PROCESS
}

impl Drop for TestPlane {
    fn drop(&mut self) {
        let _ = dataplane::detach(&self.id);
        let _ = std::fs::remove_dir_all(self.id.run_dir());
        // Nothing of the test stays on the machine (the pin and run roots
        // too, once no other plane or attachment is in them).
        dataplane::pins::prune_empty_roots();
    }
}

#[cfg(test)]
mod tests {
    use super::{test_ifindex, PLANES_PER_PROCESS};

    #[test]
    fn a_process_holds_its_planes_apart_and_its_pid_reads_back() {
        let ids: std::collections::BTreeSet<u32> =
            (0..PLANES_PER_PROCESS).map(|n| test_ifindex(4_194_303, n)).collect();
        assert_eq!(ids.len(), PLANES_PER_PROCESS as usize, "every plane its own id");
        let top = test_ifindex(99_999, PLANES_PER_PROCESS - 1);
        assert!(top > 1_000_000, "above every real interface index");
        assert_eq!((top - 1_000_000) / PLANES_PER_PROCESS, 99_999, "the pid reads back");
    }
}
