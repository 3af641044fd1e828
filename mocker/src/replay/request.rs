//! One replayed request, playing the frontend: route it, send it to the chosen engine,
//! report its lifecycle to the router, and time it.
//!
//! Flow: NATS request `RouteRequest` → `RouteReply`; subscribe to a fresh inbox and
//! publish a `GenerateRequest` to the engine with that inbox as reply subject; on
//! `first_token` publish `prefill_done`, on `finished` (or any failure after routing,
//! or a lost route reply) publish `freed`, so the router's load accounting always
//! releases the request.
//! Costs three NATS round trips' worth of messages and one subscription per request.

use super::report::{RequestOutcome, RouteFailure};
use super::{ReplayTarget, TimeScale};
use crate::protocol::{GenerateRequest, GenerateResponse, OP_GENERATE};
use engine_model::trace::TraceRequest;
use futures::StreamExt;
use kv_events::routing::{
    LifecycleEvent, LifecycleMessage, PolicyKind, Prompt, RouteDecision, RouteReply, RouteRequest,
};
use kv_events::{RequestId, decode, encode};
use std::time::Duration;
use tokio::time::Instant;

/// Why a routed request did not finish; logged at debug level.
#[derive(Debug, thiserror::Error)]
enum GenerateFailure {
    #[error("engine error: {0}")]
    Engine(String),
    #[error("timed out")]
    Timeout,
    #[error("nats: {0}")]
    Nats(String),
    #[error("unexpected message: {0}")]
    Protocol(String),
}

/// The settings shared by every request of one pass.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pass {
    /// The routing policy asked for.
    pub policy: PolicyKind,
    /// Trace time runs this many times faster than wall clock.
    pub time_scale: TimeScale,
    /// Wall-clock limit from routing to the last token.
    pub timeout: Duration,
}

/// Replays one trace request, whose prompt is `block_hashes` (engine blocks, from
/// [`engine_model::trace::BlockMapping`]); never fails, every problem is an outcome.
pub(super) async fn replay_request(
    target: &ReplayTarget,
    request_id: RequestId,
    request: &TraceRequest,
    block_hashes: Vec<kv_events::LocalBlockHash>,
    pass: Pass,
) -> RequestOutcome {
    let Pass {
        policy,
        time_scale,
        timeout,
    } = pass;
    let arrival = Instant::now();
    let deadline = arrival + timeout;
    let decision = match route(target, &request_id, request, &block_hashes, policy, timeout).await {
        Ok(decision) => decision,
        Err(failure) => {
            if failure == RouteFailure::Unreachable {
                // The router may have booked the request before its reply was lost
                // (e.g. a timeout); release it. Unknown ids are ignored by the router.
                publish_lifecycle(target, &request_id, LifecycleEvent::Freed).await;
            }
            return RequestOutcome::RouteFailed(failure);
        }
    };
    let worker_id = decision.worker_id;
    let generate = GenerateRequest {
        request_id: request_id.clone(),
        dp_rank: decision.dp_rank,
        block_hashes,
        num_tokens: request.input_length,
        max_tokens: request.output_length.max(1),
    };
    let result = generate_and_wait(target, &decision, &generate, deadline).await;
    publish_lifecycle(target, &request_id, LifecycleEvent::Freed).await;
    match result {
        Ok(timing) => RequestOutcome::Completed {
            worker_id,
            ttft_ms: time_scale.to_model_ms(timing.first_token - arrival),
            e2e_ms: time_scale.to_model_ms(timing.finished - arrival),
            cached_tokens: timing.cached_tokens,
            prompt_tokens: timing.prompt_tokens,
        },
        Err(failure) => {
            tracing::debug!(%request_id, %worker_id, %failure, "request failed");
            RequestOutcome::Failed { worker_id }
        }
    }
}

