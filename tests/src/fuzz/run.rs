//! The runner: frames through the real program with `BPF_PROG_TEST_RUN`,
//! counters compared with the reference's prediction.
//!
//! Frames run in batches on one CPU; after a batch the counters of every
//! rule's record and of the global record are read once and their deltas
//! compared with the sum the reference predicts (verdicts are compared per
//! frame). A batch that disagrees is run again frame by frame, reading the
//! counters around each frame, to name the frames.

use super::gen::{self, Rng, Targets};
use super::reference::{classify, expect, Class, Expect, RefProfile};
use crate::testrun::{pin_to_cpu, TestPlane};
use flowctl::dataplane::XdpVariant;
use flowctl_common::{reason, RuleCounters, GLOBAL_COUNTER_INDEX, XDP_DROP, XDP_PASS};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Options {
    pub frames: u64,
    pub seed: u64,
    pub out: PathBuf,
    /// Stop once this many distinct disagreements were found.
    pub max_failures: usize,
    /// A new generated profile (and a freshly loaded program) every this many frames.
    pub frames_per_profile: u64,
    pub batch: usize,
    pub cpu: usize,
    pub verbose: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            frames: 200_000,
            seed: 1,
            out: PathBuf::from("fuzz-out"),
            max_failures: 20,
            frames_per_profile: 25_000,
            batch: 512,
            cpu: 0,
            verbose: true,
        }
    }
}

/// Counter movements, as the reference predicts them or the kernel made them.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Tally {
    /// `offered_pkts` per rule record (profile order).
    pub offered: Vec<u64>,
    /// `offered_bytes` per rule record: frame lengths, so that a batch's
    /// sums also say which frames went where.
    pub bytes: Vec<u64>,
    /// Every drop counter of each rule's record (rates are huge: none).
    pub rule_drops: Vec<u64>,
    pub global_offered: u64,
    pub global_bytes: u64,
    pub non_ip: u64,
    pub malformed: u64,
    pub fragment: u64,
    pub unparsed: u64,
    /// dropped_pkts[EVASIVE, MALFORMED, FRAGMENT] of the global record.
    pub drops: [u64; 3],
    /// Every other drop reason on the global record.
    pub other_drops: u64,
}

impl Tally {
    pub fn zero(rules: usize) -> Self {
        Self {
            offered: vec![0; rules],
            bytes: vec![0; rules],
            rule_drops: vec![0; rules],
            ..Default::default()
        }
    }

    pub fn add_expect(&mut self, e: &Expect, len: usize) {
        match e.record {
            Some(i) => {
                self.offered[i] += 1;
                self.bytes[i] += len as u64;
            }
            None => {
                self.global_offered += 1;
                self.global_bytes += len as u64;
            }
        }
        self.non_ip += e.non_ip as u64;
        self.malformed += e.malformed as u64;
        self.fragment += e.fragment as u64;
        self.unparsed += e.unparsed as u64;
        self.drops[0] += e.evasive_drop as u64;
        self.drops[1] += e.malformed_drop as u64;
        self.drops[2] += e.fragment_drop as u64;
    }

    /// The kernel's movements between two snapshots (rules..., global).
    pub fn delta(before: &[RuleCounters], after: &[RuleCounters]) -> Self {
        let n = before.len() - 1;
        let mut t = Self::zero(n);
        for i in 0..n {
            t.offered[i] = after[i].offered_pkts - before[i].offered_pkts;
            t.bytes[i] = after[i].offered_bytes - before[i].offered_bytes;
            t.rule_drops[i] = after[i].dropped_total() - before[i].dropped_total();
        }
        let (b, a) = (&before[n], &after[n]);
        t.global_offered = a.offered_pkts - b.offered_pkts;
        t.global_bytes = a.offered_bytes - b.offered_bytes;
        t.non_ip = a.non_ip_pkts - b.non_ip_pkts;
        t.malformed = a.malformed_pkts - b.malformed_pkts;
        t.fragment = a.fragment_pkts - b.fragment_pkts;
        t.unparsed = a.unparsed_pkts - b.unparsed_pkts;
        for (k, r) in Expect::DROP_REASONS.iter().enumerate() {
            t.drops[k] = a.dropped_pkts[*r] - b.dropped_pkts[*r];
        }
        t.other_drops = (a.dropped_total() - b.dropped_total()) - t.drops.iter().sum::<u64>();
        t
    }

