//! [`IndexerCounters`]: what the shards applied, skipped and rejected, as atomics.
//!
//! All shards of one [`crate::ShardedIndexer`] share one `Arc<IndexerCounters>` and
//! bump it with relaxed atomic adds (a few nanoseconds per event, no locks), so the
//! daemon can export them to Prometheus at any time without asking the shards.
//! [`IndexerCounters::snapshot`] copies them into a plain struct; the values of one
//! snapshot are each exact but not read at the same instant.

use crate::error::ApplyError;
use crate::tree::ApplyOutcome;
use kv_events::KvCacheEventData;
use std::sync::atomic::{AtomicU64, Ordering};

/// Monotonic counters shared by every shard. All counts are since start.
#[derive(Debug, Default)]
pub struct IndexerCounters {
    batches: AtomicU64,
    stored_events: AtomicU64,
    removed_events: AtomicU64,
    cleared_events: AtomicU64,
    rejected_events: AtomicU64,
    blocks_stored: AtomicU64,
    duplicate_stores: AtomicU64,
    blocks_removed: AtomicU64,
    unknown_removes: AtomicU64,
    unknown_parent_rejections: AtomicU64,
    workers_removed: AtomicU64,
    queries: AtomicU64,
}

/// A copy of [`IndexerCounters`] at one moment; every field counts since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CountersSnapshot {
    /// Event batches taken off the shard queues.
    pub batches: u64,
    /// `Stored` events applied.
    pub stored_events: u64,
    /// `Removed` events applied.
    pub removed_events: u64,
    /// `Cleared` events applied.
    pub cleared_events: u64,
    /// Events refused by the tree (all reasons); see the per-reason fields.
    pub rejected_events: u64,
    /// Blocks newly indexed for a worker rank by `Stored` events.
    pub blocks_stored: u64,
    /// Blocks in `Stored` events that the rank already held (no-ops).
    pub duplicate_stores: u64,
    /// Blocks dropped by `Removed` or `Cleared` events and worker removals.
    pub blocks_removed: u64,
    /// Blocks named by `Removed` events that the rank did not hold (no-ops).
    pub unknown_removes: u64,
    /// `Stored` events refused because the rank does not hold their parent block.
    pub unknown_parent_rejections: u64,
    /// Remove-worker commands applied.
    pub workers_removed: u64,
    /// Prefix-match queries answered (one per shard per query).
    pub queries: u64,
}

fn bump(counter: &AtomicU64, by: u64) {
    if by != 0 {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

impl IndexerCounters {
    /// Fresh counters, all zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Copies every counter.
    pub fn snapshot(&self) -> CountersSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CountersSnapshot {
            batches: get(&self.batches),
            stored_events: get(&self.stored_events),
            removed_events: get(&self.removed_events),
            cleared_events: get(&self.cleared_events),
            rejected_events: get(&self.rejected_events),
            blocks_stored: get(&self.blocks_stored),
            duplicate_stores: get(&self.duplicate_stores),
            blocks_removed: get(&self.blocks_removed),
            unknown_removes: get(&self.unknown_removes),
            unknown_parent_rejections: get(&self.unknown_parent_rejections),
            workers_removed: get(&self.workers_removed),
            queries: get(&self.queries),
        }
    }

    /// Counts one batch taken off a queue.
    pub(crate) fn record_batch(&self) {
        bump(&self.batches, 1);
    }

    /// Counts one applied event of the given kind and its block-level outcome.
    pub(crate) fn record_applied(&self, data: &KvCacheEventData, outcome: &ApplyOutcome) {
        let kind = match data {
            KvCacheEventData::Stored { .. } => &self.stored_events,
            KvCacheEventData::Removed { .. } => &self.removed_events,
            KvCacheEventData::Cleared => &self.cleared_events,
        };
        bump(kind, 1);
        self.record_outcome(outcome);
    }

    /// Counts the block-level outcome of an event or a worker removal.
    pub(crate) fn record_outcome(&self, outcome: &ApplyOutcome) {
        bump(&self.blocks_stored, outcome.stored);
        bump(&self.duplicate_stores, outcome.already_present);
        bump(&self.blocks_removed, outcome.removed);
        bump(&self.unknown_removes, outcome.unknown_removed);
    }

    /// Counts one event the tree refused, under its reason.
    pub(crate) fn record_rejected(&self, error: &ApplyError) {
        bump(&self.rejected_events, 1);
        match error {
            ApplyError::UnknownParent { .. } => bump(&self.unknown_parent_rejections, 1),
        }
    }

    /// Counts one remove-worker command and the blocks it dropped.
    pub(crate) fn record_worker_removed(&self, outcome: &ApplyOutcome) {
        bump(&self.workers_removed, 1);
        self.record_outcome(outcome);
    }

    /// Counts one query answered by one shard.
    pub(crate) fn record_query(&self) {
        bump(&self.queries, 1);
    }
}
