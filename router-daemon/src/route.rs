//! The routing service: `RouteRequest` in, `RouteReply` out, on the route subject in a
//! NATS queue group so that each query is answered by exactly one replica.
//!
//! Per query: hash the prompt (or take the given block hashes), ask every indexer shard
//! for its prefix matches, then select and book under the scheduler lock — or wait in
//! the queue while every eligible rank is busy ([`crate::admission`]). Bad requests
//! get a typed error reply; nothing from the network can panic this path.

use crate::admission::AdmitError;
use crate::counters::{MessageKind, Outcome};
use crate::queue::QueueError;
use crate::state::RouterState;
use futures::StreamExt;
use kv_events::routing::{
    Prompt, RouteDecision, RouteError, RouteErrorCode, RouteReply, RouteRequest,
};
use kv_events::{LocalBlockHash, compute_block_hashes, decode, encode};
use scheduler::{ScheduleRequest, SchedulerError};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// A prompt reduced to what routing needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptBlocks {
    /// Hashes to prefix-match, in order.
    pub hashes: Vec<LocalBlockHash>,
    /// Prompt length, in tokens.
    pub num_tokens: u64,
    /// Prompt length in blocks, a partial last block counting as one.
    pub request_blocks: u32,
}

fn error(code: RouteErrorCode, message: impl Into<String>) -> RouteReply {
    RouteReply::Error(RouteError {
        code,
        message: message.into(),
    })
}

/// Turns a prompt into block hashes and sizes at `block_size` tokens per block.
///
/// # Errors
/// A `bad_request` reply for an empty prompt, or for more block hashes than
/// `ceil(num_tokens / block_size)` blocks can hold.
pub fn prompt_blocks(prompt: Prompt, block_size: u32) -> Result<PromptBlocks, RouteReply> {
    let bs = u64::from(block_size.max(1));
    let (hashes, num_tokens) = match prompt {
        Prompt::Tokens { token_ids } => (
            compute_block_hashes(&token_ids, block_size),
            token_ids.len() as u64,
        ),
        Prompt::Blocks {
            block_hashes,
            num_tokens,
        } => (block_hashes, num_tokens),
    };
    if num_tokens == 0 {
        return Err(error(RouteErrorCode::BadRequest, "empty prompt"));
    }
    let blocks = num_tokens.div_ceil(bs);
    if hashes.len() as u64 > blocks {
        return Err(error(
            RouteErrorCode::BadRequest,
            format!(
                "{} block hashes do not fit {num_tokens} tokens at {block_size} tokens per block",
                hashes.len()
            ),
        ));
    }
    let request_blocks =
        u32::try_from(blocks).map_err(|_| error(RouteErrorCode::BadRequest, "prompt too long"))?;
    Ok(PromptBlocks {
        hashes,
        num_tokens,
        request_blocks,
    })
}

/// Answers one route request payload. Counts the outcome.
pub async fn handle_route(state: &RouterState, payload: &[u8]) -> RouteReply {
    let started = std::time::Instant::now();
    let request: RouteRequest = match decode(payload) {
        Ok(r) => r,
        Err(e) => {
            state
                .counters
                .message(MessageKind::Route, Outcome::Malformed);
            return error(
                RouteErrorCode::BadRequest,
                format!("malformed route request: {e}"),
            );
        }
    };
    let reply = route(state, request).await;
    let outcome = match &reply {
        RouteReply::Routed(_) => Outcome::Ok,
        RouteReply::Error(_) => Outcome::Rejected,
    };
    state.counters.message(MessageKind::Route, outcome);
    state
        .counters
        .metrics
        .route
        .observe(&reply, started.elapsed());
    reply
}

