//! [`ConnectionMetrics`]: NATS and etcd connection state and readiness, written by
//! [`crate::health::Health`].

use super::registrar::Registrar;
use prometheus::{IntCounterVec, IntGauge};

/// NATS and etcd connection state, and overall readiness.
#[derive(Clone)]
pub struct ConnectionMetrics {
    /// 1 while both NATS connections (main and route path) are up.
    pub nats_connected: IntGauge,
    nats_events: IntCounterVec,
    /// 1 while etcd answers (the watch is running or the last call succeeded).
    pub etcd_connected: IntGauge,
    etcd_errors: IntCounterVec,
    /// 1 while `/health/readyz` reports ready.
    pub ready: IntGauge,
}

impl ConnectionMetrics {
    /// Creates the metrics through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            nats_connected: r.gauge(
                "kv_router_nats_connected",
                "1 while both NATS connections (main and route path) are up, 0 while either is down",
            )?,
            nats_events: r.counter_vec(
                "kv_router_nats_events_total",
                "NATS connection events (connected, disconnected, lame_duck, slow_consumer, \
                 server_error, client_error, draining, closed)",
                &["event"],
            )?,
            etcd_connected: r.gauge(
                "kv_router_etcd_connected",
                "1 while etcd answers, 0 while the daemon is retrying with backoff",
            )?,
            etcd_errors: r.counter_vec(
                "kv_router_etcd_errors_total",
                "etcd failures, by stage (connect, load, watch)",
                &["stage"],
            )?,
            ready: r.gauge(
                "kv_router_ready",
                "1 while the daemon reports ready on /health/readyz",
            )?,
        })
    }

    /// Counts one NATS connection event (lowercase snake-case name).
    pub(crate) fn nats_event(&self, event: &str) {
        self.nats_events.with_label_values(&[event]).inc();
    }

    /// NATS connection events counted under `event`.
    pub fn nats_events(&self, event: &str) -> u64 {
        self.nats_events.with_label_values(&[event]).get()
    }

    /// Counts one etcd failure at `stage` (`connect`, `load` or `watch`).
    pub(crate) fn etcd_error(&self, stage: &str) {
        self.etcd_errors.with_label_values(&[stage]).inc();
    }

    /// etcd failures counted at `stage`.
    #[cfg(test)]
    pub(crate) fn etcd_errors(&self, stage: &str) -> u64 {
        self.etcd_errors.with_label_values(&[stage]).get()
    }
}
