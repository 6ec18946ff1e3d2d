//! The circuit breakers' kernel part with real sockets (BPF_PROG_TEST_RUN
//! does not cover sock_addr or sock_ops programs): the `flowctl-breaker`
//! object's connect4/connect6 hooks and sock_ops program on a fresh cgroup
//! v2, and a child process in it, in a network namespace of its own
//! (`unshare -n`: loopback only, gone when it exits). Root only.

use aya::{
    maps::{Array, PerCpuArray},
    programs::{links::CgroupAttachMode, CgroupSockAddr, SockOps},
    EbpfLoader,
};
use flowctl_common::breaker::{counter, probe_word, target_flags, Control, Target};
use flowctl_tests::cgroup::Cgroup;

const CHILD: &str = r#"
import json, os, socket, subprocess, sys, threading, time
open(sys.argv[1] + "/cgroup.procs", "w").write(str(os.getpid()))
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 7901)); srv.listen(16)
threading.Thread(target=lambda: [srv.accept() for _ in range(4)], daemon=True).start()
srv2 = socket.socket(); srv2.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv2.bind(("127.0.0.1", 7905)); srv2.listen(16)
def tcp(family, addr):
    s = socket.socket(family, socket.SOCK_STREAM)
    t = time.perf_counter()
    try:
        s.connect(addr); r = "ok"
    except OSError as e:
        r = e.errno
    us = (time.perf_counter() - t) * 1e6
    s.close()
    return [r, us]
out = {}
out["refused_v4"] = tcp(socket.AF_INET, ("127.0.0.1", 7902))
out["refused_mapped_v6"] = tcp(socket.AF_INET6, ("::ffff:127.0.0.1", 7902))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.connect(("127.0.0.1", 7902)); out["udp"] = "ok"
out["exempt"] = tcp(socket.AF_INET, ("127.0.0.1", 7903))
out["success"] = tcp(socket.AF_INET, ("127.0.0.1", 7901))
out["real_refusal"] = tcp(socket.AF_INET, ("127.0.0.1", 7904))
out["probe"] = tcp(socket.AF_INET, ("127.0.0.1", 7905))
out["after_probe"] = tcp(socket.AF_INET, ("127.0.0.1", 7905))
out["other_cgroup"] = tcp(socket.AF_INET, ("127.0.0.1", 7906))
out["this_cgroup"] = tcp(socket.AF_INET, ("127.0.0.1", 7907))
out["v6"] = tcp(socket.AF_INET6, ("::1", 7909))

# A black hole: routed out of lo to an address nobody has; the SYN is lost.
subprocess.run(["ip", "route", "add", "10.99.0.0/16", "dev", "lo"], check=True)
socket.setdefaulttimeout(1.5)
out["black_hole"] = tcp(socket.AF_INET, ("10.99.0.1", 80))
time.sleep(0.05)
print(json.dumps(out))
"#;

fn target(port_lo: u16, port_hi: u16, flags: u8) -> Target {
    Target {
        addr: [0x7f00_0001, 0, 0, 0],
        prefix_len: 32,
        family: 4,
        flags,
        port_lo,
        port_hi,
        ..Default::default()
    }
}

fn dir_ino(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).unwrap().ino()
}

