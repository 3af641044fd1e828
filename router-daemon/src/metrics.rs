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

use crate::state::RouterState;
use kv_events::WorkerRank;
use kv_events::routing::RouteReply;
use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts,
};
use std::time::Duration;

/// Label names of per-rank metrics.
const RANK_LABELS: &[&str] = &["worker_id", "dp_rank"];

// Every constructor below takes a static name, help text and label set that are valid
// Prometheus identifiers (pinned by the snapshot test), so construction cannot fail.
#[allow(clippy::expect_used)]
fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition is valid")
}

#[allow(clippy::expect_used)]
fn gauge(name: &str, help: &str) -> IntGauge {
    IntGauge::new(name, help).expect("static metric definition is valid")
}

#[allow(clippy::expect_used)]
fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition is valid")
}

#[allow(clippy::expect_used)]
fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
        .expect("static metric definition is valid")
}

#[allow(clippy::expect_used)]
fn histogram_vec(name: &str, help: &str, labels: &[&str], buckets: Vec<f64>) -> HistogramVec {
    HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
        .expect("static metric definition is valid")
}

/// Latency buckets from 50 µs to 10 s, in seconds: routing is sub-millisecond when
/// healthy, and queueing or a stalled shard shows up in the upper buckets.
fn latency_buckets() -> Vec<f64> {
    vec![
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
        0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ]
}

/// Overlap buckets in blocks: 0, then powers of two up to 4096 blocks (256k tokens at
/// 64 tokens per block).
fn overlap_buckets() -> Vec<f64> {
    std::iter::once(0.0)
        .chain((0..=12).map(|e| f64::from(1u32 << e)))
        .collect()
}

fn rank_labels(rank: WorkerRank) -> [String; 2] {
    [rank.worker_id.0.to_string(), rank.dp_rank.0.to_string()]
}

fn to_i64(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// Routing queries: outcome, latency, overlap, and where they went.
#[derive(Clone)]
pub struct RouteMetrics {
    requests: IntCounterVec,
    duration: HistogramVec,
    overlap_blocks: Histogram,
    decisions: IntCounterVec,
}

impl RouteMetrics {
    fn new() -> Self {
        Self {
            requests: counter_vec(
                "kv_router_route_requests_total",
                "Routing queries answered, by outcome (routed or the error code)",
                &["outcome"],
            ),
            duration: histogram_vec(
                "kv_router_route_duration_seconds",
                "Time from receiving a routing query to having its reply, in seconds, by outcome",
                &["outcome"],
                latency_buckets(),
            ),
            overlap_blocks: histogram(
                "kv_router_route_overlap_blocks",
                "Prompt blocks already cached on the chosen worker rank, per routed query",
                overlap_buckets(),
            ),
            decisions: counter_vec(
                "kv_router_route_decisions_total",
                "Routed queries by chosen worker rank",
                RANK_LABELS,
            ),
        }
    }

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.requests.clone()),
            Box::new(self.duration.clone()),
            Box::new(self.overlap_blocks.clone()),
            Box::new(self.decisions.clone()),
        ]
    }

    /// Records one answered routing query that took `elapsed`.
    pub fn observe(&self, reply: &RouteReply, elapsed: Duration) {
        let outcome = outcome_label(reply);
        self.requests.with_label_values(&[&outcome]).inc();
        self.duration
            .with_label_values(&[&outcome])
            .observe(elapsed.as_secs_f64());
        if let RouteReply::Routed(d) = reply {
            self.overlap_blocks.observe(f64::from(d.overlap_blocks));
            let rank = WorkerRank::new(d.worker_id, d.dp_rank);
            self.decisions.with_label_values(&rank_labels(rank)).inc();
        }
    }

    /// Routed queries counted for `outcome` (`routed` or an error code).
    pub fn requests(&self, outcome: &str) -> u64 {
        self.requests.with_label_values(&[outcome]).get()
    }

    /// Forgets the per-rank decision counters of a worker that left, so label sets do
    /// not accumulate with worker churn.
    pub fn forget_worker(&self, worker_id: kv_events::WorkerId, dp_size: u32) {
        let worker = worker_id.0.to_string();
        for rank in 0..dp_size {
            let _ = self
                .decisions
                .remove_label_values(&[&worker, &rank.to_string()]);
        }
    }
}

