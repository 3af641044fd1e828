//! [`Indexer`]: shards behind read-write locks, read inline by the query path.
//!
//! Each shard is an [`OrderedIndex`] behind a `std::sync::RwLock`. A writer (the event intake, a
//! recovery reply) takes the write lock of its worker's shard in its own task; a
//! query takes each shard's read lock in turn, in the caller, with no channel hop and
//! no task switch. Many queries read a shard at once; a write waits for them and
//! briefly blocks them. Per-worker order holds because one worker's events come from
//! one intake task and go to one shard; read-your-writes holds trivially (an `apply`
//! that returned has been applied).
//!
//! Queries do not wait behind a whole batch. A writer applies a batch under the
//! shard's write lock but asks, every [`STEP_BLOCKS`] blocks and between events,
//! whether a query is waiting (a query that finds the shard held counts itself in
//! the shard's `waiting`); if one is, it stops at that block boundary
//! (`ordered/steps.rs`, a long event in parts: a store's rest hangs below its last
//! applied block), unlocks, lets the waiting queries take their read locks, and
//! goes on. std's lock has no hand-over (a writer that unlocks and locks at once gets
//! the lock back before the woken readers run), so the writer waits for `waiting`
//! to drop; both sides spin briefly rather than sleep, since a step and a query
//! last less than a sleep and a wake-up. The writer holds the lock at least 5 µs
//! before it stops, so queries asked back to back cannot starve it. So a query waits for a few blocks (about
//! 1 µs), never for a 4,096-block event (~0.5 ms at 1M entries), and nothing is
//! paid while no query waits. Each writer of a shard holds the shard's writer mutex
//! for its whole operation, so no other write and no dump or snapshot comes between
//! two steps of a batch.
//!
//! Costs: a query is N lock acquisitions plus N tree walks on the calling thread,
//! which append (rank, score) pairs to one vector, then one score map built at its
//! final size (a map per shard and a merge cost as much as the walks). A query
//! first reads the shards no writer holds (`try_read`), then waits for the others,
//! so under an event flood it overlaps its walks with the writer's batch. A batch
//! costs one uncontended mutex more than applied whole, plus, per hand-over, one
//! lock round and the resumed event's setup (a removal stopped inside a run splits
//! it); a pruning pass, a `Cleared`, a worker removal or a recovery reply (a large
//! dump: up to ~100 ms at 10 M entries) is still applied whole. A background task expires
//! approximate-mode entries. An earlier design
//! with one task per shard behind channels (queries fanning out to the tasks) was
//! slower in every measurement (`docs/benchmarks.md`) and was retired; git keeps it.
//!
//! The handle also carries the [`IndexMode`]: in approximate mode
//! [`Indexer::record_routing`] indexes routing decisions, otherwise it does nothing.

use crate::api::{IndexerApi, NeedsSlot, join_snapshots, split_snapshot, take_needs};
use crate::config::{IndexMode, IndexerConfig};
use crate::counters::IndexerCounters;
use crate::error::IndexerError;
use crate::ordered::OrderedIndex;
use crate::recovery::{RecoveryNeed, RecoveryToken};
use crate::scores::OverlapScores;
use crate::stats::{IndexerReport, IndexerStats};
use kv_events::recovery::{IndexSnapshot, RecoveryReply};
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId, WorkerRank};
use shard::{Shard, ShardWrite};
use std::future::Future;
use std::sync::{Arc, Mutex, RwLockReadGuard};
use std::time::Duration;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod shard;

pub use shard::STEP_BLOCKS;

/// Handle to N lock-protected shards; cheap to clone, every clone shares them.
///
/// Its API and guarantees are [`IndexerApi`]'s (per-worker order, read-your-writes, per-shard consistent queries,
/// [`IndexerError::ShuttingDown`] after shutdown); see the module docs for how they
/// are met. Every write is applied in the caller, under its shard's write lock,
/// before the call returns.
#[derive(Debug, Clone)]
pub struct Indexer {
    inner: Arc<Inner>,
    mode: IndexMode,
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Shard]>,
    counters: Arc<IndexerCounters>,
    needs_tx: mpsc::UnboundedSender<RecoveryNeed>,
    needs: NeedsSlot,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    expiry_changed: Arc<Notify>,
}

