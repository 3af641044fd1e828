//! [`ConnectionMetrics`]: NATS and etcd connection state and readiness, written by
//! [`crate::health::Health`].

use super::{counter_vec, gauge};
use prometheus::core::Collector;
use prometheus::{IntCounterVec, IntGauge};

/// NATS and etcd connection state, and overall readiness.
#[derive(Clone)]
pub struct ConnectionMetrics {
    /// 1 while the NATS connection is up.
    pub nats_connected: IntGauge,
    nats_events: IntCounterVec,
    /// 1 while etcd answers (the watch is running or the last call succeeded).
    pub etcd_connected: IntGauge,
    etcd_errors: IntCounterVec,
    /// 1 while `/health/readyz` reports ready.
    pub ready: IntGauge,
}

impl ConnectionMetrics {
    pub(crate) fn new() -> Self {
        Self {
            nats_connected: gauge(
                "kv_router_nats_connected",
                "1 while the NATS connection is up, 0 while disconnected",
            ),
            nats_events: counter_vec(
                "kv_router_nats_events_total",
                "NATS connection events (connected, disconnected, lame_duck, slow_consumer, \
                 server_error, client_error, draining, closed)",
                &["event"],
            ),
            etcd_connected: gauge(
                "kv_router_etcd_connected",
                "1 while etcd answers, 0 while the daemon is retrying with backoff",
            ),
            etcd_errors: counter_vec(
                "kv_router_etcd_errors_total",
                "etcd failures, by stage (connect, load, watch)",
                &["stage"],
            ),
            ready: gauge(
                "kv_router_ready",
                "1 while the daemon reports ready on /health/readyz",
            ),
        }
    }

    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.nats_connected.clone()),
            Box::new(self.nats_events.clone()),
            Box::new(self.etcd_connected.clone()),
            Box::new(self.etcd_errors.clone()),
            Box::new(self.ready.clone()),
        ]
    }

    /// Counts one NATS connection event (lowercase snake-case name).
    pub fn nats_event(&self, event: &str) {
        self.nats_events.with_label_values(&[event]).inc();
    }

    /// NATS connection events counted under `event`.
    pub fn nats_events(&self, event: &str) -> u64 {
        self.nats_events.with_label_values(&[event]).get()
    }

    /// Counts one etcd failure at `stage` (`connect`, `load` or `watch`).
    pub fn etcd_error(&self, stage: &str) {
        self.etcd_errors.with_label_values(&[stage]).inc();
    }

    /// etcd failures counted at `stage`.
    pub fn etcd_errors(&self, stage: &str) -> u64 {
        self.etcd_errors.with_label_values(&[stage]).get()
    }
}
