//! Every Prometheus metric of the daemon, grouped by the part of the daemon that
//! records them, and the one way they are created ([`registrar`]).
//!
//! Two kinds of metric live here:
//! - **recorded** where the thing happens (a message handled, a routing decision, an
//!   event batch applied to its shard, a NATS connection event): histograms and
//!   counters updated inline, a few atomic adds each;
//! - **sampled** at scrape time by [`Metrics::refresh`] from state the daemon keeps
//!   anyway (indexer counters and sizes, per-rank booked load, engine-reported load).
//!   That costs nothing between scrapes and one shard round trip plus one scheduler
//!   lock (O(registered ranks)) per scrape.
//!
//! Every metric name starts with `kv_router_`; the full list, with types and labels,
//! is in `docs/operations.md` and is pinned by a snapshot test, so a rename is a
//! reviewed change. Metric handles come from an injected [`prometheus::Registry`]
//! through a [`registrar::Registrar`]: each group has one constructor taking it, and
//! tests pass [`registrar::Registrar::unregistered`].
//!
//! This module imports no other part of the daemon: the parts that record metrics
//! depend on it, never the other way round.
//!
//! # Layout
//! - [`registrar`]: registered or unregistered metric creation (`kv_cluster::metrics`,
//!   shared with the relay and the gateway).
//! - [`counters`]: per-message counters, and the root of the metric groups below.
//! - [`route`]: routing outcome, latency, overlap and decisions.
//! - [`events`]: KV event intake, the indexer's counters and sizes, recovery.
//! - [`load`]: the wait queue and per-rank load.
//! - [`admission`]: wait-queue outcomes, replica sync, expired bookings.
//! - [`sessions`]: session affinity (sessions held, hits and overrides).
//! - [`connections`]: NATS and etcd connection state, readiness.

pub(crate) mod admission;
mod common;
pub(crate) mod connections;
pub mod counters;
pub(crate) mod events;
pub(crate) mod load;
pub(crate) mod refusals;
pub(crate) use kv_cluster::metrics as registrar;
pub(crate) mod route;
pub(crate) mod sessions;

pub(crate) use admission::{AdmissionMetrics, QueueOutcomes, SyncMetrics};
pub(crate) use connections::ConnectionMetrics;
pub(crate) use events::{EventMetrics, RecoveryMetrics};
pub(crate) use load::{QueueMetrics, WorkerLoadMetrics};
pub(crate) use registrar::Registrar;
pub(crate) use route::RouteMetrics;
pub(crate) use sessions::SessionMetrics;

use indexer::{Indexer, IndexerApi as _};
use scheduler::Scheduler;
use std::sync::MutexGuard;

/// The metric groups of [`counters::Counters`] other than the message counters.
#[derive(Clone)]
pub struct Metrics {
    /// Routing queries.
    pub route: RouteMetrics,
    /// KV event intake and indexer.
    pub events: EventMetrics,
    /// Event recovery.
    pub recovery: RecoveryMetrics,
    /// The wait queue.
    pub queue: QueueMetrics,
    /// Per-rank load.
    pub load: WorkerLoadMetrics,
    /// NATS and etcd connections, readiness.
    pub connections: ConnectionMetrics,
    /// Session affinity.
    pub sessions: SessionMetrics,
    /// Serialises [`Metrics::refresh`], whose counter sampling must not interleave.
    refresh_lock: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl Metrics {
    /// Creates every metric through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        // Registered and set once; nothing updates it afterwards.
        r.gauge_vec(
            "kv_router_build_info",
            "Always 1; the label carries the daemon version",
            &["version"],
        )?
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
        Ok(Self {
            route: RouteMetrics::new(r)?,
            events: EventMetrics::new(r)?,
            recovery: RecoveryMetrics::new(r)?,
            queue: QueueMetrics::new(r)?,
            load: WorkerLoadMetrics::new(r)?,
            connections: ConnectionMetrics::new(r)?,
            sessions: SessionMetrics::new(r)?,
            refresh_lock: Default::default(),
        })
    }

    /// Updates every sampled metric: indexer counters, queue backlog, tree sizes and
    /// blocks per rank from `indexer` (one round trip to every shard, O(ranks) each),
    /// then per-rank load under the scheduler lock `lock_scheduler` takes. Called
    /// before each scrape; concurrent calls are serialised.
    pub(crate) async fn refresh<'a>(
        &self,
        indexer: &Indexer,
        lock_scheduler: impl FnOnce() -> MutexGuard<'a, Scheduler>,
    ) {
        let _guard = self.refresh_lock.lock().await;
        self.events.sample_counters(&indexer.counters().snapshot());
        // After shutdown the shards are gone; the last sampled sizes stay exported.
        if let Ok(report) = indexer.report().await {
            self.events.sample_report(&report);
        }
        let scheduler = lock_scheduler();
        self.load.sample(&scheduler);
        self.sessions.sample(&scheduler);
    }
}