    /// One line: what moved.
    pub fn summary(&self, p: &RefProfile) -> String {
        let mut s = String::new();
        for (i, &n) in self.offered.iter().enumerate() {
            if n > 0 {
                let _ = write!(s, "offered {}x{n} ", p.rules[i].name);
            }
            if self.rule_drops[i] > 0 {
                let _ = write!(s, "drops {}x{} ", p.rules[i].name, self.rule_drops[i]);
            }
        }
        let g = [
            ("global-offered", self.global_offered),
            ("non_ip", self.non_ip),
            ("malformed", self.malformed),
            ("fragment", self.fragment),
            ("unparsed", self.unparsed),
            ("drop[evasive]", self.drops[0]),
            ("drop[malformed]", self.drops[1]),
            ("drop[fragment]", self.drops[2]),
            ("drop[other]", self.other_drops),
        ];
        for (name, n) in g {
            if n > 0 {
                let _ = write!(s, "{name}x{n} ");
            }
        }
        if s.is_empty() {
            s = "nothing ".into();
        }
        s.pop();
        s
    }

    /// The class a single frame's movements look like (for grouping).
    pub fn shape(&self) -> String {
        let mut parts = vec![];
        if self.offered.iter().any(|&n| n > 0) {
            parts.push("rule");
        }
        if self.global_offered > 0 {
            parts.push("global");
        }
        for (name, n) in [
            ("non_ip", self.non_ip),
            ("malformed", self.malformed),
            ("fragment", self.fragment),
            ("unparsed", self.unparsed),
            ("evasive", self.drops[0]),
        ] {
            if n > 0 {
                parts.push(name);
            }
        }
        parts.join("+")
    }
}

pub fn verdict_name(v: u32) -> &'static str {
    match v {
        XDP_DROP => "DROP",
        XDP_PASS => "PASS",
        _ => "OTHER",
    }
}

/// A profile loaded into a test plane, with the records read around frames.
pub struct Bench {
    pub plane: TestPlane,
    pub profile: RefProfile,
    pub text: String,
    records: Vec<u32>,
}

impl Bench {
    /// The program this kernel's loader picks.
    pub fn new(text: &str) -> Self {
        Self::new_variant(text, XdpVariant::for_kernel())
    }

    pub fn new_variant(text: &str, variant: XdpVariant) -> Self {
        Self::new_with(text, variant, true)
    }

    /// `fast_parse`: whether the entry point parses the common layout
    /// inline (the default) or sends every frame through the parser's
    /// functions (`Settings::fast_parse`).
    pub fn new_with(text: &str, variant: XdpVariant, fast_parse: bool) -> Self {
        let profile = RefProfile::parse(text)
            .unwrap_or_else(|e| panic!("generated profile rejected: {e}\n{text}"));
        let plane = TestPlane::new_variant(text, |s| s.fast_parse = fast_parse, variant);
        let mut records: Vec<u32> = profile.rules.iter().map(|r| plane.record(&r.name)).collect();
        records.push(GLOBAL_COUNTER_INDEX);
        Self { plane, profile, text: text.to_string(), records }
    }

    pub fn snapshot(&self) -> Vec<RuleCounters> {
        self.records.iter().map(|&r| self.plane.maps.counters(r).expect("read counters")).collect()
    }

    /// One frame, alone: the reference's class and expectation, the
    /// kernel's verdict and movements.
    pub fn one(&self, frame: &[u8]) -> Outcome {
        let class = classify(frame, &self.profile);
        let exp = expect(&class, &self.profile);
        let before = self.snapshot();
        let verdict = self.plane.run(frame);
        let got = Tally::delta(&before, &self.snapshot());
        let mut want = Tally::zero(self.profile.rules.len());
        want.add_expect(&exp, frame.len());
        Outcome { class, exp, want, verdict, got }
    }
}

impl Bench {
    /// Runs `frames` and says whether the counters' sums and every verdict
    /// are what the reference predicts.
    pub fn batch_agrees(&self, frames: &[Vec<u8>]) -> bool {
        let mut want = Tally::zero(self.profile.rules.len());
        let before = self.snapshot();
        let mut ok = true;
        for f in frames {
            let e = expect(&classify(f, &self.profile), &self.profile);
            want.add_expect(&e, f.len());
            ok &= self.plane.run(f) == e.verdict;
        }
        ok && Tally::delta(&before, &self.snapshot()) == want
    }

