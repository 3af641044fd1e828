//! Liveness and readiness of the daemon, as the health endpoints and the
//! `kv_router_ready` gauge report them.
//!
//! **Ready** means a routing query answered now would be as good as this replica can
//! make it: the daemon is running (not starting, not shutting down), both its NATS
//! connections (the main one and the route path's) are up, worker discovery has loaded at least once, and the initial
//! recovery of the index has finished. etcd being unreachable *after* discovery loaded
//! does not make the daemon unready: it keeps routing to the last known workers and
//! reports the loss in the `etcd` check and `kv_router_etcd_connected`.
//!
//! The state is a handful of atomics written by the parts that know (the NATS event
//! callback, discovery, start-up and shutdown) and read by the HTTP handlers; each
//! write recomputes readiness and publishes it on a [`tokio::sync::watch`] channel, so
//! waiters need no polling. Cost: a few atomic operations per state change.

use crate::metrics::ConnectionMetrics;
use serde::Serialize;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use tokio::sync::watch;
use tracing::{info, warn};

/// Where the daemon is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Connecting, subscribing, loading discovery and recovering the index.
    Starting,
    /// Serving routing queries.
    Running,
    /// Stopping intake, draining shards and closing connections.
    ShuttingDown,
    /// Shut down; nothing is served any more.
    Stopped,
}

impl Phase {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Phase::Starting,
            1 => Phase::Running,
            2 => Phase::ShuttingDown,
            _ => Phase::Stopped,
        }
    }

    fn as_u8(self) -> u8 {
        match self {
            Phase::Starting => 0,
            Phase::Running => 1,
            Phase::ShuttingDown => 2,
            Phase::Stopped => 3,
        }
    }
}

/// One readiness input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Whether the input is satisfied.
    pub ok: bool,
    /// What it is doing, or why it is not satisfied (lowercase).
    pub detail: String,
}

/// Which of the daemon's two NATS connections a change is about: both must be up
/// for the daemon to be ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Link {
    /// The main connection: KV events, load metrics, recovery, replica snapshots.
    Main,
    /// The route path's connection (`crate::route_thread`): route queries, their
    /// replies and lifecycle messages.
    Routes,
}

/// Every readiness input, as `/health/readyz` reports them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Checks {
    /// The NATS connection (required).
    pub nats: Check,
    /// etcd reachability (reported; required only until discovery first loads).
    pub etcd: Check,
    /// Worker discovery has loaded the registrations once (required).
    pub discovery: Check,
    /// The initial recovery of the index has finished (required).
    pub recovery: Check,
}

/// The body of `/health/readyz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Readiness {
    /// Whether routing queries are served at full quality.
    pub ready: bool,
    /// The daemon's phase.
    pub phase: Phase,
    /// While starting, the start-up step under way (`crate::daemon`'s steps, e.g.
    /// `"loading worker registrations from etcd"`); absent in the other phases.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<&'static str>,
    /// Each input.
    pub checks: Checks,
}

/// Shared health state of one daemon.
pub struct Health {
    phase: AtomicU8,
    nats: AtomicBool,
    /// The route path's connection ([`Link::Routes`]).
    nats_routes: AtomicBool,
    etcd: AtomicBool,
    discovery_loaded: AtomicBool,
    recovery_done: AtomicBool,
    /// Last etcd problem, or what etcd is doing; for the `etcd` check's detail.
    etcd_detail: Mutex<String>,
    recovery_detail: Mutex<String>,
    /// The start-up step under way.
    step: Mutex<&'static str>,
    metrics: ConnectionMetrics,
    ready: watch::Sender<bool>,
}