impl Drop for Inner {
    /// The last handle is gone: stop the expiry task.
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Inner {
    fn read(&self, shard: usize) -> RwLockReadGuard<'_, OrderedIndex> {
        self.shards[shard].read()
    }

    fn write(&self, shard: usize) -> ShardWrite<'_> {
        self.shards[shard].write()
    }

    fn send_needs(&self, needs: Vec<RecoveryNeed>) {
        for need in needs {
            // Nobody listening: the rank keeps buffering up to its bound.
            let _ = self.needs_tx.send(need);
        }
    }
}

impl Indexer {
    /// Builds `config.num_shards` shards and starts the TTL expiry task on the current
    /// Tokio runtime. It stops when `shutdown` (or the indexer's child token) is
    /// cancelled.
    ///
    /// # Errors
    /// [`IndexerError::InvalidConfig`] when a config field is out of range.
    ///
    /// # Panics
    /// When called outside a Tokio runtime (as `tokio::spawn` does).
    pub fn spawn(config: IndexerConfig, shutdown: CancellationToken) -> Result<Self, IndexerError> {
        config.validate()?;
        let mode = config.mode;
        let counters = Arc::new(IndexerCounters::new());
        let settings = config.shard_settings();
        let (needs_tx, needs_rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            shards: (0..config.num_shards)
                .map(|_| Shard::new(OrderedIndex::new(settings, counters.clone())))
                .collect(),
            counters,
            needs_tx,
            needs: Arc::new(Mutex::new(Some(needs_rx))),
            shutdown: shutdown.child_token(),
            tracker: TaskTracker::new(),
            expiry_changed: Arc::new(Notify::new()),
        });
        inner.tracker.spawn(expire_loop(
            Arc::downgrade(&inner),
            inner.expiry_changed.clone(),
            inner.shutdown.clone(),
        ));
        inner.tracker.close();
        Ok(Self { inner, mode })
    }

    /// KV events or approximate.
    pub fn mode(&self) -> IndexMode {
        self.mode
    }

    /// True in approximate mode: the caller should report routing decisions.
    pub fn is_approximate(&self) -> bool {
        matches!(self.mode, IndexMode::Approximate { .. })
    }

    /// Reports that `rank` was chosen for a prompt of `hashes`: in approximate mode
    /// the blocks are indexed for the configured TTL; in KV events mode nothing
    /// happens (the engine's own events will tell).
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn record_routing(
        &self,
        rank: WorkerRank,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
    ) -> Result<(), IndexerError> {
        match self.mode {
            IndexMode::KvEvents => Ok(()),
            IndexMode::Approximate { ttl } => self.insert_routed(rank, hashes, ttl).await,
        }
    }

    fn running(&self) -> Result<(), IndexerError> {
        if self.inner.shutdown.is_cancelled() {
            Err(IndexerError::ShuttingDown)
        } else {
            Ok(())
        }
    }
}

impl IndexerApi for Indexer {
    fn num_shards(&self) -> usize {
        self.inner.shards.len()
    }

    fn take_recovery_needs(&self) -> Option<mpsc::UnboundedReceiver<RecoveryNeed>> {
        take_needs(&self.inner.needs)
    }

    async fn apply(&self, batch: KvEventBatch) -> Result<(), IndexerError> {
        self.running()?;
        let shard = self.shard_of(batch.worker_id);
        let needs = self.inner.shards[shard].apply_in_steps(&batch);
        self.inner.send_needs(needs);
        Ok(())
    }

    async fn remove_worker(&self, worker_id: WorkerId) -> Result<(), IndexerError> {
        self.running()?;
        let shard = self.shard_of(worker_id);
        let outcome = self.inner.write(shard).remove_worker(worker_id);
        tracing::debug!(%worker_id, blocks = outcome.removed, "worker removed from index");
        Ok(())
    }

    async fn apply_recovered(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
        reply: RecoveryReply,
    ) -> Result<(), IndexerError> {
        self.running()?;
        let shard = self.shard_of(rank.worker_id);
        let needs = self.inner.write(shard).apply_recovered(rank, token, reply);
        self.inner.send_needs(needs);
        Ok(())
    }

    async fn abandon_recovery(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
    ) -> Result<(), IndexerError> {
        self.running()?;
        let shard = self.shard_of(rank.worker_id);
        let needs = self.inner.write(shard).abandon_recovery(rank, token);
        self.inner.send_needs(needs);
        Ok(())
    }

