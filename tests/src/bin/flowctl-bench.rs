//! `cargo xtask bench`: measures flowctl against references in one run and
//! prints ratios (absolute numbers drift 15-25% on these machines; ratios
//! within one run hold to a few percent). docs/benchmarks.md records results.
//!
//! 1. BPF_PROG_TEST_RUN, kernel-reported ns/packet, spreading packets over
//!    10k and 1M source keys with `bench_spread` (bench/ebpf), for the
//!    XDP_PASS floor, the bare reference (`bench_bare`), and flowctl's
//!    admitted and drop paths with the committed bench/profile.toml (40
//!    rules; the measured rule is in the middle, keyed by source IP). flowctl
//!    runs with its shipped counters on.
//!    Its subsections (1b-1n, docs/benchmarks.md) measure one stage each;
//!    1n (`own-table` alone) measures per-rule key tables on the reference
//!    programs (`bench_own_table`, `bench_cache_then_own_table`).
//! 2. Rule-count independence: flowctl's admitted path with 8 and 256 rules.
//! 3. Kernel bytes per key of flowctl's tables, from fdinfo memlock.
//! 4. Drop rate through a veth pair: `bench_gen` in live-frames mode walks N
//!    sources and redirects into one end; the other end runs, behind one XDP
//!    link re-pointed every 0.5 s, the XDP_DROP ceiling, the bare reference
//!    and flowctl (all refusing after each key's first packet), then XDP_PASS
//!    with the nftables netdev-ingress meter of bench/nftables.nft.
//! 6. `overload` (run alone): the BBR overload experiment (see
//!    `flowctl_tests::overload`).
//! 5. The agent's own CPU use: the real agent (`FLOWCTL_BIN`) on a veth lab
//!    with 1M keys in its key table and 1M sources in its source cache,
//!    while `flowctl top --once` runs and the metrics endpoint is scraped
//!    every second, over a minute (15 s with `quick`): CPU time / wall time.
//! 7. `breaker` (also after 5): the circuit breakers' connect() cost and
//!    recovery (`flowctl_tests::breaker_bench`).
//! 8. `fleet` (also last in the full run): the simulated 200-host fleet
//!    (`flowctl::fleet::global::sim::report`) beside the peers' published
//!    behaviour, and a global rule's per-packet cost over the same rule
//!    local (leased key, unleased key at the default share; admitted and
//!    dropped), with section 1's spreader at its key counts; then the real
//!    three-agent lab (`flowctl_tests::fleet_bench`: real agents and a real
//!    Redis, accuracy from the kernels' counters, convergence after a
//!    shift, Redis operations per agent). `fleet packet` runs the
//!    per-packet cost alone, `fleet lab` the lab alone.

use aya::{
    maps::{Array, ArrayOfMaps, MapData, ProgramArray},
    programs::{ProgramFd, TestRun, TestRunOptions, Xdp},
    Ebpf, EbpfLoader,
};
use flowctl_tests::{packet::*, testrun::TestPlane};
use std::time::Duration;

/// Interleaved rounds per measurement; the median is reported. Many short
/// rounds beat few long ones on these shared machines.
const ROUNDS: usize = 15;

struct Refs {
    ebpf: Ebpf,
}

impl Refs {
    fn load() -> Self {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries("BENCH_SOURCE_CACHE", 1 << 20)
            .load(flowctl_bench::bench_object())
            .expect("load bench object");
        for p in [
            "bench_pass",
            "bench_spread",
            "bench_bare",
            "bench_bare_small",
            "bench_own_table",
            "bench_cache_then_own_table",
        ] {
            let prog: &mut Xdp = ebpf.program_mut(p).unwrap().try_into().unwrap();
            prog.load().unwrap_or_else(|e| panic!("{p}: {e}"));
        }
        // Rule 0's own table, as large as the bare reference's; the outer
        // array holds a reference to it, so this handle may go.
        let table = MapData::create(
            aya_obj::Map::new_from_params(
                aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_LRU_HASH as u32,
                16,
                8,
                1 << 20,
                0,
            ),
            "bench_rule0",
            None,
        )
        .expect("create rule 0's own table");
        let mut tables: ArrayOfMaps<_, MapData> =
            ArrayOfMaps::try_from(ebpf.map_mut("BENCH_RULE_TABLES").unwrap()).unwrap();
        tables.set(0, &table, 0).expect("set rule 0's own table");
        Self { ebpf }
    }

    fn fd(&self, name: &str) -> ProgramFd {
        let p: &Xdp = self.ebpf.program(name).unwrap().try_into().unwrap();
        p.fd().unwrap().try_clone().unwrap()
    }

    fn set_target(&mut self, fd: &ProgramFd) {
        let mut next: ProgramArray<_> =
            ProgramArray::try_from(self.ebpf.map_mut("BENCH_NEXT").unwrap()).unwrap();
        next.set(0, fd, 0).unwrap();
    }

    fn set_keys(&mut self, n: u32) {
        let mut cfg: Array<_, u32> =
            Array::try_from(self.ebpf.map_mut("BENCH_CONFIG").unwrap()).unwrap();
        cfg.set(0, n, 0).unwrap();
        cfg.set(1, 0x0a00_0000, 0).unwrap(); // 10.0.0.0 + i: inside `measured`'s 10.0.0.0/8
    }

    fn set_bare_limit(&mut self, interval_fp: u64, burst_ns: u64) {
        let mut l: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("BENCH_LIMIT").unwrap()).unwrap();
        l.set(0, interval_fp, 0).unwrap();
        l.set(1, burst_ns, 0).unwrap();
    }

    /// Mean kernel-reported ns per packet through `bench_spread` -> target.
    fn run(&self, frame: &[u8], repeat: u32) -> (u32, f64) {
        let p: &Xdp = self.ebpf.program("bench_spread").unwrap().try_into().unwrap();
        let mut o = TestRunOptions::new();
        o.data_in = Some(frame);
        o.repeat = repeat;
        let r = p.test_run(o).expect("test run");
        (r.return_value, r.duration.as_nanos() as f64)
    }
}

impl Refs {
    /// Fills every target's tables as section 1's 1M-key row filled the
    /// reference's and `admit`'s: a section that compares a plane loaded
    /// afterwards with them would otherwise set a fresh table (10k entries)
    /// against a full one (1M), and the full one's lookups miss the cache
    /// more (about 70-150 ns for the bare reference, section 1l). Leaves
    /// the spreader at 10k keys.
    fn fill(&mut self, targets: &[ProgramFd], frame: &[u8]) {
        self.set_keys(1 << 20);
        self.touch_each(targets, frame, 1 << 20);
        self.set_keys(10_000);
    }

    /// Runs `frame` `runs` times through each target, unmeasured: with
    /// `runs` at least the spreader's key count, every key exists after.
    fn touch_each(&mut self, targets: &[ProgramFd], frame: &[u8], runs: u32) {
        for fd in targets {
            self.set_target(fd);
            self.run(frame, runs);
        }
    }

    /// Runs `frame` through each target behind the spreader: first once per
    /// key (so every key exists), then `ROUNDS` interleaved rounds of
    /// `repeat` runs. Returns each target's median ns/packet and last verdict.
    fn interleaved(
        &mut self,
        targets: &[ProgramFd],
        frame: &[u8],
        keys: u32,
        repeat: u32,
    ) -> (Vec<f64>, Vec<u32>) {
        self.interleaved_with(targets, frame, keys, repeat, || {})
    }

    /// As `interleaved`, calling `between` after the warm-up and after each
    /// round, outside the measured runs (the fleet section drains the
    /// hot-key rings there, as the agent would).
    fn interleaved_with(
        &mut self,
        targets: &[ProgramFd],
        frame: &[u8],
        keys: u32,
        repeat: u32,
        mut between: impl FnMut(),
    ) -> (Vec<f64>, Vec<u32>) {
        self.touch_each(targets, frame, keys);
        between();
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
        let mut verdicts = vec![0u32; targets.len()];
        for _ in 0..ROUNDS {
            for (i, fd) in targets.iter().enumerate() {
                self.set_target(fd);
                let (v, ns) = self.run(frame, repeat);
                verdicts[i] = v;
                samples[i].push(ns);
            }
            between();
        }
        (samples.into_iter().map(median).collect(), verdicts)
    }
}

/// The benchmark's planes load the single-buffer XDP variant explicitly:
/// `bench_spread` (a single-buffer program) tail-calls into them, and the
/// kernel refuses tail calls between frags and single-buffer programs;
/// the live-traffic run re-points one link between them and the reference
/// programs, which are single-buffer too.
fn plane(profile: &str) -> TestPlane {
    plane_with(profile, |_| {})
}

fn plane_with(profile: &str, tweak: impl FnOnce(&mut flowctl::profile::Settings)) -> TestPlane {
    TestPlane::new_variant(profile, tweak, flowctl::dataplane::XdpVariant::Single)
}

/// Puts `rule` of `plane` in the state the agent's flood loop leaves a
/// flooded rule in: the pool's first sketch lent, the flood flag set, and
/// the heartbeat check off (grace 0), so the kernel honours both for the
/// whole run.
fn lend_a_sketch(plane: &mut TestPlane, rule: &str) {
    let now = flowctl::system::clock::monotonic_ns();
    let record = plane.record(rule);
    let maps = &mut plane.maps;
    maps.update_control(record, now, |e| e.set_sketch(Some(0))).unwrap();
    maps.update_control(flowctl_common::GLOBAL_COUNTER_INDEX, now, |e| e.set_flood(true)).unwrap();
    let mut g = maps.global().unwrap();
    g.grace_ns = 0;
    maps.global.set(0, g, 0).unwrap();
}