impl Health {
    /// A starting daemon: nothing connected, nothing loaded.
    pub(crate) fn new(metrics: ConnectionMetrics) -> Self {
        metrics.ready.set(0);
        metrics.nats_connected.set(0);
        metrics.etcd_connected.set(0);
        Self {
            phase: AtomicU8::new(Phase::Starting.as_u8()),
            nats: AtomicBool::new(false),
            nats_routes: AtomicBool::new(false),
            etcd: AtomicBool::new(false),
            discovery_loaded: AtomicBool::new(false),
            recovery_done: AtomicBool::new(false),
            etcd_detail: Mutex::new("not connected yet".to_owned()),
            recovery_detail: Mutex::new("waiting for discovery".to_owned()),
            step: Mutex::new("building the router state"),
            metrics,
            ready: watch::channel(false).0,
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Acquire))
    }
    pub(crate) fn set_phase(&self, phase: Phase) {
        self.phase.store(phase.as_u8(), Ordering::Release);
        self.update();
    }

    /// Records one NATS connection going up or down; `kv_router_nats_connected` is 1
    /// while both are up.
    pub(crate) fn set_nats_connected(&self, link: Link, connected: bool) {
        let flag = match link {
            Link::Main => &self.nats,
            Link::Routes => &self.nats_routes,
        };
        let was = flag.swap(connected, Ordering::AcqRel);
        self.metrics
            .nats_connected
            .set(i64::from(self.nats_connected()));
        if was != connected && self.phase() == Phase::Running {
            if connected {
                info!(
                    ?link,
                    "nats connection re-established; subscriptions resumed"
                );
            } else {
                warn!(
                    ?link,
                    "nats connection lost; reconnecting (not ready meanwhile)"
                );
            }
        }
        self.update();
    }

    /// Whether both NATS connections are up.
    fn nats_connected(&self) -> bool {
        self.nats.load(Ordering::Acquire) && self.nats_routes.load(Ordering::Acquire)
    }

    /// Applies one event from the NATS client of `link`: counts it and tracks the
    /// connection.
    pub(crate) fn nats_event(&self, link: Link, event: &async_nats::Event) {
        use async_nats::Event;
        let name = match event {
            Event::Connected => "connected",
            Event::Disconnected => "disconnected",
            Event::LameDuckMode => "lame_duck",
            Event::Draining => "draining",
            Event::Closed => "closed",
            Event::SlowConsumer(_) => "slow_consumer",
            Event::ServerError(_) => "server_error",
            Event::ClientError(_) => "client_error",
        };
        self.metrics.nats_event(name);
        match event {
            Event::Connected => self.set_nats_connected(link, true),
            Event::Disconnected | Event::Closed => self.set_nats_connected(link, false),
            Event::SlowConsumer(sid) => {
                warn!(
                    subscription = sid,
                    "nats slow consumer: messages were dropped"
                )
            }
            Event::ServerError(e) => warn!(error = %e, "nats server error"),
            Event::ClientError(e) => warn!(error = %e, "nats client error"),
            Event::LameDuckMode => warn!("nats server entered lame duck mode"),
            Event::Draining => {}
        }
    }

    /// Records the start-up step now under way (reported while starting).
    pub(crate) fn set_step(&self, step: &'static str) {
        *self.step.lock().unwrap_or_else(|p| p.into_inner()) = step;
    }
    pub(crate) fn step(&self) -> &'static str {
        *self.step.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a successful etcd call (connect, load or watch start).
    pub(crate) fn etcd_ok(&self, detail: impl Into<String>) {
        self.etcd.store(true, Ordering::Release);
        self.metrics.etcd_connected.set(1);
        *lock(&self.etcd_detail) = detail.into();
        self.update();
    }

    /// Records an etcd failure at `stage` (`connect`, `load` or `watch`).
    pub(crate) fn etcd_failed(&self, stage: &str, error: &dyn std::fmt::Display) {
        self.etcd.store(false, Ordering::Release);
        self.metrics.etcd_connected.set(0);
        self.metrics.etcd_error(stage);
        let serving = if self.discovery_loaded.load(Ordering::Acquire) {
            "; serving the last known workers"
        } else {
            ""
        };
        *lock(&self.etcd_detail) = format!("{stage} failed: {error}{serving}");
        self.update();
    }

    /// Whether etcd answered last time it was asked.
    pub fn etcd_connected(&self) -> bool {
        self.etcd.load(Ordering::Acquire)
    }

    /// Records that discovery loaded the registrations.
    pub(crate) fn set_discovery_loaded(&self) {
        self.discovery_loaded.store(true, Ordering::Release);
        let mut detail = lock(&self.recovery_detail);
        if !self.recovery_done.load(Ordering::Acquire) {
            "recovering the index".clone_into(&mut detail);
        }
        drop(detail);
        self.update();
    }

    /// Records that the initial recovery of the index finished, with a summary.
    pub(crate) fn set_recovery_done(&self, detail: impl Into<String>) {
        self.recovery_done.store(true, Ordering::Release);
        *lock(&self.recovery_detail) = detail.into();
        self.update();
    }

    /// Whether the daemon is ready (see the module docs).
    pub(crate) fn is_ready(&self) -> bool {
        self.phase() == Phase::Running
            && self.nats_connected()
            && self.discovery_loaded.load(Ordering::Acquire)
            && self.recovery_done.load(Ordering::Acquire)
    }

    /// A receiver of readiness changes (the current value first).
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// The full readiness report.
    pub fn report(&self) -> Readiness {
        let nats = self.nats_connected();
        let nats_detail = match (self.nats.load(Ordering::Acquire), nats) {
            (_, true) => "connected",
            (true, false) => "route connection disconnected",
            (false, false) => "disconnected",
        };
        let discovery = self.discovery_loaded.load(Ordering::Acquire);
        let phase = self.phase();
        Readiness {
            ready: self.is_ready(),
            phase,
            step: (phase == Phase::Starting).then(|| self.step()),
            checks: Checks {
                nats: Check {
                    ok: nats,
                    detail: nats_detail.to_owned(),
                },
                etcd: Check {
                    ok: self.etcd_connected(),
                    detail: lock(&self.etcd_detail).clone(),
                },
                discovery: Check {
                    ok: discovery,
                    detail: if discovery {
                        "loaded"
                    } else {
                        "waiting for etcd"
                    }
                    .to_owned(),
                },
                recovery: Check {
                    ok: self.recovery_done.load(Ordering::Acquire),
                    detail: lock(&self.recovery_detail).clone(),
                },
            },
        }
    }

    fn update(&self) {
        let ready = self.is_ready();
        self.metrics.ready.set(i64::from(ready));
        self.ready.send_if_modified(|current| {
            let changed = *current != ready;
            *current = ready;
            changed
        });
    }
}

