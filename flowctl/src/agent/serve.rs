//! The loop both agents run: until SIGINT or SIGTERM, run the control loops
//! that are due and answer the control socket, one request at a time.
//!
//! A [`Service`] (the interface agent, or a cgroup's breakers-only agent)
//! says which loops are due and answers requests; this module owns the
//! signals, the sockets and the waiting. Connections are read on their own
//! tasks, so a client that connects and says nothing cannot hold up a loop;
//! the request is then handled here, where the service's state is.

use crate::{agent::socket::Response, system::notify};
use anyhow::{Context, Result};
use std::{path::PathBuf, time::Duration};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    signal::unix::{signal, Signal, SignalKind},
    time::Instant,
};

/// SIGINT and SIGTERM, installed before anything loads: one that arrives
/// while the program loads is held until the loop starts, which then ends
/// cleanly.
pub struct Signals {
    int: Signal,
    term: Signal,
}

impl Signals {
    /// Needs a tokio runtime (call inside `block_on`).
    pub fn install() -> std::io::Result<Self> {
        Ok(Self { int: signal(SignalKind::interrupt())?, term: signal(SignalKind::terminate())? })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}

/// A control loop that runs every `period`. Like a tokio interval with
/// `MissedTickBehavior::Delay`: the first run is at once, and a late run is
/// taken late, not in a burst to catch up.
pub struct Every {
    period: Duration,
    next: Instant,
}

impl Every {
    pub fn new(period: Duration) -> Self {
        Self { period, next: Instant::now() }
    }

    /// True when the loop is due at `now`; it is then next due a period on.
    pub fn due(&mut self, now: Instant) -> bool {
        if now < self.next {
            return false;
        }
        self.next = now + self.period;
        true
    }

    /// A new period starts a new schedule, due at once.
    pub fn set_period(&mut self, period: Duration) {
        if period != self.period {
            *self = Self::new(period);
        }
    }