/// Asks the router for a (worker, dp_rank).
async fn route(
    target: &ReplayTarget,
    request_id: &RequestId,
    request: &TraceRequest,
    block_hashes: &[kv_events::LocalBlockHash],
    policy: PolicyKind,
    timeout: Duration,
) -> Result<RouteDecision, RouteFailure> {
    let route_request = RouteRequest {
        policy: Some(policy),
        ..RouteRequest::new(
            request_id.clone(),
            Prompt::Blocks {
                block_hashes: block_hashes.to_vec(),
                num_tokens: request.input_length,
            },
        )
    };
    let payload = encode(&route_request).map_err(|err| {
        tracing::warn!(%request_id, %err, "cannot encode route request");
        RouteFailure::Internal
    })?;
    let nats_request = async_nats::client::Request::new()
        .payload(payload.into())
        .timeout(Some(timeout));
    let reply = target
        .nats
        .send_request(target.subjects.route(), nats_request)
        .await
        .map_err(|err| {
            tracing::debug!(%request_id, %err, "route request failed");
            RouteFailure::Unreachable
        })?;
    match decode::<RouteReply>(&reply.payload) {
        Ok(RouteReply::Routed(decision)) => Ok(decision),
        Ok(RouteReply::Error(err)) => {
            tracing::debug!(%request_id, code = ?err.code, message = %err.message, "route rejected");
            Err(err.code.into())
        }
        Err(err) => {
            tracing::warn!(%request_id, %err, "undecodable route reply");
            Err(RouteFailure::Unreachable)
        }
    }
}

/// When the engine's two messages arrived and what the first one said.
struct Timing {
    first_token: Instant,
    finished: Instant,
    cached_tokens: u64,
    prompt_tokens: u64,
}

/// Sends the generate request and waits for `first_token` then `finished`, publishing
/// `prefill_done` in between.
async fn generate_and_wait(
    target: &ReplayTarget,
    decision: &RouteDecision,
    generate: &GenerateRequest,
    deadline: Instant,
) -> Result<Timing, GenerateFailure> {
    let inbox = target.nats.new_inbox();
    let mut replies = target
        .nats
        .subscribe(inbox.clone())
        .await
        .map_err(|err| GenerateFailure::Nats(err.to_string()))?;
    let payload = encode(generate).map_err(|err| GenerateFailure::Protocol(err.to_string()))?;
    target
        .nats
        .publish_with_reply(
            target.subjects.engine(decision.worker_id, OP_GENERATE),
            inbox,
            payload.into(),
        )
        .await
        .map_err(|err| GenerateFailure::Nats(err.to_string()))?;

    let mut next = async || -> Result<GenerateResponse, GenerateFailure> {
        let message = tokio::time::timeout_at(deadline, replies.next())
            .await
            .map_err(|_| GenerateFailure::Timeout)?
            .ok_or_else(|| GenerateFailure::Nats("reply subscription closed".to_owned()))?;
        decode::<GenerateResponse>(&message.payload)
            .map_err(|err| GenerateFailure::Protocol(err.to_string()))
    };

    let (cached_tokens, prompt_tokens) = match next().await? {
        GenerateResponse::FirstToken {
            cached_tokens,
            prompt_tokens,
        } => (cached_tokens, prompt_tokens),
        GenerateResponse::Error { message } => return Err(GenerateFailure::Engine(message)),
        other => {
            return Err(GenerateFailure::Protocol(format!(
                "{other:?} before first_token"
            )));
        }
    };
    let first_token = Instant::now();
    publish_lifecycle(target, &generate.request_id, LifecycleEvent::PrefillDone).await;
    match next().await? {
        GenerateResponse::Finished { .. } => Ok(Timing {
            first_token,
            finished: Instant::now(),
            cached_tokens,
            prompt_tokens,
        }),
        GenerateResponse::Error { message } => Err(GenerateFailure::Engine(message)),
        other => Err(GenerateFailure::Protocol(format!(
            "{other:?} after first_token"
        ))),
    }
}

/// Publishes a lifecycle message; failures are logged, not fatal (the router's load
/// estimate is then off for this request, which the replay cannot repair).
async fn publish_lifecycle(target: &ReplayTarget, request_id: &RequestId, event: LifecycleEvent) {
    let message = LifecycleMessage {
        request_id: request_id.clone(),
        event,
    };
    let result = match encode(&message) {
        Ok(payload) => target
            .nats
            .publish(target.subjects.lifecycle(), payload.into())
            .await
            .map_err(|err| err.to_string()),
        Err(err) => Err(err.to_string()),
    };
    if let Err(err) = result {
        tracing::warn!(%request_id, ?event, %err, "cannot publish lifecycle message");
    }
}
