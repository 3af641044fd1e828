//! [`ShardedIndexer`]: the task-per-shard front of the index.
//!
//! Events are partitioned by worker: worker `w` always goes to shard `w % N`, so one
//! worker's events are applied in order by one task and the N trees hold disjoint
//! workers. Each shard task owns an [`crate::OrderedIndex`] (event cursors, recovery
//! buffers, TTL entries); recovery needs leave on a shared channel
//! ([`IndexerApi::take_recovery_needs`]) and replies come back on the worker's
//! event queue, ordered with its live events. A query fans out to all N shards with
//! the block hashes shared in one `Arc<[LocalBlockHash]>`, and the N partial
//! [`OverlapScores`] are merged. Cost per query: N channel round trips (run in
//! parallel across shards) plus one tree walk per shard; per event batch: one channel
//! send. The inline backend ([`crate::InlineIndexer`]) avoids the round trips and is
//! the default; this one is kept for its strict biased-select ordering and measured
//! against it in `docs/benchmarks.md`.

use crate::api::{IndexerApi, NeedsSlot, join_snapshots, split_snapshot, take_needs};
use crate::config::IndexerConfig;
use crate::counters::IndexerCounters;
use crate::error::IndexerError;
use crate::recovery::{RecoveryNeed, RecoveryToken};
use crate::scores::OverlapScores;
use crate::shard::{Query, ShardContext, ShardEvent, ShardHandle, SnapshotRequest, spawn_shard};
use crate::stats::{IndexerReport, IndexerStats};
use kv_events::recovery::{IndexSnapshot, RecoveryReply};
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId, WorkerRank};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Handle to N shard tasks, each owning a [`crate::RadixTree`] for a fixed subset of
/// workers. Cheap to clone; every clone talks to the same shards. Its API is
/// [`IndexerApi`].
///
/// # How the guarantees are met
/// - **Per-worker order**: a worker's batches and remove-worker commands go to one
///   shard over one FIFO queue, so they are applied in the order they were sent.
/// - **Read your writes**: each shard serves its queues with a biased select —
///   shutdown, then events, then dumps/stats, then queries — so events enqueued
///   before a dump, stats or query request are applied before it is answered.
/// - **Backpressure**: [`IndexerApi::apply`] returns once the batch is enqueued, not
///   once it is applied, and waits while the shard's event queue is full.
///
/// # Shutdown
/// Cancelling the token passed to [`ShardedIndexer::spawn`] (or calling
/// [`IndexerApi::shutdown`]) stops every shard at its next turn; queued events are
/// dropped and every call then fails with [`IndexerError::ShuttingDown`].
/// [`IndexerApi::closed`] resolves once all shard tasks have ended.
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

    /// Asks every shard for one kind of snapshot and waits for every answer.
    async fn gather<T>(
        &self,
        request: fn(oneshot::Sender<T>) -> SnapshotRequest,
    ) -> Result<Vec<T>, IndexerError> {
        let replies = self
            .fan_out(|shard| {
                let (reply, rx) = oneshot::channel();
                (&shard.snapshots, request(reply), rx)
            })
            .await?;
        let mut out = Vec::with_capacity(replies.len());
        for reply in replies {
            out.push(reply.await.map_err(|_| IndexerError::ShuttingDown)?);
        }
        Ok(out)
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
}

impl IndexerApi for ShardedIndexer {
    fn num_shards(&self) -> usize {
        self.shards.len()
    }

    fn take_recovery_needs(&self) -> Option<mpsc::UnboundedReceiver<RecoveryNeed>> {
        take_needs(&self.needs)
    }

    async fn apply(&self, batch: KvEventBatch) -> Result<(), IndexerError> {
        let shard = self.shard_of(batch.worker_id);
        self.send_event(shard, ShardEvent::Batch(batch)).await
    }

    async fn remove_worker(&self, worker_id: WorkerId) -> Result<(), IndexerError> {
        let shard = self.shard_of(worker_id);
        self.send_event(shard, ShardEvent::RemoveWorker(worker_id))
            .await
    }

    async fn apply_recovered(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
        reply: RecoveryReply,
    ) -> Result<(), IndexerError> {
        let shard = self.shard_of(rank.worker_id);
        self.send_event(shard, ShardEvent::Recovered { rank, token, reply })
            .await
    }

    async fn abandon_recovery(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
    ) -> Result<(), IndexerError> {
        let shard = self.shard_of(rank.worker_id);
        self.send_event(shard, ShardEvent::Abandon { rank, token })
            .await
    }

    async fn resync(&self, rank: WorkerRank) -> Result<(), IndexerError> {
        let shard = self.shard_of(rank.worker_id);
        self.send_event(shard, ShardEvent::Resync(rank)).await
    }

    fn insert_routed(
        &self,
        rank: WorkerRank,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), IndexerError>> + Send {
        let hashes = hashes.into();
        async move {
            let expires_at = tokio::time::Instant::now().into_std() + ttl;
            let event = ShardEvent::Routed {
                rank,
                hashes,
                expires_at,
            };
            self.send_event(self.shard_of(rank.worker_id), event).await
        }
    }

    async fn restore(&self, snapshot: IndexSnapshot) -> Result<(), IndexerError> {
        let parts = split_snapshot(snapshot, self.shards.len(), |w| self.shard_of(w));
        for (shard, part) in parts.into_iter().enumerate() {
            self.send_event(shard, ShardEvent::Restore(part)).await?;
        }
        Ok(())
    }

    fn find_matches(
        &self,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
    ) -> impl Future<Output = Result<OverlapScores, IndexerError>> + Send {
        let hashes = hashes.into();
        async move {
            let replies = self
                .fan_out(|shard| {
                    let (reply, rx) = oneshot::channel();
                    let query = Query {
                        hashes: hashes.clone(),
                        reply,
                    };
                    (&shard.queries, query, rx)
                })
                .await?;
            let mut scores = OverlapScores::new();
            for reply in replies {
                scores.merge(reply.await.map_err(|_| IndexerError::ShuttingDown)?);
            }
            Ok(scores)
        }
    }

    async fn dump(&self) -> Result<Vec<KvEventBatch>, IndexerError> {
        let mut batches: Vec<KvEventBatch> = self
            .gather(SnapshotRequest::Dump)
            .await?
            .into_iter()
            .flatten()
            .collect();
        batches.sort_by_key(|batch| batch.worker_id);
        Ok(batches)
    }

    async fn snapshot(&self) -> Result<IndexSnapshot, IndexerError> {
        Ok(join_snapshots(
            self.gather(SnapshotRequest::Snapshot).await?,
        ))
    }

    async fn stats(&self) -> Result<IndexerStats, IndexerError> {
        let mut total = IndexerStats::default();
        for part in self.gather(SnapshotRequest::Stats).await? {
            total += part;
        }
        Ok(total)
    }

    async fn report(&self) -> Result<IndexerReport, IndexerError> {
        let mut total = IndexerReport::default();
        for part in self.gather(SnapshotRequest::Report).await? {
            total.merge(part);
        }
        Ok(total)
    }

    fn counters(&self) -> &IndexerCounters {
        &self.counters
    }

    fn queued_events(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.events.max_capacity() - s.events.capacity())
            .sum()
    }

    fn shutdown(&self) {
        self.shutdown.cancel();
    }

    async fn closed(&self) {
        self.tracker.wait().await;
    }
}
