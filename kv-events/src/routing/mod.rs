//! Routing and request-lifecycle messages, spoken by frontends.
//!
//! A frontend sends a [`RouteRequest`] as a NATS request on `{ns}.router.route` and gets
//! one [`RouteReply`]. Routing *books* the request on the chosen worker: the router
//! counts its prefill tokens and decode blocks as that worker's load. The frontend then
//! publishes [`LifecycleMessage`]s on `{ns}.router.lifecycle`: `prefill_done` when the
//! first token arrives, `keep_alive` now and then for long requests, `freed` when the
//! request ends (for any reason). A frontend with several lifecycle messages queued
//! sends them as one [`LifecycleBatch`] (`{"messages": [...]}`, at most
//! [`crate::limits::MAX_LIFECYCLE_BATCH`]) on the same subject: under load one NATS
//! message then carries many routes' `freed`s, and the router reads and decodes one
//! message instead of each (a NATS message costs a router about as much CPU as a
//! routing decision). Routers decode both forms; routers older than the batch form
//! refuse a batch as malformed, so routers are upgraded before frontends that batch.
//!
//! Every field added after the first release is `#[serde(default)]`, so older
//! frontends keep working; decoders ignore unknown keys, so newer frontends can talk
//! to older routers (which then ignore the new fields).

use crate::disaggregation::Disaggregation;
use crate::ids::{DpRank, LocalBlockHash, RequestId, WorkerId};
use serde::{Deserialize, Serialize};

mod framing;
mod lifecycle;
pub mod overlap;
mod prompt;
pub mod removals;
mod session;

pub use framing::BATCH_FRAME_BYTES;
pub use lifecycle::{LifecycleBatch, LifecycleEvent, LifecycleMessage};

pub use removals::{
    EventPosition, MAX_REMOVAL_HASHES, RemovalsAnswer, RemovalsQuery, RemovalsReply,
};
pub use session::{MAX_SESSION_ID_BYTES, SessionId, SessionIdError};

/// The prompt of a request, as the router needs it.
///
/// On the wire: `{"type": "tokens", "token_ids": [...]}` or
/// `{"type": "blocks", "block_hashes": [...], "num_tokens": n}`, keys in any order,
/// unknown keys ignored; each list an array or one `bin` of little-endian integers
/// (what this crate encodes: `codec::packed`). Decoded without buffering the map
/// (`prompt`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Prompt {
    /// Raw token ids. The router hashes every full block with
    /// [`crate::hashing::compute_block_hashes`] at the cluster's block size; a partial
    /// last block is not hashed (it cannot be cached yet) but counts as prefill work.
    Tokens {
        /// Prompt token ids.
        #[serde(serialize_with = "crate::codec::packed::serialize")]
        token_ids: Vec<u32>,
    },
    /// Ready-made local block hashes, for frontends that hash themselves and for trace
    /// replay (Mooncake traces carry one hash id per 512-token block).
    Blocks {
        /// One hash per block, in prefix order; the last block may be partial.
        #[serde(serialize_with = "crate::codec::packed::serialize")]
        block_hashes: Vec<LocalBlockHash>,
        /// Prompt length in tokens.
        num_tokens: u64,
    },
}

impl Prompt {
    /// Whether the prompt holds no tokens. A route query with an empty prompt is a
    /// readiness probe (docs/protocol.md, "Readiness probes"): every router answers
    /// it without booking anything, and counts it apart from refused queries.
    pub fn is_empty(&self) -> bool {
        match self {
            Prompt::Tokens { token_ids } => token_ids.is_empty(),
            Prompt::Blocks { num_tokens, .. } => *num_tokens == 0,
        }
    }
}