    pub fn next(&self) -> Instant {
        self.next
    }
}

/// What an agent does between signals.
pub trait Service {
    /// Runs the loops due at `now`; returns when the next one is due.
    fn tick(&mut self, now: Instant) -> Instant;
    /// Answers one request line from the control socket.
    fn handle(&mut self, line: &str) -> Response;
    /// The control sockets to listen on now (a profile applied may add or
    /// remove one).
    fn sockets(&self) -> Vec<PathBuf>;
    /// One line on what it serves, for the service manager's status.
    fn summary(&self) -> String;
    /// A signal came: start giving back what other hosts can use (a global
    /// rule's leases). The loop keeps ticking until [`wound_down`], a
    /// second signal or [`WIND_DOWN`], whichever comes first.
    ///
    /// [`wound_down`]: Service::wound_down
    fn wind_down(&mut self) {}
    /// Whether what [`wind_down`](Service::wind_down) started is done.
    fn wound_down(&self) -> bool {
        true
    }
    /// The loop has ended: leave nothing a reader would misread.
    fn stop(&mut self);
    /// Notified when work arrives off the schedule (a profile fetched from
    /// etcd): the loop then ticks at once.
    fn wake_handle(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        None
    }
}

/// Resolves when `wake` is notified; never without one.
async fn woken(wake: &Option<std::sync::Arc<tokio::sync::Notify>>) {
    match wake {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// Runs `service` until a signal. An error binding the first sockets ends
/// it at once; one binding a socket a later profile asks for is logged.
/// The service manager hears that it is ready once the sockets are bound
/// and the first tick ran, gets the watchdog's pings from this loop (a
/// loop that hangs misses them), and hears that it stops on the signal.
pub async fn serve(service: &mut impl Service, signals: &mut Signals) -> Result<()> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Pending>(8);
    let mut sockets = Listeners::default();
    sockets.listen(service.sockets(), &tx)?;
    let wake = service.wake_handle();
    let mut next = service.tick(Instant::now());
    notify::ready(&service.summary());
    let watchdog = notify::watchdog_every();
    let mut ping = Instant::now();
    loop {
        tokio::select! {
            _ = signals.recv() => break,
            _ = tokio::time::sleep_until(ping), if watchdog.is_some() => {
                notify::watchdog();
                ping = Instant::now() + watchdog.unwrap_or_default();
            }
            _ = tokio::time::sleep_until(next) => next = service.tick(Instant::now()),
            _ = woken(&wake) => next = service.tick(Instant::now()),
            Some((line, reply)) = rx.recv() => {
                let _ = reply.send(service.handle(&line));
                if let Err(e) = sockets.listen(service.sockets(), &tx) {
                    tracing::warn!("{e:#}");
                }
                // The request may have changed the loops' periods.
                next = Instant::now();
            }
        }
    }
    notify::stopping();
    drop(sockets);
    service.wind_down();
    let deadline = Instant::now() + WIND_DOWN;
    while !service.wound_down() && Instant::now() < deadline {
        tokio::select! {
            _ = signals.recv() => break,
            _ = tokio::time::sleep_until(next.min(deadline)) => next = service.tick(Instant::now()),
        }
    }
    service.stop();
    Ok(())
}

/// Longest an agent takes to wind down after a signal: two store deadlines
/// (a release and its acknowledgement), then it stops anyway (what it did
/// not give back ends with its leases, in the kernel too).
pub const WIND_DOWN: Duration = Duration::from_secs(1);

/// A request read by a connection task, with the channel for its answer.
type Pending = (String, tokio::sync::oneshot::Sender<Response>);

/// The bound control sockets, each with its accepting task; a socket file is
/// removed when its listener goes.
#[derive(Default)]
struct Listeners {
    bound: Vec<(PathBuf, tokio::task::JoinHandle<()>)>,
}

impl Listeners {
    /// Listens on exactly `paths`.
    fn listen(
        &mut self,
        paths: Vec<PathBuf>,
        tx: &tokio::sync::mpsc::Sender<Pending>,
    ) -> Result<()> {
        self.bound.retain(|(p, task)| {
            let keep = paths.contains(p);
            if !keep {
                task.abort();
                let _ = std::fs::remove_file(p);
            }
            keep
        });
        for p in paths {
            if self.bound.iter().any(|(b, _)| *b == p) {
                continue;
            }
            let _ = std::fs::remove_file(&p);
            let listener = tokio::net::UnixListener::bind(&p)
                .with_context(|| format!("binding {}", p.display()))?;
            let tx = tx.clone();
            let task = tokio::task::spawn_local(async move {
                loop {
                    if let Ok((stream, _)) = listener.accept().await {
                        read_request(stream, tx.clone());
                    }
                }
            });
            self.bound.push((p, task));
        }
        Ok(())
    }
}

impl Drop for Listeners {
    fn drop(&mut self) {
        for (p, task) in self.bound.drain(..) {
            task.abort();
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Reads one request line from a connection on its own task and hands it to
/// the loop, which answers through the oneshot.
fn read_request(stream: tokio::net::UnixStream, tx: tokio::sync::mpsc::Sender<Pending>) {
    tokio::task::spawn_local(async move {
        let (r, mut w) = stream.into_split();
        let mut line = String::new();
        let mut reader = BufReader::new(r);
        let resp =
            match tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut line)).await {
                Ok(Ok(n)) if n > 0 => {
                    let (rtx, rrx) = tokio::sync::oneshot::channel();
                    if tx.send((line, rtx)).await.is_err() {
                        return;
                    }
                    rrx.await.unwrap_or_else(|_| Response::err("the agent is stopping"))
                }
                _ => Response::err("no request received"),
            };
        if let Ok(mut out) = serde_json::to_string(&resp) {
            out.push('\n');
            let _ = w.write_all(out.as_bytes()).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_is_due_at_once_then_a_period_after_the_late_run() {
        let mut e = Every::new(Duration::from_millis(100));
        let t0 = Instant::now();
        assert!(e.due(t0));
        assert!(!e.due(t0 + Duration::from_millis(99)));
        // Late by 150 ms: runs once, and is next due a period after that run.
        let late = t0 + Duration::from_millis(250);
        assert!(e.due(late));
        assert!(!e.due(late + Duration::from_millis(50)));
        assert_eq!(e.next(), late + Duration::from_millis(100));
        e.set_period(Duration::from_millis(100));
        assert_eq!(e.next(), late + Duration::from_millis(100), "same period: same schedule");
        e.set_period(Duration::from_millis(40));
        assert!(e.due(Instant::now()), "a new period is due at once");
    }
}
