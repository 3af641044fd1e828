//! The routing service: `RouteRequest` in, `RouteReply` out, on the route subject in a
//! NATS queue group so that each query is answered by exactly one replica.
//!
//! Per query: hash the prompt (or take the given block hashes), ask every indexer shard
//! for its prefix matches, then select and book under the scheduler lock — or wait in
//! the queue while every eligible rank is busy ([`crate::admission`]). Bad requests
//! get a typed error reply; nothing from the network can panic this path.

use crate::admission::AdmitError;
use crate::metrics::counters::{MessageKind, Outcome};
use crate::queue::QueueError;
use crate::state::RouterState;
use indexer::IndexerApi as _;
use kv_events::disaggregation::{
    Disaggregation, PREFILL_BOOKING_SUFFIX, PrefillPlacement, is_prefill_booking_id,
};
use kv_events::limits::decode_within;
use kv_events::routing::{
    MAX_ELIGIBLE_WORKERS, MAX_EXCLUDED_WORKERS, MAX_FALLBACKS, Prompt, RouteDecision, RouteError,
    RouteErrorCode, RouteFallback, RouteReply, RouteRequest,
};
use kv_events::{LocalBlockHash, RequestId, compute_block_hashes};
use scheduler::{ScheduleRequest, SchedulerError, Selection};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// A prompt reduced to what routing needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PromptBlocks {
    /// Hashes to prefix-match, in order.
    pub hashes: Vec<LocalBlockHash>,
    /// Prompt length, in tokens.
    pub num_tokens: u64,
    /// Prompt length in blocks, a partial last block counting as one.
    pub request_blocks: u32,
}

