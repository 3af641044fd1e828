//! One shard: a task that owns a [`RadixTree`] and serves it over three queues.
//!
//! A shard exists so that a tree, which is not thread-safe, can be mutated and read
//! without locks: only its task touches it. Work arrives on three bounded queues and
//! is taken in a fixed priority order by a biased `select!`:
//!
//! 1. shutdown (the indexer's cancellation token) — stop at once;
//! 2. events (KV event batches and remove-worker commands) — apply;
//! 3. snapshots (dumps and stats) — answer over a oneshot;
//! 4. queries (prefix matches) — answer over a oneshot.
//!
//! Checking the event queue before the others on every turn means a snapshot or query
//! is only served once every event enqueued before it has been applied, which is the
//! read-your-writes rule documented on [`crate::ShardedIndexer`]. The price is that a
//! sustained event flood delays queries; the event queue's bound limits how long.

use crate::config::IndexerConfig;
use crate::counters::IndexerCounters;
use crate::scores::OverlapScores;
use crate::stats::IndexerStats;
use crate::tree::RadixTree;
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A message on a shard's event queue.
#[derive(Debug)]
pub(crate) enum ShardEvent {
    /// KV events of one worker, applied in order.
    Batch(KvEventBatch),
    /// Drop every rank of a worker.
    RemoveWorker(WorkerId),
}

/// A message on a shard's snapshot queue.
#[derive(Debug)]
pub(crate) enum SnapshotRequest {
    /// Reply with [`RadixTree::dump`].
    Dump(oneshot::Sender<Vec<KvEventBatch>>),
    /// Reply with [`RadixTree::stats`].
    Stats(oneshot::Sender<IndexerStats>),
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

/// Starts shard `id` on `tracker` and returns its queues. Must run inside a Tokio
/// runtime. Capacities come from a validated `config` (all at least 1).
pub(crate) fn spawn_shard(
    id: usize,
    config: &IndexerConfig,
    shutdown: CancellationToken,
    counters: Arc<IndexerCounters>,
    tracker: &TaskTracker,
) -> ShardHandle {
    let (events_tx, events) = mpsc::channel(config.event_queue_capacity);
    let (snapshots_tx, snapshots) = mpsc::channel(SNAPSHOT_QUEUE_CAPACITY);
    let (queries_tx, queries) = mpsc::channel(config.query_queue_capacity);
    let shard = Shard {
        id,
        tree: RadixTree::new(),
        events,
        snapshots,
        queries,
        shutdown,
        counters,
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
    tree: RadixTree,
    events: mpsc::Receiver<ShardEvent>,
    snapshots: mpsc::Receiver<SnapshotRequest>,
    queries: mpsc::Receiver<Query>,
    shutdown: CancellationToken,
    counters: Arc<IndexerCounters>,
}

impl Shard {
    async fn run(mut self) {
        loop {
            tokio::select! {
                biased;
                () = self.shutdown.cancelled() => break,
                Some(event) = self.events.recv() => self.on_event(event),
                Some(request) = self.snapshots.recv() => self.on_snapshot(request),
                Some(query) = self.queries.recv() => {
                    self.counters.record_query();
                    // The caller may have given up waiting; that is not an error here.
                    let _ = query.reply.send(self.tree.find_matches(&query.hashes));
                }
                else => break, // every handle was dropped
            }
        }
        tracing::debug!(
            shard = self.id,
            nodes = self.tree.num_nodes(),
            "indexer shard stopped"
        );
    }

    fn on_event(&mut self, event: ShardEvent) {
        match event {
            ShardEvent::Batch(batch) => self.apply_batch(&batch),
            ShardEvent::RemoveWorker(worker_id) => {
                let outcome = self.tree.remove_worker(worker_id);
                self.counters.record_worker_removed(&outcome);
                tracing::debug!(%worker_id, blocks = outcome.removed, "worker removed from index");
            }
        }
    }

    fn apply_batch(&mut self, batch: &KvEventBatch) {
        self.counters.record_batch();
        for event in &batch.events {
            match self.tree.apply_event(batch.worker_id, event) {
                Ok(outcome) => self.counters.record_applied(&event.data, &outcome),
                Err(error) => {
                    self.counters.record_rejected(&error);
                    tracing::warn!(
                        worker_id = %batch.worker_id,
                        dp_rank = %event.dp_rank,
                        event_id = event.event_id,
                        reason = error.reason(),
                        %error,
                        "kv event rejected"
                    );
                }
            }
        }
    }

    fn on_snapshot(&self, request: SnapshotRequest) {
        // Replies may find the caller gone; nothing to do then.
        match request {
            SnapshotRequest::Dump(reply) => {
                let _ = reply.send(self.tree.dump());
            }
            SnapshotRequest::Stats(reply) => {
                let _ = reply.send(self.tree.stats());
            }
        }
    }
}
