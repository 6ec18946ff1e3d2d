//! The Debian package (`cargo xtask package`; docs/packaging.md), installed
//! into a clean root with `dpkg -x` (no maintainer scripts run, nothing on
//! this machine changes) and used from there: its contents and fields,
//! lintian, the manual pages under `man`, the completions in bash, zsh and
//! fish, the unit under `systemd-analyze verify`, `flowctl check` on the
//! installed default profile, and the unit's own commands (ExecStart,
//! ExecReload, its stop signal) run directly against a veth pair in
//! namespaces the test creates: systemd does not run on these machines.
//!
//! The package is `FLOWCTL_DEB`: `cargo xtask test` builds it from the binary
//! under test (`cargo xtask package --binary PATH` by hand). Without it, or
//! without root or a tool, a test is reported ignored, never passed.

use flowctl_tests::{
    lab::Lab,
    tempfile::TempFile,
    traffic::{UdpCounter, UdpStreams},
};
use serde_json::Value;
use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

const DEB: &str = "FLOWCTL_DEB";
const UNIT: &str = "lib/systemd/system/flowctl@.service";
const DEFAULT_PROFILE: &str = "etc/flowctl/default.toml";

fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        package_holds_what_debian_expects: [EnvFile(DEB), Command("dpkg-deb")],
        package_is_lintian_clean: [EnvFile(DEB), Command("lintian")],
        installed_default_profile_passes_check: [EnvFile(DEB), Command("dpkg-deb")],
        installed_man_pages_render: [EnvFile(DEB), Command("dpkg-deb"), Command("man")],
        installed_completions_load_in_bash: [EnvFile(DEB), Command("dpkg-deb"), Command("bash")],
        installed_completions_parse_in_zsh: [EnvFile(DEB), Command("dpkg-deb"), Command("zsh")],
        installed_completions_parse_in_fish: [EnvFile(DEB), Command("dpkg-deb"), Command("fish")],
        installed_unit_verifies: [EnvFile(DEB), Command("dpkg-deb"), Command("systemd-analyze")],
        unit_commands_keep_the_interface_protected_until_detach: [Root, EnvFile(DEB), Command("dpkg-deb")],
    ]);
}

fn deb() -> PathBuf {
    PathBuf::from(std::env::var_os(DEB).expect("FLOWCTL_DEB"))
}

/// The package unpacked into a fresh directory (`dpkg -x`), removed on drop.
struct Root(PathBuf);

impl Root {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(flowctl_tests::unique("flowctl-pkg-root-"));
        std::fs::create_dir(&dir).unwrap();
        let root = Root(dir);
        let out = Command::new("dpkg-deb").arg("-x").arg(deb()).arg(&root.0).output().unwrap();
        assert!(out.status.success(), "dpkg-deb -x: {}", String::from_utf8_lossy(&out.stderr));
        root
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }

    fn bin(&self) -> PathBuf {
        self.path("usr/bin/flowctl")
    }

    /// The installed `flowctl ARGS`.
    fn flowctl(&self, args: &[&str]) -> Output {
        Command::new(self.bin()).args(args).output().unwrap()
    }

    /// One attachment of the installed binary's `status --json`.
    fn attachment(&self, iface: &str) -> Option<Value> {
        let out = self.flowctl(&["status", "--json"]);
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        v.as_array()?.iter().find(|a| a["iface"] == iface).cloned()
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

/// The verbs of `flowctl --help` (without `help`).
fn verbs(root: &Root) -> Vec<String> {
    let help = ok(&root.flowctl(&["--help"]), "flowctl --help");
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|v| *v != "help")
        .map(String::from)
        .collect()
}