fn xdp_fd(plane: &TestPlane) -> ProgramFd {
    let p: &Xdp = plane.prog();
    p.fd().unwrap().try_clone().unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn rules_profile(n: usize) -> String {
    // n-1 port-range rules that the measured traffic does not match, then the
    // measured rule last: the worst case for a linear matcher.
    let mut s = String::from(
        "[settings]\nkey_table_entries = 65536\nsource_cache_entries = 65536\nmax_rules = 256\n",
    );
    for i in 0..n - 1 {
        s += &format!("[[rule]]\nname = \"r{i}\"\nproto = \"udp\"\nsrc = \"10.0.0.0/8\"\ndport = {}\nrate = \"1000/s\"\nkey = \"src\"\n", 20000 + i);
    }
    s += "[[rule]]\nname = \"measured\"\nproto = \"udp\"\ndport = 9000\nrate = \"100G/s\"\nkey = \"src\"\n";
    s
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve-cpu") {
        flowctl_tests::overload::serve_cpu(&args[2], &args[3], &args[4]);
    }
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("bench: needs root (sudo -E cargo xtask bench)");
        std::process::exit(2);
    }
    let quick = std::env::args().any(|a| a == "quick");
    if args.get(1).map(String::as_str) == Some("annotate") {
        // `perf script -F ip -i DATA | flowctl-bench annotate DIR [MIN_SHARE]`:
        // the samples of a `spin ... --jit DIR` run, per function and
        // instruction (`flowctl_tests::jit_profile`).
        let dir = std::path::Path::new(args.get(2).expect("annotate DIR [MIN_SHARE]"));
        let min_share = args.get(3).map_or(0.02, |m| m.parse().expect("MIN_SHARE: a fraction"));
        let samples = std::io::read_to_string(std::io::stdin()).expect("read the samples");
        match flowctl_tests::jit_profile::annotate(dir, &samples, min_share) {
            Ok(report) => print!("{report}"),
            Err(e) => {
                eprintln!("bench: annotate: {e:#}");
                std::process::exit(1);
            }
        }
        return;
    }
    if std::env::args().any(|a| a == "overload") {
        println!("6. Overload: BBR on and off against a CPU-bound service at 3x its capacity");
        let bin = std::env::var_os(flowctl_tests::cli::BIN_ENV)
            .expect("FLOWCTL_BIN (cargo xtask bench sets it)");
        flowctl_tests::overload::run(&std::env::current_exe().unwrap(), std::path::Path::new(&bin));
        return;
    }
    if std::env::args().any(|a| a == "breaker") {
        breaker_section(quick);
        return;
    }
    if std::env::args().any(|a| a == "shaper") {
        // `bench shaper [quick]`: section 9 alone.
        println!("9. The egress shaper");
        flowctl_tests::shaper_bench::run(quick);
        return;
    }
    if std::env::args().any(|a| a == "fleet") && std::env::args().any(|a| a == "lab") {
        // `bench fleet lab`: the real three-agent lab (8c) alone.
        println!("8. Fleet: one limit across many hosts (docs/fleet.md, \"Global limits\")");
        if let Err(e) = flowctl_tests::fleet_bench::run(quick) {
            eprintln!("bench: {e}");
            std::process::exit(1);
        }
        return;
    }
    if std::env::args().any(|a| a == "fleet") && std::env::args().any(|a| a == "packet") {
        // `bench fleet packet`: the per-packet cost of a global rule (8b) alone.
        flowctl_tests::testrun::pin_to_cpu(0);
        let mut refs = Refs::load();
        println!("8b. Per-packet cost of a global rule over a local one (BPF_PROG_TEST_RUN, kernel-reported ns/packet)");
        fleet_packet_cost(&mut refs, &bench_profile(), &bench_frame(), quick);
        return;
    }
    if std::env::args().any(|a| a == "fleet") {
        // BPF_PROG_TEST_RUN runs on the caller's CPU: one CPU, as section 1.
        flowctl_tests::testrun::pin_to_cpu(0);
        let mut refs = Refs::load();
        fleet_section(&mut refs, &bench_profile(), &bench_frame(), quick);
        return;
    }
    if std::env::args().any(|a| a == "isolated") {
        // `flowctl-bench isolated [quick]`: section 1o alone.
        flowctl_tests::testrun::pin_to_cpu(0);
        let mut refs = Refs::load();
        let repeat = repeat_for(quick);
        isolated_section(&mut refs, &bench_profile(), &bench_frame(), quick, repeat);
        return;
    }
    if std::env::args().any(|a| a == "inline-parse") {
        // `flowctl-bench inline-parse [quick]`: section 1p alone.
        flowctl_tests::testrun::pin_to_cpu(0);
        let mut refs = Refs::load();
        let repeat = repeat_for(quick);
        inline_parse_section(&mut refs, &bench_profile(), &bench_frame(), quick, repeat);
        return;
    }
    if std::env::args().any(|a| a == "veth") {
        // `flowctl-bench veth [quick]`: section 4 alone, on both CPUs as in
        // the full run (the generator pins itself).
        let mut refs = Refs::load();
        let drop_profile = refusing_profile(&bench_profile());
        println!("4. Drop rate through veth (live-frames generator), Mpps dropped by the limiter");
        veth_drop_rates(
            &mut refs,
            &drop_profile,
            if quick { &[10_000] } else { &[10_000, 1_000_000] },
            quick,
        );
        return;
    }
    if std::env::args().any(|a| a == "own-table") {
        // `flowctl-bench own-table [quick]`: section 1n alone.
        flowctl_tests::testrun::pin_to_cpu(0);
        let mut refs = Refs::load();
        let set = flowctl::profile::parse("bench", &bench_profile()).unwrap();
        let m = set.rules.iter().position(|r| r.name == "measured").unwrap();
        refs.set_bare_limit(set.rules[m].interval_fp, set.rules[m].burst_ns);
        own_table_section(&mut refs, &bench_frame(), quick, repeat_for(quick));
        return;
    }
    if std::env::args().any(|a| a == "agent") {
        println!("5. The agent's CPU with 1M keys while top and the metrics refresh every second");
        agent_cpu(if quick { 15 } else { 60 });
        return;
    }
    // One CPU for the measuring thread: BPF_PROG_TEST_RUN runs on the caller's CPU.
    flowctl_tests::testrun::pin_to_cpu(0);
    let profile = bench_profile();
    let drop_profile = refusing_profile(&profile);
    let frame = bench_frame();
    println!(
        "machine: {} CPUs online, kernel {}",
        unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) },
        std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim()
    );
    println!(
        "frame: {} bytes IPv4/UDP; {ROUNDS} interleaved rounds, median reported\n",
        frame.len()
    );

    if let Some(i) = args.iter().position(|a| a == "spin") {
        // `flowctl-bench spin VARIANT SECONDS [--jit DIR]`: one path (floor, bare, full,
        // nomatch: parse and classify only, or quota: full with section 1b's
        // quota) run for SECONDS on CPU 0, for
        // a profiler to attribute its time to the program's functions
        // (`perf record -C 0`; docs/benchmarks.md, "How to reproduce").
        let variant = args[i + 1].clone();
        let secs: f64 = args[i + 2].parse().unwrap();
        // Only the spun variant's plane is loaded: each holds its own
        // 1M-entry tables.
        let spun_text = match variant.as_str() {
            "bare" | "floor" => None,
            "full" | "full-functions" => Some(profile.clone()),
            "nomatch" => Some(profile.replace("dport = \"9000-9010\"", "dport = \"19000-19010\"")),
            "quota" => Some(quota_profile(&profile)),
            other => {
                eprintln!("bench: spin takes floor, bare, full, full-functions (the parser's functions for every frame), nomatch or quota, not {other:?}");
                std::process::exit(2);
            }
        };
        let mut refs = Refs::load();
        let set = flowctl::profile::parse("bench", &profile).unwrap();
        let m = set.rules.iter().position(|r| r.name == "measured").unwrap();
        refs.set_bare_limit(set.rules[m].interval_fp, set.rules[m].burst_ns);
        refs.set_keys(10_000);
        let spun = spun_text
            .map(|text| plane_with(&text, |s| s.fast_parse = variant.as_str() != "full-functions"));
        let fd = match (&spun, variant.as_str()) {
            (Some(p), _) => xdp_fd(p),
            (None, "bare") => refs.fd("bench_bare"),
            (None, _) => refs.fd("bench_pass"),
        };
        refs.set_target(&fd);
        // `--jit DIR`: the spun program's JIT image, for `annotate`.
        if let Some(dir) = args.iter().position(|a| a == "--jit").map(|j| &args[j + 1]) {
            use std::os::fd::AsFd as _;
            flowctl_tests::jit_profile::dump(fd.as_fd(), std::path::Path::new(dir))
                .unwrap_or_else(|e| panic!("bench: dump the JIT image: {e:#}"));
        }
        let t = std::time::Instant::now();
        let mut n = 0;
        let mut sum = 0.0;
        while t.elapsed().as_secs_f64() < secs {
            sum += refs.run(&frame, 100_000).1;
            n += 1;
        }
        println!("{variant}: {:.1} ns/packet over {n} runs", sum / n as f64);
        return;
    }
    let mut refs = Refs::load();
    // The bare reference's limit: same generous rate as `measured` for the
    // admit path (the drop path is flowctl-only; the bare program's drop path
    // is the same code with a refusal).
    let admit = plane(&profile);
    let dropper = plane(&drop_profile);
    let m = admit.state.rules.iter().position(|r| r.name == "measured").unwrap();
    let set = flowctl::profile::parse("bench", &profile).unwrap();
    refs.set_bare_limit(set.rules[m].interval_fp, set.rules[m].burst_ns);

    println!("1. BPF_PROG_TEST_RUN ns/packet (kernel-reported), packets spread over N source keys");
    println!(
        "{:>9} {:>9} {:>9} {:>13} {:>13} {:>11} {:>11} {:>14}",
        "keys",
        "floor",
        "bare",
        "flowctl-pass",
        "flowctl-drop",
        "bare/floor",
        "fc/floor",
        "fc-pass/bare"
    );
    let key_counts: &[u32] = if quick { &[10_000] } else { &[10_000, 1_000_000] };
    let repeat = repeat_for(quick);
    for &n in key_counts {
        refs.set_keys(n);
        // floor, bare, flowctl admitted, flowctl dropped
        let targets =
            [refs.fd("bench_pass"), refs.fd("bench_bare"), xdp_fd(&admit), xdp_fd(&dropper)];
        let (med, verdicts) = refs.interleaved(&targets, &frame, n, repeat);
        assert_eq!(verdicts[2], flowctl_common::XDP_PASS, "admit path passes");
        assert_eq!(verdicts[3], flowctl_common::XDP_DROP, "drop path drops");
        println!(
            "{:>9} {:>9.1} {:>9.1} {:>13.1} {:>13.1} {:>10.2}x {:>10.2}x {:>13.2}x",
            n,
            med[0],
            med[1],
            med[2],
            med[3],
            med[1] / med[0],
            med[2] / med[0],
            med[2] / med[1]
        );
        println!(
            "{:>9} flowctl drop path / bare: {:.2}x (target: flowctl within 1.5x of bare)",
            "",
            med[3] / med[1]
        );
    }

    println!("\n1b. The quota stage: flowctl's admitted path with and without a quota on `measured` (10k keys)");
    let quota_text = quota_profile(&profile);
    let with_quota = plane(&quota_text);
    // One bucket: the same lookup and swap, a 1-slot sum instead of 16.
    let one_bucket = plane(&quota_text.replace("quota_buckets = 16", "quota_buckets = 1"));
    let quota_fds = [xdp_fd(&admit), xdp_fd(&with_quota), xdp_fd(&one_bucket)];
    refs.fill(&quota_fds, &frame);
    let (qm, _) = refs.interleaved(&quota_fds, &frame, 10_000, repeat);
    println!(
        "  no quota: {:.1} ns/packet   with a 16-bucket quota: {:.1} ns/packet   ratio {:.2}x   (a 1-bucket quota: {:.1}, {:.2}x)",
        qm[0],
        qm[1],
        qm[1] / qm[0],
        qm[2],
        qm[2] / qm[0]
    );
    drop((with_quota, one_bucket));

    println!("\n1c. Statistics rings: flowctl's admitted path with statistics off, \"control\" and \"full\" (10k keys)");
    let lean = plane(&profile.replacen("[settings]", "[settings]\nstatistics = \"control\"", 1));
    let off = plane_with(&profile, |s| s.stats.level = flowctl_common::stats::level::OFF);
    assert_eq!(lean.state.stats.level, flowctl_common::stats::level::CONTROL);
    let stats_fds = [xdp_fd(&off), xdp_fd(&lean), xdp_fd(&admit)];
    refs.fill(&stats_fds, &frame);
    let (sm, _) = refs.interleaved(&stats_fds, &frame, 10_000, repeat);
    println!(
        "  off: {:.1} ns/packet   control: {:.1} ({:.2}x)   full: {:.1} ({:.2}x)   target: full within 1.15x of off",
        sm[0], sm[1], sm[1] / sm[0], sm[2], sm[2] / sm[0]
    );
    drop((lean, off));

    println!("\n1e. Nested limits: `measured` with 0 to 3 [[rule.limit]] (src /24, dport, rule), admitted and refused by the last (10k keys)");
    let nested = |n: usize, last_rate: &str| {
        let kinds = ["key = \"src_prefix\"", "key = \"dport\"", "key = \"rule\""];
        let limits: String = (0..n)
            .map(|i| {
                let rate = if i + 1 == n { last_rate } else { "100G/s" };
                format!("[[rule.limit]]\nrate = \"{rate}\"\n{}\n", kinds[i])
            })
            .collect();
        let text = profile.replace(
            "rate = \"100G/s\"\nkey = \"src\"\n",
            &format!("rate = \"100G/s\"\nkey = \"src\"\n{limits}"),
        );
        assert!(n == 0 || text != profile, "the limits went into `measured`");
        plane(&text)
    };
    let admitting: Vec<TestPlane> = (0..=3).map(|n| nested(n, "100G/s")).collect();
    let refusing: Vec<TestPlane> = (1..=3).map(|n| nested(n, "1/h")).collect();
    let fds: Vec<_> = admitting.iter().chain(&refusing).map(xdp_fd).collect();
    let (nm, verdicts) = refs.interleaved(&fds, &frame, 10_000, repeat);
    assert_eq!(verdicts[3], flowctl_common::XDP_PASS, "three limits admit");
    assert_eq!(verdicts[6], flowctl_common::XDP_DROP, "the third limit refuses");
    println!(
        "  admitted: 0 limits {:.1} ns/packet, 1 {:.1} ({:.2}x), 2 {:.1} ({:.2}x), 3 {:.1} ({:.2}x)",
        nm[0], nm[1], nm[1] / nm[0], nm[2], nm[2] / nm[0], nm[3], nm[3] / nm[0]
    );
    println!(
        "  refused by the last: 1 {:.1} ns/packet ({:.2}x the 0-limit admitted path), 2 {:.1} ({:.2}x), 3 {:.1} ({:.2}x)",
        nm[4], nm[4] / nm[0], nm[5], nm[5] / nm[0], nm[6], nm[6] / nm[0]
    );
    drop((admitting, refusing));

    println!("\n1g. Warm-up: `measured` as one aggregate bucket (key = \"rule\"), plain and with warm_up = \"1h\" (cold, on the ramp), admitted (10k keys)");
    let aggregate = profile.replace("rate = \"100G/s\"\nkey = \"src\"\n", "rate = \"100G/s\"\n");
    assert_ne!(aggregate, profile, "`measured` made an aggregate rule");
    let warm_text = aggregate
        .replace("rate = \"100G/s\"\n", "rate = \"100G/s\"\nwarm_up = \"1h\"\ncold_factor = 3\n");
    let (plain_bucket, warming) = (plane(&aggregate), plane(&warm_text));
    let (wm, verdicts) =
        refs.interleaved(&[xdp_fd(&plain_bucket), xdp_fd(&warming)], &frame, 10_000, repeat);
    assert_eq!(verdicts[1], flowctl_common::XDP_PASS, "the cold ramp admits");
    println!(
        "  plain aggregate bucket: {:.1} ns/packet   with the warm-up ramp: {:.1} ns/packet   ratio {:.2}x",
        wm[0],
        wm[1],
        wm[1] / wm[0]
    );
    drop((plain_bucket, warming));

    println!("\n1m. The flood sketch: `measured` flooded, every packet a key its 64k-entry source cache does not hold (300k keys; 1M in the full run), with buckets (each packet a cache miss, an insert that evicts, a bucket claimed) and lent a sketch (a miss, the trie, no insert, the sketch's two hashes and four cells); and the admitted path of cached keys (10k) for scale");
    let small_cache =
        profile.replace("source_cache_entries = 1048576", "source_cache_entries = 65536");
    assert_ne!(small_cache, profile);
    let (cached, bucketed, mut sketched) =
        (plane(&profile), plane(&small_cache), plane(&small_cache));
    lend_a_sketch(&mut sketched, "measured");
    refs.set_keys(10_000);
    let (cm, _) = refs.interleaved(&[xdp_fd(&cached)], &frame, 10_000, repeat);
    let flood_keys = if quick { 300_000 } else { 1_000_000 };
    refs.set_keys(flood_keys);
    let (sm, verdicts) =
        refs.interleaved(&[xdp_fd(&bucketed), xdp_fd(&sketched)], &frame, flood_keys, repeat);
    assert_eq!(verdicts[1], flowctl_common::XDP_PASS, "the sketch admits");
    let c = sketched.counters("measured");
    assert!(c.sketched_pkts > 0 && c.source_claims == 0, "decided by the sketch: {c:?}");
    println!(
        "  a flood packet with buckets: {:.1} ns/packet   with the sketch: {:.1} ns/packet ({:.2}x)   a cached key's admitted path: {:.1}",
        sm[0],
        sm[1],
        sm[1] / sm[0],
        cm[0]
    );
    refs.set_keys(10_000);
    drop((cached, bucketed, sketched));

    own_table_section(&mut refs, &frame, quick, repeat);
    isolated_section(&mut refs, &profile, &frame, quick, repeat);
    inline_parse_section(&mut refs, &profile, &frame, quick, repeat);

    println!("\n1i. Lists: the admitted path without and with a list of 1M /32s interleaved with the measured sources (every fourth address of 10.0.0.0/8 from 10.0.0.1, named by a `pass` rule after `measured`, so a trie lookup walks to full depth): sources in the cache (10k keys), and missing it (a 64k-entry source cache)");
    let list_file = million_list("src", [10, 0, 0, 1]);
    let listed = |p: &str| {
        format!(
            "{p}\n[[list]]\nname = \"interleaved\"\nfile = \"{}\"\n\n[[rule]]\nname = \"listed\"\nsrc = \"@interleaved\"\naction = \"pass\"\n",
            list_file.display()
        )
    };
    let small_cache =
        profile.replace("source_cache_entries = 1048576", "source_cache_entries = 65536");
    assert_ne!(small_cache, profile);
    let t = std::time::Instant::now();
    let list_planes = [
        plane(&profile),
        plane(&listed(&profile)),
        plane(&small_cache),
        plane(&listed(&small_cache)),
    ];
    println!("  (4 planes loaded in {:.1} s, two with the 1M list)", t.elapsed().as_secs_f64());
    let _ = std::fs::remove_file(&list_file);
    let fds: Vec<_> = list_planes.iter().map(xdp_fd).collect();
    refs.set_keys(10_000);
    let (hit, v) = refs.interleaved(&fds[..2], &frame, 10_000, repeat);
    assert!(v.iter().all(|v| *v == flowctl_common::XDP_PASS), "`measured` admits, listed or not");
    let miss_keys = if quick { 300_000 } else { 1_000_000 };
    refs.set_keys(miss_keys);
    let (miss, _) = refs.interleaved(&fds[2..], &frame, miss_keys, repeat);
    println!(
        "  cached: {:.1} ns/packet, with the list {:.1} ({:.2}x)   cache misses: {:.1} ns/packet, with the list {:.1} ({:.2}x, {:+.1} ns per lookup)",
        hit[0], hit[1], hit[1] / hit[0], miss[0], miss[1], miss[1] / miss[0], miss[1] - miss[0]
    );
    drop(list_planes);

    println!("\n1j. Destinations: the admitted path (sources cached, 10k keys) without `dst` rules, with one `dst` prefix rule after `measured` (the destination's trie lookup on every packet, small trie), and with a `dst` list of 1M /32s interleaved around the frames' destination 10.99.0.1 (every fourth address from 10.96.0.3: the lookup walks to full depth)");
    let dst_file = million_list("dst", [10, 96, 0, 3]);
    let with_dst = |dst: &str| {
        format!(
            "{profile}\n[[list]]\nname = \"interleaved\"\nfile = \"{}\"\n\n[[rule]]\nname = \"to-listed\"\ndst = \"{dst}\"\naction = \"pass\"\n",
            dst_file.display()
        )
    };
    let dst_planes =
        [plane(&profile), plane(&with_dst("192.0.2.0/24")), plane(&with_dst("@interleaved"))];
    let _ = std::fs::remove_file(&dst_file);
    let fds: Vec<_> = dst_planes.iter().map(xdp_fd).collect();
    refs.set_keys(10_000);
    let (dm, v) = refs.interleaved(&fds, &frame, 10_000, repeat);
    assert!(
        v.iter().all(|v| *v == flowctl_common::XDP_PASS),
        "`measured` admits, dst rules or not"
    );
    println!(
        "  no dst rule: {:.1} ns/packet   a dst prefix: {:.1} ({:.2}x, {:+.1} ns)   a 1M dst list: {:.1} ({:.2}x, {:+.1} ns)",
        dm[0], dm[1], dm[1] / dm[0], dm[1] - dm[0], dm[2], dm[2] / dm[0], dm[2] - dm[0]
    );
    drop(dst_planes);

    println!("\n1k. Where the time goes: the admitted and dropped paths built up a stage at a time by profile variants of `measured` (10k keys)");
    let measured_limit = "rate = \"100G/s\"\nkey = \"src\"\n";
    let stage_profiles = [
        // Parse and classify only: no rule matches the frames' port.
        profile.replace("dport = \"9000-9010\"", "dport = \"19000-19010\""),
        // Matched and counted, no bucket.
        profile.replace(measured_limit, "action = \"pass\"\n"),
        // The bucket, statistics rings off.
        profile.clone(),
        profile.clone(),
        // Dropped without a bucket, and by the bucket.
        profile.replace(measured_limit, "action = \"block\"\n"),
        drop_profile.clone(),
    ];
    for (i, p) in stage_profiles.iter().enumerate() {
        assert!(i == 2 || i == 3 || p != &profile, "variant {i} changed `measured`");
    }
    let stage_planes: Vec<TestPlane> = stage_profiles
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if i == 2 {
                plane_with(p, |s| s.stats.level = flowctl_common::stats::level::OFF)
            } else {
                plane(p)
            }
        })
        .collect();
    let mut fds = vec![refs.fd("bench_pass"), refs.fd("bench_bare")];
    fds.extend(stage_planes.iter().map(xdp_fd));
    refs.fill(&fds, &frame);
    let (st, v) = refs.interleaved(&fds, &frame, 10_000, repeat);
    assert_eq!(
        &v[2..],
        &[
            flowctl_common::XDP_PASS,
            flowctl_common::XDP_PASS,
            flowctl_common::XDP_PASS,
            flowctl_common::XDP_PASS,
            flowctl_common::XDP_DROP,
            flowctl_common::XDP_DROP
        ]
    );
    println!(
        "  floor {:.1}, bare {:.1} ns/packet; flowctl: no rule matches {:.1}, a `pass` rule {:.1}, the bucket with rings off {:.1}, with rings {:.1} ({:.2}x bare); `block` {:.1}, the bucket refusing {:.1} ({:.2}x bare)",
        st[0], st[1], st[2], st[3], st[4], st[5], st[5] / st[1], st[6], st[7], st[7] / st[1]
    );
    println!(
        "  over the floor: bare {:+.1}; parse and classify {:+.1}, match and count {:+.1}, bucket {:+.1}, rings {:+.1}; drop: block {:+.1} over the match, bucket refusing {:+.1} over block",
        st[1] - st[0], st[2] - st[0], st[3] - st[2], st[4] - st[3], st[5] - st[4], st[6] - st[3], st[7] - st[6]
    );
    drop(stage_planes);

    println!("\n1l. Table size: the bare reference and flowctl's admitted path with 1M-entry tables (the defaults) and 64k-entry ones, each filled to capacity, then the same 10k live keys");
    let small_tables = profile
        .replace("source_cache_entries = 1048576", "source_cache_entries = 65536")
        .replace("key_table_entries = 1048576", "key_table_entries = 65536");
    assert_ne!(small_tables, profile);
    let size_planes = [plane(&profile), plane(&small_tables)];
    let fds = [
        refs.fd("bench_bare"),
        refs.fd("bench_bare_small"),
        xdp_fd(&size_planes[0]),
        xdp_fd(&size_planes[1]),
    ];
    refs.fill(&fds, &frame);
    let (tm, v) = refs.interleaved(&fds, &frame, 10_000, repeat);
    assert!(v.iter().all(|v| *v == flowctl_common::XDP_PASS), "every variant admits");
    println!(
        "  bare: 1M {:.1}, 64k {:.1} ns/packet ({:+.1})   flowctl: 1M {:.1}, 64k {:.1} ({:+.1})   flowctl / bare: 1M {:.2}x, 64k {:.2}x",
        tm[0], tm[1], tm[1] - tm[0], tm[2], tm[3], tm[3] - tm[2], tm[2] / tm[0], tm[3] / tm[1]
    );
    drop(size_planes);

    if std::env::args().any(|a| a == "path") {
        // `bench path [quick]`: sections 1 to 1m alone (the per-packet
        // cost of the full path and of a quota, for a kernel change's note).
        return;
    }
    println!("\n2. Rule-count independence (flowctl admitted path, measured rule last, 10k keys)");
    refs.set_keys(10_000);
    let planes: Vec<(usize, TestPlane)> =
        [8usize, 256].iter().map(|&n| (n, plane(&rules_profile(n)))).collect();
    let fds: Vec<ProgramFd> = planes.iter().map(|(_, p)| xdp_fd(p)).collect();
    let (med, _) = refs.interleaved(&fds, &frame, 10_000, repeat);
    println!(
        "  8 rules: {:.1} ns/packet   256 rules: {:.1} ns/packet   ratio 256/8: {:.2}x",
        med[0],
        med[1],
        med[1] / med[0]
    );

    println!("\n3. Kernel memory per key (fdinfo memlock of the preallocated LRU tables)");
    let total = flowctl::dataplane::pinned_memlock(&admit.id);
    let est = set.settings.kernel_memory_bytes();
    println!(
        "  all maps: {} (the estimate `check` uses: {})",
        flowctl::profile::human_bytes(total),
        flowctl::profile::human_bytes(est)
    );
    for (name, entries) in [
        (flowctl_common::map_names::SRC_CACHE, set.settings.source_cache_entries),
        (flowctl_common::map_names::KEYS, set.settings.key_table_entries),
    ] {
        let bytes = flowctl::dataplane::map_memlock(&admit.id, name);
        println!(
            "  {name}: {:.1} kernel bytes per key ({} entries, {})",
            bytes as f64 / entries as f64,
            entries,
            flowctl::profile::human_bytes(bytes)
        );
    }
    println!("  (a source-keyed rule's key lives in the source cache alone; other keys take one key-table entry)");

    // The veth run needs both CPUs: generator on one, the rest free to move.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in 0..libc::sysconf(libc::_SC_NPROCESSORS_ONLN) as usize {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
    println!("\n4. Drop rate through veth (live-frames generator), Mpps dropped by the limiter");
    veth_drop_rates(
        &mut refs,
        &drop_profile,
        if quick { &[10_000] } else { &[10_000, 1_000_000] },
        quick,
    );

    println!("\n5. The agent's CPU with 1M keys while top and the metrics refresh every second");
    agent_cpu(if quick { 15 } else { 60 });

    println!();
    breaker_section(quick);

    println!();
    flowctl_tests::testrun::pin_to_cpu(0);
    fleet_section(&mut refs, &profile, &frame, quick);

    println!("\n9. The egress shaper");
    flowctl_tests::shaper_bench::run(quick);
}