/// Routing policy names, as selectable per daemon and overridable per request.
///
/// The formulas and their sources are documented on the scheduler's `PolicyConfig`
/// variants and in `scheduler/README.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// KV-cache-aware cost (NVIDIA Dynamo): weighted prefill blocks plus decode blocks.
    Kv,
    /// TensorRT-LLM's KV-cache-aware ADP router score: uncached tokens plus a
    /// normalized-load penalty, with a fair-share cap per rank.
    KvNormalized,
    /// SGLang's cache-aware router: least loaded when load is imbalanced, else the
    /// best prefix match if it is good enough, else least loaded.
    CacheAwareThreshold,
    /// Cycle through workers in order, ignoring cache and load.
    RoundRobin,
    /// Pick a worker uniformly at random.
    Random,
    /// The rank with the least booked load, ignoring cache.
    LeastLoaded,
    /// Lowest predicted time to first token (queued prefill, uncached tokens, decode
    /// load, through a step-time model), with extra credit for prefix reuse.
    PredictedTtft,
}

impl PolicyKind {
    /// Every policy, in documentation order.
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::Kv,
        PolicyKind::KvNormalized,
        PolicyKind::CacheAwareThreshold,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::PredictedTtft,
    ];

    /// The wire / command-line name (`kv`, `kv-normalized`, `cache-aware-threshold`,
    /// `round-robin`, `random`, `least-loaded`, `predicted-ttft`).
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Kv => "kv",
            PolicyKind::KvNormalized => "kv-normalized",
            PolicyKind::CacheAwareThreshold => "cache-aware-threshold",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::PredictedTtft => "predicted-ttft",
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.as_str()).collect();
                format!(
                    "unknown policy `{s}` (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Per-request overrides of the policy's cost knobs. Each field is optional; an absent
/// field keeps the daemon's value. Naming a knob the resolved policy does not have
/// (e.g. `temperature` under `round-robin`) is a `bad_request`, as is a value that is
/// negative or not finite.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct CostOverrides {
    /// `kv`: weight of prefill blocks against decode blocks (dimensionless).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_load_scale: Option<f64>,
    /// `kv`: how much one cached (overlap) block reduces the prefill term, in blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap_credit: Option<f64>,
    /// `kv-normalized`: β, the weight of the normalized-load term.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_balance_weight: Option<f64>,
    /// `kv`, `kv-normalized`: softmax temperature over normalized costs; 0 = argmin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
}

impl CostOverrides {
    /// Whether no knob is overridden.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A routing query: which (worker, dp_rank) should serve this prompt?
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// Frontend-chosen id; lifecycle messages refer to it.
    pub request_id: RequestId,
    /// The prompt.
    pub prompt: Prompt,
    /// Use this policy instead of the daemon's default (A/B comparisons, replay).
    #[serde(default)]
    pub policy: Option<PolicyKind>,
    /// Only consider this data-parallel rank (on any worker). If no registered worker
    /// has it, the reply is `rank_unavailable`; the router never falls back to
    /// another rank.
    #[serde(default)]
    pub dp_rank: Option<DpRank>,
    /// Per-request cost knob overrides.
    #[serde(default, skip_serializing_if = "CostOverrides::is_empty")]
    pub overrides: CostOverrides,
    /// Queue priority hint when every worker is busy: higher leaves the wait queue
    /// first; equal priorities are first come, first served. Default 0.
    #[serde(default)]
    pub priority: i32,
    /// Workers this request must not be routed to: a frontend retrying after the
    /// chosen engine failed (connection refused, error before the first byte) names
    /// the workers it already tried. At most [`MAX_EXCLUDED_WORKERS`]; more is a
    /// `bad_request`. When every registered worker is excluded the reply is
    /// `no_workers`. Empty (and absent on the wire) by default.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude_workers: Vec<WorkerId>,
    /// The conversation (or agent run) this request belongs to: the router prefers
    /// the rank that served the session's last request unless another is cheaper by
    /// a margin (`docs/protocol.md`, "Session affinity"). 1 to
    /// [`MAX_SESSION_ID_BYTES`] bytes; an empty or longer id makes the request
    /// malformed (`bad_request`). Absent on the wire by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// The frontend can run a disaggregated request (both halves, see
    /// [`crate::disaggregation`]): when prefill workers are registered, the router
    /// may answer with a prefill worker besides the decode worker. Without it (the
    /// default, not sent), the request is routed to one worker that decodes (role
    /// `both` or `decode`), never to a prefill-only worker.
    #[serde(default, skip_serializing_if = "is_false")]
    pub allow_disaggregation: bool,
    /// The only workers this request may be routed to (an endpoint picker's subset
    /// hint): when non-empty, a worker outside it is no candidate, on top of every
    /// other rule (pinned dp_rank, `exclude_workers`, busy, silent). At most
    /// [`MAX_ELIGIBLE_WORKERS`]; more is a `bad_request`. When no registered worker
    /// is in it (or every one inside is excluded) the reply is `no_workers`. Empty
    /// (every worker eligible; absent on the wire) by default. Order and duplicates
    /// do not matter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eligible_workers: Vec<WorkerId>,
    /// How many alternates the frontend wants besides the chosen worker, at most
    /// [`MAX_FALLBACKS`] (more is a `bad_request`): the decision then lists up to
    /// that many [`RouteFallback`]s, never booked. 0 (the default, not sent): none.
    /// Not offered for a disaggregated decision.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub fallbacks: u8,
}

