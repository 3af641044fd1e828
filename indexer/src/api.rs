//! [`IndexerApi`]: the API of a running indexer.
//!
//! The calls, their guarantees and their errors are stated once, here, apart from
//! how [`crate::Indexer`] meets them (a shard's [`crate::OrderedIndex`] behind a lock
//! taken in the caller), and the contract suite (`indexer/tests/contract*.rs`) runs
//! the front through this trait, next to the synchronous layers it is built on.
//!
//! # Guarantees, for every implementation
//! - **Per-worker order**: a worker's batches and remove-worker commands are applied
//!   in the order their calls were made (one worker always maps to one shard, see
//!   [`IndexerApi::shard_of`]).
//! - **Read your writes**: events whose `apply` (or `remove_worker`, ...) call
//!   returned before a [`IndexerApi::find_matches`], [`IndexerApi::dump`],
//!   [`IndexerApi::snapshot`], [`IndexerApi::stats`] or [`IndexerApi::report`] call
//!   was made are reflected in its answer.
//! - **No cross-shard atomicity**: a query reads each shard at a slightly different
//!   moment, so with concurrent writers it may see one worker's newer state next to
//!   another's older one. Scores are advisory routing hints; such torn reads are
//!   accepted.
//! - **Shutdown**: after [`IndexerApi::shutdown`] (or the cancellation of the token
//!   the front was spawned with) every async call fails with
//!   [`IndexerError::ShuttingDown`], and [`IndexerApi::closed`] resolves once the
//!   front's tasks have ended.
//!
//! The async methods return `Send` futures, so a caller may run them in spawned
//! tasks. The trait is not object safe (its futures are `impl Future`); code generic
//! over the front takes `I: IndexerApi`, and the daemon holds [`crate::Indexer`].