/// `measured` with a 16-bucket quota that never binds (section 1b).
/// Section 1n: the data plane's cost of per-rule key tables (issue 17's
/// isolation), measured on the reference programs.
fn own_table_section(refs: &mut Refs, frame: &[u8], quick: bool, repeat: u32) {
    println!("\n1n. Per-rule key tables (issue 17's isolation, the data plane's half, in the reference programs): the bare reference's bucket in rule 0's own LRU hash (an array of maps: one more array lookup, and flowctl's 16-byte source key), then after a lookup in a 1M-entry source cache (classification's, which a source-keyed rule's bucket shares today); admitted, keys as section 1");
    let own_counts: &[u32] = if quick { &[10_000] } else { &[10_000, 1_000_000] };
    for &n in own_counts {
        refs.set_keys(n);
        let fds = [
            refs.fd("bench_bare"),
            refs.fd("bench_own_table"),
            refs.fd("bench_cache_then_own_table"),
        ];
        let (om, verdicts) = refs.interleaved(&fds, frame, n, repeat);
        assert!(verdicts.iter().all(|v| *v == flowctl_common::XDP_PASS), "all admit: {verdicts:?}");
        println!(
            "  {n:>9} keys: bare {:.1}   own table {:.1} ({:.2}x)   source cache then own table {:.1} ({:.2}x, {:+.1} ns)",
            om[0],
            om[1],
            om[1] / om[0],
            om[2],
            om[2] / om[0],
            om[2] - om[0]
        );
    }
    refs.set_keys(10_000);
}

