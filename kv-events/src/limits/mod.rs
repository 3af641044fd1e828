//! Bounds on what one message from the network may carry, checked before anything
//! is allocated for it.
//!
//! Why: a router replica keeps state for everything it accepts, so a single record
//! or message that is merely *valid* can still take it down. A registration with
//! `dp_size` 4,294,967,295 once made every replica allocate a rank list of 64 GiB
//! and abort; a `Stored` event of 5M blocks or a route request of 50M tokens held
//! gigabytes. Two checks close that:
//!
//! 1. **Bytes before decoding** ([`decode_within`]): a payload longer than
//!    [`Limits::max_message_bytes`] is refused unread. The codec then checks that
//!    every length the msgpack announces is backed by bytes ([`crate::codec`]), so
//!    what a decode allocates is bounded by a multiple of this (`kv-fuzz` measures
//!    at most ~100 heap bytes per payload byte).
//! 2. **Counts and values after decoding** ([`WithinLimits`]): every count that sizes
//!    state (ranks, blocks, tokens, events, requests) and every load value the
//!    scheduler adds up is checked against its limit, so nothing over it reaches the
//!    index or the scheduler.
//!
//! A refusal names the field, the value and the limit ([`LimitError`]), and
//! [`Refusal::reason`] gives a short label for a metric. The caller counts it, logs it
//! once with its subject or key, and goes on with the next message.
//!
//! The defaults fit real engines with room to spare; each is a flag of the daemon
//! (`docs/configuration.md`, "Limits"). Cost: one comparison per count, and one pass
//! over a batch's events.

use crate::discovery::WorkerRegistration;
use crate::events::{KvCacheEventData, KvEventBatch};
use crate::metrics::LoadMetrics;
use crate::replicas::{
    BookedSequence, SequenceStep, SequenceSync, SequenceSyncBatch, SequenceUpdate, SnapshotReply,
};
use crate::routing::{Prompt, RouteBatchRequest, RouteRequest};
use crate::{CodecError, DpRank, RequestId, decode};
use serde::de::DeserializeOwned;

/// The bounds of one router replica (or other reader of the protocol); see the module
/// docs. `Copy`, so every task keeps its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload decoded, in bytes (default 8 MiB: NATS's default `max_payload`
    /// is 1 MiB, and operators who raise it for large dumps use a few MiB).
    pub max_message_bytes: usize,
    /// Largest `dp_size` of a registration, in ranks (default 1,024; the largest
    /// data-parallel deployments published, DeepSeek-V3 with DP attention, use 32–256).
    pub max_dp_size: u32,
    /// Largest KV capacity of one rank, in blocks, for registrations and load metrics
    /// (default 2^32: 4 billion blocks, 1,000× an 8-GPU node's HBM at 16-token blocks).
    pub max_kv_blocks: u64,
    /// Longest prompt of a route request or booking, in tokens (default 2^20 =
    /// 1,048,576, the longest `max_model_len` of common models today, e.g.
    /// Qwen2.5-1M; raise it together with `max_message_bytes` for 10M-token models).
    pub max_route_tokens: u64,
    /// Most events in one KV event batch (default 16,384; vLLM publishes one batch per
    /// engine step, a few events per running request).
    pub max_batch_events: usize,
    /// Most blocks named by one KV event batch, over all its `Stored` and `Removed`
    /// events (default 2^20: a full 1M-token prompt at one token per block).
    pub max_batch_blocks: usize,
}

/// Longest request id, in bytes: ids are UUIDs or similar.
pub const MAX_REQUEST_ID_BYTES: usize = 512;

/// Most lifecycle messages in one [`crate::routing::LifecycleBatch`]: 256, about
/// what a frontend queues between two wake-ups of its publisher at hundreds of
/// requests in flight (a frontend with more sends several batches), and as many as
/// the router's intake already applies under one lock from single messages. A
/// longer batch is refused whole.
pub const MAX_LIFECYCLE_BATCH: usize = 256;

/// Longest expected prefill of a booking, in ms (one hour).
pub const MAX_PREFILL_MS: u64 = 3_600_000;

