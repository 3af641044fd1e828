//! The KV block index of kv-router: which (worker, dp_rank) holds which cached prefix.
//!
//! Engines announce the KV blocks they cache as KV events (`Stored`, `Removed`,
//! `Cleared`). This crate folds those events into a radix tree keyed by
//! [`LocalBlockHash`](kv_events::LocalBlockHash), so that a routing query — the block
//! hashes of a prompt — can be answered with, for every worker rank, the number of
//! leading prompt blocks it already holds (its overlap blocks). The scheduler turns
//! those counts into an estimate of the prefill each worker would save.
//!
//! Three layers:
//! - [`RadixTree`] is the single-threaded core, path-compressed: an arena of runs
//!   (consecutive blocks sharing one holder set, their hashes contiguous) with `u32`
//!   indices, compact per-run holder sets, stable `u32` block ids, and a per-rank map
//!   from the engine's [`ExternalBlockHash`](kv_events::ExternalBlockHash) to the
//!   block it names; optionally bounded ([`Pruning`]).
//! - [`OrderedIndex`] adds what one shard needs around a tree: per-(worker, dp_rank)
//!   event cursors (duplicates dropped, gaps buffered and recovered, restarted
//!   publishers reset), approximate-mode TTL entries and snapshots. It does no I/O:
//!   it emits [`RecoveryNeed`]s and takes their replies back.
//! - [`Indexer`], the concurrent front: shards behind read-write locks, read in place
//!   by queries, giving a caller's own earlier events to its later queries. Its API
//!   is the [`IndexerApi`] trait, which the contract suite runs it through.
//!
//! `indexer/README.md` draws the data flow and states the ordering, recovery and
//! consistency rules; `docs/benchmarks.md` has the measurements.
//!
//! # Layout
//! - [`tree`]: [`RadixTree`], its [`ApplyOutcome`], dump, stats and pruning.
//! - [`ordered`]: [`OrderedIndex`], one shard's tree with its event ordering.
//! - [`recovery`]: [`RecoveryNeed`], [`RecoveryToken`], [`RecoveryReason`].
//! - [`approx`]: approximate mode (routing decisions with a TTL).
//! - [`scores`]: [`OverlapScores`], the per-rank leading-block counts of one query.
//! - `api` (private): [`IndexerApi`], the calls and guarantees of a running indexer,
//!   and the snapshot helpers.
//! - [`inline`]: [`Indexer`], its shards behind locks and its expiry task.
//! - [`config`]: [`IndexerConfig`] ([`Pruning`], [`IndexMode`], shard count,
//!   recovery buffer) and the per-shard [`ShardSettings`].
//! - [`counters`]: [`IndexerCounters`], lock-free counters the daemon exports.
//! - [`stats`]: [`IndexerStats`] and [`IndexerReport`] (sizes, blocks per rank).
//! - [`error`]: [`ApplyError`] (an event the tree refuses) and [`IndexerError`].

mod api;
pub mod approx;
pub mod config;
pub mod counters;
pub mod error;
pub mod inline;
pub mod ordered;
pub mod recovery;
pub mod scores;
pub mod stats;
pub mod tree;

pub use api::IndexerApi;
pub use config::{IndexMode, IndexerConfig, Pruning, ShardSettings};
pub use counters::{CountersSnapshot, IndexerCounters};
pub use error::{ApplyError, IndexerError};
pub use inline::Indexer;
pub use ordered::OrderedIndex;
pub use recovery::{RecoveryNeed, RecoveryReason, RecoveryToken};
pub use scores::OverlapScores;
pub use stats::{IndexerReport, IndexerStats};
pub use tree::{ApplyOutcome, RadixTree};