/// Locks a detail string; a poisoned lock only means a panic mid-assignment of a
/// `String`, which leaves a valid string behind.
fn lock(m: &Mutex<String>) -> std::sync::MutexGuard<'_, String> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Registrar;

    fn health() -> (Health, ConnectionMetrics) {
        let metrics = ConnectionMetrics::new(&Registrar::unregistered()).unwrap();
        (Health::new(metrics.clone()), metrics)
    }

    #[test]
    fn ready_only_when_running_connected_loaded_and_recovered() {
        let (h, m) = health();
        let mut rx = h.subscribe();
        assert!(!h.is_ready());
        h.nats_event(Link::Main, &async_nats::Event::Connected);
        h.nats_event(Link::Routes, &async_nats::Event::Connected);
        h.set_discovery_loaded();
        assert!(!h.is_ready(), "recovery not done");
        h.set_recovery_done("no workers to recover");
        assert!(!h.is_ready(), "still starting");
        assert!(!rx.has_changed().unwrap());
        h.set_phase(Phase::Running);
        assert!(h.is_ready());
        assert!(rx.has_changed().unwrap());
        assert!(*rx.borrow_and_update());
        assert_eq!(m.ready.get(), 1);

        h.nats_event(Link::Main, &async_nats::Event::Disconnected);
        assert!(!h.is_ready());
        assert_eq!(m.ready.get(), 0);
        assert_eq!(m.nats_connected.get(), 0);
        assert_eq!(m.nats_events("disconnected"), 1);
        h.nats_event(Link::Main, &async_nats::Event::Connected);
        assert!(h.is_ready());

        // The route path's connection alone down: no route can be answered.
        h.nats_event(Link::Routes, &async_nats::Event::Disconnected);
        assert!(!h.is_ready());
        assert_eq!(m.nats_connected.get(), 0);
        let nats = h.report().checks.nats;
        assert!(!nats.ok);
        assert_eq!(nats.detail, "route connection disconnected");
        h.nats_event(Link::Routes, &async_nats::Event::Connected);
        assert!(h.is_ready());
        assert_eq!(m.nats_connected.get(), 1);

        assert_eq!(h.report().step, None, "only a start has steps");
        h.set_phase(Phase::ShuttingDown);
        assert!(!h.is_ready());
        assert_eq!(h.report().phase, Phase::ShuttingDown);
    }

    #[test]
    fn etcd_loss_after_discovery_is_reported_but_keeps_readiness() {
        let (h, m) = health();
        h.etcd_failed("connect", &"connection refused");
        assert_eq!(m.etcd_errors("connect"), 1);
        let report = h.report();
        assert!(!report.checks.etcd.ok);
        assert!(!report.checks.discovery.ok);
        assert!(
            !report.checks.etcd.detail.contains("last known"),
            "nothing to serve yet: {}",
            report.checks.etcd.detail
        );

        h.etcd_ok("watching");
        h.set_nats_connected(Link::Main, true);
        h.set_nats_connected(Link::Routes, true);
        h.set_discovery_loaded();
        h.set_recovery_done("done");
        h.set_phase(Phase::Running);
        assert!(h.is_ready());
        assert_eq!(m.etcd_connected.get(), 1);

        h.etcd_failed("watch", &"stream closed");
        assert!(h.is_ready(), "etcd loss after load does not stop routing");
        let report = h.report();
        assert!(!report.checks.etcd.ok);
        assert!(
            report
                .checks
                .etcd
                .detail
                .contains("serving the last known workers")
        );
        assert_eq!(m.etcd_connected.get(), 0);
    }

    #[test]
    fn report_serializes_as_documented() {
        let (h, _) = health();
        h.set_step("loading worker registrations from etcd");
        let json = serde_json::to_value(h.report()).unwrap();
        assert_eq!(json["ready"], false);
        assert_eq!(json["phase"], "starting");
        assert_eq!(json["step"], "loading worker registrations from etcd");
        for check in ["nats", "etcd", "discovery", "recovery"] {
            assert_eq!(json["checks"][check]["ok"], false, "{check}");
            assert!(json["checks"][check]["detail"].is_string(), "{check}");
        }
    }
}