    /// The indices of the frames of a disagreeing batch that disagree
    /// alone: halves are re-run and the disagreeing ones split again, so a
    /// batch with one bad frame costs about twice its frames and a few
    /// counter reads, not two reads per frame.
    pub fn bad_frames(&self, frames: &[Vec<u8>], base: usize, out: &mut Vec<usize>) {
        if frames.len() <= 8 {
            for (i, f) in frames.iter().enumerate() {
                if !self.one(f).agrees() {
                    out.push(base + i);
                }
            }
            return;
        }
        let mid = frames.len() / 2;
        for (lo, part) in [(0, &frames[..mid]), (mid, &frames[mid..])] {
            if !self.batch_agrees(part) {
                self.bad_frames(part, base + lo, out);
            }
        }
    }
}

pub struct Outcome {
    pub class: Class,
    pub exp: Expect,
    pub want: Tally,
    pub verdict: u32,
    pub got: Tally,
}

impl Outcome {
    pub fn agrees(&self) -> bool {
        self.want == self.got && self.verdict == self.exp.verdict
    }

    pub fn expected_line(&self, p: &RefProfile) -> String {
        format!(
            "{} | {} | {}",
            self.class.describe(p),
            self.want.summary(p),
            verdict_name(self.exp.verdict)
        )
    }

    pub fn kernel_line(&self, p: &RefProfile) -> String {
        format!("{} | {}", self.got.summary(p), verdict_name(self.verdict))
    }

    /// What makes two disagreements the same: the reference's reason and
    /// what the kernel did instead.
    pub fn signature(&self) -> String {
        format!(
            "{} -> kernel {} {}",
            self.class.reason(),
            self.got.shape(),
            verdict_name(self.verdict)
        )
    }
}

pub fn to_hex(frame: &[u8]) -> String {
    let mut s = String::new();
    for (i, b) in frame.iter().enumerate() {
        let _ = write!(s, "{b:02x}");
        if i % 32 == 31 {
            s.push('\n');
        }
    }
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// A hex file: `#` lines are comments, whitespace is ignored.
pub fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    let digits: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.chars())
        .filter(|c| !c.is_whitespace())
        .collect();
    if !digits.len().is_multiple_of(2) {
        return Err("odd number of hex digits".into());
    }
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&digits[i..i + 2], 16).map_err(|e| format!("at {i}: {e}")))
        .collect()
}

/// A comment value in a hex file: `# key: value`.
pub fn hex_comment(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        l.trim_start()
            .strip_prefix('#')?
            .trim()
            .strip_prefix(key)?
            .strip_prefix(':')
            .map(|v| v.trim().to_string())
    })
}

#[derive(Debug)]
pub struct Failure {
    pub signature: String,
    pub count: u64,
    pub hex: PathBuf,
    pub profile: PathBuf,
    pub expected: String,
    pub kernel: String,
}

impl Failure {
    pub fn replay_command(&self) -> String {
        format!("flowctl-fuzz --replay {} --profile {}", self.hex.display(), self.profile.display())
    }
}

#[derive(Debug, Default)]
pub struct Summary {
    pub frames: u64,
    pub profiles: u64,
    pub elapsed: Duration,
    /// Time spent loading programs and applying profiles.
    pub load_time: Duration,
    pub failures: Vec<Failure>,
    /// Frames that disagreed (all signatures).
    pub disagreeing_frames: u64,
    /// Frames per reference class (with the reason for evasive,
    /// malformed and unparsed): what the generator covered.
    pub classes: BTreeMap<String, u64>,
    /// Wall time of one `BPF_PROG_TEST_RUN` call with repeat 1, and the
    /// kernel's own duration for one run of the program.
    pub per_call: Duration,
    pub per_run_kernel: Duration,
    /// Frames per XDP program.
    pub programs: BTreeMap<&'static str, u64>,
    /// Time spent re-running disagreeing batches frame by frame.
    pub bisect_time: Duration,
}

impl Summary {
    pub fn frames_per_second(&self) -> f64 {
        self.frames as f64 / self.elapsed.as_secs_f64()
    }

    /// Throughput when every batch agrees: frames over the time not spent
    /// naming disagreeing frames (what a run on an agreeing kernel gets).
    pub fn agreeing_frames_per_second(&self) -> f64 {
        self.frames as f64 / (self.elapsed - self.bisect_time).as_secs_f64()
    }
}

