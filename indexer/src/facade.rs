//! [`Indexer`]: the indexer the daemon holds, whichever [`Backend`] drives it.
//!
//! Both backends have the same API and guarantees; this handle forwards every call to
//! the one chosen in [`IndexerConfig::backend`], so the daemon (and tests) switch
//! designs with a config value. A `match` per call costs nothing measurable next to
//! the call itself. It also carries the [`IndexMode`]: in approximate mode
//! [`Indexer::record_routing`] indexes routing decisions, otherwise it does nothing.

use crate::config::{Backend, IndexMode, IndexerConfig};
use crate::counters::IndexerCounters;
use crate::error::IndexerError;
use crate::inline::InlineIndexer;
use crate::recovery::{RecoveryNeed, RecoveryToken};
use crate::scores::OverlapScores;
use crate::sharded::ShardedIndexer;
use crate::stats::{IndexerReport, IndexerStats};
use kv_events::recovery::{IndexSnapshot, RecoveryReply};
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId, WorkerRank};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A running indexer of either backend. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Indexer {
    backend: Running,
    mode: IndexMode,
}

/// The backend behind an [`Indexer`].
#[derive(Debug, Clone)]
pub enum Running {
    /// Shard tasks behind channels.
    Sharded(ShardedIndexer),
    /// Lock-protected shards read inline.
    Inline(InlineIndexer),
}

macro_rules! forward {
    ($self:ident, $i:ident => $call:expr) => {
        match &$self.backend {
            Running::Sharded($i) => $call,
            Running::Inline($i) => $call,
        }
    };
}

impl Indexer {
    /// Starts the backend named by `config.backend` on the current Tokio runtime.
    ///
    /// # Errors
    /// [`IndexerError::InvalidConfig`] when a config field is out of range.
    pub fn spawn(config: IndexerConfig, shutdown: CancellationToken) -> Result<Self, IndexerError> {
        let mode = config.mode;
        let backend = match config.backend {
            Backend::Sharded => Running::Sharded(ShardedIndexer::spawn(config, shutdown)?),
            Backend::Inline => Running::Inline(InlineIndexer::spawn(config, shutdown)?),
        };
        Ok(Self { backend, mode })
    }

    /// Which backend runs.
    pub fn backend(&self) -> Backend {
        match self.backend {
            Running::Sharded(_) => Backend::Sharded,
            Running::Inline(_) => Backend::Inline,
        }
    }

    /// The running backend itself.
    pub fn running(&self) -> &Running {
        &self.backend
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

    /// Number of shards.
    pub fn num_shards(&self) -> usize {
        forward!(self, i => i.num_shards())
    }

    /// The recovery needs receiver, the first time (see [`RecoveryNeed`]).
    pub fn take_recovery_needs(&self) -> Option<mpsc::UnboundedReceiver<RecoveryNeed>> {
        forward!(self, i => i.take_recovery_needs())
    }

    /// Applies (or enqueues) a batch of KV events under the ordering rules.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn apply(&self, batch: KvEventBatch) -> Result<(), IndexerError> {
        forward!(self, i => i.apply(batch).await)
    }

    /// Drops every rank of a worker.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn remove_worker(&self, worker_id: WorkerId) -> Result<(), IndexerError> {
        forward!(self, i => i.remove_worker(worker_id).await)
    }

    /// Hands back the reply to a recovery need.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn apply_recovered(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
        reply: RecoveryReply,
    ) -> Result<(), IndexerError> {
        forward!(self, i => i.apply_recovered(rank, token, reply).await)
    }

    /// Reports that a recovery need was given up.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn abandon_recovery(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
    ) -> Result<(), IndexerError> {
        forward!(self, i => i.abandon_recovery(rank, token).await)
    }

    /// Asks for a rank's full state (start-up).
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn resync(&self, rank: WorkerRank) -> Result<(), IndexerError> {
        forward!(self, i => i.resync(rank).await)
    }

    /// Approximate mode: indexes a routing decision for `ttl`.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn insert_routed(
        &self,
        rank: WorkerRank,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
        ttl: Duration,
    ) -> Result<(), IndexerError> {
        forward!(self, i => i.insert_routed(rank, hashes, ttl).await)
    }

    /// Loads a snapshot.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn restore(&self, snapshot: IndexSnapshot) -> Result<(), IndexerError> {
        forward!(self, i => i.restore(snapshot).await)
    }

    /// Per-rank leading-block scores of `hashes`.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn find_matches(
        &self,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
    ) -> Result<OverlapScores, IndexerError> {
        forward!(self, i => i.find_matches(hashes).await)
    }

    /// Events that rebuild the index, one batch per worker.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn dump(&self) -> Result<Vec<KvEventBatch>, IndexerError> {
        forward!(self, i => i.dump().await)
    }

    /// The dump plus every rank's event cursor.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn snapshot(&self) -> Result<IndexSnapshot, IndexerError> {
        forward!(self, i => i.snapshot().await)
    }

    /// Sizes summed over shards.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn stats(&self) -> Result<IndexerStats, IndexerError> {
        forward!(self, i => i.stats().await)
    }

    /// Sizes, blocks per rank and recovery state.
    ///
    /// # Errors
    /// [`IndexerError::ShuttingDown`] after shutdown.
    pub async fn report(&self) -> Result<IndexerReport, IndexerError> {
        forward!(self, i => i.report().await)
    }

    /// Shared counters.
    pub fn counters(&self) -> &IndexerCounters {
        forward!(self, i => i.counters())
    }

    /// Messages waiting in event queues (always 0 for the inline backend).
    pub fn queued_events(&self) -> usize {
        forward!(self, i => i.queued_events())
    }

    /// Stops the indexer.
    pub fn shutdown(&self) {
        forward!(self, i => i.shutdown())
    }

    /// Resolves once the indexer's tasks have ended.
    pub async fn closed(&self) {
        forward!(self, i => i.closed().await)
    }
}