/// `routed`, or the error code's wire name (`no_workers`, `overloaded`, ...).
fn outcome_label(reply: &RouteReply) -> String {
    match reply {
        RouteReply::Routed(_) => "routed".to_owned(),
        RouteReply::Error(e) => serde_json::to_value(e.code)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| "error".to_owned()),
    }
}

/// KV event intake and the indexer behind it.
#[derive(Clone)]
pub struct EventMetrics {
    lag: Histogram,
    applied: IntCounterVec,
    order: IntCounterVec,
    recoveries: IntCounterVec,
    blocks: IntCounterVec,
    queued: IntGauge,
    tree_nodes: IntGauge,
    tree_blocks: IntGauge,
    tree_ranks: IntGauge,
    tree_bytes: IntGauge,
    rank_blocks: IntGaugeVec,
    recovering_ranks: IntGauge,
    buffered_events: IntGauge,
}

impl EventMetrics {
    fn new() -> Self {
        Self {
            lag: histogram(
                "kv_router_event_lag_seconds",
                "Intake lag of a KV event batch: from its delivery to the daemon until its \
                 shard queue accepted it (includes backpressure waits), in seconds",
                latency_buckets(),
            ),
            applied: counter_vec(
                "kv_router_indexer_events_total",
                "KV events taken by the indexer shards, by event type and outcome",
                &["type", "outcome"],
            ),
            order: counter_vec(
                "kv_router_indexer_event_order_total",
                "Events outside the expected per-rank sequence, by kind (duplicate, \
                 stale_epoch, gap, publisher_restart, buffered, buffer_overflow, lost)",
                &["kind"],
            ),
            recoveries: counter_vec(
                "kv_router_indexer_recoveries_total",
                "Recovery steps of the indexer, by result (requested, range, dump, \
                 ignored, abandoned)",
                &["result"],
            ),
            blocks: counter_vec(
                "kv_router_indexer_block_ops_total",
                "Block-level effects of applied KV events and worker removals, by op \
                 (stored, duplicate, removed, unknown_removed, recovered, pruned, \
                 forgotten, approximate, expired)",
                &["op"],
            ),
            queued: gauge(
                "kv_router_indexer_queued_events",
                "Event batches waiting in the shard queues",
            ),
            tree_nodes: gauge(
                "kv_router_indexer_nodes",
                "Radix tree nodes (distinct block positions) over all shards",
            ),
            tree_blocks: gauge(
                "kv_router_indexer_blocks",
                "Indexed (worker rank, block) entries over all shards",
            ),
            tree_ranks: gauge(
                "kv_router_indexer_ranks",
                "Worker ranks known to the indexer",
            ),
            tree_bytes: gauge(
                "kv_router_indexer_memory_bytes",
                "Approximate heap footprint of the radix trees, in bytes",
            ),
            rank_blocks: gauge_vec(
                "kv_router_indexer_rank_blocks",
                "Blocks indexed for each worker rank",
                RANK_LABELS,
            ),
            recovering_ranks: gauge(
                "kv_router_indexer_recovering_ranks",
                "Worker ranks with a recovery of missed events pending",
            ),
            buffered_events: gauge(
                "kv_router_indexer_buffered_events",
                "Events held in recovery buffers until their gap is filled",
            ),
        }
    }

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.lag.clone()),
            Box::new(self.applied.clone()),
            Box::new(self.order.clone()),
            Box::new(self.recoveries.clone()),
            Box::new(self.blocks.clone()),
            Box::new(self.queued.clone()),
            Box::new(self.tree_nodes.clone()),
            Box::new(self.tree_blocks.clone()),
            Box::new(self.tree_ranks.clone()),
            Box::new(self.tree_bytes.clone()),
            Box::new(self.rank_blocks.clone()),
            Box::new(self.recovering_ranks.clone()),
            Box::new(self.buffered_events.clone()),
        ]
    }

    /// Records the intake lag of one batch.
    pub fn observe_lag(&self, lag: Duration) {
        self.lag.observe(lag.as_secs_f64());
    }

    /// Raises a sampled monotonic counter to `value` (it never goes down; a scrape
    /// lock serialises the callers, see [`refresh`]).
    fn raise(counter: &IntCounter, value: u64) {
        let current = counter.get();
        if value > current {
            counter.inc_by(value - current);
        }
    }

    fn sample_counters(&self, c: &indexer::CountersSnapshot) {
        let pairs = [
            (["stored", "applied"], c.stored_events),
            (["removed", "applied"], c.removed_events),
            (["cleared", "applied"], c.cleared_events),
            (
                ["stored", "rejected"],
                c.unknown_parent_rejections + c.forgotten_parent_rejections,
            ),
        ];
        for (labels, value) in pairs {
            Self::raise(&self.applied.with_label_values(&labels), value);
        }
        let order = [
            ("duplicate", c.duplicate_events),
            ("stale_epoch", c.stale_epoch_events),
            ("gap", c.gaps),
            ("publisher_restart", c.publisher_restarts),
            ("buffered", c.buffered_events),
            ("buffer_overflow", c.buffer_overflows),
            ("lost", c.events_lost),
        ];
        for (kind, value) in order {
            Self::raise(&self.order.with_label_values(&[kind]), value);
        }
        let recoveries = [
            ("requested", c.recovery_requests),
            ("range", c.recovered_ranges),
            ("dump", c.recovered_dumps),
            ("ignored", c.recovery_replies_ignored),
            ("abandoned", c.recoveries_abandoned),
        ];
        for (result, value) in recoveries {
            Self::raise(&self.recoveries.with_label_values(&[result]), value);
        }
        let ops = [
            ("stored", c.blocks_stored),
            ("duplicate", c.duplicate_stores),
            ("removed", c.blocks_removed),
            ("unknown_removed", c.unknown_removes),
            ("recovered", c.recovered_blocks),
            ("pruned", c.pruned_entries),
            ("forgotten", c.forgotten_blocks),
            ("approximate", c.approximate_blocks),
            ("expired", c.expired_blocks),
        ];
        for (op, value) in ops {
            Self::raise(&self.blocks.with_label_values(&[op]), value);
        }
    }

    fn sample_report(&self, r: &indexer::IndexerReport) {
        let s = &r.stats;
        self.tree_nodes.set(to_i64(s.nodes));
        self.tree_blocks.set(to_i64(s.entries));
        self.tree_ranks.set(to_i64(s.ranks));
        self.tree_bytes.set(to_i64(s.memory_bytes));
        self.rank_blocks.reset();
        for &(rank, blocks) in &r.blocks_per_rank {
            self.rank_blocks
                .with_label_values(&rank_labels(rank))
                .set(to_i64(blocks));
        }
        self.recovering_ranks.set(to_i64(r.recovering_ranks));
        self.buffered_events.set(to_i64(r.buffered_events));
    }
}

