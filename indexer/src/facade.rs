//! [`Indexer`]: the indexer the daemon holds, whichever [`Backend`] drives it.
//!
//! Both backends implement [`IndexerApi`]; this handle is the run-time choice between
//! them, made from [`IndexerConfig::backend`], so the daemon (and tests) switch
//! designs with a config value. Its [`IndexerApi`] implementation forwards every
//! call to the chosen backend; a `match` per call costs nothing measurable next to
//! the call itself. It also carries the [`IndexMode`]: in approximate mode
//! [`Indexer::record_routing`] indexes routing decisions, otherwise it does nothing.

use crate::api::IndexerApi;
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
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A running indexer of either backend; its API is [`IndexerApi`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Indexer {
    backend: Front,
    mode: IndexMode,
}

/// The backend behind an [`Indexer`].
#[derive(Debug, Clone)]
enum Front {
    Sharded(ShardedIndexer),
    Inline(InlineIndexer),
}

/// Evaluates `$call` with `$i` bound to the running backend.
macro_rules! forward {
    ($self:ident, $i:ident => $call:expr) => {
        match &$self.backend {
            Front::Sharded($i) => $call,
            Front::Inline($i) => $call,
        }
    };
}

impl Indexer {
    /// Starts the backend named by `config.backend` on the current Tokio runtime.
    ///
    /// # Errors
    /// [`IndexerError::InvalidConfig`] when a config field is out of range.
    ///
    /// # Panics
    /// When called outside a Tokio runtime (as `tokio::spawn` does).
    pub fn spawn(config: IndexerConfig, shutdown: CancellationToken) -> Result<Self, IndexerError> {
        let mode = config.mode;
        let backend = match config.backend {
            Backend::Sharded => Front::Sharded(ShardedIndexer::spawn(config, shutdown)?),
            Backend::Inline => Front::Inline(InlineIndexer::spawn(config, shutdown)?),
        };
        Ok(Self { backend, mode })
    }

    /// Which backend runs.
    pub fn backend(&self) -> Backend {
        match self.backend {
            Front::Sharded(_) => Backend::Sharded,
            Front::Inline(_) => Backend::Inline,
        }
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
}

impl IndexerApi for Indexer {
    fn num_shards(&self) -> usize {
        forward!(self, i => i.num_shards())
    }

    fn take_recovery_needs(&self) -> Option<mpsc::UnboundedReceiver<RecoveryNeed>> {
        forward!(self, i => i.take_recovery_needs())
    }

    async fn apply(&self, batch: KvEventBatch) -> Result<(), IndexerError> {
        forward!(self, i => i.apply(batch).await)
    }

    async fn remove_worker(&self, worker_id: WorkerId) -> Result<(), IndexerError> {
        forward!(self, i => i.remove_worker(worker_id).await)
    }

    async fn apply_recovered(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
        reply: RecoveryReply,
    ) -> Result<(), IndexerError> {
        forward!(self, i => i.apply_recovered(rank, token, reply).await)
    }

    async fn abandon_recovery(
        &self,
        rank: WorkerRank,
        token: RecoveryToken,
    ) -> Result<(), IndexerError> {
        forward!(self, i => i.abandon_recovery(rank, token).await)
    }

    async fn resync(&self, rank: WorkerRank) -> Result<(), IndexerError> {
        forward!(self, i => i.resync(rank).await)
    }

    fn insert_routed(
        &self,
        rank: WorkerRank,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), IndexerError>> + Send {
        let hashes = hashes.into();
        async move { forward!(self, i => i.insert_routed(rank, hashes, ttl).await) }
    }

    async fn restore(&self, snapshot: IndexSnapshot) -> Result<(), IndexerError> {
        forward!(self, i => i.restore(snapshot).await)
    }

    fn find_matches(
        &self,
        hashes: impl Into<Arc<[LocalBlockHash]>>,
    ) -> impl Future<Output = Result<OverlapScores, IndexerError>> + Send {
        let hashes = hashes.into();
        async move { forward!(self, i => i.find_matches(hashes).await) }
    }

    async fn dump(&self) -> Result<Vec<KvEventBatch>, IndexerError> {
        forward!(self, i => i.dump().await)
    }

    async fn snapshot(&self) -> Result<IndexSnapshot, IndexerError> {
        forward!(self, i => i.snapshot().await)
    }

    async fn stats(&self) -> Result<IndexerStats, IndexerError> {
        forward!(self, i => i.stats().await)
    }

    async fn report(&self) -> Result<IndexerReport, IndexerError> {
        forward!(self, i => i.report().await)
    }

    fn counters(&self) -> &IndexerCounters {
        forward!(self, i => i.counters())
    }

    fn queued_events(&self) -> usize {
        forward!(self, i => i.queued_events())
    }

    fn shutdown(&self) {
        forward!(self, i => i.shutdown())
    }

    async fn closed(&self) {
        forward!(self, i => i.closed().await)
    }
}