/// The files at their Debian paths, the control fields, the conffile, and
/// maintainer scripts that parse.
pub fn package_holds_what_debian_expects() {
    let contents = ok(&run(Command::new("dpkg-deb").arg("--contents").arg(deb())), "--contents");
    let files: Vec<&str> = contents
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(|p| p.trim_start_matches("./"))
        .collect();
    let root = Root::new();
    let mut want: Vec<String> = [
        "usr/bin/flowctl",
        UNIT,
        DEFAULT_PROFILE,
        "usr/share/bash-completion/completions/flowctl",
        "usr/share/zsh/vendor-completions/_flowctl",
        "usr/share/fish/vendor_completions.d/flowctl.fish",
        "usr/share/doc/flowctl/copyright",
        "usr/share/doc/flowctl/changelog.Debian.gz",
        "usr/share/doc/flowctl/README.Debian",
        "usr/share/man/man1/flowctl.1.gz",
    ]
    .map(String::from)
    .to_vec();
    let verbs = verbs(&root);
    assert!(verbs.len() >= 10 && verbs.iter().any(|v| v == "attach"), "{verbs:?}");
    assert!(!verbs.iter().any(|v| v == "generate"), "generate is hidden");
    want.extend(verbs.iter().map(|v| format!("usr/share/man/man1/flowctl-{v}.1.gz")));
    for w in &want {
        assert!(files.contains(&w.as_str()), "{w} not in the package: {files:?}");
    }
    // Owned by root, no file writable by others.
    for l in contents.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(f[1], "root/root", "{l}");
        assert_ne!(f[0].as_bytes()[8], b'w', "writable by others: {l}");
    }
    let field = |name: &str| {
        ok(&run(Command::new("dpkg-deb").arg("--field").arg(deb()).arg(name)), name)
            .trim()
            .to_string()
    };
    assert_eq!(field("Package"), "flowctl");
    assert!(field("Version").starts_with(env!("CARGO_PKG_VERSION")), "{}", field("Version"));
    assert!(field("Depends").contains("libc6 (>="), "{}", field("Depends"));
    let ctrl = root.path("DEBIAN-control");
    ok(&run(Command::new("dpkg-deb").arg("--control").arg(deb()).arg(&ctrl)), "--control");
    assert_eq!(
        std::fs::read_to_string(ctrl.join("conffiles")).unwrap(),
        format!("/{DEFAULT_PROFILE}\n")
    );
    for script in ["postinst", "prerm", "postrm"] {
        ok(&run(Command::new("sh").arg("-n").arg(ctrl.join(script))), script);
    }
    // The binary is stripped and still carries its BPF programs (the
    // attach test runs them; here, `--version` runs).
    let v = ok(&root.flowctl(&["--version"]), "--version");
    assert_eq!(v.trim(), format!("flowctl {}", env!("CARGO_PKG_VERSION")));
}

/// lintian, pedantic, with no error or warning (the one override, shipped in
/// the package, says why).
pub fn package_is_lintian_clean() {
    let out = run(Command::new("lintian")
        .args(["--fail-on", "error,warning", "--pedantic", "--no-tag-display-limit"])
        .arg(deb()));
    ok(&out, "lintian");
    let tags = String::from_utf8_lossy(&out.stdout);
    assert!(!tags.lines().any(|l| l.starts_with("E:") || l.starts_with("W:")), "{tags}");
}

/// `flowctl check` from the installed binary on the installed default
/// profile; every rule of it is dry-run.
pub fn installed_default_profile_passes_check() {
    let root = Root::new();
    let profile = root.path(DEFAULT_PROFILE);
    let out = ok(&root.flowctl(&["check", profile.to_str().unwrap()]), "flowctl check");
    assert!(out.contains(": ok,") && out.contains("kernel memory"), "{out}");
    let text = std::fs::read_to_string(&profile).unwrap();
    let rules: Vec<&str> = text.split("\n[[rule]]\n").skip(1).collect();
    assert_eq!(rules.len(), 4, "{text}");
    for rule in rules {
        assert!(
            rule.contains("\naction = \"dry-run\"\n") || rule.contains("\naction = \"pass\"\n"),
            "a default rule drops: {rule}"
        );
    }
}

/// Each page renders under `man -l` without a warning, with its name, and
/// `man -M` finds the verbs' pages by name where they are installed.
pub fn installed_man_pages_render() {
    let root = Root::new();
    let dir = root.path("usr/share/man/man1");
    let mut pages: Vec<PathBuf> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    pages.sort();
    assert!(pages.len() > 10, "{pages:?}");
    for p in &pages {
        let out = run(Command::new("man")
            .args(["--warnings", "-l"])
            .arg(p)
            .env("MANWIDTH", "80")
            .env("MAN_DISABLE_SECCOMP", "1")
            .stdin(Stdio::null()));
        let text = ok(&out, &p.display().to_string());
        let name = p.file_name().unwrap().to_string_lossy().trim_end_matches(".1.gz").to_string();
        assert!(text.contains("NAME") && text.contains("SYNOPSIS"), "{name}: {text}");
        assert!(text.contains(&name), "{name}: {text}");
        assert!(text.contains("SEE ALSO"), "{name}: {text}");
        let warnings = String::from_utf8_lossy(&out.stderr);
        assert!(warnings.trim().is_empty(), "{name}: man warned: {warnings}");
    }
    for v in verbs(&root) {
        let out = run(Command::new("man")
            .arg("-M")
            .arg(root.path("usr/share/man"))
            .args(["-w", &format!("flowctl-{v}")]));
        let found = ok(&out, &format!("man -w flowctl-{v}"));
        assert!(found.trim().ends_with(&format!("flowctl-{v}.1.gz")), "{found}");
    }
}

