//! `cargo xtask demo` runs this: the main job on an embedded default. With a
//! built flowctl (FLOWCTL_BIN), it makes a throwaway lab (two namespaces joined by veth), attaches with
//! demo/profile.toml, drives UDP traffic, prints counters, and cleans up.

use flowctl_tests::lab::Lab;
use std::error::Error;
use std::{
    net::UdpSocket,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn sh_run(cmd: &mut Command) -> Result<()> {
    let st = cmd.status()?;
    if !st.success() {
        return Err(format!("{cmd:?} failed: {st}").into());
    }
    Ok(())
}

fn main() -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        return Err(
            "the demo creates network namespaces and loads XDP: run `sudo -E cargo xtask demo`"
                .into(),
        );
    }
    let bin = std::path::PathBuf::from(
        std::env::var_os(flowctl_tests::cli::BIN_ENV)
            .ok_or("set FLOWCTL_BIN (cargo xtask demo does)")?,
    );
    let lab = Lab::new("fdemo", 203);
    // A second client address that the profile trusts.
    lab.add_client_address("10.201.203.9");
    println!("lab: {} ({}) <-> {} ({})", lab.ns_cli, lab.ip_cli, lab.ns_srv, lab.ip_srv);
    sh_run(Command::new(&bin).args(["check", "demo/profile.toml"]))?;
    let mut agent = Command::new(&bin)
        .args(["attach", &lab.veth_srv, "--netns", &lab.ns_srv, "--profile", "demo/profile.toml"])
        .stdin(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = Command::new(&bin).args(["status", "--json"]).output()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if v.as_array().is_some_and(|a| {
            a.iter().any(|x| x["iface"] == lab.veth_srv.as_str() && x["agent_ready"] == true)
        }) {
            break;
        }
        if Instant::now() > deadline {
            let _ = agent.kill();
            return Err("the agent did not come up within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let target = format!("{}:5353", lab.ip_srv);
    // 3 s at ~2000 packets/s from one source (limit 200/s + burst 50), and
    // 300 packets from the trusted address (exempt).
    let guard = AgentGuard(agent);
    let (sent, trusted) = Lab::in_ns(&lab.ns_cli, {
        let target = target.clone();
        let cli = lab.ip_cli.clone();
        move || {
            let s = UdpSocket::bind(format!("{cli}:0")).expect("bind the client address");
            let t = UdpSocket::bind("10.201.203.9:0").expect("bind the trusted address");
            let start = Instant::now();
            let mut n = 0u64;
            let mut m = 0u64;
            while start.elapsed() < Duration::from_secs(3) && n < 10_000 {
                let _ = s.send_to(b"demo", &target);
                n += 1;
                if m < 300 && n.is_multiple_of(5) {
                    let _ = t.send_to(b"trusted", &target);
                    m += 1;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            (n, m)
        }
    });
    println!("\nsent {sent} UDP packets to {target} from {} and {trusted} from the trusted 10.201.203.9\n", lab.ip_cli);
    sh_run(Command::new(&bin).arg("status"))?;
    println!();
    sh_run(Command::new(&bin).args([
        "explain",
        &lab.veth_srv,
        "udp",
        &lab.ip_cli,
        "5353",
        "--netns",
        &lab.ns_srv,
    ]))?;
    drop(guard);
    drop(lab);
    println!("\ndemo done: agent stopped, XDP detached, lab removed");
    Ok(())
}

/// Stops the agent (SIGINT: it detaches) also when the demo fails midway.
struct AgentGuard(std::process::Child);

impl Drop for AgentGuard {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let _ = self.0.wait();
    }
}
