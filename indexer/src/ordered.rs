//! [`OrderedIndex`]: a [`RadixTree`] plus per-(worker, dp_rank) event ordering,
//! gap recovery bookkeeping, approximate (TTL) entries and snapshots.
//!
//! This is the whole state of one shard, as plain synchronous data: the concurrent
//! front ([`crate::Indexer`]) holds one per shard behind a lock, and tests drive it
//! directly without a runtime.
//!
//! # Ordering rules (per worker rank)
//! A cursor holds the publisher epoch the index follows and the next `event_id` it
//! expects. For each incoming event:
//! 1. an older epoch is dropped (counted); a newer epoch means the publisher
//!    restarted: the rank is cleared and the cursor starts again at 0 in that epoch.
//!    A `Cleared` at event 0 from a publisher without epochs (epoch 0) also resets;
//! 2. an `event_id` below the cursor is a duplicate and is dropped (counted);
//! 3. the expected `event_id` is applied and the cursor advances, unless a recovery
//!    is pending, in which case it is buffered;
//! 4. an `event_id` above the cursor is a gap: the event is buffered and a
//!    [`RecoveryNeed`] for the missing range is emitted;
//! 5. an applied `Stored` whose parent the rank does not hold emits a need for a
//!    full dump (the index diverged from the publisher), and later events are
//!    buffered until it arrives.
//!
//! The buffer is bounded (`recovery_buffer_events` per rank): on overflow it is
//! dropped and a dump is requested instead. When the reply comes back
//! (`apply_recovered`), its events (or dump) are applied, then the buffer from the new
//! cursor on; a remaining hole starts another recovery. When the owner gives up
//! (`abandon_recovery`), buffered events are applied past the holes, which are
//! counted as lost. The reply logic lives in `ordered/replies.rs`, the approximate
//! (TTL) entries in `ordered/approximate.rs`.

mod approximate;
mod replies;
mod steps;

pub use steps::BatchSteps;

use crate::approx::ExpiryQueue;
pub use crate::config::ShardSettings;
use crate::counters::{Counter, IndexerCounters};
use crate::error::ApplyError;
use crate::recovery::{RecoveryNeed, RecoveryReason, RecoveryToken};
use crate::scores::OverlapScores;
use crate::stats::{IndexerReport, IndexerStats};
use crate::tree::{ApplyOutcome, Interrupt, RadixTree};
use kv_events::recovery::{IndexSnapshot, RankCursor, RecoveryRequest};
use kv_events::{
    DpRank, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash, WorkerId, WorkerRank,
};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::Arc;
use tracing::{info, warn};

/// The ordering state of one worker rank.
#[derive(Debug)]
pub(crate) struct Cursor {
    epoch: u64,
    next: u64,
    pending: Option<RecoveryToken>,
    /// Whether the pending recovery (if any) is a dump.
    pending_dump: bool,
    buffer: BTreeMap<u64, KvCacheEvent>,
}

impl Cursor {
    fn new(epoch: u64) -> Self {
        Self {
            epoch,
            next: 0,
            pending: None,
            pending_dump: false,
            buffer: BTreeMap::new(),
        }
    }
}

/// A radix tree with event ordering, recovery bookkeeping and TTL entries. See the
/// module docs.
#[derive(Debug)]
pub struct OrderedIndex {
    tree: RadixTree,
    cursors: FxHashMap<WorkerRank, Cursor>,
    expiry: ExpiryQueue,
    settings: ShardSettings,
    counters: Arc<IndexerCounters>,
    next_token: u64,
}

impl OrderedIndex {
    /// An empty index that bumps `counters`.
    pub fn new(settings: ShardSettings, counters: Arc<IndexerCounters>) -> Self {
        Self {
            tree: RadixTree::with_pruning(settings.pruning),
            cursors: FxHashMap::default(),
            expiry: ExpiryQueue::default(),
            settings: ShardSettings {
                recovery_buffer_events: settings.recovery_buffer_events.max(1),
                ..settings
            },
            counters,
            next_token: 0,
        }
    }

    /// The underlying tree.
    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    /// The counters this index bumps.
    pub fn counters(&self) -> &Arc<IndexerCounters> {
        &self.counters
    }