/// Most prefill tokens a rank may report as queued, in tokens: 2^40, far above any
/// engine, and low enough that a sum over a million ranks cannot overflow a `u64`.
pub const MAX_QUEUED_PREFILL_TOKENS: u64 = 1 << 40;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: 8 << 20,
            max_dp_size: 1024,
            max_kv_blocks: 1 << 32,
            max_route_tokens: 1 << 20,
            max_batch_events: 16_384,
            max_batch_blocks: 1 << 20,
        }
    }
}

/// A value over its limit: the field, what it was and the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} is {value}, over the limit of {limit}")]
pub struct LimitError {
    /// The field or count, as named on the wire (e.g. `dp_size`, `token_ids`).
    pub field: &'static str,
    /// Its value.
    pub value: u64,
    /// The limit it broke.
    pub limit: u64,
}

/// Why a payload was not accepted by [`decode_within`].
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Longer than [`Limits::max_message_bytes`]; not decoded.
    #[error("message of {bytes} bytes, over the limit of {limit}")]
    TooLarge {
        /// The payload's length, in bytes.
        bytes: usize,
        /// The limit, in bytes.
        limit: usize,
    },
    /// Not a valid encoding of the expected message.
    #[error("malformed: {0}")]
    Malformed(#[from] CodecError),
    /// Decoded, but a count or value is over its limit.
    #[error(transparent)]
    OverLimit(#[from] LimitError),
}

impl Refusal {
    /// A short label for metrics: `too_large`, `malformed` or `over_limit`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::TooLarge { .. } => "too_large",
            Self::Malformed(_) => "malformed",
            Self::OverLimit(_) => "over_limit",
        }
    }
}

/// A message whose counts and values can be checked against [`Limits`].
pub trait WithinLimits {
    /// `Ok` when every count and value is within `limits`.
    ///
    /// # Errors
    /// The first [`LimitError`] found.
    fn within(&self, limits: &Limits) -> Result<(), LimitError>;
}

/// Decodes a msgpack `payload` of at most [`Limits::max_message_bytes`] and checks the
/// result against `limits`.
///
/// # Errors
/// [`Refusal`]: too large (not decoded), malformed, or over a limit.
pub fn decode_within<T: DeserializeOwned + WithinLimits>(
    payload: &[u8],
    limits: &Limits,
) -> Result<T, Refusal> {
    check_bytes(payload.len(), limits)?;
    let message: T = decode(payload)?;
    message.within(limits)?;
    Ok(message)
}

/// [`Refusal::TooLarge`] when `bytes` is over [`Limits::max_message_bytes`].
///
/// # Errors
/// As described.
pub fn check_bytes(bytes: usize, limits: &Limits) -> Result<(), Refusal> {
    if bytes > limits.max_message_bytes {
        return Err(Refusal::TooLarge {
            bytes,
            limit: limits.max_message_bytes,
        });
    }
    Ok(())
}

/// `Err` naming `field` when `value` is over `limit`.
fn at_most(
    field: &'static str,
    value: impl TryInto<u64>,
    limit: impl TryInto<u64>,
) -> Result<(), LimitError> {
    let value = value.try_into().unwrap_or(u64::MAX);
    let limit = limit.try_into().unwrap_or(u64::MAX);
    if value > limit {
        return Err(LimitError {
            field,
            value,
            limit,
        });
    }
    Ok(())
}

/// A rank below `max_dp_size`.
fn rank(dp_rank: DpRank, limits: &Limits) -> Result<(), LimitError> {
    at_most("dp_rank", dp_rank.0, limits.max_dp_size.saturating_sub(1))
}

fn request_id(id: &RequestId) -> Result<(), LimitError> {
    at_most("request_id", id.0.len(), MAX_REQUEST_ID_BYTES)
}

impl WithinLimits for WorkerRegistration {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        at_most("dp_size", self.dp_size, limits.max_dp_size)?;
        at_most(
            "total_kv_blocks",
            self.total_kv_blocks,
            limits.max_kv_blocks,
        )
    }
}

impl WithinLimits for KvEventBatch {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        at_most("events", self.events.len(), limits.max_batch_events)?;
        let mut blocks = 0usize;
        for event in &self.events {
            blocks += match &event.data {
                KvCacheEventData::Stored { blocks, .. } => blocks.len(),
                KvCacheEventData::Removed { block_hashes, .. } => block_hashes.len(),
                KvCacheEventData::Cleared => 0,
            };
        }
        at_most("blocks", blocks, limits.max_batch_blocks)?;
        for event in &self.events {
            rank(event.dp_rank, limits)?;
        }
        Ok(())
    }
}

