//! The agent of an interface: its control loops and its answers.
//!
//! Every 500 ms the heartbeat (the kernel fails open without it) and the
//! record `top` and the metrics read; every 250 ms the CPU signal and, while
//! someone asks, the key samples; once per statistics bucket the BBR loop;
//! every second (a quarter of the statistics ring's span, if shorter) the
//! SYN totals; at KLimiter's sample period its loop; at the breakers' period theirs; and
//! now and then a walk of the key tables for their occupancy.

use crate::{
    agent::{
        bbr::BbrLoop,
        breakers::BreakerAgent,
        flood::{self, FloodLoop},
        heavy::{self, KeyWatcher},
        klimiter::KlimiterLoop,
        leases::LeaseLoop,
        occupancy,
        preflight::{self, BreakerChange},
        serve::{Every, Service},
        socket::{self, Request, Response},
        syn_totals::SynCounter,
    },
    controllers::cpu::{self, CpuSignal},
    dataplane::{self, state::AttachState, Egress, Maps},
    fleet::etcd::Follower,
    profile::RuleSet,
    system::clock::monotonic_ns,
};
use flowctl_common::{AgentRecord, NO_CPU_SIGNAL};
use std::{
    path::{Path, PathBuf},
    time::Duration,
};
use tokio::time::Instant;

pub struct InterfaceAgent<'a> {
    pub maps: Maps,
    pub state: AttachState,
    pub set: RuleSet,
    pub cpu: CpuSignal,
    pub ebpf: &'a mut aya::Ebpf,
    /// The TC egress counter's attachments (released when the agent ends).
    pub egress: &'a mut Egress,
    pub breakers: Option<BreakerAgent>,
    /// `--cgroup`, for breakers a later profile adds.
    pub cgroup: Option<PathBuf>,
    /// `--profile etcd://...`: the profiles the watcher fetches.
    pub etcd: Option<Follower>,
    /// The global rules' leases (`None` without global rules).
    pub leases: Option<LeaseLoop>,
    loops: Loops,
}

/// The control loops' schedules and state.
struct Loops {
    beat: Every,
    cpu: Every,
    cpu_failing: bool,
    keys: Every,
    bbr: Every,
    bbr_loop: BbrLoop,
    klimiter: Every,
    klimiter_loop: Option<KlimiterLoop>,
    breakers: Every,
    /// SYNs since attach, out of the statistics rings.
    syns: Every,
    syn_counter: SynCounter,
    next_walk: Instant,
    flood: Every,
    /// The flood loop's watches (`FloodLoop::watch`), when it has them.
    flood_watch: Every,
    /// `None` when its maps could not be set up (said in the log).
    flood_loop: Option<FloodLoop>,
    published: AgentRecord,
    watcher: Option<KeyWatcher>,
}