/// Writes a disagreeing frame and its profile; returns their paths.
pub fn write_case(
    out: &Path,
    n: usize,
    frame: &[u8],
    b: &Bench,
    o: &Outcome,
) -> (PathBuf, PathBuf) {
    let (profile, p) = (&b.text, &b.profile);
    std::fs::create_dir_all(out).expect("create the output directory");
    let hex = out.join(format!("fail-{n:03}.hex"));
    let prof = out.join(format!("fail-{n:03}.toml"));
    let text = format!(
        "# class: {}\n# program: {}\n# expected: {}\n# kernel: {}\n# length: {}\n{}",
        o.class.kind(),
        b.plane.prog_name(),
        o.expected_line(p),
        o.kernel_line(p),
        frame.len(),
        to_hex(frame)
    );
    std::fs::write(&hex, text).expect("write the frame");
    std::fs::write(&prof, profile).expect("write the profile");
    (hex, prof)
}

/// Measures one `BPF_PROG_TEST_RUN` with repeat 1: wall time per call
/// (syscall and all), and the kernel's per-run duration.
pub fn per_call_cost(b: &Bench, calls: u32) -> (Duration, Duration) {
    let frame = crate::packet::V4::new([10, 1, 2, 3])
        .build(crate::packet::L4::Udp { sport: 1, dport: 53 }, 32);
    for _ in 0..1000 {
        b.plane.run(&frame);
    }
    let t = Instant::now();
    let mut kernel = Duration::ZERO;
    for _ in 0..calls {
        kernel += b.plane.run_repeat(&frame, 1).1;
    }
    (t.elapsed() / calls, kernel / calls)
}

/// The fuzzing loop.
pub fn run(o: &Options) -> Summary {
    pin_to_cpu(o.cpu);
    let mut s = Summary::default();
    let mut by_sig: BTreeMap<String, usize> = BTreeMap::new();
    let start = Instant::now();
    let mut round = 0u64;
    while s.frames < o.frames && s.failures.len() < o.max_failures {
        let mut prng = Rng::derive(o.seed, round * 2);
        // Every generated profile must be accepted (Bench::new_variant says
        // which was not): skipping refused ones once hid that numeric
        // protocols were never generated in a form the profile took.
        let text = gen::profile(&mut prng);
        // Both entry points: the one this kernel's loader picks, and every
        // other round the single-buffer one (what kernels before 5.18 run).
        let variant = if round % 2 == 1 { XdpVariant::Single } else { XdpVariant::for_kernel() };
        // And both parsers: rounds 2 and 3 of every four send the common
        // layout through the parser's functions too, so the inline parse
        // (`parse::fast`) and the functions are each held to the reference.
        let fast_parse = round % 4 < 2;
        let t_load = Instant::now();
        let bench = Bench::new_with(&text, variant, fast_parse);
        s.load_time += t_load.elapsed();
        s.profiles += 1;
        if round == 0 {
            let (call, kernel) = per_call_cost(&bench, 20_000);
            s.per_call = call;
            s.per_run_kernel = kernel;
            if o.verbose {
                println!("flowctl-fuzz: program {}; one BPF_PROG_TEST_RUN (repeat 1) costs {:.2} us wall, {} ns in the program; a program load + apply {:.0} ms", bench.plane.prog_name(), call.as_secs_f64() * 1e6, kernel.as_nanos(), t_load.elapsed().as_secs_f64() * 1e3);
            }
        }
        let mut targets = Targets::of(&bench.profile);
        if bench.plane.prog_name() == flowctl_common::XDP_PROGRAM_FRAGS {
            targets.max_frame = gen::MAX_JUMBO_FRAME;
        }
        let mut frng = Rng::derive(o.seed, round * 2 + 1);
        let this_round = o.frames_per_profile.min(o.frames - s.frames);
        *s.programs.entry(bench.plane.prog_name()).or_default() += this_round;
        let mut done = 0u64;
        let nrules = bench.profile.rules.len();
        while done < this_round && s.failures.len() < o.max_failures {
            let n = (o.batch as u64).min(this_round - done) as usize;
            let frames: Vec<Vec<u8>> = (0..n).map(|_| gen::frame(&mut frng, &targets)).collect();
            let mut want = Tally::zero(nrules);
            let mut verdicts_ok = true;
            let before = bench.snapshot();
            for f in &frames {
                let class = classify(f, &bench.profile);
                *s.classes.entry(class.reason()).or_default() += 1;
                let e = expect(&class, &bench.profile);
                want.add_expect(&e, f.len());
                if bench.plane.run(f) != e.verdict {
                    verdicts_ok = false;
                }
            }
            let got = Tally::delta(&before, &bench.snapshot());
            done += n as u64;
            s.frames += n as u64;
            if got == want && verdicts_ok {
                continue;
            }
            // Name the frames.
            let t_bisect = Instant::now();
            let mut bad = Vec::new();
            bench.bad_frames(&frames, 0, &mut bad);
            for f in bad.iter().map(|&i| &frames[i]) {
                let out = bench.one(f);
                if out.agrees() {
                    continue;
                }
                s.disagreeing_frames += 1;
                let sig = out.signature();
                if let Some(&i) = by_sig.get(&sig) {
                    s.failures[i].count += 1;
                    continue;
                }
                if s.failures.len() >= o.max_failures {
                    continue;
                }
                let (hex, prof) = write_case(&o.out, s.failures.len(), f, &bench, &out);
                let fail = Failure {
                    signature: sig.clone(),
                    count: 1,
                    hex,
                    profile: prof,
                    expected: out.expected_line(&bench.profile),
                    kernel: out.kernel_line(&bench.profile),
                };
                if o.verbose {
                    println!(
                        "DISAGREE [{}] {}\n  reference: {}\n  kernel:    {}\n  reproduce: {}",
                        s.failures.len(),
                        sig,
                        fail.expected,
                        fail.kernel,
                        fail.replay_command()
                    );
                }
                by_sig.insert(sig, s.failures.len());
                s.failures.push(fail);
            }
            s.bisect_time += t_bisect.elapsed();
        }
        round += 1;
    }
    s.elapsed = start.elapsed();
    s
}

