//! Prometheus counters of the relay, registered in an injected registry (several
//! relays can run in one test process).
//!
//! | metric | labels | counts |
//! |---|---|---|
//! | `kv_relay_frames_total` | `outcome`: `ok`, `duplicate`, `malformed`, `bad_rank` | ZMQ messages from the engine |
//! | `kv_relay_engine_events_total` | `kind`, `outcome`: `published` or a [`crate::translate::Skip`] label (`no_change`, `orphan`, `unplaced`, `bad_blocks`, `unsupported_group`, `group_conflict`, `unknown_medium`, `unknown_type`, `format`) | engine events |
//! | `kv_relay_gaps_total` | `result`: `filled`, `cleared` | gaps in the engine's seq |
//! | `kv_relay_resets_total` | `reason`: `restart`, `reconnect`, `gap` | ranks cleared |
//! | `kv_relay_connect_replays_total` | `result`: `complete`, `partial`, `empty`, `incomplete`, `failed` | replay-buffer reads when an engine socket connects |
//! | `kv_relay_replay_requests_total` | `stop`: `end`, `hole`, `cut`, `enough`, `silent`, `failed` | requests to the engine's replay socket, by how the reply stopped ([`crate::replay::Stop`]) |
//! | `kv_relay_replay_missing_batches_total` | | batches known to exist (seen after a hole) that a read ending short did not get |
//! | `kv_relay_published_events_total` | | our KV events published to NATS |
//! | `kv_relay_recovery_requests_total` | | router recovery requests answered |
//! | `kv_relay_scrapes_total` | `outcome`: `ok`, `failed`, `block_size_conflict`, `models_ok`, `models_failed` | engine /metrics scrapes (and pages stating another block size than the one in use), and reads of its /v1/models for `max_model_len` |
//! | `kv_relay_engine_connected` | | engine sockets currently connected |

use kv_cluster::metrics::{self, Registrar};
use prometheus::{IntCounter, IntCounterVec, IntGauge, Registry};

/// The relay's metrics.
#[derive(Clone)]
pub struct RelayCounters {
    frames: IntCounterVec,
    events: IntCounterVec,
    gaps: IntCounterVec,
    resets: IntCounterVec,
    connect_replays: IntCounterVec,
    replay_requests: IntCounterVec,
    replay_missing: IntCounter,
    published: IntCounter,
    recovery: IntCounter,
    scrapes: IntCounterVec,
    connected: IntGauge,
}

