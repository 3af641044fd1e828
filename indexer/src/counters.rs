//! [`IndexerCounters`]: what the shards applied, skipped, rejected, recovered and
//! pruned, as atomics.
//!
//! All shards of one indexer share one `Arc<IndexerCounters>` and bump it with
//! relaxed atomic adds (a few nanoseconds per event, no locks), so the daemon can
//! export them to Prometheus at any time without asking the shards.
//! [`IndexerCounters::snapshot`] copies them into a plain struct; the values of one
//! snapshot are each exact but not read at the same instant.

use crate::error::ApplyError;
use crate::tree::ApplyOutcome;
use kv_events::KvCacheEventData;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// Monotonic counters shared by every shard. All counts are since start.
        #[derive(Debug, Default)]
        pub struct IndexerCounters {
            $($name: AtomicU64,)*
        }

        /// A copy of [`IndexerCounters`] at one moment; every field counts since start
        /// unless it says it is a gauge.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct CountersSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl IndexerCounters {
            /// Copies every counter.
            pub fn snapshot(&self) -> CountersSnapshot {
                CountersSnapshot {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}

counters! {
    /// Event batches taken off the shard queues.
    batches,
    /// `Stored` events applied.
    stored_events,
    /// `Removed` events applied.
    removed_events,
    /// `Cleared` events applied.
    cleared_events,
    /// Events refused by the tree (all reasons); see the per-reason fields.
    rejected_events,
    /// Blocks newly indexed for a worker rank by `Stored` events.
    blocks_stored,
    /// Blocks in `Stored` events that the holder (rank, tier, KV cache group) already
    /// held: each added a copy, a second physical block under the same engine hash.
    duplicate_stores,
    /// Blocks dropped by `Removed` or `Cleared` events and worker removals.
    blocks_removed,
    /// Copies dropped by `Removed` events while their block stayed held (it leaves
    /// with its last copy), and copies dropped with their block by `Cleared` events
    /// and worker removals.
    copies_removed,
    /// Blocks named by `Removed` events that the rank did not hold (no-ops).
    unknown_removes,
    /// `Stored` events refused because the rank does not hold their parent block.
    unknown_parent_rejections,
    /// `Stored` events refused because the index pruned their parent block.
    forgotten_parent_rejections,
    /// `Stored` events refused because their KV cache group is known with another
    /// window.
    window_mismatch_rejections,
    /// Remove-worker commands applied.
    workers_removed,
    /// Prefix-match queries answered (one per shard per query).
    queries,
    /// Events dropped because their `event_id` was already applied (duplicates).
    duplicate_events,
    /// Events dropped because they carry an older publisher epoch than the rank's.
    stale_epoch_events,
    /// Ranks reset because their publisher restarted (a newer epoch, or a `Cleared`
    /// at event 0 from a publisher without epochs).
    publisher_restarts,
    /// Gaps in a rank's `event_id`s that started a recovery.
    gaps,
    /// Recovery requests issued (gaps, unknown parents, overflows, resyncs, retries).
    recovery_requests,
    /// Recovery replies applied as a range of events.
    recovered_ranges,
    /// Recovery replies applied as a full dump of the rank.
    recovered_dumps,
    /// Events applied from recovery ranges.
    recovered_events,
    /// Blocks applied from recovery dumps.
    recovered_blocks,
    /// Recovery replies ignored (superseded, for an unknown rank, or older than the
    /// index's state).
    recovery_replies_ignored,
    /// Recoveries given up (publisher unreachable); buffered events were applied
    /// past the gap.
    recoveries_abandoned,
    /// Events known lost: skipped over when a recovery was given up.
    events_lost,
    /// Events put in a recovery buffer.
    buffered_events,
    /// Recovery buffers that overflowed and were replaced by a dump request.
    buffer_overflows,
    /// Events whose id was further ahead of the rank's cursor than its recovery
    /// buffer holds: dropped, and a dump requested instead of the range.
    far_ahead_events,
    /// (rank, block) entries pruned to stay under the memory bound.
    pruned_entries,
    /// Blocks named by events after this index had pruned them.
    forgotten_blocks,
    /// Blocks inserted by the router's own routing decisions (approximate mode).
    approximate_blocks,
    /// Approximate blocks dropped when their TTL expired.
    expired_blocks,
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
        bump(&self.duplicate_stores, outcome.copies_added);
        bump(&self.blocks_removed, outcome.removed);
        bump(&self.copies_removed, outcome.copies_removed);
        bump(&self.unknown_removes, outcome.unknown_removed);
        bump(&self.forgotten_blocks, outcome.forgotten);
        bump(&self.pruned_entries, outcome.pruned);
    }

    /// Counts one event the tree refused, under its reason.
    pub(crate) fn record_rejected(&self, error: &ApplyError) {
        bump(&self.rejected_events, 1);
        match error {
            ApplyError::UnknownParent { .. } => bump(&self.unknown_parent_rejections, 1),
            ApplyError::ForgottenParent { .. } => bump(&self.forgotten_parent_rejections, 1),
            ApplyError::WindowMismatch { .. } => bump(&self.window_mismatch_rejections, 1),
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

    /// Adds `by` to one of the ordering and recovery counters.
    pub(crate) fn add(&self, counter: Counter, by: u64) {
        let target = match counter {
            Counter::DuplicateEvents => &self.duplicate_events,
            Counter::StaleEpochEvents => &self.stale_epoch_events,
            Counter::PublisherRestarts => &self.publisher_restarts,
            Counter::Gaps => &self.gaps,
            Counter::RecoveryRequests => &self.recovery_requests,
            Counter::RecoveredRanges => &self.recovered_ranges,
            Counter::RecoveredDumps => &self.recovered_dumps,
            Counter::RecoveredEvents => &self.recovered_events,
            Counter::RecoveredBlocks => &self.recovered_blocks,
            Counter::RecoveryRepliesIgnored => &self.recovery_replies_ignored,
            Counter::RecoveriesAbandoned => &self.recoveries_abandoned,
            Counter::EventsLost => &self.events_lost,
            Counter::BufferedEvents => &self.buffered_events,
            Counter::BufferOverflows => &self.buffer_overflows,
            Counter::FarAheadEvents => &self.far_ahead_events,
            Counter::ApproximateBlocks => &self.approximate_blocks,
            Counter::ExpiredBlocks => &self.expired_blocks,
        };
        bump(target, by);
    }
}

/// The ordering, recovery and approximate-mode counters, for [`IndexerCounters::add`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    DuplicateEvents,
    StaleEpochEvents,
    PublisherRestarts,
    Gaps,
    RecoveryRequests,
    RecoveredRanges,
    RecoveredDumps,
    RecoveredEvents,
    RecoveredBlocks,
    RecoveryRepliesIgnored,
    RecoveriesAbandoned,
    EventsLost,
    BufferedEvents,
    BufferOverflows,
    FarAheadEvents,
    ApproximateBlocks,
    ExpiredBlocks,
}