fn connect_hooks_refuse_at_once_and_sock_ops_counts_outcomes() {
    let (cg, other) = (Cgroup::new("flowctl-brk-"), Cgroup::new("flowctl-brko-"));
    let mut ebpf = EbpfLoader::new()
        .load(flowctl::dataplane::object::breaker_object())
        .expect("load the breaker object");
    let live = flowctl::system::clock::monotonic_ns() + 60_000_000_000;
    let refuse = Control { drop_ppm: 1_000_000, errno: 111, ..Default::default() };
    let mut deadline: Array<_, u64> =
        Array::try_from(ebpf.map_mut(flowctl_common::map_names::BREAKER_DEADLINE).unwrap())
            .unwrap();
    deadline.set(0, live, 0).unwrap();
    {
        let mut targets: Array<_, Target> =
            Array::try_from(ebpf.map_mut(flowctl_common::map_names::BREAKER_TARGETS).unwrap())
                .unwrap();
        let in_cgroup = |port, cgroup: &std::path::Path| Target {
            cgroup_id: dir_ino(cgroup),
            cgroup_level: 1,
            ..target(port, port, 0)
        };
        targets.set(0, target(7903, 7903, target_flags::EXEMPT), 0).unwrap();
        targets.set(1, target(7902, 7902, 0), 0).unwrap();
        targets.set(2, target(7905, 7905, 0), 0).unwrap();
        targets.set(3, target(7901, 7904, 0), 0).unwrap();
        targets
            .set(
                4,
                Target {
                    addr: [0x0a63_0001, 0, 0, 0],
                    prefix_len: 32,
                    family: 4,
                    port_lo: 80,
                    port_hi: 80,
                    ..Default::default()
                },
                0,
            )
            .unwrap();
        targets.set(5, in_cgroup(7906, other.path()), 0).unwrap();
        targets.set(6, in_cgroup(7907, cg.path()), 0).unwrap();
        targets
            .set(
                7,
                Target {
                    addr: [0, 0, 0, 1],
                    prefix_len: 128,
                    family: 6,
                    port_lo: 7909,
                    port_hi: 7909,
                    ..Default::default()
                },
                0,
            )
            .unwrap();
        let mut control: Array<_, Control> =
            Array::try_from(ebpf.map_mut(flowctl_common::map_names::BREAKER_CONTROL).unwrap())
                .unwrap();
        for slot in [0, 1, 5, 6, 7] {
            control.set(slot, refuse, 0).unwrap();
        }
        // Half-open, one probe, round (epoch) 5.
        control
            .set(2, Control { probes: 1, probe_word: probe_word::pack(5, 0, 0, 0), ..refuse }, 0)
            .unwrap();
        control.set(3, Control { drop_ppm: 0, ..refuse }, 0).unwrap();
        control.set(4, Control { drop_ppm: 0, ..refuse }, 0).unwrap();
    }
    let fd = std::fs::File::open(cg.path()).unwrap();
    for name in ["flowctl_connect4", "flowctl_connect6"] {
        let p: &mut CgroupSockAddr = ebpf.program_mut(name).unwrap().try_into().unwrap();
        p.load().unwrap();
        p.attach(&fd, CgroupAttachMode::Single).unwrap();
    }
    let p: &mut SockOps = ebpf.program_mut("flowctl_sock_ops").unwrap().try_into().unwrap();
    p.load().unwrap();
    p.attach(&fd, CgroupAttachMode::Single).unwrap();

    let out = std::process::Command::new("unshare")
        .args(["-n", "python3", "-c", CHILD])
        .arg(cg.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("{v}");
    assert_eq!(v["refused_v4"][0], 111, "ECONNREFUSED from the hook");
    assert!(
        flowctl_tests::need::in_vm() || v["refused_v4"][1].as_f64().unwrap() < 1000.0,
        "fails at once: {} us",
        v["refused_v4"][1]
    );
    assert_eq!(
        v["refused_mapped_v6"][0], 111,
        "a connect6 to an IPv4-mapped address matches the IPv4 target"
    );
    assert_eq!(v["udp"], "ok", "UDP connect() is never throttled");
    assert_eq!(
        v["exempt"][0], 111,
        "exempt: passed through, and refused by the real (closed) port"
    );
    assert_eq!(v["success"][0], "ok");
    assert_eq!(v["real_refusal"][0], 111);
    assert_ne!(v["black_hole"][0], "ok");
    assert_eq!(v["probe"][0], "ok", "half-open: the one probe goes");
    assert_eq!(v["after_probe"][0], 111, "half-open: no probe left, refused");

    let counts: PerCpuArray<_, u64> =
        PerCpuArray::try_from(ebpf.map(flowctl_common::map_names::BREAKER_COUNTS).unwrap())
            .unwrap();
    let get =
        |t: u32, c: u32| -> u64 { counts.get(&(t * counter::COUNT + c), 0).unwrap().iter().sum() };
    assert_eq!(
        (get(1, counter::CALLS), get(1, counter::REFUSED_LOCALLY)),
        (2, 2),
        "v4 and mapped v6 refused locally"
    );
    assert_eq!(get(1, counter::ATTEMPTS), 0, "nothing was sent to the refused target");
    assert_eq!(
        (get(0, counter::CALLS), get(0, counter::REFUSED_LOCALLY), get(0, counter::ATTEMPTS)),
        (1, 0, 0),
        "exempt target passes, uncounted"
    );
    assert_eq!(get(3, counter::ATTEMPTS), 2, "the success and the real refusal went out");
    assert_eq!(get(3, counter::SUCCESSES), 1);
    assert_eq!(get(3, counter::REFUSED_BY_PEER), 1, "SYN_SENT -> CLOSE of the refused connect");
    assert_eq!(get(4, counter::ATTEMPTS), 1);
    assert_eq!(get(4, counter::TIMEOUTS), 1, "the SYN's first retransmission timeout decides it");
    assert_eq!(
        (get(4, counter::SUCCESSES), get(4, counter::REFUSED_BY_PEER)),
        (0, 0),
        "and nothing else counts it again"
    );
    assert_eq!(
        (get(2, counter::PROBES), get(2, counter::REFUSED_LOCALLY), get(2, counter::SUCCESSES)),
        (1, 1, 1)
    );
    assert_eq!(get(5, counter::CALLS), 0, "a breaker for another cgroup does not see this process");
    assert_eq!(
        (get(6, counter::CALLS), get(6, counter::REFUSED_LOCALLY)),
        (1, 1),
        "one for its own cgroup does"
    );
    assert_eq!(v["this_cgroup"][0], 111);
    assert_eq!(
        (get(7, counter::CALLS), get(7, counter::REFUSED_LOCALLY), get(7, counter::ATTEMPTS)),
        (1, 1, 0),
        "an IPv6 target (::1/128)"
    );
    let control: Array<_, Control> =
        Array::try_from(ebpf.map(flowctl_common::map_names::BREAKER_CONTROL).unwrap()).unwrap();
    let w = control.get(&2, 0).unwrap().probe_word;
    assert_eq!(
        (probe_word::epoch(w), probe_word::admitted(w), probe_word::ok(w), probe_word::failed(w)),
        (5, 1, 1, 0),
        "the probe's success lands in its round"
    );
}

/// The test and what it needs (flowctl_tests::need): a cgroup v2 hierarchy
/// to attach to (`/sys/fs/cgroup` on pure v2 hosts, `/sys/fs/cgroup/unified`
/// on hybrid ones), `bpf_set_retval` (5.18), and a python3 child under
/// `unshare -n`.
fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        connect_hooks_refuse_at_once_and_sock_ops_counts_outcomes: [Root, CgroupV2, Kernel(5, 18), Command("python3"), Command("unshare")],
    ]);
}