impl<'a> InterfaceAgent<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mut maps: Maps,
        state: AttachState,
        set: RuleSet,
        cpu: CpuSignal,
        ebpf: &'a mut aya::Ebpf,
        egress: &'a mut Egress,
        breakers: Option<BreakerAgent>,
        cgroup: Option<PathBuf>,
    ) -> Self {
        let klimiter_loop = KlimiterLoop::new(&set);
        let flood_loop = flood_loop_or_log(FloodLoop::start(&mut maps, &state, &set));
        let watcher = match KeyWatcher::open(&state.id) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!("top --keys unavailable: {e:#}");
                None
            }
        };
        let loops = Loops {
            beat: Every::new(Duration::from_millis(500)),
            cpu: Every::new(cpu::SAMPLE_PERIOD),
            cpu_failing: false,
            keys: Every::new(Duration::from_millis(250)),
            bbr: Every::new(Duration::from_nanos(state.stats.bucket_ns)),
            bbr_loop: BbrLoop::default(),
            klimiter: Every::new(period_of(klimiter_loop.as_ref())),
            klimiter_loop,
            breakers: Every::new(
                breakers.as_ref().map(|b| b.tick_period()).unwrap_or(Duration::from_secs(1)),
            ),
            syns: Every::new(SynCounter::period(&state.stats)),
            syn_counter: SynCounter::new(&state),
            next_walk: Instant::now(),
            flood: Every::new(flood_period(&flood_loop)),
            flood_watch: Every::new(watch_period(&flood_loop).unwrap_or(flood::MAX_PERIOD)),
            flood_loop,
            published: AgentRecord { cpu_permille: NO_CPU_SIGNAL, ..Default::default() },
            watcher,
        };
        Self {
            maps,
            state,
            set,
            cpu,
            ebpf,
            egress,
            breakers,
            cgroup,
            etcd: None,
            leases: None,
            loops,
        }
    }

    fn apply(&mut self, path: &Path) -> Response {
        let plan = match preflight::interface_apply(
            path,
            &self.state,
            &self.cpu,
            self.breakers.as_ref(),
            self.cgroup.as_deref(),
        ) {
            Ok(p) => p,
            Err(e) => return Response::err(format!("{e:#}")),
        };
        let set = plan.set;
        // The shapers first: what they need of the interface (fq at its
        // root, a kernel that has it) is only known by installing it, and
        // a profile whose shapers cannot run is refused whole, with the
        // shapers as they were.
        if let Err(e) =
            dataplane::set_shapers(self.ebpf, &mut self.maps, &set, self.egress, &self.state.iface)
        {
            if let Err(back) = dataplane::set_shapers(
                self.ebpf,
                &mut self.maps,
                &self.set,
                self.egress,
                &self.state.iface,
            ) {
                tracing::warn!("restoring the shapers after a refused apply: {back:#}");
            }
            return Response::err(format!("{e:#} (nothing was applied)"));
        }
        let result = dataplane::apply(&mut self.maps, &mut self.state, &set)
            .and_then(|()| self.state.record_profile(path))
            .and_then(|()| match plan.breakers {
                BreakerChange::None => Ok(()),
                BreakerChange::Stop => {
                    self.breakers = None;
                    Ok(())
                }
                BreakerChange::Apply => self.breakers.as_mut().expect("planned").apply(&set, path),
                BreakerChange::Start(point) => {
                    self.breakers = Some(BreakerAgent::start(point, &set, path)?);
                    Ok(())
                }
            });
        if let Err(e) = result {
            // The rules were not applied: the shapers go back to the
            // profile still in force.
            if let Err(back) = dataplane::set_shapers(
                self.ebpf,
                &mut self.maps,
                &self.set,
                self.egress,
                &self.state.iface,
            ) {
                tracing::warn!("restoring the shapers after a failed apply: {back:#}");
            }
            return Response::err(format!("{e:#}"));
        }
        let n = set.rules.len();
        let changed = set != self.set;
        self.set = set;
        if changed {
            self.profile_changed();
        }
        let generation = self.maps.global().map(|g| g.generation).unwrap_or(0);
        match plan.cpu {
            Some(c) => {
                self.cpu = c;
                Response::ok(format!(
                    "applied {n} rules (generation {generation}); CPU signal now from {:?}",
                    self.cpu.source()
                ))
            }
            None => Response::ok(format!("applied {n} rules (generation {generation})")),
        }
    }

    /// `flowctl list update`: the profile in force with one list read
    /// again, applied like a profile (the kernel sees the old list or the
    /// new one, never part of either); the rules keep their buckets.
    fn update_list(&mut self, name: &str, file: Option<&Path>) -> Response {
        let started = std::time::Instant::now();
        let set = match crate::profile::list::replace(&self.set, name, file) {
            Ok(s) => s,
            Err(e) => return Response::err(format!("{e} (nothing was applied)")),
        };
        tracing::debug!("list `{name}` read and checked in {:?}", started.elapsed());
        let before = self.set.lists.iter().find(|l| l.prefixes.name == name);
        let before = before.map_or(0, |l| l.prefixes.prefixes.len());
        let after = set.lists.iter().find(|l| l.prefixes.name == name);
        let after = after.map_or(0, |l| l.prefixes.prefixes.len());
        if let Err(e) = dataplane::apply(&mut self.maps, &mut self.state, &set) {
            return Response::err(format!("{e:#}"));
        }
        // Applied: what the agent holds follows, even if the record fails.
        self.set = set;
        if let Err(e) = self.state.save() {
            return Response::err(format!(
                "list `{name}` applied, but the attachment's state was not saved: {e:#}"
            ));
        }
        let generation = self.maps.global().map(|g| g.generation).unwrap_or(0);
        tracing::info!(list = name, before, after, "list updated (generation {generation})");
        let mut r = Response::ok(format!(
            "list `{name}`: {after} prefixes (were {before}), applied in {} ms (generation {generation})",
            started.elapsed().as_millis()
        ));
        r.data = Some(serde_json::json!({
            "list": name, "prefixes": after, "before": before, "generation": generation,
            "ms": started.elapsed().as_millis() as u64,
        }));
        r
    }

    /// A new profile: its egress targets, and a new KLimiter keeping the
    /// ratios of the entries it still has.
    fn profile_changed(&mut self) {
        if let Err(e) = dataplane::set_egress(self.ebpf, &mut self.maps, &self.set, self.egress) {
            tracing::warn!("egress counters: {e:#}");
        }

        let mut next = KlimiterLoop::new(&self.set);
        if let (Some(n), Some(o)) = (next.as_mut(), self.loops.klimiter_loop.as_ref()) {
            n.inherit(o);
        }
        self.loops.klimiter.set_period(period_of(next.as_ref()));
        self.loops.klimiter_loop = next;
        // Sketches lent under the old rules are taken back; the new rules
        // are watched from here.
        self.loops.flood_loop = flood_loop_or_log(match self.loops.flood_loop.take() {
            Some(old) => old.restart(&mut self.maps, &self.state, &self.set),
            None => FloodLoop::start(&mut self.maps, &self.state, &self.set),
        });
        self.loops.flood.set_period(flood_period(&self.loops.flood_loop));
        self.loops
            .flood_watch
            .set_period(watch_period(&self.loops.flood_loop).unwrap_or(flood::MAX_PERIOD));
        // The global rules: new limits for the same store, else a new loop
        // (its leases start over; the keys run at their default share
        // until they are granted again).
        match self.leases.as_mut() {
            Some(l) if l.same_store(&self.set) => l.update(&self.state, &self.set),
            _ => {
                if let Some(old) = self.leases.take() {
                    old.stop();
                }
                let rt = tokio::runtime::Handle::current();
                match LeaseLoop::start(&self.state, &self.set, &rt) {
                    Ok(l) => self.leases = l,
                    Err(e) => tracing::error!(
                        "global rules: {e:#} (their keys stay at their default share)"
                    ),
                }
            }
        }
    }

    fn keys(&mut self, rule: &str, top: usize) -> Response {
        let Some(w) = self.loops.watcher.as_mut() else {
            return Response::err("key sampling is unavailable in this agent (see its log)");
        };
        let report = w
            .ask(&mut self.maps)
            .and_then(|()| heavy::rule_report(w, &self.maps, &self.state, rule, top));
        match report.and_then(|r| Ok(serde_json::to_value(r)?)) {
            Ok(v) => Response { ok: true, message: String::new(), data: Some(v) },
            Err(e) => Response::err(format!("{e:#}")),
        }
    }
}