/// The bash script loads and registers a completion for `flowctl`, which
/// completes the verbs.
pub fn installed_completions_load_in_bash() {
    let root = Root::new();
    let file = root.path("usr/share/bash-completion/completions/flowctl");
    let script = format!(
        "set -e; source {f}; complete -p flowctl; \
         COMP_WORDS=(flowctl at); COMP_CWORD=1; COMP_LINE='flowctl at'; COMP_POINT=10; \
         _flowctl flowctl at flowctl; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        f = file.display()
    );
    let out = ok(&run(Command::new("bash").args(["--norc", "--noprofile", "-c", &script])), "bash");
    assert!(out.contains("-F _flowctl") && out.lines().any(|l| l.ends_with(" flowctl")), "{out}");
    assert!(out.lines().any(|l| l == "attach"), "`flowctl at<TAB>` completes attach: {out}");
}

/// zsh parses the script (`zsh -n`), and it defines `_flowctl` when loaded.
pub fn installed_completions_parse_in_zsh() {
    let root = Root::new();
    let file = root.path("usr/share/zsh/vendor-completions/_flowctl");
    ok(&run(Command::new("zsh").arg("-n").arg(&file)), "zsh -n");
    let script = format!(
        "fpath=({} $fpath); autoload -Uz compinit && compinit -u -D; autoload -Uz _flowctl; whence -w _flowctl",
        file.parent().unwrap().display()
    );
    let out = ok(&run(Command::new("zsh").args(["-f", "-c", &script])), "zsh");
    assert!(out.contains("_flowctl: function"), "{out}");
}

/// fish parses the script (`fish --no-execute`), and loading it completes the verbs.
pub fn installed_completions_parse_in_fish() {
    let root = Root::new();
    let file = root.path("usr/share/fish/vendor_completions.d/flowctl.fish");
    ok(&run(Command::new("fish").arg("--no-execute").arg(&file)), "fish --no-execute");
    let script = format!("source {}; complete --do-complete 'flowctl at'", file.display());
    let out = ok(&run(Command::new("fish").args(["--no-config", "-c", &script])), "fish");
    assert!(out.lines().any(|l| l.starts_with("attach")), "{out}");
}