    /// Applies a batch under the ordering rules; returns the recoveries to perform.
    /// The same as [`OrderedIndex::apply_batch_step`] never interrupted.
    pub fn apply_batch(&mut self, batch: &KvEventBatch) -> Vec<RecoveryNeed> {
        let mut steps = BatchSteps::default();
        while !self.apply_batch_step(batch, &mut steps, Interrupt::NEVER) {}
        steps.into_needs()
    }

    /// Runs the ordering rules for `event`: true when it is due now (the cursor has
    /// moved past it and the caller must apply it, whole or in parts, then
    /// [`OrderedIndex::settle`] it); false when it was dropped or buffered.
    fn decide(
        &mut self,
        worker_id: WorkerId,
        epoch: u64,
        event: &KvCacheEvent,
        needs: &mut Vec<RecoveryNeed>,
    ) -> bool {
        let rank = WorkerRank::new(worker_id, event.dp_rank);
        let limit = self.settings.recovery_buffer_events;
        let cursor = self
            .cursors
            .entry(rank)
            .or_insert_with(|| Cursor::new(epoch));
        if epoch < cursor.epoch {
            self.counters.add(Counter::StaleEpochEvents, 1);
            return false;
        }
        if cursor.epoch == 0 && cursor.next == 0 {
            // A cursor that has applied nothing yet (e.g. created by a resync) adopts
            // the publisher's epoch, keeping its pending recovery and buffer.
            cursor.epoch = epoch;
        }
        let legacy_restart = epoch == 0
            && event.event_id == 0
            && cursor.next > 0
            && matches!(event.data, KvCacheEventData::Cleared);
        if epoch > cursor.epoch || legacy_restart {
            let seen = cursor.next > 0 || cursor.epoch > 0;
            let old_epoch = cursor.epoch;
            *cursor = Cursor::new(epoch);
            self.tree.clear_rank(rank);
            if seen {
                self.counters.add(Counter::PublisherRestarts, 1);
                info!(%worker_id, dp_rank = %rank.dp_rank, old_epoch, epoch, "kv event publisher restarted; rank reset");
            }
        }
        let Some(cursor) = self.cursors.get_mut(&rank) else {
            return false; // unreachable: inserted above
        };
        if event.event_id < cursor.next {
            self.counters.add(Counter::DuplicateEvents, 1);
            return false;
        }
        let horizon = cursor.next.saturating_add(limit as u64);
        if event.event_id > horizon {
            // Beyond what the buffer can hold, so beyond any range worth asking for;
            // and a forged id (u64::MAX) kept in the buffer would leave the same hole
            // after every reply, asked for again at once, forever. The event is
            // dropped, and so is the buffer: a dump covers both if they were real.
            // While a dump is pending it covers this event too (it is taken later).
            self.counters.add(Counter::FarAheadEvents, 1);
            cursor.buffer.clear();
            if cursor.pending.is_some() && cursor.pending_dump {
                return false;
            }
            let reason = RecoveryReason::FarAhead {
                expected: cursor.next,
                received: event.event_id,
            };
            warn!(%worker_id, dp_rank = %rank.dp_rank, expected = cursor.next, received = event.event_id, limit, "kv event id beyond the recovery buffer dropped; requesting a dump");
            needs.push(self.start_recovery(rank, reason, true));
            return false;
        }
        if cursor.pending.is_some() || event.event_id > cursor.next {
            let gap = (cursor.pending.is_none()).then_some(RecoveryReason::Gap {
                expected: cursor.next,
                received: event.event_id,
            });
            cursor
                .buffer
                .entry(event.event_id)
                .or_insert_with(|| event.clone());
            self.counters.add(Counter::BufferedEvents, 1);
            let overflow = cursor.buffer.len() > limit;
            if overflow {
                cursor.buffer.clear();
                self.counters.add(Counter::BufferOverflows, 1);
                warn!(%worker_id, dp_rank = %rank.dp_rank, limit, "recovery buffer overflowed; requesting a dump");
                needs.push(self.start_recovery(rank, RecoveryReason::BufferOverflow, true));
            } else if let Some(reason) = gap {
                self.counters.add(Counter::Gaps, 1);
                needs.push(self.start_recovery(rank, reason, false));
            }
            return false;
        }
        cursor.next = cursor.next.saturating_add(1);
        true
    }