/// The attachment's profile is named by its etcd key and version, not the
/// staged file the apply read.
pub fn record_source(state: &mut AttachState, f: &Follower) {
    let source = f.source();
    if state.profile_path != source {
        state.profile_path = source;
        if let Err(e) = state.save() {
            tracing::warn!("recording the profile's source: {e:#}");
        }
    }
}

/// The flood loop's period (the longest while there is none, unused then).
fn flood_period(l: &Option<FloodLoop>) -> Duration {
    l.as_ref().map_or(flood::MAX_PERIOD, FloodLoop::period)
}

fn watch_period(l: &Option<FloodLoop>) -> Option<Duration> {
    l.as_ref().and_then(FloodLoop::watch_period)
}

fn flood_loop_or_log(started: anyhow::Result<FloodLoop>) -> Option<FloodLoop> {
    match started {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::error!("flood sketches: {e:#} (flooded rules keep their buckets)");
            None
        }
    }
}

/// KLimiter's sample period (1 s while there is none, unused then).
fn period_of(k: Option<&KlimiterLoop>) -> Duration {
    k.map(|k| k.sample_period()).unwrap_or(Duration::from_secs(1))
}

impl Service for InterfaceAgent<'_> {
    fn tick(&mut self, now: Instant) -> Instant {
        // A newer profile from etcd, validated: applied like `flowctl apply`.
        if let Some(path) = self.etcd.as_mut().and_then(|f| f.take_newer()) {
            let r = self.apply(&path);
            let outcome = if r.ok { Ok(()) } else { Err(r.message) };
            if let Some(f) = self.etcd.as_mut() {
                f.outcome(outcome);
                record_source(&mut self.state, f);
            }
        }
        let l = &mut self.loops;
        let maps = &mut self.maps;
        if l.beat.due(now) {
            if let Err(e) = dataplane::heartbeat(maps) {
                tracing::warn!("heartbeat failed: {e:#}");
            }
            l.published.updated_ns = monotonic_ns();
            if let Err(e) = maps.set_agent_record(&l.published) {
                tracing::warn!("publishing agent state failed: {e:#}");
            }
        }
        if now >= l.next_walk {
            let started = std::time::Instant::now();
            if let Err(e) = occupancy::walk(&self.state.id, maps, &self.state, &mut l.published) {
                tracing::warn!("counting the key tables failed: {e:#}");
            }
            l.next_walk = Instant::now() + occupancy::next_walk_after(started.elapsed());
        }
        if l.cpu.due(now) {
            match self.cpu.tick() {
                Ok(v) => {
                    l.cpu_failing = false;
                    l.published.cpu_permille = v.map(|v| v.round() as u32).unwrap_or(NO_CPU_SIGNAL);
                    l.published.cpu_source = self.cpu.source().code();
                }
                // Hold the last value; say so once per failure episode.
                Err(e) if !l.cpu_failing => {
                    l.cpu_failing = true;
                    tracing::warn!("CPU signal: {e:#} (holding the last value)");
                }
                Err(_) => {}
            }
        }
        let bbr_on = self.set.rules.iter().any(|r| r.bbr.is_some());
        if bbr_on && l.bbr.due(now) {
            let cpu = l.published.cpu_permille;
            if let Err(e) = l.bbr_loop.tick(maps, &self.state, &self.set, cpu, monotonic_ns()) {
                tracing::warn!("BBR loop: {e:#}");
            }
        }
        if let Some(k) = l.klimiter_loop.as_mut() {
            if l.klimiter.due(now) {
                if let Err(e) = k.sample(maps, &self.state, &self.set, l.published.cpu_permille) {
                    tracing::warn!("KLimiter: {e:#}");
                }
            }
        }
        // A read of the loop's stands for a watch too.
        let watch_due = l.flood_watch.due(now);
        if l.flood.due(now) {
            if let Some(f) = l.flood_loop.as_mut() {
                if let Err(e) = f.tick(maps, now.into_std()) {
                    tracing::warn!("flood loop: {e:#}");
                }
            }
        } else if watch_due {
            if let Some(f) = l.flood_loop.as_mut().filter(|f| f.watch_period().is_some()) {
                if let Err(e) = f.watch(maps, now.into_std()) {
                    tracing::warn!("flood loop: {e:#}");
                }
            }
        }
        if l.syns.due(now) {
            if let Err(e) = l.syn_counter.tick(maps, &self.state) {
                tracing::warn!("counting SYNs: {e:#}");
            }
        }
        if l.keys.due(now) {
            if let Some(w) = l.watcher.as_mut().filter(|w| w.active()) {
                if let Err(e) = w.poll(maps) {
                    tracing::warn!("key sampling: {e:#}");
                }
            }
        }
        if let Some(b) = self.breakers.as_mut() {
            l.breakers.set_period(b.tick_period());
            if l.breakers.due(now) {
                if let Err(e) = b.tick(monotonic_ns()) {
                    tracing::warn!("breakers: {e:#}");
                }
            }
        }
        let mut next = l
            .beat
            .next()
            .min(l.next_walk)
            .min(l.cpu.next())
            .min(l.keys.next())
            .min(l.syns.next())
            .min(l.flood.next());
        if watch_period(&l.flood_loop).is_some() {
            next = next.min(l.flood_watch.next());
        }
        if let Some(g) = self.leases.as_mut() {
            next = next.min(Instant::from_std(g.tick()));
        }
        if bbr_on {
            next = next.min(l.bbr.next());
        }
        if l.klimiter_loop.is_some() {
            next = next.min(l.klimiter.next());
        }
        if self.breakers.is_some() {
            next = next.min(l.breakers.next());
        }
        next
    }

    fn handle(&mut self, line: &str) -> Response {
        match serde_json::from_str::<Request>(line) {
            Ok(Request::Apply { .. }) if self.etcd.is_some() => Response::err(
                "this agent follows a profile in etcd; change it with `flowctl publish etcd://... FILE` (nothing was applied)",
            ),
            Ok(Request::Apply { profile }) => self.apply(Path::new(&profile)),
            Ok(Request::ListUpdate { name, file }) => {
                self.update_list(&name, file.as_deref().map(Path::new))
            }
            Ok(Request::Keys { rule, top }) => self.keys(&rule, top),
            Err(e) => Response::err(format!("bad request: {e}")),
        }
    }

    /// Its own socket, and its cgroup's while it holds breakers (so
    /// `flowctl apply --cgroup` reaches it too).
    fn summary(&self) -> String {
        format!("{} rules on {}", self.set.rules.len(), self.state.iface)
    }

    fn sockets(&self) -> Vec<PathBuf> {
        let mut v = vec![socket::socket_path(&self.state.id)];
        v.extend(self.breakers.as_ref().map(|b| b.point.socket_path()));
        v
    }

    fn wake_handle(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        self.etcd.as_ref().map(|f| f.wake_handle())
    }

    fn wind_down(&mut self) {
        // A new agent for the attachment now waits for this one instead of
        // refusing to start.
        dataplane::pins::note_phase(&self.state.id, crate::system::lock::phase::STOPPING);
        if let Some(g) = self.leases.as_mut() {
            g.release_all();
        }
    }

    fn wound_down(&self) -> bool {
        self.leases.as_ref().is_none_or(|g| g.released())
    }

    fn stop(&mut self) {
        if let Some(f) = &self.etcd {
            f.stop();
        }
        if let Some(g) = &self.leases {
            g.stop();
        }
        if let Some(w) = self.loops.watcher.as_mut() {
            let _ = w.stop(&mut self.maps);
        }
        // A kept data plane goes on without sketches: no loop takes them
        // back when the flood ends.
        if let Some(f) = self.loops.flood_loop.as_mut() {
            if let Err(e) = f.clear(&mut self.maps) {
                tracing::warn!("taking the flood sketches back: {e:#}");
            }
        }
        // The SYN totals as far as the ring has settled, for a next agent
        // (or `status`) of a kept data plane.
        if let Err(e) = self.loops.syn_counter.tick(&self.maps, &self.state) {
            tracing::warn!("counting SYNs: {e:#}");
        }
        // Readers show "agent not running" at once, not after the grace
        // period.
        let _ = self.maps.set_agent_record(&AgentRecord::default());
    }
}