/// Section 1o: `measured` isolated (`isolate = true`, its own 1M-entry
/// table) against the same rule in the shared tables, keyed by source
/// (whose bucket was in the source's cache entry) and by source and port
/// (which already paid a key-table lookup).
fn isolated_section(refs: &mut Refs, profile: &str, frame: &[u8], quick: bool, repeat: u32) {
    println!("\n1o. Isolated rules: `measured` with isolate = true (its own table, 1M entries) against the same rule in the shared tables; admitted, keys as section 1");
    let measured = "rate = \"100G/s\"\nkey = \"src\"";
    assert!(profile.contains(measured), "bench/profile.toml's `measured` as written here");
    let keyed = |key: &str, isolate: bool| {
        let own = if isolate { "\nisolate = true\ntable_entries = 1048576" } else { "" };
        profile.replace(measured, &format!("rate = \"100G/s\"\nkey = \"{key}\"{own}"))
    };
    let counts: &[u32] = if quick { &[10_000] } else { &[10_000, 1_000_000] };
    for key in ["src", "src_dport"] {
        // Two planes at a time: each holds its own 1M-entry tables.
        let (shared, isolated) = (plane(&keyed(key, false)), plane(&keyed(key, true)));
        let fds = [xdp_fd(&shared), xdp_fd(&isolated)];
        for &n in counts {
            refs.set_keys(n);
            let (m, verdicts) = refs.interleaved(&fds, frame, n, repeat);
            assert!(
                verdicts.iter().all(|v| *v == flowctl_common::XDP_PASS),
                "all admit: {verdicts:?}"
            );
            println!(
                "  key {key:<9} {n:>9} keys: shared {:.1} ns/packet   isolated {:.1} ({:.2}x, {:+.1} ns)",
                m[0],
                m[1],
                m[1] / m[0],
                m[1] - m[0]
            );
        }
        refs.set_keys(10_000);
    }
}