fn is_zero<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

fn is_false(value: &bool) -> bool {
    !*value
}

/// The most workers one [`RouteRequest`] may exclude: far above any sane retry count,
/// and small enough that checking candidates against the list stays cheap.
pub const MAX_EXCLUDED_WORKERS: usize = 64;

/// The most workers one [`RouteRequest`] may name as eligible: 16,384 covers the
/// largest fleets deployed as one pool today (a few thousand engines, each one worker
/// however many GPUs it spans) with room to spare, while the list stays a bounded
/// 128 KiB of ids to sort (O(n log n) per request) and the JSON under NATS's default
/// 1 MiB payload (an id is at most 20 digits).
pub const MAX_ELIGIBLE_WORKERS: usize = 16_384;

/// The most alternates one [`RouteRequest`] may ask for: a proxy retries down a
/// short list (GAIE's endpoint-picker protocol), and each alternate costs the router
/// a sort of the priced candidates.
pub const MAX_FALLBACKS: u8 = 4;

impl RouteRequest {
    /// A request with the daemon's policy, no pinned rank, no overrides, priority 0.
    pub fn new(request_id: impl Into<RequestId>, prompt: Prompt) -> Self {
        Self {
            request_id: request_id.into(),
            prompt,
            policy: None,
            dp_rank: None,
            overrides: CostOverrides::default(),
            priority: 0,
            exclude_workers: Vec::new(),
            session_id: None,
            allow_disaggregation: false,
            eligible_workers: Vec::new(),
            fallbacks: 0,
        }
    }
}

/// An alternate to a [`RouteDecision`]'s worker: where the request would go next,
/// not booked. A frontend that sends the request there instead (its proxy retried)
/// moves the booking itself (`docs/protocol.md`, "Fallbacks").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteFallback {
    /// The alternate worker (never the chosen one, never another fallback's).
    pub worker_id: WorkerId,
    /// Its lowest-cost data-parallel rank.
    pub dp_rank: DpRank,
    /// Leading prompt blocks cached on that rank, in blocks.
    pub overlap_blocks: u32,
}