impl RelayCounters {
    /// Creates every metric through `r` (registered in its registry, if it has one).
    ///
    /// # Errors
    /// When a metric of the same name is already registered.
    pub fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            frames: r.counter_vec(
                "kv_relay_frames_total",
                "ZMQ messages received from the engine, by outcome",
                &["outcome"],
            )?,
            events: r.counter_vec(
                "kv_relay_engine_events_total",
                "Engine KV events, by kind and outcome",
                &["kind", "outcome"],
            )?,
            gaps: r.counter_vec(
                "kv_relay_gaps_total",
                "Gaps in the engine's sequence, by result",
                &["result"],
            )?,
            resets: r.counter_vec(
                "kv_relay_resets_total",
                "Ranks cleared because the engine stream broke, by reason",
                &["reason"],
            )?,
            connect_replays: r.counter_vec(
                "kv_relay_connect_replays_total",
                "Reads of the engine's replay buffer when an engine socket connects, by result",
                &["result"],
            )?,
            replay_requests: r.counter_vec(
                "kv_relay_replay_requests_total",
                "Requests to the engine's replay socket, by how the reply stopped",
                &["stop"],
            )?,
            replay_missing: r.counter(
                "kv_relay_replay_missing_batches_total",
                "Engine batches known to exist that a replay read ending short did not get",
            )?,
            published: r.counter(
                "kv_relay_published_events_total",
                "KV events the relay published to NATS",
            )?,
            recovery: r.counter(
                "kv_relay_recovery_requests_total",
                "Router recovery requests the relay answered",
            )?,
            scrapes: r.counter_vec(
                "kv_relay_scrapes_total",
                "Scrapes of the engine's Prometheus endpoint and reads of its /v1/models, by outcome",
                &["outcome"],
            )?,
            connected: r.gauge(
                "kv_relay_engine_connected",
                "Engine event sockets currently connected",
            )?,
        })
    }

    /// Counters registered nowhere.
    pub fn unregistered() -> Self {
        metrics::unregistered(Self::new)
    }

    /// Counters registered in `registry`.
    ///
    /// # Errors
    /// When a metric of the same name is already registered.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Self::new(&Registrar::new(registry))
    }

    /// Counts one engine message.
    pub fn frame(&self, outcome: &str) {
        self.frames.with_label_values(&[outcome]).inc();
    }

    /// Engine messages counted with `outcome`.
    pub fn frames(&self, outcome: &str) -> u64 {
        self.frames.with_label_values(&[outcome]).get()
    }

    /// Counts one engine event.
    pub fn event(&self, kind: &str, outcome: &str) {
        self.events.with_label_values(&[kind, outcome]).inc();
    }

    /// Engine events counted with (kind, outcome).
    pub fn events(&self, kind: &str, outcome: &str) -> u64 {
        self.events.with_label_values(&[kind, outcome]).get()
    }

    /// Counts one gap.
    pub fn gap(&self, result: &str) {
        self.gaps.with_label_values(&[result]).inc();
    }

    /// Gaps counted with `result`.
    pub fn gaps(&self, result: &str) -> u64 {
        self.gaps.with_label_values(&[result]).get()
    }

    /// Counts one cleared rank.
    pub fn reset(&self, reason: &str) {
        self.resets.with_label_values(&[reason]).inc();
    }

    /// Ranks cleared for `reason`.
    pub fn resets(&self, reason: &str) -> u64 {
        self.resets.with_label_values(&[reason]).get()
    }

    /// Counts one replay-buffer read at connect.
    pub fn connect_replay(&self, result: &str) {
        self.connect_replays.with_label_values(&[result]).inc();
    }

    /// Replay-buffer reads at connect counted with `result`.
    pub fn connect_replays(&self, result: &str) -> u64 {
        self.connect_replays.with_label_values(&[result]).get()
    }

    /// Counts one replay request that stopped with `stop`.
    pub fn replay_request(&self, stop: &str) {
        self.replay_requests.with_label_values(&[stop]).inc();
    }

    /// Replay requests counted with `stop`.
    pub fn replay_requests(&self, stop: &str) -> u64 {
        self.replay_requests.with_label_values(&[stop]).get()
    }

    /// Counts `n` batches a replay read did not get.
    pub fn replay_missing(&self, n: u64) {
        self.replay_missing.inc_by(n);
    }

    /// Batches replay reads did not get, so far.
    pub fn replay_missing_total(&self) -> u64 {
        self.replay_missing.get()
    }

    /// Counts published KV events.
    pub fn published(&self, n: usize) {
        self.published.inc_by(n as u64);
    }

    /// KV events published so far.
    pub fn published_total(&self) -> u64 {
        self.published.get()
    }

    /// Counts one answered recovery request.
    pub fn recovery_request(&self) {
        self.recovery.inc();
    }

    /// Router recovery requests answered so far.
    pub fn recovery_requests(&self) -> u64 {
        self.recovery.get()
    }

    /// Counts one scrape.
    pub fn scrape(&self, outcome: &str) {
        self.scrapes.with_label_values(&[outcome]).inc();
    }

    /// Scrapes counted with `outcome`.
    pub fn scrapes(&self, outcome: &str) -> u64 {
        self.scrapes.with_label_values(&[outcome]).get()
    }

    /// Sets the connected-sockets gauge.
    pub fn set_connected(&self, n: usize) {
        self.connected.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
