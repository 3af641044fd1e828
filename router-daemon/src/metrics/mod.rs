//! The daemon's Prometheus metrics beyond the per-message counters of
//! [`crate::counters`], grouped by the part of the daemon that records them.
//!
//! Two kinds of metric live here:
//! - **recorded** where the thing happens (a routing decision, an event batch taken by
//!   a shard queue, a NATS connection event): histograms and counters updated inline,
//!   a few atomic adds each;
//! - **sampled** at scrape time by [`refresh`] from state the daemon keeps anyway
//!   (indexer counters and sizes, per-rank booked load, engine-reported load). That
//!   costs nothing between scrapes and one shard round trip plus one scheduler lock
//!   (O(registered ranks)) per scrape.
//!
//! Every metric name starts with `kv_router_`; the full list, with types and labels,
//! is in `docs/operations.md` and is pinned by a snapshot test, so a rename is a
//! reviewed change. Metric handles come from an injected [`prometheus::Registry`]
//! (see [`crate::counters::Counters::register`]).

//!
//! # Layout
//! - [`route`]: routing outcome, latency, overlap and decisions.
//! - [`events`]: KV event intake, the indexer's counters and sizes, recovery.
//! - [`load`]: the wait queue and per-rank load.
//! - [`connections`]: NATS and etcd connection state, readiness.

pub mod connections;
pub mod events;
pub mod load;
pub mod route;

pub use connections::ConnectionMetrics;
pub use events::{EventMetrics, RecoveryMetrics};
pub use load::{QueueMetrics, WorkerLoadMetrics};
pub use route::RouteMetrics;

use crate::state::RouterState;
use indexer::IndexerApi as _;
use kv_events::WorkerRank;
use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

/// Label names of per-rank metrics.
pub(crate) const RANK_LABELS: &[&str] = &["worker_id", "dp_rank"];

// Every constructor below takes a static name, help text and label set that are valid
// Prometheus identifiers (pinned by the snapshot test), so construction cannot fail.
#[allow(clippy::expect_used)]
pub(crate) fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition is valid")
}

#[allow(clippy::expect_used)]
pub(crate) fn gauge(name: &str, help: &str) -> IntGauge {
    IntGauge::new(name, help).expect("static metric definition is valid")
}

#[allow(clippy::expect_used)]
pub(crate) fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition is valid")
}

#[allow(clippy::expect_used)]
pub(crate) fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
        .expect("static metric definition is valid")
}

#[allow(clippy::expect_used)]
pub(crate) fn histogram_vec(
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: Vec<f64>,
) -> HistogramVec {
    HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
        .expect("static metric definition is valid")
}

/// Latency buckets from 50 µs to 10 s, in seconds: routing is sub-millisecond when
/// healthy, and queueing or a stalled shard shows up in the upper buckets.
pub(crate) fn latency_buckets() -> Vec<f64> {
    vec![
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        0.5, 1.0, 2.5, 5.0, 10.0,
    ]
}

/// Overlap buckets in blocks: 0, then powers of two up to 4096 blocks (256k tokens at
/// 64 tokens per block).
pub(crate) fn overlap_buckets() -> Vec<f64> {
    std::iter::once(0.0)
        .chain((0..=12).map(|e| f64::from(1u32 << e)))
        .collect()
}

pub(crate) fn rank_labels(rank: WorkerRank) -> [String; 2] {
    [rank.worker_id.0.to_string(), rank.dp_rank.0.to_string()]
}

pub(crate) fn to_i64(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// The metric groups of [`crate::counters::Counters`] other than the message counters.
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
    build_info: IntGaugeVec,
    /// Serialises [`refresh`], whose counter sampling must not interleave.
    refresh_lock: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl Metrics {
    /// Creates every metric, unregistered.
    pub fn new() -> Self {
        let build_info = gauge_vec(
            "kv_router_build_info",
            "Always 1; the label carries the daemon version",
            &["version"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        Self {
            route: RouteMetrics::new(),
            events: EventMetrics::new(),
            recovery: RecoveryMetrics::new(),
            queue: QueueMetrics::new(),
            load: WorkerLoadMetrics::new(),
            connections: ConnectionMetrics::new(),
            build_info,
            refresh_lock: Default::default(),
        }
    }

    /// Every collector, for registration and for the metric-name snapshot.
    pub fn collectors(&self) -> Vec<Box<dyn Collector>> {
        let mut all = self.route.collectors();
        all.extend(self.events.collectors());
        all.extend(self.recovery.collectors());
        all.extend(self.queue.collectors());
        all.extend(self.load.collectors());
        all.extend(self.connections.collectors());
        all.push(Box::new(self.build_info.clone()));
        all
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Updates every sampled metric from `state`: indexer counters, queue backlog, tree
/// sizes and blocks per rank (one round trip to every shard, O(ranks) each), and
/// per-rank load (one scheduler lock). Called before each scrape; concurrent calls
/// are serialised.
pub async fn refresh(state: &RouterState) {
    let metrics = &state.counters.metrics;
    let _guard = metrics.refresh_lock.lock().await;
    metrics
        .events
        .sample_counters(&state.indexer.counters().snapshot());
    metrics
        .events
        .queued
        .set(to_i64(state.indexer.queued_events()));
    // After shutdown the shards are gone; the last sampled sizes stay exported.
    if let Ok(report) = state.indexer.report().await {
        metrics.events.sample_report(&report);
    }
    metrics.load.sample(state);
}
