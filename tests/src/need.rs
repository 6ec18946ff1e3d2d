//! The privileged tests' harness: each test declares what it needs from the
//! host ([`Need`]); the needs are checked once, when the trials are collected,
//! and a test whose needs are unmet is reported *ignored* (with its reason on
//! one line, `skipped NAME: needs ...`), never passed. The test targets are
//! `harness = false` binaries that hand their list to [`run`], which keeps
//! libtest's command line (name filters, `--exact`, `--skip`, `--list`,
//! `--ignored`, `--test-threads`, `--nocapture`) through `libtest-mimic`.
//!
//! ```ignore
//! fn main() {
//!     use flowctl_tests::need::Need::*;
//!     flowctl_tests::need::run(flowctl_tests::trials![
//!         verifier_instruction_budget: [Root],
//!         cgroup_v2_usage_against_cpu_max: [Root, CgroupV2Cpu],
//!     ]);
//! }
//! ```

use flowctl::system::cgroup::{self, Mount};
use libtest_mimic::{Arguments, Completion, Failed, FormatSetting, Trial};
use std::path::PathBuf;

/// What a test needs from the host to run at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Effective uid 0: loading programs, namespaces, cgroups.
    Root,
    /// A cgroup v2 hierarchy (the breakers' hooks attach to v2 cgroups).
    CgroupV2,
    /// The cpu and cpuacct controllers on cgroup v1 hierarchies (a hybrid
    /// host such as this project's machines; absent on pure v2).
    CgroupV1Cpu,
    /// The cpu controller on the cgroup v2 hierarchy (listed in its root's
    /// `cgroup.controllers`: pure v2 hosts; on hybrid ones cpu is on v1).
    CgroupV2Cpu,
    /// Linux MAJOR.MINOR or newer.
    Kernel(u32, u32),
    /// A program on PATH.
    Command(&'static str),
    /// A qdisc this kernel can create (`sch_KIND`, built in, loaded, or a
    /// module it can load): the egress shaper needs `fq`, which this
    /// project's host kernel lacks and Debian's 6.1 and 6.12 have.
    Qdisc(&'static str),
    /// A kernel *without* that qdisc: the refusal a profile needing it gets.
    NoQdisc(&'static str),
    /// A kernel that loads extension (`freplace`) programs, which libxdp's
    /// dispatcher needs (this project's host kernel refuses them: EPERM).
    Freplace,
    /// An environment variable naming an existing file (`FLOWCTL_DEB`: the
    /// package under test, which `cargo xtask test` builds and sets).
    EnvFile(&'static str),
}

/// One test: its name (as libtest names it: the function's), its body and
/// its needs.
pub struct Test {
    pub name: &'static str,
    pub run: fn(),
    pub needs: &'static [Need],
}

/// `trials![name: [Need, ...], ...]`: the [`Test`]s of functions in scope,
/// named after them.
#[macro_export]
macro_rules! trials {
    ($($f:ident: [$($n:expr),* $(,)?]),* $(,)?) => {
        vec![$($crate::need::Test { name: stringify!($f), run: $f, needs: &[$($n),*] }),*]
    };
}

/// What the host has, probed once.
#[derive(Clone, Debug, Default)]
pub struct Host {
    pub root: bool,
    pub mounts: Vec<Mount>,
    pub v2: Option<PathBuf>,
    /// The controllers the v2 hierarchy's root offers.
    pub v2_controllers: Vec<String>,
    /// `uname -r`.
    pub release: String,
}

impl Host {
    pub fn probe() -> Self {
        let mounts = cgroup::mounts().unwrap_or_default();
        let v2 = cgroup::v2_of(&mounts);
        let v2_controllers =
            v2.as_deref().and_then(|p| cgroup::v2_controllers(p).ok()).unwrap_or_default();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        Self { root: unsafe { libc::geteuid() } == 0, mounts, v2, v2_controllers, release }
    }

    /// The running kernel's MAJOR.MINOR.
    pub fn kernel(&self) -> Option<(u32, u32)> {
        kernel_version(&self.release)
    }

    fn v1_has(&self, controller: &str) -> bool {
        !cgroup::v1_of(&self.mounts, controller).is_empty()
    }

    /// Why `need` is unmet here ("needs ..."), or None when it is met.
    pub fn unmet(&self, need: Need) -> Option<String> {
        let pure_v2 = self.v2.is_some() && self.mounts.iter().all(|m| m.v2);
        match need {
            Need::Root => (!self.root).then(|| "needs root (run `cargo xtask test`)".to_string()),
            Need::CgroupV2 => self.v2.is_none().then(|| {
                "needs a cgroup v2 hierarchy (no cgroup2 mount in /proc/self/mounts)".to_string()
            }),
            Need::CgroupV1Cpu => {
                let missing: Vec<&str> =
                    ["cpu", "cpuacct"].into_iter().filter(|c| !self.v1_has(c)).collect();
                (!missing.is_empty()).then(|| match pure_v2 {
                    true => {
                        "needs cgroup v1 cpu controller (this host is pure cgroup v2)".to_string()
                    }
                    false => format!(
                        "needs cgroup v1 cpu controller (no v1 hierarchy carries {})",
                        missing.join(" or ")
                    ),
                })
            }
            Need::CgroupV2Cpu => {
                let Some(v2) = &self.v2 else {
                    return Some(
                        "needs cgroup v2 cpu controller (no cgroup v2 hierarchy)".to_string(),
                    );
                };
                (!self.v2_controllers.iter().any(|c| c == "cpu")).then(|| match self.v1_has("cpu") {
                    true => format!("needs cgroup v2 cpu controller (this host is hybrid: cpu is on cgroup v1, v2 at {} has none)", v2.display()),
                    false => format!("needs cgroup v2 cpu controller (not in {}/cgroup.controllers)", v2.display()),
                })
            }
            Need::Kernel(major, minor) => match self.kernel() {
                Some(v) if v >= (major, minor) => None,
                _ => {
                    Some(format!("needs Linux {major}.{minor} or newer (this is {})", self.release))
                }
            },
            Need::Command(c) => (!on_path(c)).then(|| format!("needs `{c}` on PATH")),
            Need::NoQdisc(kind) => qdisc_available(&self.release, kind).then(|| {
                format!("needs a kernel without the {kind} qdisc ({} has sch_{kind}): it checks the refusal", self.release)
            }),
            Need::Qdisc(kind) => (!qdisc_available(&self.release, kind)).then(|| {
                format!(
                    "needs the {kind} qdisc (no sch_{kind} built into or as a module of {})",
                    self.release
                )
            }),
            Need::Freplace => freplace_refused().map(|why| {
                format!("needs a kernel that loads extension (freplace) programs ({} refuses them: {why})", self.release)
            }),
            Need::EnvFile(var) => match std::env::var_os(var) {
                Some(p) if std::path::Path::new(&p).is_file() => None,
                Some(p) => Some(format!("needs {var} to name a file (no file at {p:?})")),
                None => Some(format!("needs {var} (a file; `cargo xtask test` sets it)")),
            },
        }
    }

    /// Every unmet need of a test, on one line; None when it can run.
    pub fn unmet_all(&self, needs: &[Need]) -> Option<String> {
        let why: Vec<String> = needs.iter().filter_map(|n| self.unmet(*n)).collect();
        (!why.is_empty()).then(|| why.join("; "))
    }
}

/// Why this kernel refuses an extension program (None: it loads one): the
/// bench object's `bench_pass_ext` loaded against its `bench_pass`.
fn freplace_refused() -> Option<String> {
    static ONCE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| load_an_extension().err()).clone()
}

fn load_an_extension() -> Result<(), String> {
    use aya::programs::{Extension, ProgramError, Xdp};
    let mut ebpf = aya::EbpfLoader::new()
        .load(flowctl_bench::bench_object())
        .map_err(|e| format!("loading the bench object: {e}"))?;
    let target: &mut Xdp = ebpf
        .program_mut("bench_pass")
        .ok_or("no bench_pass")?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    target.load().map_err(|e| format!("loading bench_pass: {e}"))?;
    let fd = target.fd().and_then(|f| Ok(f.try_clone()?)).map_err(|e| e.to_string())?;
    let ext: &mut Extension = ebpf
        .program_mut("bench_pass_ext")
        .ok_or("no bench_pass_ext")?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    ext.load(fd, "bench_pass").map_err(|e| match e {
        ProgramError::LoadError { io_error, .. } => io_error.to_string(),
        e => e.to_string(),
    })
}

/// The environment variable the kernel matrix exports in its VMs (xtask).
pub const VM_ENV: &str = "FLOWCTL_TEST_VM";

/// Whether this run is in one of the kernel matrix's VMs (TCG, 10-50x
/// slower): tests assert correctness there (verdicts, counters), not speed.
pub fn in_vm() -> bool {
    std::env::var_os(VM_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// "6.12.117+deb12-amd64" -> (6, 12).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.split(|c: char| !c.is_ascii_digit());
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Whether kernel `release` has `sch_KIND`: loaded, or listed among its
/// built-in or loadable modules.
fn qdisc_available(release: &str, kind: &str) -> bool {
    let module = format!("sch_{kind}");
    if std::path::Path::new("/sys/module").join(&module).exists() {
        return true;
    }
    let lists = ["modules.builtin", "modules.dep"];
    lists.iter().any(|l| {
        std::fs::read_to_string(format!("/lib/modules/{release}/{l}"))
            .is_ok_and(|t| t.lines().any(|line| line.contains(&format!("/{module}.ko"))))
    })
}

fn on_path(cmd: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let ok = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if cmd.contains('/') {
        return ok(std::path::Path::new(cmd));
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| ok(&d.join(cmd))))
}

/// Runs the tests as libtest would (its command line from the process
/// arguments) and exits: 0 unless a test failed. A test with unmet needs is
/// ignored (and stays ignored under `--ignored`/`--include-ignored`: it
/// cannot run here); each runs on a thread of its own, named after it, like
/// libtest's (the tests enter namespaces per thread), and a panic fails it.
pub fn run(tests: Vec<Test>) -> ! {
    let (args, names) = arguments();
    let tests: Vec<Test> = match &names {
        None => tests,
        Some(names) => tests
            .into_iter()
            .filter(|t| {
                names
                    .iter()
                    .any(|n| if args.exact { t.name == n } else { t.name.contains(n.as_str()) })
            })
            .collect(),
    };
    let host = Host::probe();
    let quiet_list = args.list || matches!(args.format, Some(FormatSetting::Json));
    let mut trials = Vec::with_capacity(tests.len());
    for t in tests {
        let unmet = host.unmet_all(t.needs);
        let (name, f) = (t.name, t.run);
        let why = unmet.clone();
        let trial = Trial::ignorable_test(name, move || match why {
            Some(why) => Ok(Completion::ignored_with(why)),
            None => run_on_thread(name, f),
        })
        .with_ignored_flag(unmet.is_some());
        if let Some(why) = &unmet {
            if !args.is_filtered_out(&trial) {
                match quiet_list {
                    true => eprintln!("skipped {name}: {why}"),
                    false => println!("skipped {name}: {why}"),
                }
            }
        }
        trials.push(trial);
    }
    let conclusion = libtest_mimic::run(&args, trials);
    print_slowest();
    conclusion.exit()
}

/// Wall time of each test that ran, for the summary after the run.
static TIMES: std::sync::Mutex<Vec<(&'static str, f64)>> = std::sync::Mutex::new(Vec::new());

/// The slowest tests of the run, after libtest's summary: where a tier's
/// time goes (under TCG the same tests take 10-50x longer, and the VM
/// tiers have a timeout).
fn print_slowest() {
    let mut times = TIMES.lock().map(|t| t.clone()).unwrap_or_default();
    if times.len() < 2 {
        return;
    }
    times.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = times.iter().map(|t| t.1).sum();
    println!("slowest of {} tests ({total:.1} s in all):", times.len());
    for (name, secs) in times.iter().take(8) {
        println!("  {secs:8.1} s  {name}");
    }
}

/// libtest's arguments. libtest takes several name filters (`e2e a b c`,
/// as the kernel matrix runs its subset); libtest-mimic takes one, so with
/// more than one the names are taken out here and applied to the list.
fn arguments() -> (Arguments, Option<Vec<String>>) {
    const WITH_VALUE: &[&str] =
        &["--test-threads", "--logfile", "--skip", "--color", "--format", "-Z"];
    let all: Vec<String> = std::env::args().collect();
    let mut flags = vec![all[0].clone()];
    let mut names = Vec::new();
    let mut i = 1;
    while i < all.len() {
        let a = &all[i];
        if WITH_VALUE.contains(&a.as_str()) {
            flags.push(a.clone());
            if let Some(v) = all.get(i + 1) {
                flags.push(v.clone());
            }
            i += 2;
            continue;
        }
        if a.starts_with('-') {
            flags.push(a.clone());
        } else {
            names.push(a.clone());
        }
        i += 1;
    }
    if names.len() <= 1 {
        return (Arguments::from_args(), None);
    }
    (Arguments::from_iter(flags), Some(names))
}

fn run_on_thread(name: &'static str, f: fn()) -> Result<Completion, Failed> {
    let started = std::time::Instant::now();
    let result = run_and_join(name, f);
    if let Ok(mut t) = TIMES.lock() {
        t.push((name, started.elapsed().as_secs_f64()));
    }
    result
}

fn run_and_join(name: &str, f: fn()) -> Result<Completion, Failed> {
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(f)
        .map_err(|e| Failed::from(format!("spawning the test thread: {e}")))?;
    handle.join().map(|()| Completion::Completed).map_err(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied());
        Failed::from(match msg {
            Some(m) => format!("test panicked: {m}"),
            None => "test panicked".to_string(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(mounts: &str, controllers: &str, root: bool) -> Host {
        let mounts = cgroup::parse_mounts(mounts);
        let v2 = cgroup::v2_of(&mounts);
        let v2_controllers = controllers.split_whitespace().map(String::from).collect();
        Host { root, mounts, v2, v2_controllers, release: "6.12.117+deb12-amd64".into() }
    }

    const HYBRID: &str = "cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\ncgroup /sys/fs/cgroup/cpuacct cgroup rw,cpuacct 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
    const PURE: &str = "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n";

    #[test]
    fn needs_on_a_hybrid_host() {
        let h = host(HYBRID, "hugetlb", true);
        assert_eq!(h.unmet_all(&[Need::Root, Need::CgroupV2, Need::CgroupV1Cpu]), None);
        let why = h.unmet(Need::CgroupV2Cpu).unwrap();
        assert!(why.contains("hybrid") && why.contains("/sys/fs/cgroup/unified"), "{why}");
    }

    #[test]
    fn needs_on_a_pure_v2_host() {
        let h = host(PURE, "cpuset cpu io memory pids", true);
        assert_eq!(h.unmet_all(&[Need::Root, Need::CgroupV2, Need::CgroupV2Cpu]), None);
        assert_eq!(
            h.unmet(Need::CgroupV1Cpu).unwrap(),
            "needs cgroup v1 cpu controller (this host is pure cgroup v2)"
        );
    }

    #[test]
    fn unmet_needs_join_on_one_line() {
        let h = host("", "", false);
        let why = h
            .unmet_all(&[
                Need::Root,
                Need::CgroupV2,
                Need::Kernel(7, 1),
                Need::Kernel(6, 12),
                Need::Command("sh"),
            ])
            .unwrap();
        assert_eq!(
            why,
            "needs root (run `cargo xtask test`); needs a cgroup v2 hierarchy (no cgroup2 mount in /proc/self/mounts); needs Linux 7.1 or newer (this is 6.12.117+deb12-amd64)"
        );
        assert!(h.unmet(Need::Command("flowctl-no-such-program")).is_some());
    }

    #[test]
    fn kernel_versions_parse() {
        assert_eq!(kernel_version("6.1.0-54-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("6.18.0"), Some((6, 18)));
        assert_eq!(kernel_version("garbage"), None);
    }
}
