//! The agent of a cgroup with breakers only (`attach --cgroup PATH`): the
//! breakers' loop and `apply`.

use crate::agent::{
    breakers::BreakerAgent,
    preflight,
    serve::{Every, Service},
    socket::{Request, Response},
};
use crate::system::clock::monotonic_ns;
use std::path::{Path, PathBuf};
use tokio::time::Instant;

pub struct CgroupAgent {
    pub breakers: BreakerAgent,
    tick: Every,
}

impl CgroupAgent {
    pub fn new(breakers: BreakerAgent) -> Self {
        let tick = Every::new(breakers.tick_period());
        Self { breakers, tick }
    }

    fn apply(&mut self, path: &Path) -> Response {
        let set = match preflight::cgroup_apply(path) {
            Ok(s) => s,
            Err(e) => return Response::err(format!("{e:#}")),
        };
        match self.breakers.apply(&set, path) {
            Ok(()) => Response::ok(format!("applied {} breakers", set.breakers.len())),
            Err(e) => Response::err(format!("{e:#} (nothing was applied)")),
        }
    }
}

impl Service for CgroupAgent {
    fn tick(&mut self, now: Instant) -> Instant {
        self.tick.set_period(self.breakers.tick_period());
        if self.tick.due(now) {
            if let Err(e) = self.breakers.tick(monotonic_ns()) {
                tracing::warn!("breakers: {e:#}");
            }
        }
        self.tick.next()
    }

    fn handle(&mut self, line: &str) -> Response {
        match serde_json::from_str::<Request>(line) {
            Ok(Request::Apply { profile }) => self.apply(Path::new(&profile)),
            Ok(_) => Response::err("this agent runs breakers only (no interface)"),
            Err(e) => Response::err(format!("bad request: {e}")),
        }
    }

    fn sockets(&self) -> Vec<PathBuf> {
        vec![self.breakers.point.socket_path()]
    }

    fn summary(&self) -> String {
        format!(
            "{} breakers on cgroup {}",
            self.breakers.breakers(),
            self.breakers.point.path.display()
        )
    }

    fn stop(&mut self) {}
}
