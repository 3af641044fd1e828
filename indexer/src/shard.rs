//! One shard of the [`crate::ShardedIndexer`]: a task that owns an [`OrderedIndex`]
//! and serves it over three queues and a timer.
//!
//! A shard exists so that a tree, which is not thread-safe for writes, can be mutated
//! and read without locks: only its task touches it. Work arrives on three bounded
//! queues and is taken in a fixed priority order by a biased `select!`:
//!
//! 1. shutdown (the indexer's cancellation token) — stop at once;
//! 2. events (KV event batches, recovery replies, resyncs, routing decisions in
//!    approximate mode, remove-worker commands, snapshot restores) — apply;
//! 3. the approximate-mode TTL timer — expire due blocks;
//! 4. snapshots (dumps, stats, reports) — answer over a oneshot;
//! 5. queries (prefix matches) — answer over a oneshot.
//!
//! Checking the event queue before the others on every turn means a snapshot or query
//! is only served once every event enqueued before it has been applied, which is the
//! read-your-writes rule documented on [`crate::ShardedIndexer`]. The price is that a
//! sustained event flood delays queries; the event queue's bound limits how long.
//! Recovery needs found while applying go out on an unbounded channel (at most one
//! pending per rank, so it stays small).

use crate::config::IndexerConfig;
use crate::counters::IndexerCounters;
use crate::ordered::OrderedIndex;
use crate::recovery::{RecoveryNeed, RecoveryToken};
use crate::scores::OverlapScores;
use crate::stats::{IndexerReport, IndexerStats};
use kv_events::recovery::{IndexSnapshot, RecoveryReply};
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId, WorkerRank};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A message on a shard's event queue: anything that changes the index.
#[derive(Debug)]
pub(crate) enum ShardEvent {
    /// KV events of one worker, applied under the ordering rules.
    Batch(KvEventBatch),
    /// Drop every rank of a worker.
    RemoveWorker(WorkerId),
    /// The reply to a recovery need.
    Recovered {
        rank: WorkerRank,
        token: RecoveryToken,
        reply: RecoveryReply,
    },
    /// The owner gave up a recovery.
    Abandon {
        rank: WorkerRank,
        token: RecoveryToken,
    },
    /// Ask for a rank's full state.
    Resync(WorkerRank),
    /// A routing decision to index until `expires_at` (approximate mode).
    Routed {
        rank: WorkerRank,
        hashes: Arc<[LocalBlockHash]>,
        expires_at: Instant,
    },
    /// Load (part of) a snapshot.
    Restore(IndexSnapshot),
}

/// A message on a shard's snapshot queue.
#[derive(Debug)]
pub(crate) enum SnapshotRequest {
    /// Reply with [`OrderedIndex::dump`].
    Dump(oneshot::Sender<Vec<KvEventBatch>>),
    /// Reply with [`OrderedIndex::stats`].
    Stats(oneshot::Sender<IndexerStats>),
    /// Reply with [`OrderedIndex::snapshot`].
    Snapshot(oneshot::Sender<IndexSnapshot>),
    /// Reply with [`OrderedIndex::report`].
    Report(oneshot::Sender<IndexerReport>),
}

/// A prefix-match query; the hashes are shared by every shard of the fan-out.
#[derive(Debug)]
pub(crate) struct Query {
    /// The query's block hashes, in prompt order.
    pub(crate) hashes: Arc<[LocalBlockHash]>,
    /// Where the shard's partial scores go.
    pub(crate) reply: oneshot::Sender<OverlapScores>,
}

/// The sending side of one shard's queues.
#[derive(Debug, Clone)]
pub(crate) struct ShardHandle {
    pub(crate) events: mpsc::Sender<ShardEvent>,
    pub(crate) snapshots: mpsc::Sender<SnapshotRequest>,
    pub(crate) queries: mpsc::Sender<Query>,
}

/// Snapshots are rare (dumps, metric scrapes); a short queue is enough.
const SNAPSHOT_QUEUE_CAPACITY: usize = 16;