async fn route(state: &RouterState, request: RouteRequest) -> RouteReply {
    let prompt = match prompt_blocks(request.prompt, state.block_size) {
        Ok(p) => p,
        Err(reply) => return reply,
    };
    // Approximate mode indexes the decision below; keep the hashes for it.
    let routed_hashes = state
        .indexer
        .is_approximate()
        .then(|| prompt.hashes.clone());
    let overlaps = match state.indexer.find_matches(prompt.hashes.clone()).await {
        Ok(o) => o,
        Err(e) => {
            return error(
                RouteErrorCode::Internal,
                format!("indexer unavailable: {e}"),
            );
        }
    };
    let mut schedule = ScheduleRequest::new(
        request.request_id.clone(),
        prompt.hashes,
        prompt.num_tokens,
        state.block_size,
    );
    schedule.request_blocks = prompt.request_blocks;
    schedule.policy = request.policy;
    schedule.dp_rank = request.dp_rank;
    schedule.overrides = request.overrides;
    match crate::admission::admit(state, schedule, overlaps, request.priority).await {
        Ok(sel) => {
            debug!(request_id = %request.request_id, worker = %sel.rank, overlap_blocks = sel.overlap_blocks, "routed");
            if let Some(hashes) = routed_hashes
                && let Err(e) = state.indexer.record_routing(sel.rank, hashes).await
            {
                warn!(error = %e, "routing decision not indexed");
            }
            RouteReply::Routed(RouteDecision {
                request_id: request.request_id,
                worker_id: sel.rank.worker_id,
                dp_rank: sel.rank.dp_rank,
                overlap_blocks: sel.overlap_blocks,
                request_blocks: prompt.request_blocks,
                policy: sel.policy,
            })
        }
        Err(e) => admit_error(e),
    }
}

/// The reply for a request that was not booked.
fn admit_error(e: AdmitError) -> RouteReply {
    let code = match &e {
        AdmitError::Scheduler(SchedulerError::NoWorkers) => RouteErrorCode::NoWorkers,
        AdmitError::Scheduler(SchedulerError::RankUnavailable(_)) => {
            RouteErrorCode::RankUnavailable
        }
        AdmitError::Scheduler(
            SchedulerError::DuplicateRequest(_) | SchedulerError::InvalidOverride { .. },
        )
        | AdmitError::Queue(QueueError::Duplicate(_)) => RouteErrorCode::BadRequest,
        AdmitError::Scheduler(SchedulerError::AllBusy)
        | AdmitError::Queue(QueueError::Full(_))
        | AdmitError::TimedOut(_) => RouteErrorCode::Overloaded,
        AdmitError::Queue(QueueError::Closed) | AdmitError::Scheduler(_) => {
            RouteErrorCode::Internal
        }
    };
    error(code, e.to_string())
}

/// Serves the route subject until `intake` is cancelled; queries already being handled
/// are answered before this returns.
pub async fn serve(
    state: Arc<RouterState>,
    client: async_nats::Client,
    subscriber: async_nats::Subscriber,
    max_inflight: usize,
    intake: CancellationToken,
) {
    crate::nats::drain_on_cancel(subscriber, intake)
        .for_each_concurrent(Some(max_inflight), |msg| {
            let state = state.clone();
            let client = client.clone();
            async move {
                let Some(reply_to) = msg.reply.clone() else {
                    state
                        .counters
                        .message(MessageKind::Route, Outcome::Malformed);
                    warn!(subject = %msg.subject, "route request without a reply subject skipped");
                    return;
                };
                let reply = handle_route(&state, &msg.payload).await;
                match encode(&reply) {
                    Ok(bytes) => {
                        if let Err(e) = client.publish(reply_to, bytes.into()).await {
                            warn!(error = %e, "failed to publish route reply");
                        }
                    }
                    Err(e) => warn!(error = %e, "failed to encode route reply"),
                }
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_prompts_hash_full_blocks_and_count_the_partial_one() {
        let p = prompt_blocks(
            Prompt::Tokens {
                token_ids: (0..40).collect(),
            },
            16,
        )
        .unwrap();
        assert_eq!(p.hashes.len(), 2);
        assert_eq!(p.num_tokens, 40);
        assert_eq!(p.request_blocks, 3);
    }

    #[test]
    fn block_prompts_are_checked_against_their_length() {
        let hashes = vec![LocalBlockHash(1), LocalBlockHash(2)];
        let ok = prompt_blocks(
            Prompt::Blocks {
                block_hashes: hashes.clone(),
                num_tokens: 600,
            },
            512,
        )
        .unwrap();
        assert_eq!(ok.request_blocks, 2);
        let too_many = prompt_blocks(
            Prompt::Blocks {
                block_hashes: hashes,
                num_tokens: 100,
            },
            512,
        );
        assert!(matches!(
            too_many,
            Err(RouteReply::Error(RouteError {
                code: RouteErrorCode::BadRequest,
                ..
            }))
        ));
        let empty = prompt_blocks(Prompt::Tokens { token_ids: vec![] }, 16);
        assert!(matches!(
            empty,
            Err(RouteReply::Error(RouteError {
                code: RouteErrorCode::BadRequest,
                ..
            }))
        ));
    }
}