/// Recovery of missed KV events (gap detected, dump fetched, ...).
#[derive(Clone)]
pub struct RecoveryMetrics {
    runs: IntCounterVec,
    duration: Histogram,
}

impl RecoveryMetrics {
    fn new() -> Self {
        Self {
            runs: counter_vec(
                "kv_router_recovery_runs_total",
                "Recoveries of missed KV events, by kind (e.g. replay, dump) and outcome \
                 (ok, failed)",
                &["kind", "outcome"],
            ),
            duration: histogram(
                "kv_router_recovery_duration_seconds",
                "Time from detecting missed KV events to having applied the recovered \
                 state, in seconds",
                latency_buckets(),
            ),
        }
    }

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![Box::new(self.runs.clone()), Box::new(self.duration.clone())]
    }

    /// Records one recovery run of `kind` (lowercase, e.g. `replay`, `dump`) that ended
    /// with `ok` after `elapsed`.
    pub fn observe(&self, kind: &str, ok: bool, elapsed: Duration) {
        let outcome = if ok { "ok" } else { "failed" };
        self.runs.with_label_values(&[kind, outcome]).inc();
        self.duration.observe(elapsed.as_secs_f64());
    }

    /// Runs counted for (kind, outcome).
    pub fn runs(&self, kind: &str, outcome: &str) -> u64 {
        self.runs.with_label_values(&[kind, outcome]).get()
    }
}

/// The wait queue of routing queries when every worker is busy.
#[derive(Clone)]
pub struct QueueMetrics {
    depth: IntGauge,
    wait: Histogram,
}