/// Section 1p: the entry point's inline parse of the common layout
/// (`parse::fast`) against the parser's functions for every frame, the same
/// object loaded both ways (`Settings::fast_parse`), admitted and refused,
/// beside the floor and the bare reference.
fn inline_parse_section(refs: &mut Refs, profile: &str, frame: &[u8], quick: bool, repeat: u32) {
    println!("\n1p. The inline parse: flowctl's admitted and refused paths with the common layout parsed inline (the default) and by the parser's functions, beside the floor and the bare reference; keys as section 1");
    let refusing = refusing_profile(profile);
    let planes = [
        plane(profile),
        plane_with(profile, |s| s.fast_parse = false),
        plane(&refusing),
        plane_with(&refusing, |s| s.fast_parse = false),
    ];
    let mut fds = vec![refs.fd("bench_pass"), refs.fd("bench_bare")];
    fds.extend(planes.iter().map(xdp_fd));
    let counts: &[u32] = if quick { &[10_000] } else { &[10_000, 1_000_000] };
    // Every table full, as a long-running LRU table is (section 1l).
    refs.fill(&fds, frame);
    for &n in counts {
        refs.set_keys(n);
        let (m, v) = refs.interleaved(&fds, frame, n, repeat);
        use flowctl_common::{XDP_DROP, XDP_PASS};
        assert_eq!(&v[2..], &[XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP], "verdicts");
        println!(
            "  {n:>9} keys: floor {:.1}, bare {:.1}   admitted: inline {:.1} ({:.2}x bare), functions {:.1} ({:.2}x bare), inline/functions {:.2}x ({:+.1} ns)   refused: inline {:.1} ({:.2}x bare), functions {:.1} ({:.2}x bare), {:.2}x ({:+.1} ns)",
            m[0],
            m[1],
            m[2],
            m[2] / m[1],
            m[3],
            m[3] / m[1],
            m[2] / m[3],
            m[2] - m[3],
            m[4],
            m[4] / m[1],
            m[5],
            m[5] / m[1],
            m[4] / m[5],
            m[4] - m[5]
        );
    }
    refs.set_keys(10_000);
    drop(planes);
    // IPv6 (no extension headers), admitted: the functions cost it three
    // calls. `measured` for IPv6 sources; the spreader rewrites bytes 4-7
    // of the source (the frame's offset 26), inside fd00::/8.
    let v6_profile = profile.replace("src = \"10.0.0.0/8\"", "src = \"fd00::/8\"");
    assert_ne!(v6_profile, profile);
    let mut src = [0u8; 16];
    src[0] = 0xfd;
    src[15] = 1;
    let v6_frame = V6::new(src).build(L4::Udp { sport: 4000, dport: 9005 }, 18);
    let v6_planes = [plane(&v6_profile), plane_with(&v6_profile, |s| s.fast_parse = false)];
    let mut fds = vec![refs.fd("bench_pass"), refs.fd("bench_bare")];
    fds.extend(v6_planes.iter().map(xdp_fd));
    refs.fill(&fds, &v6_frame);
    let (m, v) = refs.interleaved(&fds, &v6_frame, 10_000, repeat);
    assert_eq!(&v[2..], &[flowctl_common::XDP_PASS, flowctl_common::XDP_PASS], "verdicts");
    println!(
        "  IPv6, 10000 keys: floor {:.1}, bare {:.1} (reading 4 bytes of the source)   admitted: inline {:.1} ({:.2}x bare), functions {:.1} ({:.2}x bare), inline/functions {:.2}x ({:+.1} ns)",
        m[0],
        m[1],
        m[2],
        m[2] / m[1],
        m[3],
        m[3] / m[1],
        m[2] / m[3],
        m[2] - m[3]
    );
}

/// `BPF_PROG_TEST_RUN` runs per measurement: fewer in a quick run.
fn repeat_for(quick: bool) -> u32 {
    if quick {
        100_000
    } else {
        300_000
    }
}

/// The benchmark profile with `measured` refusing every packet after the
/// first (its rate `1/h`): the drop path.
fn refusing_profile(profile: &str) -> String {
    let text = profile.replace("rate = \"100G/s\"", "rate = \"1/h\"");
    assert_ne!(text, profile, "bench/profile.toml's `measured` rate as written here");
    text
}

fn quota_profile(profile: &str) -> String {
    let text = profile.replace(
        "rate = \"100G/s\"",
        "rate = \"100G/s\"\nquota = 4000000000\nquota_window = \"1h\"\nquota_buckets = 16",
    );
    assert_ne!(text, profile);
    text
}

/// The committed benchmark profile (bench/profile.toml).
fn bench_profile() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/profile.toml"))
        .expect("bench/profile.toml")
}

/// The measured frame: 60 bytes of IPv4/UDP from 10.0.0.1 to port 9005.
/// A list file of a million /32s, every fourth address from `first`.
fn million_list(tag: &str, first: [u8; 4]) -> std::path::PathBuf {
    use std::fmt::Write;
    let path =
        std::env::temp_dir().join(format!("flowctl-bench-{tag}-list-{}.txt", std::process::id()));
    let mut text = String::with_capacity(16 << 20);
    let base = u32::from(std::net::Ipv4Addr::from(first));
    for i in 0..1_000_000u32 {
        let _ = writeln!(text, "{}", std::net::Ipv4Addr::from(base + i * 4));
    }
    std::fs::write(&path, text).expect("write the bench list");
    path
}

