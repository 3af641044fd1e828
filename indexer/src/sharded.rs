//! [`ShardedIndexer`]: the task-per-shard front of the index.
//!
//! Events are partitioned by worker: worker `w` always goes to shard `w % N`, so one
//! worker's events are applied in order by one task and the N trees hold disjoint
//! workers. Each shard task owns an [`crate::OrderedIndex`] (event cursors, recovery
//! buffers, TTL entries); recovery needs leave on a shared channel
//! ([`ShardedIndexer::take_recovery_needs`]) and replies come back on the worker's
//! event queue, ordered with its live events. A query fans out to all N shards with
//! the block hashes shared in one `Arc<[LocalBlockHash]>`, and the N partial
//! [`OverlapScores`] are merged. Cost per query: N channel round trips (run in
//! parallel across shards) plus one tree walk per shard; per event batch: one channel
//! send. The inline backend ([`crate::InlineIndexer`]) avoids the round trips and is
//! the default; this one is kept for its strict biased-select ordering and measured
//! against it in `docs/benchmarks.md`.

use crate::config::IndexerConfig;
use crate::counters::IndexerCounters;
use crate::error::IndexerError;
use crate::recovery::{RecoveryNeed, RecoveryToken};
use crate::scores::OverlapScores;
use crate::shard::{Query, ShardContext, ShardEvent, ShardHandle, SnapshotRequest, spawn_shard};
use crate::stats::{IndexerReport, IndexerStats};
use kv_events::recovery::{IndexSnapshot, RecoveryReply};
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId, WorkerRank};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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

/// Handle to N shard tasks, each owning a [`crate::RadixTree`] for a fixed subset of
/// workers. Cheap to clone; every clone talks to the same shards.
///
/// # Ordering and consistency
/// - **Per-worker order**: a worker's batches and remove-worker commands go to one
///   shard over one FIFO queue, so they are applied in the order they were sent.
/// - **Read your writes**: each shard serves its queues with a biased select —
///   shutdown, then events, then dumps/stats, then queries. Events whose `apply` (or
///   `remove_worker`) call returned before a [`ShardedIndexer::dump`],
///   [`ShardedIndexer::stats`] or [`ShardedIndexer::find_matches`] call was made are
///   reflected in its answer.
/// - **No cross-shard atomicity**: a query reads each shard at a slightly different
///   moment, so with concurrent writers it may see one worker's newer state next to
///   another's older one. Scores are advisory routing hints; such torn reads are
///   accepted.
///
/// # Shutdown
/// Cancelling the token passed to [`ShardedIndexer::spawn`] (or calling
/// [`ShardedIndexer::shutdown`]) stops every shard at its next turn; queued events
/// are dropped and every call then fails with [`IndexerError::ShuttingDown`].
/// [`ShardedIndexer::closed`] resolves once all shard tasks have ended.
#[derive(Debug, Clone)]
pub struct ShardedIndexer {
    shards: Arc<[ShardHandle]>,
    counters: Arc<IndexerCounters>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    needs: NeedsSlot,
}

impl ShardedIndexer {
    /// Starts `config.num_shards` shard tasks on the current Tokio runtime. They stop
    /// when `shutdown` (or the indexer's own child token) is cancelled, or when every
    /// handle is dropped.
    ///
    /// # Errors
    /// [`IndexerError::InvalidConfig`] when a config field is 0.
    ///
    /// # Panics
    /// When called outside a Tokio runtime (as `tokio::spawn` does).
    pub fn spawn(config: IndexerConfig, shutdown: CancellationToken) -> Result<Self, IndexerError> {
        config.validate()?;
        let (needs_tx, needs_rx) = mpsc::unbounded_channel();
        let context = ShardContext {
            shutdown: shutdown.child_token(),
            counters: Arc::new(IndexerCounters::new()),
            needs: needs_tx,
        };
        let tracker = TaskTracker::new();
        let shards: Arc<[ShardHandle]> = (0..config.num_shards)
            .map(|id| spawn_shard(id, &config, &context, &tracker))
            .collect();
        tracker.close();
        Ok(Self {
            shards,
            counters: context.counters,
            shutdown: context.shutdown,
            tracker,
            needs: Arc::new(Mutex::new(Some(needs_rx))),
        })
    }