/// The router's choice for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDecision {
    /// Echo of the request id.
    pub request_id: RequestId,
    /// The chosen worker.
    pub worker_id: WorkerId,
    /// The chosen data-parallel rank on that worker.
    pub dp_rank: DpRank,
    /// Leading prompt blocks already cached on the chosen rank (prefix match), in blocks.
    pub overlap_blocks: u32,
    /// Prompt length in blocks (a partial last block counts as one).
    pub request_blocks: u32,
    /// Leading prompt blocks past `overlap_blocks` that requests already booked on the
    /// chosen rank share with this prompt (they are prefilling or decoding them, and
    /// the index has not seen them stored yet), in blocks, capped like the overlap at
    /// the full blocks before the last prompt token. An engine that caches blocks as
    /// it computes them may serve these from cache too, so its reported cached
    /// tokens can lie anywhere from `overlap_blocks` to `overlap_blocks +
    /// in_flight_blocks` blocks without the router's picture being wrong. 0 (and
    /// absent on the wire) when none, for a disaggregated request, and from routers
    /// that predate the field.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub in_flight_blocks: u32,
    /// The chosen rank's KV event position at the decision (the last event the
    /// router had applied for it), for asking `{ns}.router.removals` later whether
    /// an eviction raced the route ([`removals`]). Absent for a disaggregated
    /// request, when the router keeps no removals (`--removals-per-rank 0`), and
    /// from routers that predate the field. Boxed so a decision (and every
    /// `Result` whose error is a [`RouteReply`]) stays small.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_position: Option<Box<EventPosition>>,
    /// The policy that made the decision.
    pub policy: PolicyKind,
    /// For a request that allowed disaggregation, when prefill workers are
    /// registered: whether (and where) its prompt is prefilled on another worker, and
    /// why. `worker_id`, `dp_rank` and `overlap_blocks` above are then the decode
    /// worker's. Absent otherwise (not serialized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<Disaggregation>,
    /// Up to the request's `fallbacks` alternates, best first: the next lowest-cost
    /// ranks under the same cost the choice used, one per worker, on workers other
    /// than the chosen one, eligible under the same rules. Not booked. Fewer when
    /// fewer workers are eligible; empty (absent on the wire) when none was asked,
    /// for a disaggregated decision, and for policies without a per-rank cost that
    /// cannot rank alternates (`docs/protocol.md`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<RouteFallback>,
}

/// Why a route request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteErrorCode {
    /// The request could not be decoded or is invalid (e.g. an empty prompt, a bad
    /// override, a duplicate request id).
    BadRequest,
    /// No worker is registered.
    NoWorkers,
    /// Every eligible worker is busy and the wait queue is full, or the request
    /// waited in the queue longer than the router's limit.
    Overloaded,
    /// The request pinned a `dp_rank` that no registered worker has.
    RankUnavailable,
    /// The router failed internally (e.g. shutting down).
    Internal,
}

/// A failed routing query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteError {
    /// Machine-readable reason.
    pub code: RouteErrorCode,
    /// Human-readable detail, lowercase.
    pub message: String,
}

/// The reply to a [`RouteRequest`]: `{"status": "routed", ...decision}` or
/// `{"status": "error", "code": ..., "message": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum RouteReply {
    /// The request was routed and booked.
    Routed(RouteDecision),
    /// The request was not routed.
    Error(RouteError),
}

/// In which order the router places the requests of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BatchOrder {
    /// In the given order (first come, first served).
    AsGiven,
    /// Requests pinned to a dp_rank first, then grouped by their first block hash
    /// (requests of one conversation or shared system prompt together), longer
    /// prompts first within a group — TensorRT-LLM's ADP router order, so requests
    /// sharing a prefix see each other's bookings. The default.
    #[default]
    GroupByPrefix,
}

/// Several routing queries answered together, on `{ns}.router.route_batch`: each
/// request is placed seeing the bookings of the ones placed before it (and
/// `kv-normalized` sizes its fair share with the requests still to place), in one
/// round trip — for a frontend that receives a batch (parallel sampling with `n > 1`,
/// an offline batch API). A batch never waits in the router's queue: entries that find
/// every eligible rank busy, or arrive while other requests wait, are `overloaded`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteBatchRequest {
    /// The requests, at least one; the daemon caps the count (`--max-route-batch`).
    pub requests: Vec<RouteRequest>,
    /// Placement order. Default `group-by-prefix`.
    #[serde(default)]
    pub order: BatchOrder,
}

/// The reply to a [`RouteBatchRequest`]: `{"status": "answered", "replies": [...]}`
/// with one [`RouteReply`] per request in input order (each routed or failed on its
/// own), or `{"status": "error", "code": ..., "message": ...}` when the batch as a
/// whole is refused (malformed, empty, too large, shutting down).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum RouteBatchReply {
    /// Every request got its own reply.
    Answered {
        /// One reply per request, in input order.
        replies: Vec<RouteReply>,
    },
    /// The batch was refused as a whole; nothing was booked.
    Error(RouteError),
}

#[cfg(test)]
mod tests;
