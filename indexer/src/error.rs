//! Error types of the indexer crate.
//!
//! Two enums because the two layers fail for different reasons: [`ApplyError`] is a
//! KV event the [`crate::RadixTree`] refuses (the event is dropped, the tree is left
//! unchanged, and the shard logs and counts it), while [`IndexerError`] is a call on
//! the running [`crate::Indexer`] that could not be served. Both are small,
//! `Copy`-sized values: building one never allocates.

use kv_events::{ExternalBlockHash, GroupId, WorkerRank};
use std::num::NonZeroU32;

/// A KV event the radix tree refused; the tree is unchanged when this is returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// A `Stored` event names a parent block that this worker rank does not hold
    /// (never stored, already removed, or cleared). Storing the chain at the root
    /// instead would index it under the wrong prefix, so the whole event is dropped.
    #[error("unknown parent block {parent_hash} for worker rank {rank}")]
    UnknownParent {
        /// The worker rank whose event was refused.
        rank: WorkerRank,
        /// The engine hash named as parent.
        parent_hash: ExternalBlockHash,
    },
    /// A `Stored` event names a parent block that this index pruned to stay under its
    /// memory bound. The chain's blocks are remembered as forgotten too; prefix matches
    /// are unchanged. Not a sign of lost events, so it does not start recovery.
    #[error("parent block {parent_hash} of worker rank {rank} was pruned by the index")]
    ForgottenParent {
        /// The worker rank whose event was refused.
        rank: WorkerRank,
        /// The engine hash named as parent.
        parent_hash: ExternalBlockHash,
    },
    /// A `Stored` event names a KV cache group the worker rank already has with a
    /// different window (`window_blocks`; `None` is full attention). A group's window
    /// is fixed by its first store: taking the new one would change what every held
    /// block of the group is worth. The event is dropped; a publisher restarted with
    /// another model announces a new epoch, which resets the rank.
    #[error(
        "kv cache group {group} of worker rank {rank} has window {known:?} blocks, a store named {window_blocks:?}"
    )]
    WindowMismatch {
        /// The worker rank whose event was refused.
        rank: WorkerRank,
        /// The group the event named.
        group: GroupId,
        /// The window the event named.
        window_blocks: Option<NonZeroU32>,
        /// The window the group has.
        known: Option<NonZeroU32>,
    },
}

impl ApplyError {
    /// A short lowercase reason, for log fields and metric labels.
    pub fn reason(&self) -> &'static str {
        match self {
            ApplyError::UnknownParent { .. } => "unknown_parent",
            ApplyError::ForgottenParent { .. } => "forgotten_parent",
            ApplyError::WindowMismatch { .. } => "window_mismatch",
        }
    }
}

/// A call on the running [`crate::Indexer`] that could not be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IndexerError {
    /// The shutdown token was cancelled; the request
    /// was not applied (for events) or not answered (for queries, dumps, stats).
    #[error("indexer is shutting down")]
    ShuttingDown,
    /// An [`crate::IndexerConfig`] value is out of range.
    #[error("invalid indexer config field `{field}`: {reason}")]
    InvalidConfig {
        /// Name of the offending field, e.g. `num_shards`.
        field: &'static str,
        /// What is wrong with it, lowercase.
        reason: &'static str,
    },
}