/// `systemd-analyze verify` of an instance of the installed unit, against
/// the clean root (the ExecStart binary is looked up there), with nothing
/// said; and the same check fails where the unit is broken (it is not
/// vacuous).
pub fn installed_unit_verifies() {
    let root = Root::new();
    std::fs::copy(root.path(DEFAULT_PROFILE), root.path("etc/flowctl/test0.toml")).unwrap();
    let verify = |root: &Root| {
        run(Command::new("systemd-analyze")
            .arg("verify")
            .arg(format!("--root={}", root.0.display()))
            // Manual pages are checked by installed_man_pages_render; the
            // clean root has no sysinit.target to order against.
            .args(["--man=no", "--recursive-errors=no", "flowctl@test0.service"]))
    };
    let out = verify(&root);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.trim().is_empty(), "{}: {said}", out.status);
    // Broken on purpose: the binary gone, a misspelt setting.
    let broken = Root::new();
    std::fs::remove_file(broken.bin()).unwrap();
    let out = verify(&broken);
    assert!(!out.status.success(), "verify passed without /usr/bin/flowctl");
    assert!(String::from_utf8_lossy(&out.stderr).contains("/usr/bin/flowctl"));
    let unit = broken.path(UNIT);
    let text = std::fs::read_to_string(&unit).unwrap().replace("Restart=", "Restrat=");
    std::fs::write(&unit, text).unwrap();
    std::fs::copy(root.bin(), broken.bin()).unwrap();
    let out = verify(&broken);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("Restrat"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The unit's `[Service]` settings (`Key=value`; a repeated key keeps each value).
fn service(unit: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut in_service = false;
    for l in unit.lines().map(str::trim) {
        if l.starts_with('[') {
            in_service = l == "[Service]";
        } else if in_service && !l.is_empty() && !l.starts_with('#') {
            let (k, v) = l.split_once('=').unwrap();
            out.entry(k.to_string()).or_default().push(v.to_string());
        }
    }
    out
}

/// A unit's command line as systemd would run it for instance `iface`, on
/// the clean root's files, in namespace `netns` (`--netns`: the interface
/// lives in the lab's namespace, as in every end-to-end test).
fn unit_command(root: &Root, line: &str, iface: &str, netns: &str, env: &[String]) -> Command {
    assert!(!line.starts_with(['-', '@', '+', '!', ':']), "prefixed command {line}");
    let line = line.replace("%I", iface).replace("%i", iface);
    assert!(!line.contains('%'), "an unhandled specifier: {line}");
    let mut words = line.split_whitespace().map(|w| {
        if w == "/usr/bin/flowctl" {
            root.bin().to_string_lossy().into_owned()
        } else if let Some(rest) = w.strip_prefix("/etc/flowctl/") {
            root.path("etc/flowctl").join(rest).to_string_lossy().into_owned()
        } else {
            w.to_string()
        }
    });
    let mut cmd = Command::new(words.next().unwrap());
    cmd.args(words).args(["--netns", netns]);
    for e in env {
        let (k, v) = e.split_once('=').unwrap();
        cmd.env(k, v);
    }
    cmd
}

/// The agent of ExecStart, as systemd would hold it: stopped with the
/// unit's KillSignal. Dropped still running (a failed test), SIGKILL.
struct Service {
    child: Child,
    log: TempFile,
}

impl Service {
    fn start(mut cmd: Command, root: &Root, iface: &str) -> Self {
        let log = TempFile::new("flowctl-pkg-agent-", ".log", "");
        let f = std::fs::File::create(log.path()).unwrap();
        let child = cmd.stdin(Stdio::null()).stderr(f).spawn().unwrap();
        let mut s = Service { child, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        while root.attachment(iface).is_none_or(|a| a["agent_ready"] != true) {
            if let Ok(Some(st)) = s.child.try_wait() {
                panic!("ExecStart exited: {st}: {}", s.said());
            }
            assert!(Instant::now() < deadline, "the agent did not come up: {}", s.said());
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    fn said(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// What `systemctl stop` does here: the unit's KillSignal, then wait
    /// (TimeoutStopSec is 15 s); the agent must exit successfully.
    fn stop(self, signal: i32) -> String {
        unsafe { libc::kill(self.child.id() as i32, signal) };
        self.exited()
    }

    /// Waits (15 s at most) for the agent to exit, which it must do
    /// successfully (`Restart=on-failure` then leaves the unit stopped).
    fn exited(mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "agent exit {st}: {}", self.said());
                return self.said();
            }
            assert!(Instant::now() < deadline, "the agent outlived TimeoutStopSec");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Detaches on drop (a failed test leaves no kept data plane behind).
struct DetachOnDrop {
    bin: PathBuf,
    iface: String,
    netns: String,
}

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        let _ = Command::new(&self.bin)
            .args(["detach", &self.iface, "--netns", &self.netns])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn signal_number(name: &str) -> i32 {
    match name.trim_start_matches("SIG") {
        "TERM" => libc::SIGTERM,
        "INT" => libc::SIGINT,
        other => panic!("KillSignal={other}: not one this test knows"),
    }
}

/// The ids of the pinned maps of an attachment (the same ids: the same maps).
fn map_ids(attachment: &Value) -> Vec<u32> {
    let dir = format!(
        "{}/v{}/ifaces/{}-{}",
        flowctl_common::PIN_ROOT,
        flowctl_common::LAYOUT_VERSION,
        attachment["netns_inode"],
        attachment["ifindex"]
    );
    flowctl_common::map_names::ALL
        .iter()
        .map(|n| aya::maps::MapData::from_pin(format!("{dir}/{n}")).unwrap().info().unwrap().id())
        .collect()
}

/// The unit's lifecycle from the installed files: ExecStart on the default
/// profile; ExecReload to a limiting profile (a bad one changes nothing);
/// then, under steady traffic, the unit's stop (KillSignal) and a new
/// ExecStart, as `systemctl restart` and the package's upgrade do: the kept
/// data plane enforces throughout (not one packet past the drained
/// bucket), and the new agent adopts the same maps. Protection goes only
/// with the explicit `flowctl detach` (which also stops the running agent,
/// for good), after which the traffic passes.
pub fn unit_commands_keep_the_interface_protected_until_detach() {
    let root = Root::new();
    let unit = std::fs::read_to_string(root.path(UNIT)).unwrap();
    let svc = service(&unit);
    let one = |k: &str| -> String {
        let v = svc.get(k).unwrap_or_else(|| panic!("no {k}= in the unit"));
        assert_eq!(v.len(), 1, "{k}: {v:?}");
        v[0].clone()
    };
    let (exec_start, exec_reload) = (one("ExecStart"), one("ExecReload"));
    assert!(exec_start.contains("--keep"), "{exec_start}");
    assert!(!svc.contains_key("ExecStop"), "stop is the KillSignal (see the unit)");
    let kill = signal_number(&one("KillSignal"));
    let env = svc.get("Environment").cloned().unwrap_or_default();
    // tracing colours its lines even off a terminal; the journal would keep
    // the escape codes.
    assert!(env.iter().any(|e| e == "NO_COLOR=1"), "{env:?}");

    let lab = Lab::new("fpkg", 245);
    let iface = lab.veth_srv.clone();
    let _cleanup =
        DetachOnDrop { bin: root.bin(), iface: iface.clone(), netns: lab.ns_srv.clone() };
    let profile = root.path(&format!("etc/flowctl/{iface}.toml"));
    let default = std::fs::read_to_string(root.path(DEFAULT_PROFILE)).unwrap();
    std::fs::write(&profile, &default).unwrap();
    let start = || unit_command(&root, &exec_start, &iface, &lab.ns_srv, &env);
    let reload = || run(&mut unit_command(&root, &exec_reload, &iface, &lab.ns_srv, &env));

    // Start on the default profile: attached, every rule dry-run.
    let agent = Service::start(start(), &root, &iface);
    let a = root.attachment(&iface).unwrap();
    assert_eq!(a["mode"], "native", "{a}");
    assert_eq!(a["rules"].as_array().unwrap().len(), 4, "{a}");
    let gen0 = a["generation"].as_u64().unwrap();

    // Reload: a bad profile changes nothing; a good one (the default's
    // settings: table sizes are fixed at load) is applied at once.
    std::fs::write(&profile, "[[rule]]\nname = \"x\"\nrate = \"0/s\"\n").unwrap();
    let out = reload();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(root.attachment(&iface).unwrap()["generation"].as_u64().unwrap(), gen0);
    let settings = default.split("[[rule]]").next().unwrap();
    std::fs::write(
        &profile,
        format!(
            "{settings}[[rule]]\nname = \"slow\"\nproto = \"udp\"\ndport = 7300\nrate = \"1/h\"\nburst = 3\nkey = \"src\"\n"
        ),
    )
    .unwrap();
    ok(&reload(), "ExecReload");
    let a = root.attachment(&iface).unwrap();
    assert_eq!(a["generation"].as_u64().unwrap(), gen0 + 1);
    assert_eq!(a["rules"].as_array().unwrap().len(), 1, "{a}");
    let ids = map_ids(&a);

    // Steady traffic: the burst of 3 passes, then the key is refused.
    let counter = UdpCounter::start(&lab, 7300);
    let traffic =
        UdpStreams::start(&lab, &[7300], Duration::from_millis(5), Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(counter.count(), 3, "the burst, then refused");

    // Stop (systemctl stop / the first half of a restart or an upgrade).
    let said = agent.stop(kill);
    assert!(said.contains("keeps enforcing"), "{said}");
    let a = root.attachment(&iface).expect("the data plane stays");
    assert_eq!(a["agent_running"], false, "{a}");
    std::thread::sleep(Duration::from_millis(500));
    // Start again: the new agent adopts the pins.
    let agent = Service::start(start(), &root, &iface);
    assert!(agent.said().contains("adopted the pinned data plane"), "{}", agent.said());
    let a = root.attachment(&iface).unwrap();
    assert_eq!(map_ids(&a), ids, "the same maps across the restart");
    std::thread::sleep(Duration::from_millis(500));
    traffic.stop();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(counter.count(), 3, "no packet got past the drained key across stop and start");

    // Removing protection: `flowctl detach` stops the unit's agent (which
    // exits successfully: Restart=on-failure leaves it stopped), then
    // removes the data plane.
    assert_eq!(one("Restart"), "on-failure");
    let out = ok(&root.flowctl(&["detach", &iface, "--netns", &lab.ns_srv]), "detach");
    assert!(out.contains("stopped its agent") && out.contains("detached from"), "{out}");
    let said = agent.exited();
    assert!(!said.contains('\x1b'), "the journal gets plain lines (NO_COLOR): {said:?}");
    assert!(root.attachment(&iface).is_none(), "nothing attached after detach");
    let traffic =
        UdpStreams::start(&lab, &[7300], Duration::from_millis(5), Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(300));
    traffic.stop();
    std::thread::sleep(Duration::from_millis(100));
    assert!(counter.count() > 3 + 20, "traffic passes once detached: {}", counter.count());
    let out = ok(&root.flowctl(&["detach", &iface, "--netns", &lab.ns_srv]), "detach again");
    assert!(out.contains("nothing attached"), "idempotent: {out}");
}
