//! [`AdmissionMetrics`]: what admission records besides the queue's depth and wait
//! ([`super::QueueMetrics`]) — how requests left the wait queue, the sequence sync
//! between replicas, and expired bookings. Each is a counter bumped where the thing
//! happens: one atomic add.
//!
//! These are registered apart from [`super::Metrics`] because admission is built
//! apart from the counters (it owns the scheduler), and their names are not part of
//! [`super::counters::Counters::descriptors`].

use super::common::latency_buckets;
use super::registrar::Registrar;
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};
use std::sync::OnceLock;

/// Admission's counters, handed to the wait queue, the replica sync and the expiry
/// task.
#[derive(Clone)]
pub struct AdmissionMetrics {
    /// How requests left (or could not join) the wait queue.
    pub outcomes: QueueOutcomes,
    /// Sequence sync messages between replicas.
    pub sync: SyncMetrics,
    /// `kv_router_requests_expired_total`: bookings dropped because no lifecycle
    /// message arrived within the request TTL.
    pub expired: IntCounter,
}

impl AdmissionMetrics {
    /// Creates the metrics through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            outcomes: QueueOutcomes::new(r)?,
            sync: SyncMetrics::new(r)?,
            expired: r.counter(
                "kv_router_requests_expired_total",
                "Booked requests dropped because no lifecycle message arrived within the TTL",
            )?,
        })
    }
}

/// How requests left (or failed to join) the wait queue, for Prometheus.
#[derive(Clone)]
pub struct QueueOutcomes {
    /// `kv_router_queue_requests_total{outcome}`: `routed`, `failed` (could not be
    /// routed as asked, e.g. its pinned rank left), `timed_out` (withdrawn after the
    /// maximum wait), `refused` (queue full, duplicate id, or shutting down).
    pub counter: IntCounterVec,
}

impl QueueOutcomes {
    /// Creates the counter through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            counter: r.counter_vec(
                "kv_router_queue_requests_total",
                "Route requests that left (or could not join) the wait queue, by outcome",
                &["outcome"],
            )?,
        })
    }

    pub(crate) fn count(&self, outcome: &str) {
        self.counter.with_label_values(&[outcome]).inc();
    }

    /// Requests counted so far with `outcome`.
    pub fn get(&self, outcome: &str) -> u64 {
        self.counter.with_label_values(&[outcome]).get()
    }
}

/// Sync message counters.
#[derive(Clone)]
pub struct SyncMetrics {
    /// `kv_router_sequence_sync_total{direction, outcome}`, in steps (a sync
    /// message carries one or more). Out: `queued` (only once a peer has been
    /// heard), `dropped` (outbox full), `published`, `failed`, and `announced` (empty
    /// batches: the hello at start-up and the answers to peers heard for the first
    /// time). In: `applied`, `duplicate` (already applied), `own` (our own message,
    /// ignored), `rejected` (e.g. unknown rank), and `malformed`
    /// (in messages). Start-up snapshot, `snapshot_out` (answering a peer):
    /// `answered` (requests), `published` and `failed` (reply chunks);
    /// `snapshot_in` (our own snapshot): `applied`, `duplicate` (already known from
    /// the live subject), `freed` (freed meanwhile, skipped), `rejected` (e.g.
    /// unknown rank), all in bookings, and `malformed` (undecodable requests and
    /// replies).
    pub messages: IntCounterVec,
    /// `kv_router_replica_sync_lag_seconds`: per peer message carrying a time stamp,
    /// from the peer queueing its first step (deciding it) to this replica having
    /// applied the whole message, by the two hosts' clocks (a clock behind the
    /// peer's records 0).
    pub lag: Histogram,
    /// `kv_router_replica_peers_heard`: distinct peer replicas (router ids) this
    /// replica has heard from since it started; 0 on a lone replica, which then
    /// publishes no sync steps.
    pub peers: IntGauge,
    /// `kv_router_replica_peers_array_only`: of those, the peers that decode only
    /// bookings with array block hashes (versions before the packed form, which send
    /// no `accepts_packed`); while it is above 0 this replica publishes arrays.
    pub peers_array_only: IntGauge,
    /// The handles of the counts made per routed request ([`HOT`]), resolved at
    /// first use: a label lookup hashes the labels under the vector's lock.
    hot: std::sync::Arc<[OnceLock<IntCounter>; HOT.len()]>,
}

/// The (direction, outcome) pairs counted on every booking and step.
const HOT: [(&str, &str); 3] = [("out", "queued"), ("out", "published"), ("in", "applied")];

impl SyncMetrics {
    /// Creates the counters through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            messages: r.counter_vec(
                "kv_router_sequence_sync_total",
                "Sequence sync messages between router replicas, by direction and outcome",
                &["direction", "outcome"],
            )?,
            lag: r.histogram(
                "kv_router_replica_sync_lag_seconds",
                "Replication lag of a peer replica's sync message: from the peer \
                 deciding its first step to this replica having applied it, by the two \
                 hosts' clocks, in seconds",
                latency_buckets(),
            )?,
            peers: r.gauge(
                "kv_router_replica_peers_heard",
                "Distinct peer router replicas heard from since start-up; a replica \
                 publishes its sync steps only once it has heard one",
            )?,
            peers_array_only: r.gauge(
                "kv_router_replica_peers_array_only",
                "Peer router replicas heard that decode only array block hashes; while \
                 above 0 this replica publishes its bookings' hashes as arrays",
            )?,
            hot: std::sync::Arc::default(),
        })
    }

    /// Records the lag of one peer message, in microseconds.
    pub(crate) fn observe_lag_us(&self, lag_us: u64) {
        self.lag.observe(lag_us as f64 / 1e6);
    }

    pub(crate) fn count(&self, direction: &str, outcome: &str) {
        self.count_steps(direction, outcome, 1);
    }

    /// Counts `steps` steps of one sync message.
    pub(crate) fn count_steps(&self, direction: &str, outcome: &str, steps: u64) {
        let resolve = || self.messages.with_label_values(&[direction, outcome]);
        match HOT.iter().position(|&hot| hot == (direction, outcome)) {
            Some(i) => self.hot[i].get_or_init(resolve).inc_by(steps),
            None => resolve().inc_by(steps),
        }
    }

    /// Messages counted so far for (direction, outcome).
    pub fn get(&self, direction: &str, outcome: &str) -> u64 {
        self.messages.with_label_values(&[direction, outcome]).get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Registry;

    /// Counts through resolved handles and through label lookups land in the same
    /// series.
    #[test]
    fn sync_counts_through_resolved_handles_and_lookups_agree() {
        let registry = Registry::new();
        let m = SyncMetrics::new(&Registrar::new(&registry)).unwrap();
        m.count("out", "queued");
        m.count("out", "queued");
        m.count_steps("out", "published", 5);
        m.count_steps("in", "applied", 3);
        m.count("in", "rejected");
        m.count("out", "queued");
        assert_eq!(m.get("out", "queued"), 3);
        assert_eq!(m.get("out", "published"), 5);
        assert_eq!(m.get("in", "applied"), 3);
        assert_eq!(m.get("in", "rejected"), 1);
        assert_eq!(m.get("out", "dropped"), 0);
        let families = registry.gather();
        let family = families
            .iter()
            .find(|f| f.name() == "kv_router_sequence_sync_total")
            .unwrap();
        let total: f64 = family
            .get_metric()
            .iter()
            .map(|s| s.get_counter().value())
            .sum();
        assert_eq!(total, 12.0, "every count once, in one series each");
    }
}