use crate::counters::IndexerCounters;
use crate::error::IndexerError;
use crate::recovery::{RecoveryNeed, RecoveryToken};
use crate::scores::OverlapScores;
use crate::stats::{IndexerReport, IndexerStats};
use kv_events::recovery::{IndexSnapshot, RecoveryReply};
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId, WorkerRank};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// A running KV block index: KV events and recovery replies in, per-rank prefix
/// scores, dumps and sizes out. Implemented by [`crate::Indexer`]. Handles are cheap to clone; every clone shares the same
/// shards. See the module docs for the ordering, consistency and shutdown rules.
pub trait IndexerApi: Clone + Send + Sync + 'static {
    /// Number of shards (each owns the workers `w` with `w % num_shards` equal to
    /// its index). At least 1.
    fn num_shards(&self) -> usize;

    /// The shard owning `worker_id`: `worker_id % num_shards`.
    fn shard_of(&self, worker_id: WorkerId) -> usize {
        // The remainder is below `num_shards`, which is a usize, so it fits.
        (worker_id.0 % self.num_shards() as u64) as usize
    }

    /// The stream of recoveries the shards need (gaps, unknown parents, overflows,
    /// resyncs); see [`RecoveryNeed`]. Returns the receiver the first time, `None`
    /// afterwards. Without a taker, ranks with gaps buffer up to their bound and then
    /// keep asking for dumps that never come.
    fn take_recovery_needs(&self) -> Option<mpsc::UnboundedReceiver<RecoveryNeed>>;

    /// Applies a batch of KV events under the ordering rules (duplicates dropped,
    /// gaps buffered and recovered, restarted publishers reset), before returning,
    /// under its worker's shard's write lock. Events
    /// the tree refuses are logged and counted ([`IndexerApi::counters`]), not
    /// returned.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown; the batch is not applied.
    fn apply(&self, batch: KvEventBatch) -> impl Future<Output = Result<(), IndexerError>> + Send;

    /// Drops every rank of `worker_id` (the worker left or its lease expired),
    /// ordered after the worker's earlier batches.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn remove_worker(
        &self,
        worker_id: WorkerId,
    ) -> impl Future<Output = Result<(), IndexerError>> + Send;

    /// Hands back the reply to recovery `token` of `rank` (ordered after the events
    /// already applied or queued for that worker). Further needs it leaves (a hole
    /// after it, a refused parent) arrive on [`IndexerApi::take_recovery_needs`].
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn apply_recovered(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
        reply: RecoveryReply,
    ) -> impl Future<Output = Result<(), IndexerError>> + Send;

    /// Reports that recovery `token` of `rank` was given up (the publisher cannot be
    /// reached): buffered events are applied past their holes, which are counted as
    /// lost. Ignored when `token` is not the rank's pending recovery.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn abandon_recovery(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
    ) -> impl Future<Output = Result<(), IndexerError>> + Send;

    /// Asks for `rank`'s full state (start-up): a dump need is emitted unless one is
    /// pending.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn resync(&self, rank: WorkerRank) -> impl Future<Output = Result<(), IndexerError>> + Send;

    /// Approximate mode: indexes that `rank` was chosen for a prompt of `hashes`,
    /// for `ttl` from now (on the Tokio clock); the entries then expire.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn insert_routed(
        &self,
        rank: WorkerRank,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), IndexerError>> + Send;

    /// Loads a snapshot (normally into an empty indexer), each worker into its
    /// shard.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn restore(
        &self,
        snapshot: IndexSnapshot,
    ) -> impl Future<Output = Result<(), IndexerError>> + Send;

    /// Scores every worker rank by the number of leading blocks of `hashes` it
    /// holds, across all shards (see [`crate::RadixTree::find_matches`]); a rank with
    /// KV cache groups by the engine's hybrid hit.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn find_matches(
        &self,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
    ) -> impl Future<Output = Result<OverlapScores, IndexerError>> + Send;

    /// Events that rebuild the whole index on an empty one: every shard's
    /// [`crate::RadixTree::dump`], one batch per worker, sorted by worker id.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn dump(&self) -> impl Future<Output = Result<Vec<KvEventBatch>, IndexerError>> + Send;

    /// The whole index as data: the dump plus every rank's event cursor (batches
    /// sorted by worker, cursors by rank).
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn snapshot(&self) -> impl Future<Output = Result<IndexSnapshot, IndexerError>> + Send;

    /// Nodes, entries, ranks and approximate bytes, summed over shards.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn stats(&self) -> impl Future<Output = Result<IndexerStats, IndexerError>> + Send;

    /// Sizes, blocks per rank and recovery state, summed over shards.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    fn report(&self) -> impl Future<Output = Result<IndexerReport, IndexerError>> + Send;

    /// Counters of applied, skipped, rejected and recovered events, shared by all
    /// shards.
    fn counters(&self) -> &IndexerCounters;

    /// Stops the indexer: cancels its own child token (the token passed to `spawn`
    /// is not affected). Queued events are dropped.
    fn shutdown(&self);

    /// Resolves once the indexer's tasks have ended (after shutdown).
    fn closed(&self) -> impl Future<Output = ()> + Send;
}

/// The receiving end of an indexer's recovery needs, taken once by its owner.
pub(crate) type NeedsSlot = Arc<Mutex<Option<mpsc::UnboundedReceiver<RecoveryNeed>>>>;

/// Takes the receiver out of `slot`; `None` after the first call.
pub(crate) fn take_needs(slot: &NeedsSlot) -> Option<mpsc::UnboundedReceiver<RecoveryNeed>> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Splits a snapshot by the shard that owns each worker.
pub(crate) fn split_snapshot(
    snapshot: IndexSnapshot,
    num_shards: usize,
    shard_of: impl Fn(WorkerId) -> usize,
) -> Vec<IndexSnapshot> {
    let mut parts = vec![IndexSnapshot::default(); num_shards];
    for batch in snapshot.batches {
        parts[shard_of(batch.worker_id)].batches.push(batch);
    }
    for cursor in snapshot.cursors {
        parts[shard_of(cursor.worker_id)].cursors.push(cursor);
    }
    parts
}

/// Joins per-shard snapshots: batches sorted by worker, cursors by rank.
pub(crate) fn join_snapshots(parts: impl IntoIterator<Item = IndexSnapshot>) -> IndexSnapshot {
    let mut out = IndexSnapshot::default();
    for part in parts {
        out.batches.extend(part.batches);
        out.cursors.extend(part.cursors);
    }
    out.batches.sort_by_key(|b| b.worker_id);
    out.cursors
        .sort_unstable_by_key(|c| (c.worker_id, c.dp_rank));
    out
}