    /// Counts and logs the result of applying a due `event`; a store refused for an
    /// unknown parent pushes a dump need for its rank to `needs`.
    fn settle(
        &mut self,
        worker_id: WorkerId,
        event: &KvCacheEvent,
        result: Result<ApplyOutcome, ApplyError>,
        needs: &mut Vec<RecoveryNeed>,
    ) {
        if self.count(worker_id, event, result).is_err() {
            let rank = WorkerRank::new(worker_id, event.dp_rank);
            needs.push(self.start_recovery(rank, RecoveryReason::UnknownParent, true));
        }
    }

    /// Applies one event to the tree, counting and logging the outcome. `Err` when it
    /// was refused for an unknown parent (which calls for recovery); a pruned parent
    /// or a group's changed window is not lost state, and a dump would not help.
    fn apply_one(&mut self, worker_id: WorkerId, event: &KvCacheEvent) -> Result<(), ()> {
        let result = self.tree.apply_event(worker_id, event);
        self.count(worker_id, event, result)
    }

    /// Counts and logs `result`, the outcome of applying `event`; `Err` as
    /// [`OrderedIndex::apply_one`]'s.
    fn count(
        &self,
        worker_id: WorkerId,
        event: &KvCacheEvent,
        result: Result<ApplyOutcome, ApplyError>,
    ) -> Result<(), ()> {
        match result {
            Ok(outcome) => {
                self.counters.record_applied(&event.data, &outcome);
                Ok(())
            }
            Err(error) => {
                self.counters.record_rejected(&error);
                warn!(
                    %worker_id,
                    dp_rank = %event.dp_rank,
                    event_id = event.event_id,
                    reason = error.reason(),
                    %error,
                    "kv event rejected"
                );
                match error {
                    ApplyError::UnknownParent { .. } => Err(()),
                    ApplyError::ForgottenParent { .. } | ApplyError::WindowMismatch { .. } => {
                        Ok(())
                    }
                }
            }
        }
    }

    /// Marks `rank` as recovering under a fresh token and builds the need.
    fn start_recovery(
        &mut self,
        rank: WorkerRank,
        reason: RecoveryReason,
        dump: bool,
    ) -> RecoveryNeed {
        self.next_token += 1;
        let token = RecoveryToken(self.next_token);
        let cursor = self.cursors.entry(rank).or_insert_with(|| Cursor::new(0));
        cursor.pending = Some(token);
        cursor.pending_dump = dump;
        let request = RecoveryRequest {
            dp_rank: rank.dp_rank,
            epoch: cursor.epoch,
            start_event_id: cursor.next,
            dump,
        };
        self.counters.add(Counter::RecoveryRequests, 1);
        info!(
            worker_id = %rank.worker_id,
            dp_rank = %rank.dp_rank,
            reason = reason.label(),
            start_event_id = request.start_event_id,
            epoch = request.epoch,
            dump,
            buffered = cursor.buffer.len(),
            "kv event recovery needed"
        );
        RecoveryNeed {
            rank,
            token,
            request,
            reason,
        }
    }

    /// Asks for `rank`'s full state (used at start-up): a dump need, unless a
    /// recovery of that rank is already pending. Live events arriving meanwhile are
    /// buffered and applied after the dump's position, so nothing is lost or applied
    /// twice.
    pub fn resync(&mut self, rank: WorkerRank) -> Option<RecoveryNeed> {
        let cursor = self.cursors.entry(rank).or_insert_with(|| Cursor::new(0));
        if cursor.pending.is_some() {
            return None;
        }
        Some(self.start_recovery(rank, RecoveryReason::Resync, true))
    }