/// Prints a summary's last lines.
pub fn report(s: &Summary) -> String {
    let mut r = String::new();
    let _ = writeln!(
        r,
        "flowctl-fuzz: {} frames, {} profiles in {:.1} s ({:.0} frames/s; loads {:.1} s; naming disagreeing frames {:.1} s, {:.0} frames/s without); {} disagreeing frames, {} distinct",
        s.frames,
        s.profiles,
        s.elapsed.as_secs_f64(),
        s.frames_per_second(),
        s.load_time.as_secs_f64(),
        s.bisect_time.as_secs_f64(),
        s.agreeing_frames_per_second(),
        s.disagreeing_frames,
        s.failures.len()
    );
    let progs: Vec<String> = s.programs.iter().map(|(p, n)| format!("{p} {n}")).collect();
    let _ = writeln!(r, "frames per program: {}", progs.join(", "));
    let _ = writeln!(r, "frames per class (reference):");
    for (k, n) in &s.classes {
        let _ = writeln!(r, "  {n:>9} {k}");
    }
    let _ = writeln!(
        r,
        "disagreements (frames, reference class -> what the kernel moved, an example):"
    );
    for f in &s.failures {
        let _ = writeln!(r, "  {}x {}\n     {}", f.count, f.signature, f.replay_command());
    }
    r
}

/// Replays one frame file under a profile on a fresh plane.
pub fn replay(hex: &Path, profile: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(hex).map_err(|e| format!("{}: {e}", hex.display()))?;
    let frame = from_hex(&text).map_err(|e| format!("{}: {e}", hex.display()))?;
    let prof =
        std::fs::read_to_string(profile).map_err(|e| format!("{}: {e}", profile.display()))?;
    // The program the case was found on (`# program:`), else the loader's pick.
    let variant = match hex_comment(&text, "program").as_deref() {
        Some(flowctl_common::XDP_PROGRAM) => XdpVariant::Single,
        _ => XdpVariant::for_kernel(),
    };
    // Both parsers: the inline one (`parse::fast`) and the functions.
    let mut msg = String::new();
    let mut agree = true;
    for fast_parse in [true, false] {
        let b = Bench::new_with(&prof, variant, fast_parse);
        let out = b.one(&frame);
        let _ = write!(
            msg,
            "{} ({} bytes, {}, {})\n  reference: {}\n  kernel:    {}\n",
            hex.display(),
            frame.len(),
            b.plane.prog_name(),
            if fast_parse { "inline parse" } else { "the parser's functions" },
            out.expected_line(&b.profile),
            out.kernel_line(&b.profile)
        );
        if let Some(want) = hex_comment(&text, "class") {
            if want != out.class.kind() {
                let _ = writeln!(
                    msg,
                    "  the file says class {want}, the reference says {}",
                    out.class.kind()
                );
                return Err(msg);
            }
        }
        agree &= out.agrees();
        msg += if out.agrees() { "  agree\n" } else { "  DISAGREE\n" };
    }
    if agree {
        Ok(msg)
    } else {
        Err(msg)
    }
}

#[allow(dead_code)]
fn _reason_indices_are_distinct() {
    const _: () =
        assert!(reason::EVASIVE != reason::MALFORMED && reason::MALFORMED != reason::FRAGMENT);
}