    async fn resync(&self, rank: WorkerRank) -> Result<(), IndexerError> {
        self.running()?;
        let shard = self.shard_of(rank.worker_id);
        let need = self.inner.write(shard).resync(rank);
        self.inner.send_needs(need.into_iter().collect());
        Ok(())
    }

    fn insert_routed(
        &self,
        rank: WorkerRank,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), IndexerError>> + Send {
        let hashes = hashes.into();
        async move {
            self.running()?;
            let expires_at = tokio::time::Instant::now().into_std() + ttl;
            let shard = self.shard_of(rank.worker_id);
            self.inner
                .write(shard)
                .insert_routed(rank, &hashes, expires_at);
            self.inner.expiry_changed.notify_one();
            Ok(())
        }
    }

    async fn restore(&self, snapshot: IndexSnapshot) -> Result<(), IndexerError> {
        self.running()?;
        let parts = split_snapshot(snapshot, self.num_shards(), |w| self.shard_of(w));
        for (shard, part) in parts.iter().enumerate() {
            self.inner.write(shard).restore(part);
        }
        Ok(())
    }

    fn find_matches(
        &self,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
    ) -> impl Future<Output = Result<OverlapScores, IndexerError>> + Send {
        let hashes = hashes.into();
        async move {
            self.running()?;
            // Pairs from every shard first, then one map sized once: no per-shard map,
            // no merge, no rehash. Shards a writer holds now are read last, so the
            // query walks the free ones while the writer finishes its batch instead of
            // waiting for it first.
            let mut pairs = Vec::new();
            let mut any_tier = Vec::new();
            let mut busy = Vec::new();
            for (i, shard) in self.inner.shards.iter().enumerate() {
                match shard.try_read() {
                    Some(index) => index.collect_matches(&hashes, &mut pairs, &mut any_tier),
                    None => busy.push(i),
                }
            }
            for i in busy {
                let index = self.inner.shards[i].read_waiting();
                index.collect_matches(&hashes, &mut pairs, &mut any_tier);
            }
            Ok(OverlapScores::from_tiers(pairs, any_tier))
        }
    }

    async fn dump(&self) -> Result<Vec<KvEventBatch>, IndexerError> {
        self.running()?;
        let mut batches = Vec::new();
        for shard in self.inner.shards.iter() {
            batches.extend(shard.read_whole().1.dump());
        }
        batches.sort_by_key(|b| b.worker_id);
        Ok(batches)
    }

    async fn snapshot(&self) -> Result<IndexSnapshot, IndexerError> {
        self.running()?;
        Ok(join_snapshots(
            (self.inner.shards.iter()).map(|shard| shard.read_whole().1.snapshot()),
        ))
    }

    async fn stats(&self) -> Result<IndexerStats, IndexerError> {
        self.running()?;
        let mut total = IndexerStats::default();
        for shard in 0..self.num_shards() {
            total += self.inner.read(shard).stats();
        }
        Ok(total)
    }

    async fn report(&self) -> Result<IndexerReport, IndexerError> {
        self.running()?;
        let mut total = IndexerReport::default();
        for shard in 0..self.num_shards() {
            total.merge(self.inner.read(shard).report());
        }
        Ok(total)
    }

    fn counters(&self) -> &IndexerCounters {
        &self.inner.counters
    }

    fn shutdown(&self) {
        self.inner.shutdown.cancel();
    }

    async fn closed(&self) {
        self.inner.tracker.wait().await;
    }
}

/// Expires approximate-mode blocks at their deadlines until shutdown or until every
/// handle is dropped.
async fn expire_loop(
    inner: std::sync::Weak<Inner>,
    changed: Arc<Notify>,
    shutdown: CancellationToken,
) {
    loop {
        let next = {
            let Some(strong) = inner.upgrade() else {
                return;
            };
            (0..strong.shards.len())
                .filter_map(|s| strong.read(s).next_expiry())
                .min()
        };
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
                None => std::future::pending().await,
            }
        };
        let expire = tokio::select! {
            () = shutdown.cancelled() => return,
            () = changed.notified() => false,
            () = sleep => true,
        };
        if expire {
            let Some(strong) = inner.upgrade() else {
                return;
            };
            let now = tokio::time::Instant::now().into_std();
            for shard in 0..strong.shards.len() {
                strong.write(shard).expire(now);
            }
        }
    }
}
