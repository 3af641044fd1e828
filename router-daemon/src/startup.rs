//! Telling an operator what a slow start waits for.
//!
//! Why: a start waits on things outside the daemon — NATS, etcd, a NATS cluster
//! carrying a message between two nodes, publishers answering dumps. Once, a start
//! waited forever on a message a NATS cluster had dropped while `/health/livez` said
//! 200 and nothing was logged, so nothing restarted it. Now each step of
//! [`crate::daemon::Starting::start`] records its name ([`crate::health::Health::set_step`],
//! shown as `step` in `/health/readyz`), and while the start runs,
//! [`report_slow_start`] logs every [`REPORT_EVERY`] a warning naming the step, how
//! long the start has taken and the NATS and etcd checks. Steps that can fail fast do
//! so (the NATS round trips give up after [`kv_cluster::barrier::BARRIER_DEADLINE`]); steps
//! that wait for NATS or etcd to come back keep waiting, reported here.
//!
//! Cost: one timer task per start, ended with it.

use crate::health::Health;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::warn;

/// How long a start may take before the first warning, and the time between two.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(10);

/// One warning about a start not done yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlowStart {
    /// The step under way.
    pub step: &'static str,
    /// Seconds since the start began.
    pub waited_s: u64,
    /// The NATS check's detail (`connected` or `disconnected`).
    pub nats: String,
    /// The etcd check's detail.
    pub etcd: String,
}

/// Logs a [`SlowStart`] warning every [`REPORT_EVERY`] until the returned guard is
/// dropped (the end of the start, whether it succeeded, failed or was abandoned).
pub(crate) fn report_slow_start(health: Arc<Health>) -> DropGuard {
    watch_start(health, REPORT_EVERY, |slow| {
        warn!(
            step = slow.step,
            waited_s = slow.waited_s,
            nats = %slow.nats,
            etcd = %slow.etcd,
            "kv-router is still starting; not ready"
        );
    })
}

/// Hands `report` a [`SlowStart`] every `every` until the returned guard is dropped.
pub(crate) fn watch_start(
    health: Arc<Health>,
    every: Duration,
    report: impl Fn(&SlowStart) + Send + 'static,
) -> DropGuard {
    let done = CancellationToken::new();
    let stop = done.clone();
    let started = Instant::now();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval_at(started + every, every);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let checks = health.report().checks;
            report(&SlowStart {
                step: health.step(),
                waited_s: started.elapsed().as_secs(),
                nats: checks.nats.detail,
                etcd: checks.etcd.detail,
            });
        }
    });
    done.drop_guard()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::metrics::{ConnectionMetrics, Registrar};
    use std::sync::Mutex;

    #[tokio::test(start_paused = true)]
    async fn a_slow_start_is_reported_with_its_step_until_it_ends() {
        let metrics = ConnectionMetrics::new(&Registrar::unregistered()).unwrap();
        let health = Arc::new(Health::new(metrics));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let guard = watch_start(health.clone(), Duration::from_secs(10), move |slow| {
            sink.lock().unwrap().push(slow.clone());
        });
        health.set_step("replica sync: a NATS round trip between its two connections");
        tokio::time::sleep(Duration::from_millis(9_900)).await;
        assert!(
            seen.lock().unwrap().is_empty(),
            "a quick start says nothing"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        health.set_step("loading worker registrations from etcd");
        tokio::time::sleep(Duration::from_secs(10)).await;
        {
            let seen = seen.lock().unwrap();
            let steps: Vec<_> = seen.iter().map(|s| (s.step, s.waited_s)).collect();
            assert_eq!(
                steps,
                [
                    (
                        "replica sync: a NATS round trip between its two connections",
                        10
                    ),
                    ("loading worker registrations from etcd", 20),
                ]
            );
            assert_eq!(seen[0].nats, "disconnected");
            assert_eq!(seen[0].etcd, "not connected yet");
        }
        drop(guard);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(
            seen.lock().unwrap().len(),
            2,
            "the start ended: no more reports"
        );
    }
}
