//! [`EventMetrics`] (KV event intake and the indexer's counters and sizes, sampled at
//! scrape time) and [`RecoveryMetrics`] (recoveries of missed events, recorded by the
//! recovery service).

use super::common::{RANK_LABELS, latency_buckets, rank_labels, to_i64};
use super::registrar::Registrar;
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};
use std::time::Duration;

/// KV event intake and the indexer behind it.
#[derive(Clone)]
pub struct EventMetrics {
    lag: Histogram,
    applied: IntCounterVec,
    order: IntCounterVec,
    recoveries: IntCounterVec,
    blocks: IntCounterVec,
    tree_nodes: IntGauge,
    tree_blocks: IntGauge,
    tree_ranks: IntGauge,
    tree_bytes: IntGauge,
    rank_blocks: IntGaugeVec,
    recovering_ranks: IntGauge,
    buffered_events: IntGauge,
}

impl EventMetrics {
    /// Creates the metrics through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            lag: r.histogram(
                "kv_router_event_lag_seconds",
                "Intake lag of a KV event batch: from its delivery to the daemon until it \
                 was applied to its shard (includes waiting for the shard's write lock), \
                 in seconds",
                latency_buckets(),
            )?,
            applied: r.counter_vec(
                "kv_router_indexer_events_total",
                "KV events taken by the indexer shards, by event type and outcome",
                &["type", "outcome"],
            )?,
            order: r.counter_vec(
                "kv_router_indexer_event_order_total",
                "Events outside the expected per-rank sequence, by kind (duplicate, \
                 stale_epoch, gap, publisher_restart, buffered, buffer_overflow, lost)",
                &["kind"],
            )?,
            recoveries: r.counter_vec(
                "kv_router_indexer_recoveries_total",
                "Recovery steps of the indexer, by result (requested, range, dump, \
                 ignored, abandoned)",
                &["result"],
            )?,
            blocks: r.counter_vec(
                "kv_router_indexer_block_ops_total",
                "Block-level effects of applied KV events and worker removals, by op \
                 (stored, duplicate, removed, copy_removed, unknown_removed, recovered, \
                 pruned, forgotten, approximate, expired)",
                &["op"],
            )?,
            tree_nodes: r.gauge(
                "kv_router_indexer_nodes",
                "Radix tree nodes (distinct block positions) over all shards",
            )?,
            tree_blocks: r.gauge(
                "kv_router_indexer_blocks",
                "Indexed (worker rank, block) entries over all shards",
            )?,
            tree_ranks: r.gauge(
                "kv_router_indexer_ranks",
                "Worker ranks known to the indexer",
            )?,
            tree_bytes: r.gauge(
                "kv_router_indexer_memory_bytes",
                "Approximate heap footprint of the radix trees, in bytes",
            )?,
            rank_blocks: r.gauge_vec(
                "kv_router_indexer_rank_blocks",
                "Blocks indexed for each worker rank",
                RANK_LABELS,
            )?,
            recovering_ranks: r.gauge(
                "kv_router_indexer_recovering_ranks",
                "Worker ranks with a recovery of missed events pending",
            )?,
            buffered_events: r.gauge(
                "kv_router_indexer_buffered_events",
                "Events held in recovery buffers until their gap is filled",
            )?,
        })
    }

    /// Records the intake lag of one batch.
    pub(crate) fn observe_lag(&self, lag: Duration) {
        self.lag.observe(lag.as_secs_f64());
    }

    /// Raises a sampled monotonic counter to `value` (it never goes down; a scrape
    /// lock serialises the callers, see [`super::Metrics::refresh`]).
    fn raise(counter: &IntCounter, value: u64) {
        let current = counter.get();
        if value > current {
            counter.inc_by(value - current);
        }
    }

    pub(crate) fn sample_counters(&self, c: &indexer::CountersSnapshot) {
        let pairs = [
            (["stored", "applied"], c.stored_events),
            (["removed", "applied"], c.removed_events),
            (["cleared", "applied"], c.cleared_events),
            (
                ["stored", "rejected"],
                c.unknown_parent_rejections
                    + c.forgotten_parent_rejections
                    + c.window_mismatch_rejections,
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
            ("far_ahead", c.far_ahead_events),
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
            ("copy_removed", c.copies_removed),
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

    pub(crate) fn sample_report(&self, r: &indexer::IndexerReport) {
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
    degraded_ranks: IntGauge,
    degraded: IntCounterVec,
    skipped: IntCounterVec,
    refused: IntCounterVec,
}

impl RecoveryMetrics {
    /// Creates the metrics through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            runs: r.counter_vec(
                "kv_router_recovery_runs_total",
                "Recoveries of missed KV events, by kind (e.g. replay, dump) and outcome \
                 (ok, failed)",
                &["kind", "outcome"],
            )?,
            duration: r.histogram(
                "kv_router_recovery_duration_seconds",
                "Time from detecting missed KV events to having applied the recovered \
                 state, in seconds",
                latency_buckets(),
            )?,
            degraded_ranks: r.gauge(
                "kv_router_recovery_degraded_ranks",
                "Worker ranks whose recoveries stopped closing their gap: not asked \
                 again until a cool-down ends or their publisher restarts",
            )?,
            degraded: r.counter_vec(
                "kv_router_recovery_degraded_total",
                "Worker ranks degraded after their recovery budget was spent, by reason \
                 (hole_not_closed, unreachable)",
                &["reason"],
            )?,
            skipped: r.counter_vec(
                "kv_router_recovery_skipped_total",
                "Recovery needs resolved without a request, by reason (degraded: the \
                 rank is degraded; superseded: a newer need of the rank replaced it)",
                &["reason"],
            )?,
            refused: r.counter_vec(
                "kv_router_recovery_replies_refused_total",
                "Recovery replies refused, by reason (too_many_chunks, too_large, \
                 malformed, out_of_order, mismatch)",
                &["reason"],
            )?,
        })
    }
    pub(crate) fn set_degraded_ranks(&self, ranks: usize) {
        self.degraded_ranks.set(to_i64(ranks));
    }

    /// Counts a rank degraded for `reason`.
    pub(crate) fn degrade(&self, reason: &str) {
        self.degraded.with_label_values(&[reason]).inc();
    }

    /// Counts a need resolved without a request for `reason`.
    pub(crate) fn skip(&self, reason: &str) {
        self.skipped.with_label_values(&[reason]).inc();
    }

    /// Counts a reply refused for `reason`.
    pub(crate) fn refuse(&self, reason: &str) {
        self.refused.with_label_values(&[reason]).inc();
    }

    /// Ranks degraded now.
    pub fn degraded_ranks(&self) -> i64 {
        self.degraded_ranks.get()
    }

    /// Replies counted as refused for `reason`.
    pub fn refused(&self, reason: &str) -> u64 {
        self.refused.with_label_values(&[reason]).get()
    }

    /// Needs counted as skipped for `reason`.
    pub fn skipped(&self, reason: &str) -> u64 {
        self.skipped.with_label_values(&[reason]).get()
    }

    /// Records one recovery run of `kind` (lowercase, e.g. `replay`, `dump`) that ended
    /// with `ok` after `elapsed`.
    pub(crate) fn observe(&self, kind: &str, ok: bool, elapsed: Duration) {
        let outcome = if ok { "ok" } else { "failed" };
        self.runs.with_label_values(&[kind, outcome]).inc();
        self.duration.observe(elapsed.as_secs_f64());
    }

    /// Runs counted for (kind, outcome).
    pub fn runs(&self, kind: &str, outcome: &str) -> u64 {
        self.runs.with_label_values(&[kind, outcome]).get()
    }
}