/// What every shard of one indexer shares.
pub(crate) struct ShardContext {
    pub(crate) shutdown: CancellationToken,
    pub(crate) counters: Arc<IndexerCounters>,
    pub(crate) needs: mpsc::UnboundedSender<RecoveryNeed>,
}

/// Starts shard `id` on `tracker` and returns its queues. Must run inside a Tokio
/// runtime. Capacities come from a validated `config` (all at least 1).
pub(crate) fn spawn_shard(
    id: usize,
    config: &IndexerConfig,
    context: &ShardContext,
    tracker: &TaskTracker,
) -> ShardHandle {
    let (events_tx, events) = mpsc::channel(config.event_queue_capacity);
    let (snapshots_tx, snapshots) = mpsc::channel(SNAPSHOT_QUEUE_CAPACITY);
    let (queries_tx, queries) = mpsc::channel(config.query_queue_capacity);
    let shard = Shard {
        id,
        index: OrderedIndex::new(config.shard_settings(), context.counters.clone()),
        events,
        snapshots,
        queries,
        shutdown: context.shutdown.clone(),
        needs: context.needs.clone(),
    };
    tracker.spawn(shard.run());
    ShardHandle {
        events: events_tx,
        snapshots: snapshots_tx,
        queries: queries_tx,
    }
}

struct Shard {
    id: usize,
    index: OrderedIndex,
    events: mpsc::Receiver<ShardEvent>,
    snapshots: mpsc::Receiver<SnapshotRequest>,
    queries: mpsc::Receiver<Query>,
    shutdown: CancellationToken,
    needs: mpsc::UnboundedSender<RecoveryNeed>,
}

/// Sleeps until `deadline`, or forever when there is none.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

impl Shard {
    async fn run(mut self) {
        loop {
            let expiry = self.index.next_expiry();
            tokio::select! {
                biased;
                () = self.shutdown.cancelled() => break,
                Some(event) = self.events.recv() => self.on_event(event),
                () = sleep_until(expiry) => {
                    self.index.expire(tokio::time::Instant::now().into_std());
                }
                Some(request) = self.snapshots.recv() => self.on_snapshot(request),
                Some(query) = self.queries.recv() => {
                    // The caller may have given up waiting; that is not an error here.
                    let _ = query.reply.send(self.index.find_matches(&query.hashes));
                }
                else => break, // every handle was dropped
            }
        }
        tracing::debug!(
            shard = self.id,
            nodes = self.index.tree().num_nodes(),
            "indexer shard stopped"
        );
    }

    fn on_event(&mut self, event: ShardEvent) {
        let needs = match event {
            ShardEvent::Batch(batch) => self.index.apply_batch(&batch),
            ShardEvent::RemoveWorker(worker_id) => {
                let outcome = self.index.remove_worker(worker_id);
                tracing::debug!(%worker_id, blocks = outcome.removed, "worker removed from index");
                Vec::new()
            }
            ShardEvent::Recovered { rank, token, reply } => {
                self.index.apply_recovered(rank, token, reply)
            }
            ShardEvent::Abandon { rank, token } => self.index.abandon_recovery(rank, token),
            ShardEvent::Resync(rank) => self.index.resync(rank).into_iter().collect(),
            ShardEvent::Routed {
                rank,
                hashes,
                expires_at,
            } => {
                self.index.insert_routed(rank, &hashes, expires_at);
                Vec::new()
            }
            ShardEvent::Restore(snapshot) => {
                self.index.restore(&snapshot);
                Vec::new()
            }
        };
        for need in needs {
            // Nobody listening (a test without a recovery handler): the rank keeps
            // buffering up to its bound; nothing else to do.
            let _ = self.needs.send(need);
        }
    }

    fn on_snapshot(&self, request: SnapshotRequest) {
        // Replies may find the caller gone; nothing to do then.
        match request {
            SnapshotRequest::Dump(reply) => {
                let _ = reply.send(self.index.dump());
            }
            SnapshotRequest::Stats(reply) => {
                let _ = reply.send(self.index.stats());
            }
            SnapshotRequest::Snapshot(reply) => {
                let _ = reply.send(self.index.snapshot());
            }
            SnapshotRequest::Report(reply) => {
                let _ = reply.send(self.index.report());
            }
        }
    }
}
