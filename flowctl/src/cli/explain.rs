//! `flowctl explain`: which rule, key and limit the kernel applies to a
//! packet, asked of the loaded classifier itself.

use crate::{
    cli::enter,
    dataplane::{
        pins::{run_file, AttachId},
        state::AttachState,
        Maps,
    },
    profile,
};
use anyhow::{Context, Result};
use std::net::IpAddr;

pub fn explain(
    iface: &str,
    proto: &str,
    src: &str,
    dport: Option<u16>,
    dst: Option<&str>,
    netns: &Option<String>,
) -> Result<()> {
    enter(netns)?;
    let id = AttachId::of(iface)?;
    let state =
        AttachState::load(&id)?.with_context(|| format!("nothing is attached to {iface}"))?;
    let set = profile::load_recorded(&id.run_dir().join(run_file::PROFILE))?;
    let proto_n: u8 = match proto {
        "tcp" => 6,
        "udp" => 17,
        "icmp" => 1,
        "icmpv6" => 58,
        p => p.parse().with_context(|| format!("unknown protocol `{p}`"))?,
    };
    let src: IpAddr = src.parse().with_context(|| format!("`{src}` is not an IP address"))?;
    let dst: Option<IpAddr> = dst
        .map(|d| d.parse().with_context(|| format!("`{d}` is not an IP address")))
        .transpose()?;
    if dst.is_some_and(|d| d.is_ipv4() != src.is_ipv4()) {
        anyhow::bail!("--dst and the source are of different IP versions");
    }
    let port = if proto_n == 6 || proto_n == 17 { dport } else { None };
    let maps = Maps::open(&id)?;
    match maps.classify(&src, dst.as_ref(), proto_n, port)? {
        None => out!("no rule matches: the packet passes unlimited"),
        Some(i) => {
            let r = set
                .rules
                .get(i as usize)
                .context("kernel rule index outside the active profile")?;
            let st = state.rules.get(i as usize);
            out!("rule   {} (#{}, line {} of the active profile)", r.name, i + 1, r.line);
            out!("match  {}", r.match_text());
            out!("action {}", r.action_name());
            if r.action != flowctl_common::action::PASS && !r.block {
                if r.interval_fp != 0 {
                    out!("limit  {} {} with burst {}", r.rate_text, r.unit_name(), r.burst);
                }
                if let Some(q) = r.quota_text() {
                    out!("quota  {q}");
                }
                out!("key    {}", r.key_name());
                for (n, l) in r.limits.iter().enumerate() {
                    out!(
                        "and    limit {} (line {}): {} {} with burst {} per {}",
                        n + 1,
                        l.line,
                        l.rate_text,
                        r.unit_name(),
                        l.burst,
                        l.key_name()
                    );
                }
            }
            if let Some(st) = st {
                out!("state  id {} record {}", st.state_id, st.record);
            }
        }
    }
    Ok(())
}
