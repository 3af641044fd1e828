//! The mock engine's request protocol, spoken by the trace replay (the frontend role).
//!
//! Generate: the frontend subscribes to a fresh inbox, then publishes a
//! [`GenerateRequest`] to `{ns}.engine.{worker_id}.generate` with the inbox as the NATS
//! reply subject. The engine publishes exactly two [`GenerateResponse`]s to that inbox:
//! `first_token` when prefill ends, then `finished`, or a single `error`.
//!
//! Clear: a request to `{ns}.engine.{worker_id}.clear` (empty body) drops every cached
//! block of an idle worker, publishes a `Cleared` KV event per dp_rank, and replies
//! with a [`ClearReply`]. The replay uses it to start each policy from a cold cache.
//!
//! All payloads are msgpack maps (see `kv_events::codec`).

use engine_model::EngineRequest;
use kv_events::{DpRank, LocalBlockHash, RequestId};
use serde::{Deserialize, Serialize};

/// The `op` token of the generate subject (`{ns}.engine.{worker}.generate`).
pub const OP_GENERATE: &str = "generate";
/// The `op` token of the clear subject (`{ns}.engine.{worker}.clear`).
pub const OP_CLEAR: &str = "clear";

/// One inference request sent to a mock engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Frontend-chosen id (the same one used for routing).
    pub request_id: RequestId,
    /// The data-parallel rank the router chose.
    #[serde(default)]
    pub dp_rank: DpRank,
    /// One local block hash per prompt block, in prefix order (the last may be partial).
    pub block_hashes: Vec<LocalBlockHash>,
    /// Prompt length, in tokens.
    pub num_tokens: u64,
    /// Tokens to generate (decode steps), at least 1.
    pub max_tokens: u64,
}

/// The request as the engine core admits it; NATS requests carry no token ids.
impl From<GenerateRequest> for EngineRequest {
    fn from(req: GenerateRequest) -> Self {
        Self {
            request_id: req.request_id,
            block_hashes: req.block_hashes,
            prompt_tokens: req.num_tokens,
            max_tokens: req.max_tokens,
            token_ids: None,
        }
    }
}

/// A message from the engine to the request's reply inbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GenerateResponse {
    /// Prefill finished and the first token was produced.
    FirstToken {
        /// Prompt tokens served from the engine's prefix cache, in tokens.
        cached_tokens: u64,
        /// Prompt tokens, in tokens (echo of `num_tokens`).
        prompt_tokens: u64,
    },
    /// The request finished.
    Finished {
        /// Tokens generated, in tokens.
        output_tokens: u64,
    },
    /// The request was rejected or failed; no further message follows.
    Error {
        /// Lowercase reason.
        message: String,
    },
}

/// The reply to a clear request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClearReply {
    /// The cache is empty and `Cleared` events were published.
    Cleared,
    /// The worker still has requests in flight and was left untouched.
    Busy {
        /// Requests still running or waiting.
        active_requests: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::{decode, encode};

    #[test]
    fn protocol_round_trips() {
        let req = GenerateRequest {
            request_id: "r".into(),
            dp_rank: DpRank(0),
            block_hashes: vec![LocalBlockHash(5)],
            num_tokens: 300,
            max_tokens: 20,
        };
        assert_eq!(
            decode::<GenerateRequest>(&encode(&req).unwrap()).unwrap(),
            req
        );
        for resp in [
            GenerateResponse::FirstToken {
                cached_tokens: 0,
                prompt_tokens: 300,
            },
            GenerateResponse::Finished { output_tokens: 20 },
            GenerateResponse::Error {
                message: "queue full".into(),
            },
        ] {
            assert_eq!(
                decode::<GenerateResponse>(&encode(&resp).unwrap()).unwrap(),
                resp
            );
        }
        for reply in [ClearReply::Cleared, ClearReply::Busy { active_requests: 2 }] {
            assert_eq!(
                decode::<ClearReply>(&encode(&reply).unwrap()).unwrap(),
                reply
            );
        }
    }
}
