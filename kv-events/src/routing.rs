//! Routing and request-lifecycle messages, spoken by frontends.
//!
//! A frontend sends a [`RouteRequest`] as a NATS request on `{ns}.router.route` and gets
//! one [`RouteReply`]. Routing *books* the request on the chosen worker: the router
//! counts its prefill tokens and decode blocks as that worker's load. The frontend then
//! publishes [`LifecycleMessage`]s on `{ns}.router.lifecycle`: `prefill_done` when the
//! first token arrives, `freed` when the request ends (for any reason).

use crate::ids::{DpRank, LocalBlockHash, RequestId, WorkerId};
use serde::{Deserialize, Serialize};

/// The prompt of a request, as the router needs it.
///
/// On the wire: `{"type": "tokens", "token_ids": [...]}` or
/// `{"type": "blocks", "block_hashes": [...], "num_tokens": n}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Prompt {
    /// Raw token ids. The router hashes every full block with
    /// [`crate::hashing::compute_block_hashes`] at the cluster's block size; a partial
    /// last block is not hashed (it cannot be cached yet) but counts as prefill work.
    Tokens {
        /// Prompt token ids.
        token_ids: Vec<u32>,
    },
    /// Ready-made local block hashes, for frontends that hash themselves and for trace
    /// replay (Mooncake traces carry one hash id per 512-token block).
    Blocks {
        /// One hash per block, in prefix order; the last block may be partial.
        block_hashes: Vec<LocalBlockHash>,
        /// Prompt length in tokens.
        num_tokens: u64,
    },
}

/// Routing policy names, as selectable per daemon and overridable per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// KV-cache-aware cost: uncached prefill blocks plus active decode blocks.
    Kv,
    /// Cycle through workers in order, ignoring cache and load.
    RoundRobin,
    /// Pick a worker uniformly at random.
    Random,
}

impl PolicyKind {
    /// Every policy, in documentation order.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Kv, PolicyKind::RoundRobin, PolicyKind::Random];

    /// The wire / command-line name (`kv`, `round-robin`, `random`).
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Kv => "kv",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
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
            .ok_or_else(|| format!("unknown policy `{s}` (expected kv, round-robin or random)"))
    }
}

/// A routing query: which (worker, dp_rank) should serve this prompt?
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// Frontend-chosen id; lifecycle messages refer to it.
    pub request_id: RequestId,
    /// The prompt.
    pub prompt: Prompt,
    /// Use this policy instead of the daemon's default (A/B comparisons, replay).
    #[serde(default)]
    pub policy: Option<PolicyKind>,
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
    /// The policy that made the decision.
    pub policy: PolicyKind,
}

/// Why a route request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteErrorCode {
    /// The request could not be decoded or is invalid (e.g. an empty prompt).
    BadRequest,
    /// No worker is registered.
    NoWorkers,
    /// Every worker is saturated and the wait queue is full.
    Overloaded,
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

/// A step in a routed request's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LifecycleEvent {
    /// The first output token was produced: prefill is over, the request now decodes.
    PrefillDone,
    /// The request finished or was aborted; its load is released.
    Freed,
}

/// A lifecycle update for a previously routed request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LifecycleMessage {
    /// The id given in the [`RouteRequest`].
    pub request_id: RequestId,
    /// What happened.
    pub event: LifecycleEvent,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    #[test]
    fn route_messages_round_trip() {
        let req = RouteRequest {
            request_id: "r1".into(),
            prompt: Prompt::Blocks {
                block_hashes: vec![LocalBlockHash(1)],
                num_tokens: 700,
            },
            policy: Some(PolicyKind::RoundRobin),
        };
        assert_eq!(decode::<RouteRequest>(&encode(&req).unwrap()).unwrap(), req);

        let ok = RouteReply::Routed(RouteDecision {
            request_id: "r1".into(),
            worker_id: WorkerId(2),
            dp_rank: DpRank(0),
            overlap_blocks: 1,
            request_blocks: 2,
            policy: PolicyKind::Kv,
        });
        assert_eq!(decode::<RouteReply>(&encode(&ok).unwrap()).unwrap(), ok);

        let err = RouteReply::Error(RouteError {
            code: RouteErrorCode::NoWorkers,
            message: "no workers registered".into(),
        });
        assert_eq!(decode::<RouteReply>(&encode(&err).unwrap()).unwrap(), err);

        let life = LifecycleMessage {
            request_id: "r1".into(),
            event: LifecycleEvent::Freed,
        };
        assert_eq!(
            decode::<LifecycleMessage>(&encode(&life).unwrap()).unwrap(),
            life
        );
    }

    #[test]
    fn policy_names_parse_and_print() {
        for p in PolicyKind::ALL {
            assert_eq!(p.as_str().parse::<PolicyKind>().unwrap(), p);
            let wire: String = decode(&encode(&p).unwrap()).unwrap();
            assert_eq!(wire, p.as_str());
        }
        assert!("fastest".parse::<PolicyKind>().is_err());
    }

    #[test]
    fn request_without_policy_field_decodes() {
        #[derive(Serialize)]
        struct Minimal {
            request_id: &'static str,
            prompt: Prompt,
        }
        let bytes = encode(&Minimal {
            request_id: "x",
            prompt: Prompt::Tokens {
                token_ids: vec![1, 2],
            },
        })
        .unwrap();
        let req: RouteRequest = decode(&bytes).unwrap();
        assert_eq!(req.policy, None);
    }
}