impl WithinLimits for LoadMetrics {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        rank(self.dp_rank, limits)?;
        at_most(
            "kv_total_blocks",
            self.kv_total_blocks,
            limits.max_kv_blocks,
        )?;
        at_most("kv_used_blocks", self.kv_used_blocks, limits.max_kv_blocks)?;
        at_most(
            "active_decode_blocks",
            self.active_decode_blocks,
            limits.max_kv_blocks,
        )?;
        at_most(
            "active_prefill_tokens",
            self.active_prefill_tokens,
            MAX_QUEUED_PREFILL_TOKENS,
        )
    }
}

impl WithinLimits for RouteRequest {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        request_id(&self.request_id)?;
        match &self.prompt {
            Prompt::Tokens { token_ids } => {
                at_most("token_ids", token_ids.len(), limits.max_route_tokens)
            }
            Prompt::Blocks {
                block_hashes,
                num_tokens,
            } => {
                at_most("num_tokens", *num_tokens, limits.max_route_tokens)?;
                at_most("block_hashes", block_hashes.len(), limits.max_route_tokens)
            }
        }
    }
}

impl WithinLimits for crate::routing::RemovalsQuery {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        rank(self.dp_rank, limits)?;
        at_most(
            "block_hashes",
            self.block_hashes.len(),
            crate::routing::MAX_REMOVAL_HASHES,
        )
    }
}

impl WithinLimits for crate::routing::overlap::OverlapQuery {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        rank(self.dp_rank, limits)?;
        at_most(
            "block_hashes",
            self.block_hashes.len(),
            crate::routing::overlap::MAX_OVERLAP_HASHES,
        )
    }
}

/// The count of requests is the daemon's `--max-route-batch` (answered with an error
/// reply, not skipped); here each request is checked.
impl WithinLimits for RouteBatchRequest {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        self.requests.iter().try_for_each(|r| r.within(limits))
    }
}

impl WithinLimits for BookedSequence {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        rank(self.dp_rank, limits)?;
        at_most(
            "block_hashes",
            self.block_hashes.len(),
            limits.max_route_tokens,
        )?;
        at_most(
            "request_blocks",
            self.request_blocks,
            limits.max_route_tokens,
        )?;
        at_most(
            "prefill_tokens",
            self.prefill_tokens,
            limits.max_route_tokens,
        )?;
        if let Some(ms) = self.expected_prefill_ms {
            at_most("expected_prefill_ms", ms, MAX_PREFILL_MS)?;
        }
        Ok(())
    }
}

impl WithinLimits for SequenceSync {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        step_within(&self.request_id, &self.update, limits)
    }
}

impl WithinLimits for SequenceStep {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        step_within(&self.request_id, &self.update, limits)
    }
}

/// The number of steps is bounded by the payload's bytes; each step is checked.
impl WithinLimits for SequenceSyncBatch {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        self.steps.iter().try_for_each(|step| step.within(limits))
    }
}

fn step_within(id: &RequestId, update: &SequenceUpdate, limits: &Limits) -> Result<(), LimitError> {
    request_id(id)?;
    match update {
        SequenceUpdate::Booked(booked) => booked.within(limits),
        SequenceUpdate::PrefillDone | SequenceUpdate::KeepAlive | SequenceUpdate::Freed => Ok(()),
    }
}

/// The number of entries is bounded by the payload's bytes; each entry is checked.
impl WithinLimits for SnapshotReply {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        self.requests.iter().try_for_each(|entry| {
            request_id(&entry.request_id)?;
            entry.booked.within(limits)
        })
    }
}

impl WithinLimits for crate::routing::LifecycleMessage {
    fn within(&self, _: &Limits) -> Result<(), LimitError> {
        request_id(&self.request_id)
    }
}

impl WithinLimits for crate::routing::LifecycleBatch {
    fn within(&self, limits: &Limits) -> Result<(), LimitError> {
        at_most("messages", self.messages.len(), MAX_LIFECYCLE_BATCH)?;
        self.messages.iter().try_for_each(|m| m.within(limits))
    }
}

impl WithinLimits for crate::replicas::SnapshotRequest {
    fn within(&self, _: &Limits) -> Result<(), LimitError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