    /// Drops every rank of `worker_id`: its blocks, cursors, buffers and TTL entries.
    /// Pending recoveries of the worker become stale.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> ApplyOutcome {
        self.cursors.retain(|rank, _| rank.worker_id != worker_id);
        self.expiry.remove_worker(worker_id);
        let outcome = self.tree.remove_worker(worker_id);
        self.counters.record_worker_removed(&outcome);
        outcome
    }

    /// See [`RadixTree::find_matches`].
    pub fn find_matches(&self, hashes: &[LocalBlockHash]) -> OverlapScores {
        self.counters.record_query();
        self.tree.find_matches(hashes)
    }

    /// One query's pairs, appended: GPU overlaps to `gpu` ([`RadixTree::collect_matches`])
    /// and any-tier overlaps to `any_tier` ([`RadixTree::collect_any_tier_matches`]),
    /// counted as one query.
    pub fn collect_matches(
        &self,
        hashes: &[LocalBlockHash],
        gpu: &mut Vec<(WorkerRank, u32)>,
        any_tier: &mut Vec<(WorkerRank, u32)>,
    ) {
        self.counters.record_query();
        self.tree.collect_matches(hashes, gpu);
        self.tree.collect_any_tier_matches(hashes, any_tier);
    }

    /// See [`RadixTree::dump`].
    pub fn dump(&self) -> Vec<KvEventBatch> {
        self.tree.dump()
    }

    /// The tree's dump plus every rank's cursor.
    pub fn snapshot(&self) -> IndexSnapshot {
        let mut cursors: Vec<RankCursor> = self
            .cursors
            .iter()
            .map(|(rank, c)| RankCursor {
                worker_id: rank.worker_id,
                dp_rank: rank.dp_rank,
                epoch: c.epoch,
                next_event_id: c.next,
            })
            .collect();
        cursors.sort_unstable_by_key(|c| (c.worker_id, c.dp_rank));
        IndexSnapshot {
            batches: self.tree.dump(),
            cursors,
        }
    }

    /// Loads a snapshot into this index (normally empty): its events are applied
    /// without ordering checks and its cursors replace the current ones of those
    /// ranks. Returns the applied outcome.
    pub fn restore(&mut self, snapshot: &IndexSnapshot) -> ApplyOutcome {
        let mut total = ApplyOutcome::default();
        for batch in &snapshot.batches {
            for event in &batch.events {
                match self.tree.apply_event(batch.worker_id, event) {
                    Ok(outcome) => total += outcome,
                    Err(error) => self.counters.record_rejected(&error),
                }
            }
        }
        for c in &snapshot.cursors {
            let cursor = Cursor {
                next: c.next_event_id,
                ..Cursor::new(c.epoch)
            };
            self.cursors
                .insert(WorkerRank::new(c.worker_id, c.dp_rank), cursor);
        }
        self.counters.record_outcome(&total);
        total
    }

    /// The cursor of `rank`: its epoch and next expected `event_id`.
    pub fn cursor(&self, rank: WorkerRank) -> Option<RankCursor> {
        self.cursors.get(&rank).map(|c| RankCursor {
            worker_id: rank.worker_id,
            dp_rank: rank.dp_rank,
            epoch: c.epoch,
            next_event_id: c.next,
        })
    }

    /// Ranks with a recovery pending, and events buffered over all ranks.
    pub fn recovering(&self) -> (usize, usize) {
        self.cursors.values().fold((0, 0), |(ranks, events), c| {
            (
                ranks + usize::from(c.pending.is_some()),
                events + c.buffer.len(),
            )
        })
    }

    /// Sizes of the tree.
    pub fn stats(&self) -> IndexerStats {
        self.tree.stats()
    }

    /// Blocks held per worker rank, sorted by rank.
    pub fn blocks_per_rank(&self) -> Vec<(WorkerRank, usize)> {
        self.tree.blocks_per_rank()
    }

    /// Approximate blocks whose TTL is tracked.
    pub fn approximate_blocks(&self) -> usize {
        self.expiry.len()
    }

    /// Sizes, blocks per rank and recovery state of this index.
    pub fn report(&self) -> IndexerReport {
        let (recovering_ranks, buffered_events) = self.recovering();
        IndexerReport {
            stats: self.stats(),
            blocks_per_rank: self.blocks_per_rank(),
            recovering_ranks,
            buffered_events,
            approximate_blocks: self.approximate_blocks(),
        }
    }

    /// The dp ranks of `worker_id` this index has a cursor for.
    pub fn ranks_of(&self, worker_id: WorkerId) -> Vec<DpRank> {
        let mut ranks: Vec<DpRank> = self
            .cursors
            .keys()
            .filter(|r| r.worker_id == worker_id)
            .map(|r| r.dp_rank)
            .collect();
        ranks.sort_unstable();
        ranks
    }
}

#[cfg(test)]
mod tests;
