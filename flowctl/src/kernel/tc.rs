//! The rtnetlink requests aya 0.14 lacks: deleting the `clsact` qdisc
//! flowctl added and counting the filters left on it (so a qdisc another
//! flowctl agent's filter still uses stays), for the TC fallback; and the
//! root qdisc the egress shaper needs: reading what is there, installing
//! `fq` with its horizon, and removing it again.

use super::rtnl::{attr, each_attr, Socket, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use std::io;

const RTM_NEWQDISC: u16 = 36;
const RTM_DELQDISC: u16 = 37;
const RTM_GETQDISC: u16 = 38;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_REPLACE: u16 = 0x100;
const TCA_OPTIONS: u16 = 2;
const TC_H_ROOT: u32 = 0xffff_ffff;
// fq's options (include/uapi/linux/pkt_sched.h, enum TCA_FQ_*).
const TCA_FQ_PLIMIT: u16 = 1;
const TCA_FQ_FLOW_PLIMIT: u16 = 2;
const TCA_FQ_HORIZON: u16 = 14;
const TCA_FQ_HORIZON_DROP: u16 = 15;
const RTM_NEWTFILTER: u16 = 44;
const RTM_GETTFILTER: u16 = 46;
const TCA_KIND: u16 = 1;
const TC_H_CLSACT: u32 = 0xffff_fff1;
const TC_H_MIN_INGRESS: u32 = 0xfff2;
const TC_H_MIN_EGRESS: u32 = 0xfff3;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TcMsg {
    family: u8,
    pad1: u8,
    pad2: u16,
    ifindex: i32,
    handle: u32,
    parent: u32,
    info: u32,
}

/// A tc request: `tcmsg` and, when given, the kind attribute.
fn send(s: &Socket, ty: u16, flags: u16, tc: TcMsg, kind: Option<&[u8]>) -> io::Result<()> {
    let attrs = kind.map(|k| attr(TCA_KIND, k)).unwrap_or_default();
    s.request(ty, flags, &tc, &attrs)
}

/// Removes the `clsact` qdisc of `ifindex` (and with it every filter on it).
pub fn del_clsact(ifindex: u32) -> io::Result<()> {
    let s = Socket::open()?;
    let tc = TcMsg {
        ifindex: ifindex as i32,
        handle: 0xffff_0000,
        parent: TC_H_CLSACT,
        ..Default::default()
    };
    send(&s, RTM_DELQDISC, NLM_F_REQUEST | NLM_F_ACK, tc, Some(b"clsact\0"))?;
    s.replies(0).map(|_| ())
}

/// How many filters (of any kind, from anyone) the `clsact` qdisc of
/// `ifindex` holds on its ingress and egress hooks.
pub fn clsact_filters(ifindex: u32) -> io::Result<usize> {
    let mut total = 0;
    for minor in [TC_H_MIN_INGRESS, TC_H_MIN_EGRESS] {
        let s = Socket::open()?;
        let tc = TcMsg {
            ifindex: ifindex as i32,
            parent: (TC_H_CLSACT & 0xffff_0000) | minor,
            ..Default::default()
        };
        send(&s, RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP, tc, None)?;
        total += s.replies(RTM_NEWTFILTER)?;
    }
    Ok(total)
}

/// The root qdisc of an interface, as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootQdisc {
    pub kind: String,
    /// 0 for a qdisc the kernel attached by default (no handle given).
    pub handle: u32,
}

impl RootQdisc {
    /// One the kernel attached itself (the default qdisc, `noqueue` of a
    /// virtual device, `mq` of a multi-queue NIC), which replacing loses
    /// nothing an operator configured and deleting ours brings back.
    pub fn is_default(&self) -> bool {
        self.handle == 0
            || matches!(self.kind.as_str(), "noqueue" | "pfifo_fast" | "mq")
                && self.handle & 0xffff_0000 == 0x8000_0000
    }
}

/// The root qdisc of `ifindex` (None: none reported).
pub fn root_qdisc(ifindex: u32) -> io::Result<Option<RootQdisc>> {
    let s = Socket::open()?;
    let tc = TcMsg { ifindex: ifindex as i32, ..Default::default() };
    send(&s, RTM_GETQDISC, NLM_F_REQUEST | NLM_F_DUMP, tc, None)?;
    let mut root = None;
    s.each_reply(RTM_NEWQDISC, |m| {
        if m.len() < size_of::<TcMsg>() {
            return;
        }
        let t: TcMsg = unsafe { std::ptr::read_unaligned(m.as_ptr() as *const TcMsg) };
        if t.ifindex as u32 != ifindex || t.parent != TC_H_ROOT {
            return;
        }
        each_attr(&m[size_of::<TcMsg>()..], |ty, payload| {
            if ty == TCA_KIND {
                let kind = payload.split(|&b| b == 0).next().unwrap_or_default();
                root = Some(RootQdisc {
                    kind: String::from_utf8_lossy(kind).into_owned(),
                    handle: t.handle,
                });
            }
        });
    })?;
    Ok(root)
}

/// Installs `fq` as the root qdisc of `ifindex` (replacing a default
/// one), dropping what is stamped more than `horizon_us` ahead, with
/// room for `flow_plimit` packets per flow: the shaper's own horizon
/// governs how long packets wait, not fq's default of 100 per flow.
/// ENOENT: this kernel has no fq (sch_fq).
pub fn add_root_fq(ifindex: u32, horizon_us: u32, flow_plimit: u32) -> io::Result<()> {
    let s = Socket::open()?;
    let tc = TcMsg { ifindex: ifindex as i32, parent: TC_H_ROOT, ..Default::default() };
    let mut opts = Vec::new();
    opts.extend(attr(TCA_FQ_PLIMIT, &(flow_plimit.saturating_mul(4)).to_ne_bytes()));
    opts.extend(attr(TCA_FQ_FLOW_PLIMIT, &flow_plimit.to_ne_bytes()));
    opts.extend(attr(TCA_FQ_HORIZON, &horizon_us.to_ne_bytes()));
    opts.extend(attr(TCA_FQ_HORIZON_DROP, &[1u8]));
    let mut attrs = attr(TCA_KIND, b"fq\0");
    attrs.extend(attr(TCA_OPTIONS, &opts));
    s.request(RTM_NEWQDISC, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, &tc, &attrs)?;
    s.replies(0).map(|_| ())
}

/// Removes the root qdisc of `ifindex` (the kernel attaches its default
/// again).
pub fn del_root_qdisc(ifindex: u32) -> io::Result<()> {
    let s = Socket::open()?;
    let tc = TcMsg { ifindex: ifindex as i32, parent: TC_H_ROOT, ..Default::default() };
    send(&s, RTM_DELQDISC, NLM_F_REQUEST | NLM_F_ACK, tc, None)?;
    s.replies(0).map(|_| ())
}