pub(crate) fn error(code: RouteErrorCode, message: impl Into<String>) -> RouteReply {
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
pub(crate) fn prompt_blocks(prompt: Prompt, block_size: u32) -> Result<PromptBlocks, RouteReply> {
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
    let request: RouteRequest = match decode_within(payload, &state.limits) {
        Ok(r) => r,
        Err(refusal) => {
            let subject = state.subjects.route();
            state
                .counters
                .refused(MessageKind::Route, &subject, &refusal);
            return error(
                RouteErrorCode::BadRequest,
                format!("route request refused: {refusal}"),
            );
        }
    };
    let probe = request.prompt.is_empty();
    let reply = route(state, request).await;
    let outcome = match &reply {
        RouteReply::Routed(_) => Outcome::Ok,
        RouteReply::Error(_) => Outcome::Rejected,
    };
    state.counters.message(MessageKind::Route, outcome);
    let route_metrics = &state.counters.metrics.route;
    if probe {
        // Answered as any empty prompt is (refused, nothing booked), but counted
        // apart so that frontends' health checks do not read as refused queries.
        route_metrics.observe_probe(started.elapsed());
    } else {
        route_metrics.observe(&reply, started.elapsed());
    }
    reply
}

async fn route(state: &RouterState, request: RouteRequest) -> RouteReply {
    let priority = request.priority;
    let Some(block_size) = state.block_size.get() else {
        return no_block_size();
    };
    let schedule = match schedule_request(request, block_size.get()) {
        Ok(s) => s,
        Err(reply) => return reply,
    };
    let overlaps = match state
        .indexer
        .find_matches(schedule.block_hashes.as_slice())
        .await
    {
        Ok(o) => o,
        Err(e) => {
            return error(
                RouteErrorCode::Internal,
                format!("indexer unavailable: {e}"),
            );
        }
    };
    // Approximate mode indexes the decision; keep what it needs before `admit` takes
    // the request.
    let request_id = schedule.request_id.clone();
    let request_blocks = schedule.request_blocks;
    let routed_hashes = state
        .indexer
        .is_approximate()
        .then(|| schedule.block_hashes.clone());
    match state.admission.admit(schedule, overlaps, priority).await {
        Ok(sel) => routed(state, request_id, request_blocks, &sel, routed_hashes).await,
        Err(e) => admit_error(e),
    }
}

/// Validates a route request into what the scheduler needs.
///
/// # Errors
/// A `bad_request` reply for a prompt `prompt_blocks` refuses, for more than
/// [`MAX_EXCLUDED_WORKERS`] excluded workers, more than [`MAX_ELIGIBLE_WORKERS`]
/// eligible workers or more than [`MAX_FALLBACKS`] fallbacks, or for a request id ending with
/// `#prefill` (reserved for the booking of a disaggregated request's prefill half).
pub fn schedule_request(
    request: RouteRequest,
    block_size: u32,
) -> Result<ScheduleRequest, RouteReply> {
    if is_prefill_booking_id(&request.request_id) {
        return Err(error(
            RouteErrorCode::BadRequest,
            format!(
                "request id {} ends with `{PREFILL_BOOKING_SUFFIX}`, which the router reserves \
                 for the prefill half of a disaggregated request",
                request.request_id
            ),
        ));
    }
    at_most(
        "excluded workers",
        request.exclude_workers.len(),
        MAX_EXCLUDED_WORKERS,
    )?;
    at_most(
        "eligible workers",
        request.eligible_workers.len(),
        MAX_ELIGIBLE_WORKERS,
    )?;
    at_most(
        "fallbacks asked",
        usize::from(request.fallbacks),
        usize::from(MAX_FALLBACKS),
    )?;
    let prompt = prompt_blocks(request.prompt, block_size)?;
    let mut schedule = ScheduleRequest::new(
        request.request_id,
        prompt.hashes,
        prompt.num_tokens,
        block_size,
    );
    schedule.request_blocks = prompt.request_blocks;
    schedule.policy = request.policy;
    schedule.dp_rank = request.dp_rank;
    schedule.overrides = request.overrides;
    schedule.exclude(request.exclude_workers);
    schedule.restrict_to(request.eligible_workers);
    schedule.fallbacks = request.fallbacks;
    schedule.session_id = request.session_id;
    schedule.allow_disaggregation = request.allow_disaggregation;
    Ok(schedule)
}

/// A `bad_request` reply when a list of `what` holds `count` entries, over `max`.
fn at_most(what: &str, count: usize, max: usize) -> Result<(), RouteReply> {
    if count > max {
        return Err(error(
            RouteErrorCode::BadRequest,
            format!("{count} {what}, at most {max}"),
        ));
    }
    Ok(())
}

/// The reply for a booked request; in approximate mode also indexes the decision
/// (`routed_hashes`) as if the rank had cached the prompt — for a disaggregated
/// request on the prefill rank and on the decode rank, which stores the
/// transferred blocks too (as vLLM's decode instances do).
pub(crate) async fn routed(
    state: &RouterState,
    request_id: RequestId,
    request_blocks: u32,
    sel: &Selection,
    routed_hashes: Option<Vec<LocalBlockHash>>,
) -> RouteReply {
    let remote = sel.disaggregation.and_then(|d| d.prefill);
    debug!(
        request_id = %request_id,
        worker = %sel.rank,
        overlap_blocks = sel.overlap_blocks,
        prefill = ?remote.map(|p| p.rank.to_string()),
        "routed",
    );
    state.counters.metrics.sessions.observe(sel.session);
    if let Some(hashes) = routed_hashes {
        let hashes: Arc<[LocalBlockHash]> = hashes.into();
        let ranks = std::iter::once(sel.rank).chain(remote.map(|p| p.rank));
        for rank in ranks {
            if let Err(e) = state.indexer.record_routing(rank, hashes.clone()).await {
                warn!(error = %e, %rank, "routing decision not indexed");
            }
        }
    }
    RouteReply::Routed(RouteDecision {
        request_id,
        worker_id: sel.rank.worker_id,
        dp_rank: sel.rank.dp_rank,
        overlap_blocks: sel.overlap_blocks,
        request_blocks,
        in_flight_blocks: sel.in_flight_blocks,
        kv_position: remote
            .is_none()
            .then(|| state.removals.position(sel.rank))
            .flatten()
            .map(Box::new),
        policy: sel.policy,
        disaggregation: sel.disaggregation.map(|d| Disaggregation {
            reason: d.reason,
            prefill: d.prefill.map(|p| PrefillPlacement {
                worker_id: p.rank.worker_id,
                dp_rank: p.rank.dp_rank,
                overlap_blocks: p.overlap_blocks,
            }),
        }),
        fallbacks: sel
            .fallbacks
            .iter()
            .map(|f| RouteFallback {
                worker_id: f.rank.worker_id,
                dp_rank: f.rank.dp_rank,
                overlap_blocks: f.overlap_blocks,
            })
            .collect(),
    })
}

/// The reply while no block size is known (adopted, no worker registered): the same
/// `no_workers` reply as for a router with no worker.
pub(crate) fn no_block_size() -> RouteReply {
    admit_error(AdmitError::Scheduler(SchedulerError::NoWorkers))
}

/// The reply for a request that was not booked.
pub(crate) fn admit_error(e: AdmitError) -> RouteReply {
    let code = match &e {
        AdmitError::Scheduler(SchedulerError::NoWorkers | SchedulerError::AllExcluded) => {
            RouteErrorCode::NoWorkers
        }
        AdmitError::Scheduler(SchedulerError::RankUnavailable(_)) => {
            RouteErrorCode::RankUnavailable
        }
        AdmitError::Scheduler(
            SchedulerError::DuplicateRequest(_)
            | SchedulerError::FreedBeforeRouted(_)
            | SchedulerError::InvalidOverride { .. }
            | SchedulerError::ReservedRequestId(_),
        )
        | AdmitError::Queue(QueueError::Duplicate(_)) => RouteErrorCode::BadRequest,
        AdmitError::Scheduler(SchedulerError::AllBusy)
        | AdmitError::Queue(QueueError::Full(_))
        | AdmitError::TimedOut(_)
        | AdmitError::WaitersAhead => RouteErrorCode::Overloaded,
        AdmitError::Queue(QueueError::Closed) | AdmitError::Scheduler(_) => {
            RouteErrorCode::Internal
        }
    };
    error(code, e.to_string())
}

/// Serves the route subjects (the queue group's and this replica's own) until
/// `intake` is cancelled; queries already being handled are answered before this
/// returns. Every reply carries the `answered_by` headers
/// ([`kv_events::ROUTER_ID_HEADER`]).
pub(crate) async fn serve(
    state: Arc<RouterState>,
    client: async_nats::Client,
    subscribers: Vec<async_nats::Subscriber>,
    max_inflight: usize,
    intake: CancellationToken,
    answered_by: async_nats::HeaderMap,
) {
    let service = crate::service::Service {
        client,
        max_inflight,
        intake,
        kind: MessageKind::Route,
        headers: Some(answered_by),
    };
    crate::service::serve_requests(state, subscribers, service, |state, payload| async move {
        handle_route(&state, &payload).await
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::WorkerId;

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
    fn prefill_half_ids_are_refused_and_the_disaggregation_flag_is_kept() {
        let prompt = || Prompt::Tokens {
            token_ids: (0..8).collect(),
        };
        let reserved = schedule_request(RouteRequest::new("r-1#prefill", prompt()), 4);
        let Err(RouteReply::Error(e)) = reserved else {
            panic!("a reserved id was accepted: {reserved:?}");
        };
        assert_eq!(e.code, RouteErrorCode::BadRequest);
        assert!(e.message.contains("r-1#prefill") && e.message.contains("reserves"));
        let mut request = RouteRequest::new("r-1", prompt());
        request.allow_disaggregation = true;
        let schedule = schedule_request(request, 4).unwrap();
        assert!(schedule.allow_disaggregation);
        assert!(
            !schedule_request(RouteRequest::new("r-2", prompt()), 4)
                .unwrap()
                .allow_disaggregation
        );
    }

    #[test]
    fn eligible_sets_and_fallbacks_are_bounded_and_carried() {
        let prompt = || Prompt::Tokens {
            token_ids: (0..8).collect(),
        };
        let refused = |request: RouteRequest| match schedule_request(request, 4) {
            Err(RouteReply::Error(e)) => e,
            other => panic!("accepted: {other:?}"),
        };
        let mut wide = RouteRequest::new("r-1", prompt());
        wide.eligible_workers = (0..=MAX_ELIGIBLE_WORKERS as u64).map(WorkerId).collect();
        let e = refused(wide);
        assert_eq!(e.code, RouteErrorCode::BadRequest);
        assert!(
            e.message.contains("eligible workers, at most"),
            "{}",
            e.message
        );
        let mut greedy = RouteRequest::new("r-2", prompt());
        greedy.fallbacks = MAX_FALLBACKS + 1;
        let e = refused(greedy);
        assert_eq!(e.code, RouteErrorCode::BadRequest);
        assert!(e.message.contains("fallbacks asked"), "{}", e.message);
        let mut fine = RouteRequest::new("r-3", prompt());
        fine.eligible_workers = vec![WorkerId(5), WorkerId(2), WorkerId(5)];
        fine.fallbacks = MAX_FALLBACKS;
        let schedule = schedule_request(fine, 4).unwrap();
        assert_eq!(schedule.eligible_workers, [WorkerId(2), WorkerId(5)]);
        assert_eq!(schedule.fallbacks, MAX_FALLBACKS);
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