impl QueueMetrics {
    fn new() -> Self {
        Self {
            depth: gauge(
                "kv_router_queue_depth",
                "Routing queries waiting because every worker rank is busy",
            ),
            wait: histogram(
                "kv_router_queue_wait_seconds",
                "Time a routing query waited in the queue before it was scheduled or \
                 refused, in seconds",
                latency_buckets(),
            ),
        }
    }

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![Box::new(self.depth.clone()), Box::new(self.wait.clone())]
    }

    /// Sets the number of queued queries.
    pub fn set_depth(&self, depth: usize) {
        self.depth.set(to_i64(depth));
    }

    /// Records how long one query waited.
    pub fn observe_wait(&self, wait: Duration) {
        self.wait.observe(wait.as_secs_f64());
    }
}

/// Per-rank load: what the scheduler booked and what the engine last reported.
#[derive(Clone)]
pub struct WorkerLoadMetrics {
    prefill_tokens: IntGaugeVec,
    decode_blocks: IntGaugeVec,
    requests: IntGaugeVec,
    engine_kv_used: IntGaugeVec,
    engine_kv_total: IntGaugeVec,
    engine_running: IntGaugeVec,
    engine_waiting: IntGaugeVec,
}

impl WorkerLoadMetrics {
    fn new() -> Self {
        Self {
            prefill_tokens: gauge_vec(
                "kv_router_worker_active_prefill_tokens",
                "Prompt tokens routed to the rank whose prefill is not done, in tokens",
                RANK_LABELS,
            ),
            decode_blocks: gauge_vec(
                "kv_router_worker_active_decode_blocks",
                "KV blocks held by requests routed to the rank and not yet freed",
                RANK_LABELS,
            ),
            requests: gauge_vec(
                "kv_router_worker_active_requests",
                "Requests routed to the rank by this replica and not yet freed",
                RANK_LABELS,
            ),
            engine_kv_used: gauge_vec(
                "kv_router_engine_kv_used_blocks",
                "KV blocks in use, as last reported by the engine rank",
                RANK_LABELS,
            ),
            engine_kv_total: gauge_vec(
                "kv_router_engine_kv_total_blocks",
                "KV cache capacity in blocks, as last reported by the engine rank",
                RANK_LABELS,
            ),
            engine_running: gauge_vec(
                "kv_router_engine_requests_running",
                "Requests in the running batch, as last reported by the engine rank",
                RANK_LABELS,
            ),
            engine_waiting: gauge_vec(
                "kv_router_engine_requests_waiting",
                "Requests waiting for a batch slot or KV space, as last reported by the \
                 engine rank",
                RANK_LABELS,
            ),
        }
    }

    fn all(&self) -> [&IntGaugeVec; 7] {
        [
            &self.prefill_tokens,
            &self.decode_blocks,
            &self.requests,
            &self.engine_kv_used,
            &self.engine_kv_total,
            &self.engine_running,
            &self.engine_waiting,
        ]
    }

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
        self.all()
            .into_iter()
            .map(|g| Box::new(g.clone()) as Box<dyn Collector>)
            .collect()
    }

    fn sample(&self, state: &RouterState) {
        for g in self.all() {
            g.reset();
        }
        let scheduler = state.scheduler();
        for &rank in scheduler.ranks() {
            let labels = rank_labels(rank);
            let load = scheduler.rank_load(rank);
            self.prefill_tokens
                .with_label_values(&labels)
                .set(to_i64(load.active_prefill_tokens));
            self.decode_blocks
                .with_label_values(&labels)
                .set(to_i64(load.active_decode_blocks));
            self.requests
                .with_label_values(&labels)
                .set(to_i64(load.active_requests));
            if let Some(m) = scheduler.load_metrics(rank) {
                self.engine_kv_used
                    .with_label_values(&labels)
                    .set(to_i64(m.kv_used_blocks));
                self.engine_kv_total
                    .with_label_values(&labels)
                    .set(to_i64(m.kv_total_blocks));
                self.engine_running
                    .with_label_values(&labels)
                    .set(i64::from(m.num_requests_running));
                self.engine_waiting
                    .with_label_values(&labels)
                    .set(i64::from(m.num_requests_waiting));
            }
        }
    }
}

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
    fn new() -> Self {
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

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
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
