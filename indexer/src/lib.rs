//! The KV block index of kv-router: which (worker, dp_rank) holds which cached prefix.
//!
//! Engines announce the KV blocks they cache as KV events (`Stored`, `Removed`,
//! `Cleared`). This crate folds those events into a radix tree keyed by
//! [`LocalBlockHash`](kv_events::LocalBlockHash), so that a routing query — the block
//! hashes of a prompt — can be answered with, for every worker rank, the number of
//! leading prompt blocks it already holds (its overlap blocks). The scheduler turns
//! those counts into an estimate of the prefill each worker would save.
//!
//! Two layers:
//! - [`RadixTree`] is the single-threaded core: an arena of nodes with `u32` indices,
//!   compact per-node holder sets and a per-rank map from the engine's
//!   [`ExternalBlockHash`](kv_events::ExternalBlockHash) to the node it names.
//! - [`ShardedIndexer`] is the async front: N shard tasks, each owning one tree and a
//!   sticky subset of workers; queries fan out to every shard and the partial scores
//!   are merged. The shard loop gives events priority over dumps and queries, which
//!   is what makes a caller's own earlier events visible to its later queries.
//!
//! `indexer/README.md` draws the data flow and states the ordering rules.
//!
//! # Layout
//! - [`tree`]: [`RadixTree`], its [`ApplyOutcome`] and the dump / stats views.
//! - [`scores`]: [`OverlapScores`], the per-rank leading-block counts of one query.
//! - [`sharded`]: [`ShardedIndexer`], the cloneable handle over the shard tasks.
//! - `shard` (private): one shard task: its channels and its biased event loop.
//! - [`config`]: [`IndexerConfig`] (shard count, queue capacities).
//! - [`counters`]: [`IndexerCounters`], lock-free counters the daemon exports.
//! - [`stats`]: [`IndexerStats`], sizes of a tree or of all shards summed.
//! - [`error`]: [`ApplyError`] (an event the tree refuses) and [`IndexerError`].

pub mod approx;
pub mod config;
pub mod counters;
pub mod error;
mod facade;
pub mod inline;
pub mod ordered;
pub mod recovery;
pub mod scores;
mod shard;
pub mod sharded;
pub mod stats;
pub mod tree;

pub use config::{Backend, IndexMode, IndexerConfig, Pruning};
pub use counters::{CountersSnapshot, IndexerCounters};
pub use error::{ApplyError, IndexerError};
pub use facade::{Indexer, Running};
pub use inline::InlineIndexer;
pub use ordered::{OrderedIndex, ShardSettings};
pub use recovery::{RecoveryNeed, RecoveryReason, RecoveryToken};
pub use scores::OverlapScores;
pub use sharded::ShardedIndexer;
pub use stats::{IndexerReport, IndexerStats};
pub use tree::{ApplyOutcome, RadixTree};