    /// The stream of recoveries the shards need (gaps, unknown parents, overflows,
    /// resyncs); see [`RecoveryNeed`]. Returns the receiver the first time, `None`
    /// afterwards. Without a taker, ranks with gaps buffer up to their bound and then
    /// keep asking for dumps that never come.
    pub fn take_recovery_needs(&self) -> Option<mpsc::UnboundedReceiver<RecoveryNeed>> {
        take_needs(&self.needs)
    }

    /// Number of shard tasks.
    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    /// The shard owning `worker_id`: `worker_id % num_shards`.
    pub fn shard_of(&self, worker_id: WorkerId) -> usize {
        // The remainder is below `num_shards`, which is a usize, so it fits.
        (worker_id.0 % self.shards.len() as u64) as usize
    }

    /// Enqueues a batch of KV events on its worker's shard, waiting while that queue
    /// is full (backpressure). Returns once enqueued, not once applied; events the
    /// tree refuses are logged and counted by the shard, not returned here.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown; the batch is not applied.
    pub async fn apply(&self, batch: KvEventBatch) -> Result<(), IndexerError> {
        let shard = self.shard_of(batch.worker_id);
        self.send_event(shard, ShardEvent::Batch(batch)).await
    }

    /// Enqueues the removal of every rank of `worker_id` (the worker left or its
    /// lease expired). Ordered after the worker's earlier batches.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn remove_worker(&self, worker_id: WorkerId) -> Result<(), IndexerError> {
        let shard = self.shard_of(worker_id);
        self.send_event(shard, ShardEvent::RemoveWorker(worker_id))
            .await
    }

    /// Hands the reply to recovery `token` of `rank` to its shard (ordered after the
    /// events already queued for that worker).
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn apply_recovered(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
        reply: RecoveryReply,
    ) -> Result<(), IndexerError> {
        let shard = self.shard_of(rank.worker_id);
        self.send_event(shard, ShardEvent::Recovered { rank, token, reply })
            .await
    }

    /// Tells the shard of `rank` that recovery `token` was given up.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn abandon_recovery(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
    ) -> Result<(), IndexerError> {
        let shard = self.shard_of(rank.worker_id);
        self.send_event(shard, ShardEvent::Abandon { rank, token })
            .await
    }

    /// Asks for `rank`'s full state: a dump need is emitted unless one is pending.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn resync(&self, rank: WorkerRank) -> Result<(), IndexerError> {
        let shard = self.shard_of(rank.worker_id);
        self.send_event(shard, ShardEvent::Resync(rank)).await
    }

    /// Approximate mode: indexes that `rank` was chosen for a prompt of `hashes`,
    /// for `ttl` from now (on the Tokio clock).
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn insert_routed(
        &self,
        rank: WorkerRank,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
        ttl: Duration,
    ) -> Result<(), IndexerError> {
        let expires_at = tokio::time::Instant::now().into_std() + ttl;
        let event = ShardEvent::Routed {
            rank,
            hashes: hashes.into(),
            expires_at,
        };
        self.send_event(self.shard_of(rank.worker_id), event).await
    }

    /// Loads a snapshot (normally into an empty indexer), each worker into its shard.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn restore(&self, snapshot: IndexSnapshot) -> Result<(), IndexerError> {
        let parts = split_snapshot(snapshot, self.shards.len(), |w| self.shard_of(w));
        for (shard, part) in parts.into_iter().enumerate() {
            self.send_event(shard, ShardEvent::Restore(part)).await?;
        }
        Ok(())
    }

    async fn send_event(&self, shard: usize, event: ShardEvent) -> Result<(), IndexerError> {
        if self.shutdown.is_cancelled() {
            return Err(IndexerError::ShuttingDown);
        }
        self.shards[shard]
            .events
            .send(event)
            .await
            .map_err(|_| IndexerError::ShuttingDown)
    }

    /// Scores every worker rank by the number of leading blocks of `hashes` it
    /// holds, across all shards (see [`crate::RadixTree::find_matches`]).
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] when a shard has stopped.
    pub async fn find_matches(
        &self,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
    ) -> Result<OverlapScores, IndexerError> {
        let hashes = hashes.into();
        let replies = self
            .fan_out(|shard| {
                let (reply, rx) = oneshot::channel();
                (
                    &shard.queries,
                    Query {
                        hashes: hashes.clone(),
                        reply,
                    },
                    rx,
                )
            })
            .await?;
        let mut scores = OverlapScores::new();
        for reply in replies {
            scores.merge(reply.await.map_err(|_| IndexerError::ShuttingDown)?);
        }
        Ok(scores)
    }

    /// Events that rebuild the whole index on an empty one: every shard's
    /// [`crate::RadixTree::dump`], concatenated, one batch per worker, sorted by
    /// worker id. Includes every event enqueued before this call.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] when a shard has stopped.
    pub async fn dump(&self) -> Result<Vec<KvEventBatch>, IndexerError> {
        let replies = self.snapshot_request(SnapshotRequest::Dump).await?;
        let mut batches = Vec::new();
        for reply in replies {
            batches.extend(reply.await.map_err(|_| IndexerError::ShuttingDown)?);
        }
        batches.sort_by_key(|batch| batch.worker_id);
        Ok(batches)
    }

    /// The whole index as data (tree dump plus event cursors), including every event
    /// enqueued before this call.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] when a shard has stopped.
    pub async fn snapshot(&self) -> Result<IndexSnapshot, IndexerError> {
        let replies = self.snapshot_request(SnapshotRequest::Snapshot).await?;
        let mut parts = Vec::with_capacity(replies.len());
        for reply in replies {
            parts.push(reply.await.map_err(|_| IndexerError::ShuttingDown)?);
        }
        Ok(join_snapshots(parts))
    }

    /// Sizes, blocks per rank and recovery state, summed over shards.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] when a shard has stopped.
    pub async fn report(&self) -> Result<IndexerReport, IndexerError> {
        let replies = self.snapshot_request(SnapshotRequest::Report).await?;
        let mut total = IndexerReport::default();
        for reply in replies {
            total.merge(reply.await.map_err(|_| IndexerError::ShuttingDown)?);
        }
        Ok(total)
    }

    /// Nodes, entries, ranks and approximate bytes, summed over shards.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] when a shard has stopped.
    pub async fn stats(&self) -> Result<IndexerStats, IndexerError> {
        let replies = self.snapshot_request(SnapshotRequest::Stats).await?;
        let mut total = IndexerStats::default();
        for reply in replies {
            total += reply.await.map_err(|_| IndexerError::ShuttingDown)?;
        }
        Ok(total)
    }

    async fn snapshot_request<T>(
        &self,
        request: fn(oneshot::Sender<T>) -> SnapshotRequest,
    ) -> Result<Vec<oneshot::Receiver<T>>, IndexerError> {
        self.fan_out(|shard| {
            let (reply, rx) = oneshot::channel();
            (&shard.snapshots, request(reply), rx)
        })
        .await
    }

    /// Sends one message per shard, built by `build`, and collects the receivers.
    async fn fan_out<'a, M: 'a, R>(
        &'a self,
        mut build: impl FnMut(&'a ShardHandle) -> (&'a mpsc::Sender<M>, M, R),
    ) -> Result<Vec<R>, IndexerError> {
        if self.shutdown.is_cancelled() {
            return Err(IndexerError::ShuttingDown);
        }
        let mut receivers = Vec::with_capacity(self.shards.len());
        for shard in self.shards.iter() {
            let (queue, message, rx) = build(shard);
            queue
                .send(message)
                .await
                .map_err(|_| IndexerError::ShuttingDown)?;
            receivers.push(rx);
        }
        Ok(receivers)
    }

    /// Counters of applied, skipped and rejected events, shared by all shards.
    pub fn counters(&self) -> &IndexerCounters {
        &self.counters
    }

    /// Messages waiting in the event queues of all shards (a backlog gauge).
    pub fn queued_events(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.events.max_capacity() - s.events.capacity())
            .sum()
    }

    /// Stops every shard (cancels the indexer's child token; the token passed to
    /// `spawn` is not affected).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Resolves once every shard task has ended.
    pub async fn closed(&self) {
        self.tracker.wait().await;
    }
}