fn bench_frame() -> Vec<u8> {
    V4::new([10, 0, 0, 1]).build(L4::Udp { sport: 4000, dport: 9005 }, 18)
}

fn breaker_section(quick: bool) {
    match std::env::var_os(flowctl_tests::cli::BIN_ENV) {
        Some(bin) => flowctl_tests::breaker_bench::run(std::path::Path::new(&bin), quick),
        None => {
            println!("7. skipped: set FLOWCTL_BIN to a release flowctl (cargo xtask bench does)")
        }
    }
}

/// CPU seconds (user + system) a process has used, from /proc/PID/stat.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / ticks
}

fn agent_cpu(seconds: u64) {
    use flowctl::dataplane::{count_entries, pins::AttachId};
    use flowctl_common::{map_names, BucketKey, SrcEntry, SrcKey};
    use std::time::Instant;
    let Some(bin) = std::env::var_os(flowctl_tests::cli::BIN_ENV) else {
        println!("  skipped: set FLOWCTL_BIN to a release flowctl (cargo xtask bench does)");
        return;
    };
    for l in sh(&["ip", "netns", "list"]).lines() {
        if let Some(name) = l.split_whitespace().next().filter(|n| n.starts_with("fagent")) {
            let _ = std::process::Command::new("ip").args(["netns", "del", name]).status();
        }
    }
    let lab = flowctl_tests::lab::Lab::new("fagent", 231);
    let prof =
        std::env::temp_dir().join(format!("flowctl-bench-agent-{}.toml", std::process::id()));
    std::fs::write(
        &prof,
        "[settings]\nkey_table_entries = 1048576\nsource_cache_entries = 1048576\n\
[[rule]]\nname = \"per-src\"\nproto = \"udp\"\nrate = \"100/s\"\nkey = \"src\"\n\
[[rule]]\nname = \"per-port\"\nproto = \"tcp\"\nrate = \"100/s\"\nkey = \"src_dport\"\n",
    )
    .unwrap();
    let mut agent = std::process::Command::new(&bin)
        .args(["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile"])
        .arg(&prof)
        .args(["--metrics", "127.0.0.1:9464"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the agent");
    let id = flowctl_tests::lab::Lab::in_ns(&lab.ns_srv, {
        let dev = lab.veth_srv.clone();
        move || AttachId::of(&dev).unwrap()
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    // The control socket exists once the agent has attached and serves.
    while !flowctl::agent::socket::socket_path(&id).exists() {
        assert!(Instant::now() < deadline, "the agent did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A million keys in each table, written from here (as traffic from a
    // million sources would leave them).
    let fill = Instant::now();
    let mut keys: aya::maps::HashMap<_, BucketKey, u64> = aya::maps::HashMap::try_from(
        aya::maps::Map::LruHashMap(MapData::from_pin(id.pin_dir().join(map_names::KEYS)).unwrap()),
    )
    .unwrap();
    let mut srcs: aya::maps::HashMap<_, SrcKey, SrcEntry> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(
            MapData::from_pin(id.pin_dir().join(map_names::SRC_CACHE)).unwrap(),
        ))
        .unwrap();
    for i in 0..1_000_000u32 {
        let k = BucketKey {
            // The second rule's (the first state took a block of ids).
            state_id: 1 + flowctl_common::STATE_IDS_PER_RULE,
            family: 4,
            dport: 443,
            src: [0x0a00_0000 | i, 0, 0, 0],
            ..Default::default()
        };
        keys.insert(k, 0, 0).unwrap();
        srcs.insert(SrcKey { addr: [0, 0, 0xffff, 0x0a00_0000 | i] }, SrcEntry::default(), 0)
            .unwrap();
    }
    let t = Instant::now();
    let n = count_entries(&id, map_names::KEYS, size_of::<BucketKey>(), 8).unwrap();
    println!("  filled 1M keys and 1M sources in {:.1}s; one batched count of the key table: {n} entries in {:.0} ms", fill.elapsed().as_secs_f64(), t.elapsed().as_secs_f64() * 1e3);

    let pid = agent.id();
    let (c0, w0) = (cpu_seconds(pid), Instant::now());
    let mut scrape_ok = 0;
    for _ in 0..seconds {
        let tick = Instant::now();
        let top = std::process::Command::new(&bin)
            .args(["top", "--once", "--json", "--interval", "0.1", &lab.veth_srv])
            .output()
            .unwrap();
        assert!(top.status.success());
        let body = flowctl_tests::traffic::try_metrics_get("127.0.0.1:9464", "/metrics", None);
        if body.is_ok_and(|b| b.contains("flowctl_key_table_entries")) {
            scrape_ok += 1;
        }
        if let Some(d) = Duration::from_secs(1).checked_sub(tick.elapsed()) {
            std::thread::sleep(d);
        }
    }
    let (cpu, wall) = (cpu_seconds(pid) - c0, w0.elapsed().as_secs_f64());
    println!(
        "  agent: {:.2}s CPU over {:.0}s wall = {:.2}% of one core ({} of {} scrapes carried the key-table estimate); target: under 2%",
        cpu, wall, 100.0 * cpu / wall, scrape_ok, seconds
    );
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let _ = agent.wait();
    let _ = std::fs::remove_file(&prof);
}

fn sh(args: &[&str]) -> String {
    flowctl_tests::lab::sh(args)
}

/// Sum of the receiving veth's XDP drop counters (ethtool -S).
fn xdp_drops(ns: &str, dev: &str) -> u64 {
    veth_stat(ns, dev, "_xdp_drops:")
}

/// A veth's per-queue ethtool counters whose name ends with `suffix`, summed.
fn veth_stat(ns: &str, dev: &str, suffix: &str) -> u64 {
    sh(&["ip", "netns", "exec", ns, "ethtool", "-S", dev])
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("rx_queue_")
                .and_then(|r| r.split_once(suffix))
                .map(|(_, v)| v.trim().parse::<u64>().unwrap_or(0))
        })
        .sum()
}

/// Packets the nftables meter dropped: what XDP passed up, minus what reached
/// IP (listing nft counters would walk the million-element set).
fn nft_drops(ns: &str, dev: &str) -> u64 {
    let passed_up = veth_stat(ns, dev, "_xdp_packets:");
    let snmp = sh(&["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"]);
    let mut ip = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (ip.next().unwrap_or(""), ip.next().unwrap_or(""));
    let col = names.split_whitespace().position(|n| n == "InReceives").unwrap_or(0);
    let in_receives: u64 =
        values.split_whitespace().nth(col).and_then(|v| v.parse().ok()).unwrap_or(0);
    passed_up.saturating_sub(in_receives)
}

/// Why section 4 cannot run here, if the kernel refuses live frames.
///
/// Some kernels answer BPF_F_TEST_XDP_LIVE_FRAMES with EPERM for every
/// program, batch size, frame and namespace, as root with every capability:
/// the 6.18.44 Firecracker guest's build (2026-12-07) refuses it inside
/// bpf_prog_test_run_xdp (net/bpf/test_run.c), after the function's
/// `flags & ~BPF_F_TEST_XDP_LIVE_FRAMES` check (flags 3 still get EINVAL)
/// and before its `batch_size > TEST_XDP_MAX_BATCH` check (batch 300 gets
/// EPERM, not E2BIG), with no capability check on the way. Upstream's
/// bpf_prog_test_run_xdp has no EPERM return at all, so no attribute the
/// bench could send gets past it. Other generators (bpf_clone_redirect,
/// AF_PACKET, AF_XDP's copy mode; no pktgen in that build) hand the veth
/// skbs, which it copies into XDP buffers: another measurement than the
/// recorded one, so the section says why it is skipped instead of panicking.
fn live_frames_refused(refs: &mut Refs) -> Option<String> {
    let prog: &mut Xdp = refs.ebpf.program_mut("bench_drop").unwrap().try_into().unwrap();
    if prog.fd().is_err() {
        prog.load().unwrap();
    }
    let frame = V4::new([10, 0, 0, 1]).build(L4::Udp { sport: 4000, dport: 9005 }, 18);
    let mut o = TestRunOptions::new();
    o.data_in = Some(&frame);
    o.repeat = 1;
    o.attrs = aya::programs::TestRunAttrs::new().xdp_live_frames(64);
    match prog.test_run(o) {
        Err(aya::programs::ProgramError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::EPERM) =>
        {
            let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
            Some(format!(
                "this kernel ({}) refuses BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES (EPERM from bpf_prog_test_run_xdp), which the generator needs",
                release.trim()
            ))
        }
        _ => None,
    }
}

fn veth_drop_rates(refs: &mut Refs, drop_profile: &str, key_counts: &[u32], quick: bool) {
    use std::sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    };
    if let Some(why) = live_frames_refused(refs) {
        println!("  skipped: {why}");
        return;
    }
    // Labs of earlier runs that were killed before they could clean up.
    for l in sh(&["ip", "netns", "list"]).lines() {
        if let Some(name) = l.split_whitespace().next().filter(|n| n.starts_with("fbench")) {
            let _ = std::process::Command::new("ip").args(["netns", "del", name]).status();
        }
    }
    let lab = flowctl_tests::lab::Lab::new("fbench", 230);
    let mut dropper = plane(drop_profile);
    let slot = Duration::from_millis(500);
    let rounds = if quick { 2 } else { 4 };
    for &n in key_counts {
        refs.set_keys(n);
        refs.set_bare_limit(
            flowctl_common::gcra::interval_fp(1, 3600),
            flowctl_common::gcra::burst_ns(flowctl_common::gcra::interval_fp(1, 3600), 1),
        );
        // The generator runs on its own thread in the client namespace with its
        // own copy of the bench object (bpf_redirect resolves the ifindex in
        // the caller's namespace).
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let gen = {
            let (stop, sent, ns, dev) =
                (stop.clone(), sent.clone(), lab.ns_cli.clone(), lab.veth_cli.clone());
            std::thread::spawn(move || {
                flowctl::system::netns::enter_netns(&ns).unwrap();
                flowctl_tests::testrun::pin_to_cpu(1);
                let mut ebpf = EbpfLoader::new().load(flowctl_bench::bench_object()).unwrap();
                let ifindex = flowctl::system::netns::ifindex(&dev).unwrap();
                {
                    let mut cfg: Array<_, u32> =
                        Array::try_from(ebpf.map_mut("BENCH_CONFIG").unwrap()).unwrap();
                    cfg.set(0, n, 0).unwrap();
                    cfg.set(1, 0x0a00_0000, 0).unwrap();
                    cfg.set(2, ifindex, 0).unwrap();
                }
                let prog: &mut Xdp = ebpf.program_mut("bench_gen").unwrap().try_into().unwrap();
                prog.load().unwrap();
                let frame = V4::new([10, 0, 0, 1]).build(L4::Udp { sport: 4000, dport: 9005 }, 18);
                while !stop.load(Ordering::Relaxed) {
                    let mut o = TestRunOptions::new();
                    o.data_in = Some(&frame);
                    o.repeat = 1 << 16;
                    o.attrs = aya::programs::TestRunAttrs::new().xdp_live_frames(64);
                    // The kernel ends a run early with EINTR when a signal is
                    // pending (bpf_test_timer_continue); the frames it sent are
                    // counted at the receiver, so run again.
                    match prog.test_run(o) {
                        Ok(_) => {
                            sent.fetch_add(1 << 16, Ordering::Relaxed);
                        }
                        Err(aya::programs::ProgramError::SyscallError(e))
                            if e.io_error.raw_os_error() == Some(libc::EINTR) => {}
                        Err(e) => panic!("live-frames run: {e:?}"),
                    }
                }
            })
        };
        // Receiver: one XDP link on the server end, re-pointed between variants.
        flowctl::system::netns::enter_netns(&lab.ns_srv).unwrap();
        let ceiling: &mut Xdp = refs.ebpf.program_mut("bench_drop").unwrap().try_into().unwrap();
        if ceiling.fd().is_err() {
            ceiling.load().unwrap();
        }
        let id =
            ceiling.attach(&lab.veth_srv, aya::programs::XdpMode::Driver).expect("attach on veth");
        let mut link = Some(ceiling.take_link(id).unwrap());
        let names = ["ceiling", "bare", "flowctl", "nftables"];
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        let nft_rules =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/nftables.nft"))
                .unwrap()
                .replace("DEV", &lab.veth_srv);
        for round in 0..rounds + 1 {
            for (i, name) in names.iter().enumerate() {
                let prog: &mut Xdp = match *name {
                    "ceiling" => refs.ebpf.program_mut("bench_drop").unwrap().try_into().unwrap(),
                    "bare" => refs.ebpf.program_mut("bench_bare").unwrap().try_into().unwrap(),
                    "flowctl" => {
                        let name = dropper.prog_name();
                        dropper.ebpf.program_mut(name).unwrap().try_into().unwrap()
                    }
                    _ => refs.ebpf.program_mut("bench_pass").unwrap().try_into().unwrap(),
                };
                let lid = prog.attach_to_link(link.take().unwrap()).expect("re-point the link");
                link = Some(prog.take_link(lid).unwrap());
                if *name == "nftables" {
                    let f = std::env::temp_dir()
                        .join(format!("flowctl-bench-{}.nft", std::process::id()));
                    std::fs::write(&f, &nft_rules).unwrap();
                    sh(&["ip", "netns", "exec", &lab.ns_srv, "nft", "-f", f.to_str().unwrap()]);
                    let _ = std::fs::remove_file(f);
                }
                std::thread::sleep(Duration::from_millis(50)); // let the ring settle
                let (d0, s0, t0) = (
                    if *name == "nftables" {
                        nft_drops(&lab.ns_srv, &lab.veth_srv)
                    } else {
                        xdp_drops(&lab.ns_srv, &lab.veth_srv)
                    },
                    sent.load(Ordering::Relaxed),
                    std::time::Instant::now(),
                );
                std::thread::sleep(slot);
                let d1 = if *name == "nftables" {
                    nft_drops(&lab.ns_srv, &lab.veth_srv)
                } else {
                    xdp_drops(&lab.ns_srv, &lab.veth_srv)
                };
                let dt = t0.elapsed().as_secs_f64();
                let _ = s0;
                if *name == "nftables" {
                    sh(&[
                        "ip",
                        "netns",
                        "exec",
                        &lab.ns_srv,
                        "nft",
                        "delete",
                        "table",
                        "netdev",
                        "flowctl_bench",
                    ]);
                }
                if round > 0 {
                    // Round 0 fills the key tables; it is not reported.
                    rates[i].push((d1 - d0) as f64 / dt / 1e6);
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        gen.join().unwrap();
        drop(link);
        let med: Vec<f64> = rates.into_iter().map(median).collect();
        println!(
            "  {n:>8} keys: ceiling {:.2}  bare {:.2}  flowctl {:.2}  nftables {:.3}  | bare/ceiling {:.2}x  flowctl/bare {:.2}x  flowctl/nftables {:.1}x",
            med[0], med[1], med[2], med[3], med[1] / med[0], med[2] / med[1], med[2] / med[3]
        );
    }
}

/// Section 8 (`cargo xtask bench fleet`; also at the end of the full run):
/// the simulated fleet against the peers' published behaviour, the
/// per-packet cost of a global rule over a local one, then the real
/// three-agent lab (exits non-zero if the lab could not be run through).
fn fleet_section(refs: &mut Refs, profile: &str, frame: &[u8], quick: bool) {
    println!("8. Fleet: one limit across many hosts (docs/fleet.md, \"Global limits\")");
    println!(
        "\n8a. The simulated fleet ({}: flowctl::fleet::global::sim::report; the real allocator and agent loop on a virtual clock)",
        if quick { "quick, 15 s per scenario" } else { "full, 30 s per scenario" }
    );
    let t = std::time::Instant::now();
    let mut table = Vec::new();
    flowctl::fleet::global::sim::report(&mut table, quick).expect("the simulated fleet");
    let table = String::from_utf8_lossy(&table).into_owned();
    print!("{table}");
    println!("  ({:.1} s of simulation)", t.elapsed().as_secs_f64());
    peers(&table, quick);

    println!("\n8b. Per-packet cost of a global rule over a local one (BPF_PROG_TEST_RUN, kernel-reported ns/packet)");
    fleet_packet_cost(refs, profile, frame, quick);

    if let Err(e) = flowctl_tests::fleet_bench::run(quick) {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}

/// One row of `sim::report`'s table: worst A/bound and store calls per host
/// per second (all hosts; carrying hosts).
struct SimRow {
    worst: f64,
    ops: f64,
    ops_carriers: f64,
}

/// The rows of `sim::report`'s table by scenario name (the name is the
/// first 36 columns; the numbers follow, ops/host/s and carriers last).
fn sim_rows(table: &str) -> std::collections::BTreeMap<String, SimRow> {
    let mut rows = std::collections::BTreeMap::new();
    for line in table.lines() {
        let (Some(name), Some(rest)) = (line.get(..36), line.get(36..)) else { continue };
        let tokens: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| tokens.get(i).and_then(|x| x.parse::<f64>().ok());
        let (Some(worst), Some(ops), Some(ops_carriers)) =
            (num(0), num(tokens.len().wrapping_sub(2)), num(tokens.len().wrapping_sub(1)))
        else {
            continue;
        };
        rows.insert(name.trim().to_string(), SimRow { worst, ops, ops_carriers });
    }
    rows
}

/// The peers' published behaviour (docs/fleet.md's table, from
/// ../shared/brief/fleet.md) on the simulated fleet's load, beside
/// flowctl's measured figures.
fn peers(table: &str, quick: bool) {
    use flowctl::fleet::global::sim::{scenarios, Load};
    let rows = sim_rows(table);
    let get = |name: &str| rows.get(name);
    let cfgs = scenarios(quick);
    let Some((_, uniform)) = cfgs.iter().find(|(n, _)| *n == "uniform, 200 hosts") else {
        println!("  (the sim's scenarios changed names: peers' comparison skipped)");
        return;
    };
    let (l, b, hosts) = (uniform.rule.rate as f64, uniform.rule.burst as f64, uniform.hosts);
    let total = match uniform.load {
        Load::Uniform { total } => total as f64,
        _ => 2.0 * l,
    };
    let per_host = total / hosts as f64;
    let fmt = |r: Option<&SimRow>, f: fn(&SimRow) -> f64| {
        r.map_or("?".to_string(), |r| format!("{:.2}", f(r)))
    };
    println!("\n  against the peers' published figures (docs/fleet.md), on the same load ({total:.0}/s offered for one key, L = {l:.0}/s, B = {b:.0}):");
    println!(
        "  - store calls: envoyproxy/ratelimit makes a Redis round trip per decision: {per_host:.0}/s per host when {hosts} hosts share the load, {total:.0}/s on a host carrying it alone; flowctl: {} (uniform) and {} on the one carrier, per host per second, never per packet",
        fmt(get("uniform, 200 hosts"), |r| r.ops),
        fmt(get("1 host carries the key"), |r| r.ops_carriers),
    );
    println!(
        "  - latency added to a decision: envoyproxy/ratelimit one round trip (here 1-5 ms; its timeout 20 ms, then fail open); flowctl: none, the packet path reads a BPF map (8b)"
    );
    println!(
        "  - accuracy: envoyproxy/ratelimit's fixed windows admit up to 2L in a window of one window's length that straddles a boundary: A/bound up to {:.2} with these L and B (2L / (L + B)); flowctl's worst window over every healthy scenario: {}",
        2.0 * l / (l + b),
        rows.iter()
            .filter(|(n, _)| !n.contains("unreachable"))
            .map(|(_, r)| r.worst)
            .fold(None, |m: Option<f64>, w| Some(m.map_or(w, |m| m.max(w))))
            .map_or("?".to_string(), |w| format!("{w:.3}"))
    );
    println!(
        "  - gubernator GLOBAL: each host admits from its own copy and sends hits to the key's owner asynchronously, so the overshoot grows with N and the sync delay (no bound); flowctl's worst A/bound with 1, 3 and {hosts} hosts carrying the key: {}, {}, {} (at most 1: the bound holds whatever N)",
        fmt(get("1 host carries the key"), |r| r.worst),
        fmt(get("3 hosts carry the key"), |r| r.worst),
        fmt(get("uniform, 200 hosts"), |r| r.worst),
    );
    println!(
        "  - store unreachable: envoyproxy/ratelimit fails open (unlimited), gubernator N x L; flowctl keeps its leases and never raises a rate: worst A/bound {} against L*t + B (its outage bound is 2L*t + B)",
        fmt(get("store unreachable 5-9 s (3 hosts)"), |r| r.worst),
    );
}

/// bench/profile.toml with `measured` at `rate`, local, or global with the
/// given extra lines (a `[fleet]` section the test plane never connects
/// to, and a global key table as large as the source cache).
fn fleet_profile(profile: &str, rate: &str, global: bool) -> String {
    let rate_line = format!("rate = \"{rate}\"");
    let mut p = profile.replace("rate = \"100G/s\"", &rate_line);
    assert_eq!(p.matches(&rate_line).count(), 1, "one rule at {rate}: {p}");
    if global {
        p = p.replacen("[settings]\n", "[settings]\nglobal_key_entries = 1048576\n", 1);
        p = p.replace(&rate_line, &format!("{rate_line}\nscope = \"global\""));
        p.push_str("\n[fleet]\nredis = \"redis://127.0.0.1:6379\"\n");
    }
    p
}

/// The bucket key of the spreader's key `i` (source 10.0.0.0 + i) under
/// rule `m` of `plane`.
fn spread_key(plane: &TestPlane, m: usize, i: u32) -> flowctl_common::BucketKey {
    let mut k = flowctl_common::BucketKey {
        state_id: plane.state.rules[m].state_id,
        family: 4,
        ..Default::default()
    };
    k.src[0] = 0x0a00_0000 + i;
    k
}

fn fleet_packet_cost(refs: &mut Refs, profile: &str, frame: &[u8], quick: bool) {
    use flowctl::dataplane::GlobalKeys;
    use flowctl_common::{grant, MAX_GRANTS, XDP_DROP, XDP_PASS};
    // The same rule both ways: `measured`, keyed by source, at 1G/s
    // (admitted) and 1/h (dropped). 1G/s rather than section 1's 100G/s: a
    // global rule's amounts stay under 2^32 (docs/design.md, C4). A global
    // rule's rate is whole units per second (its leases split integers), so
    // the dropping global rule is at 1/s and its leased keys' grant at 1/h
    // (a host holding a small share of it); its unleased keys run at the
    // default share, 1% of 1/s. At 1/s itself a key visited less often than
    // every second (1M keys) would be admitted.
    let (pass_rate, drop_rate, global_drop_rate) = ("1G/s", "1/h", "1/s");
    let local_pass = plane(&fleet_profile(profile, pass_rate, false));
    let leased_pass = plane(&fleet_profile(profile, pass_rate, true));
    let share_pass = plane(&fleet_profile(profile, pass_rate, true));
    let local_drop = plane(&fleet_profile(profile, drop_rate, false));
    let leased_drop = plane(&fleet_profile(profile, global_drop_rate, true));
    let share_drop = plane(&fleet_profile(profile, global_drop_rate, true));
    let m = local_pass.state.rules.iter().position(|r| r.name == "measured").unwrap();
    let rule_of = |rate: &str, global: bool| {
        let set = flowctl::profile::parse("bench", &fleet_profile(profile, rate, global)).unwrap();
        assert_eq!(set.rules[m].global.is_some(), global, "`measured` is global: {global}");
        (set.rules[m].interval_fp, set.rules[m].burst)
    };
    // A leased key's grant: the whole limit (one host holding it; a share
    // of it costs the same per packet); 1/h on the dropping rule.
    let leases =
        [(&leased_pass, rule_of(pass_rate, true)), (&leased_drop, rule_of(drop_rate, false))];
    let mut gks: Vec<GlobalKeys> = [&leased_pass, &share_pass, &leased_drop, &share_drop]
        .iter()
        .map(|p| GlobalKeys::open(&p.id).expect("the global rule's maps"))
        .collect();
    println!(
        "  `measured` keyed by source, local or scope = \"global\", admitted at {pass_rate} and dropped at {drop_rate} (global: the rule at {global_drop_rate}, the grant at {drop_rate}); leased: a grant in FLOWCTL_GRANTS for the key (the hot key's case), share: no lease (the default share, 1% of the rule's rate)"
    );
    println!(
        "{:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8}  leased keys",
        "keys", "path", "local", "leased", "ratio", "share", "ratio"
    );
    let key_counts: &[u32] = if quick { &[10_000] } else { &[10_000, 1_000_000] };
    let repeat = repeat_for(quick);
    for &n in key_counts {
        refs.set_keys(n);
        let leased = n.min(MAX_GRANTS);
        for (i, (p, (interval_fp, burst))) in leases.iter().enumerate() {
            let gk = &mut gks[if i == 0 { 0 } else { 2 }];
            for k in 0..leased {
                gk.set_grant(&spread_key(p, m, k), *interval_fp, *burst).expect("set a grant");
            }
        }
        let targets = [
            xdp_fd(&local_pass),
            xdp_fd(&leased_pass),
            xdp_fd(&share_pass),
            xdp_fd(&local_drop),
            xdp_fd(&leased_drop),
            xdp_fd(&share_drop),
        ];
        // Between rounds, drain the hot-key rings as the agent does (a full
        // ring would make the kernel's reports cheaper than they are).
        let (med, verdicts) = refs.interleaved_with(&targets, frame, n, repeat, || {
            for gk in gks.iter_mut() {
                let _ = gk.hot(1 << 16);
            }
        });
        assert_eq!(
            verdicts,
            [XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP, XDP_DROP],
            "admitted and dropped paths"
        );
        // The grants reached the keys' buckets (so the leased runs measured
        // the leased path) and the unleased keys run at the share.
        let probe = spread_key(&leased_pass, m, 1);
        let word = gks[0].bucket(&probe).expect("a leased key's bucket").grant;
        assert_eq!(
            word,
            grant::encode(leases[0].1 .0, leases[0].1 .1),
            "the bucket cached the grant"
        );
        let b = gks[1].bucket(&spread_key(&share_pass, m, 1)).expect("an unleased key's bucket");
        assert_eq!(b.grant, grant::NO_LEASE);
        // Each key's bucket made once (the warm-up), none refused: the
        // runs measured lookups of existing buckets.
        for (name, p) in [("leased", &leased_pass), ("share", &share_pass)] {
            let c = p.counters("measured");
            println!(
                "{:>9} {name}: {} bucket inserts, {} insert failures",
                "", c.key_inserts, c.insert_failures
            );
        }
        let leased_note = if leased == n {
            format!("{leased} of {n} (every key)")
        } else {
            format!("{leased} of {n} (FLOWCTL_GRANTS holds {MAX_GRANTS}); the rest at the share")
        };
        for (path, o) in [("admit", 0), ("drop", 3)] {
            println!(
                "{:>9} {:>7} {:>8.1} {:>8.1} {:>7.3}x {:>8.1} {:>7.3}x  {}",
                n,
                path,
                med[o],
                med[o + 1],
                med[o + 1] / med[o],
                med[o + 2],
                med[o + 2] / med[o],
                if o == 0 { leased_note.as_str() } else { "" }
            );
        }
        println!(
            "{:>9} leased/local: admitted {:.3}x, dropped {:.3}x (target: at most 1.05x)",
            "",
            med[1] / med[0],
            med[4] / med[3]
        );
    }
    println!("  network round trips on the packet path: 0, by construction: the XDP program reads the key's grant from a BPF map (FLOWCTL_GRANTS, re-read at most every {} ms into the key's bucket); only the agent's lease loop talks to Redis", grant::REFRESH_NS / 1_000_000);
}
