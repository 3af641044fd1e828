//! The removals query: did an eviction race a route?
//!
//! **Why.** A route decision reads the index at one moment; the engine may evict some
//! of the predicted prefix blocks after that moment and before the request's
//! prefill, recompute and re-store them. The engine then reports fewer cached tokens
//! than the router predicted although the router's picture was right when it
//! decided. The route reply names the chosen rank's [`EventPosition`] at the
//! decision ([`super::RouteDecision::kv_position`]), and a frontend that sees an
//! over-claim asks `{ns}.router.removals` ([`crate::Subjects::router_removals`])
//! whether blocks of the prompt were removed from that rank after that position.
//!
//! The router answers from a bounded memory of recent `Removed` events per rank; a
//! removed block is matched by the [`LocalBlockHash`] a later `Stored` event of the
//! same engine block hash names (the request that found it missing recomputes and
//! re-stores it). An engine that never publishes `Removed` is never excused.

use super::RouteError;
use crate::ids::{DpRank, LocalBlockHash, WorkerId};
use serde::{Deserialize, Serialize};

/// Where a rank's KV event stream stood: the publisher epoch and the `event_id` of
/// the last event the router applied for that rank. Ordered by epoch, then event id
/// (a restarted publisher has a higher epoch and counts its events from 0 again), so
/// positions are comparable across router replicas, which see the same stream.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct EventPosition {
    /// The publisher epoch of the batch (`KvEventBatch::epoch`).
    pub epoch: u64,
    /// The event's `event_id` within that epoch.
    pub event_id: u64,
}

/// The most block hashes one [`RemovalsQuery`] may carry: an over-claim names the
/// blocks between the engine's cached count and the router's overlap, and the
/// first of them decides; 256 blocks (4,096 tokens at 16 tokens a block) is far
/// more than one eviction race leaves, and bounds the router's work per query.
pub const MAX_REMOVAL_HASHES: usize = 256;

/// "Of these block hashes, which were removed from this rank after `after`?",
/// asked on `{ns}.router.removals` (queue group `{ns}-router`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovalsQuery {
    /// The worker the request was routed to.
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
    /// The rank's position at the decision (the route reply's `kv_position`).
    pub after: EventPosition,
    /// Block hashes of the prompt, in prompt order, at most [`MAX_REMOVAL_HASHES`]
    /// (more is a `bad_request`).
    #[serde(
        serialize_with = "crate::codec::packed::serialize",
        deserialize_with = "crate::codec::packed::deserialize"
    )]
    pub block_hashes: Vec<LocalBlockHash>,
}

/// What the router remembers of a rank's removals after a position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovalsAnswer {
    /// Indices into the query's `block_hashes` (ascending) of the blocks removed
    /// from the rank by an event after `after` and stored again since. Empty when
    /// none.
    pub removed: Vec<u32>,
    /// False when the router's memory of the rank does not reach back to `after`
    /// (older removals were forgotten, or the router began remembering the rank
    /// after it): an empty `removed` then proves nothing.
    pub complete: bool,
    /// True when the rank was cleared (`Cleared` event) after `after`: every block
    /// of the prompt was removed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cleared: bool,
}

/// The reply to a [`RemovalsQuery`]: `{"status": "answered", ...answer}` or
/// `{"status": "error", "code": ..., "message": ...}` (code `bad_request` for an
/// undecodable or over-long query).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum RemovalsReply {
    /// The router's answer.
    Answered(RemovalsAnswer),
    /// The query was refused.
    Error(RouteError),
}
