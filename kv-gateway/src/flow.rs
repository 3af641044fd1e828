//! One request's way through the gateway: tokenize → route → forward → answer, with
//! failover while the client has seen nothing (before the first token; for a client
//! that did not stream, until the answer is whole).
//!
//! ```text
//! body ─ parse ─ model? ─ tokenize ─ length? ─┬─ route (exclude tried) ─ engine URL? ─ open ─┬─ first event ─ Answer (stream / assemble)
//!                                             │                  └─ prefill half ─ open decode ─┤
//!                                             └─────── retry on AttemptFailure::Retry ◀──────┘
//! ```
//!
//! `length?` is the prompt bound of [`crate::limit`]: a prompt the engines would refuse
//! for its length is refused here, before it costs a route and a forward.
//!
//! Every routed attempt holds a [`crate::router::Booking`]; an attempt that fails
//! drops it (so the router frees that worker's load) before the next one is routed.
//! When the router names a prefill worker, the attempt runs the two halves of a
//! disaggregated request (`halves`) and its answer is the decode worker's; a failed
//! half excludes the worker of that half from the next route.
//!
//! Reading, checking and tokenizing a body (`parse`, `model?`, `tokenize`, `length?`)
//! is module `plan`, which the endpoint picker (`kv-epp`) reaches through
//! [`Flow::tokenize_body`].

use crate::answer::{Answer, Shape};
use crate::config::{ModelConfig, RequestLimits};
use crate::error::ApiError;
use crate::forward::{AttemptFailure, EngineCall, EngineClient, Events, FirstTokenDeadline};
use crate::limit::PromptLimits;
use crate::metrics::GatewayMetrics;
use crate::openai::{
    ChatRequest, CompletionRequest, EngineTarget, chat_as_completion, chat_for_engine,
    completion_for_engine,
};
use crate::parity::ParityMonitor;
use crate::router::{Booking, RouterClient};
use crate::tokenize::PromptTokenizer;
use crate::workers::WorkerUrls;
use axum::Json;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use eventsource_stream::Event;
use halves::Half;
use kv_events::routing::{Prompt, RouteDecision, SessionId};
use kv_events::{RequestId, WorkerId, compute_block_hashes};
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::sync::Arc;
use tokio::time::Instant;
use tracing::{debug, warn};

mod halves;
mod plan;

pub use plan::{BodyKind, Tokenized};

/// What the request path needs, shared by every request.
#[derive(Clone)]
pub struct Flow {
    /// Model, tokenization and forwarding settings.
    pub model: ModelConfig,
    /// Timeouts, sizes, retries.
    pub limits: RequestLimits,
    /// The bound on one prompt, read per request.
    pub prompt: PromptLimits,
    /// Prompt → token ids.
    pub tokenizer: PromptTokenizer,
    /// Routing and lifecycle.
    pub router: RouterClient,
    /// Worker id → engine URL.
    pub workers: WorkerUrls,
    /// Engine HTTP client.
    pub engine: EngineClient,
    /// Metrics.
    pub metrics: GatewayMetrics,
    /// Predicted overlap against the engines' cached tokens.
    pub parity: ParityMonitor,
}

/// What the engine is sent, per mode.
enum EngineRequest {
    Completion {
        request: CompletionRequest,
        forward_tokens: bool,
    },
    ChatAsCompletion(ChatRequest),
    Chat(ChatRequest),
}

impl EngineRequest {
    fn body(
        &self,
        tokens: &[u32],
        target: EngineTarget<'_>,
    ) -> Result<Map<String, Value>, ApiError> {
        Ok(match self {
            Self::Completion {
                request,
                forward_tokens,
            } => completion_for_engine(request, forward_tokens.then_some(tokens), target),
            Self::ChatAsCompletion(chat) => chat_as_completion(chat, tokens, target)?,
            Self::Chat(chat) => chat_for_engine(chat, target),
        })
    }

    fn path(&self) -> &'static str {
        match self {
            Self::Completion { .. } | Self::ChatAsCompletion(_) => "/v1/completions",
            Self::Chat(_) => "/v1/chat/completions",
        }
    }

    fn shape(&self) -> Shape {
        match self {
            Self::Completion { .. } => Shape::Completion,
            Self::ChatAsCompletion(_) => Shape::ChatFromCompletion,
            Self::Chat(_) => Shape::Chat,
        }
    }
}

/// A parsed, tokenized request ready to route.
struct Plan {
    endpoint: &'static str,
    /// The prompt's token ids, shared with the answer's parity check (module
    /// `parity::race`), which reads them after the request ends.
    tokens: Arc<[u32]>,
    request: EngineRequest,
    stream: bool,
    include_usage: bool,
    /// The `x-session-id` header, else the body's `prompt_cache_key`, passed to the
    /// router.
    session: Option<SessionId>,
}

impl Flow {
    /// `POST /v1/completions`, of the session `session` (the `x-session-id` header,
    /// which wins over the body's `prompt_cache_key`).
    pub async fn completion(
        &self,
        body: &[u8],
        session: Option<SessionId>,
        arrived: Instant,
    ) -> Result<Response, ApiError> {
        let plan = self.plan_completion(body, session).await?;
        self.serve(plan, arrived).await
    }

    /// `POST /v1/chat/completions`, of the session `session` (the `x-session-id`
    /// header, which wins over the body's `prompt_cache_key`).
    pub async fn chat(
        &self,
        body: &[u8],
        session: Option<SessionId>,
        arrived: Instant,
    ) -> Result<Response, ApiError> {
        let plan = self.plan_chat(body, session).await?;
        self.serve(plan, arrived).await
    }

    /// Routes and forwards, failing over while nothing has reached the client: before
    /// the first token, and for a client that did not stream, until the answer is
    /// whole.
    async fn serve(&self, plan: Plan, arrived: Instant) -> Result<Response, ApiError> {
        let deadline = arrived + self.limits.request_timeout;
        let attempts = self.limits.max_retries + 1;
        // Workers that failed, of either half: the router picks neither half there.
        let mut exclude: Vec<WorkerId> = Vec::new();
        let mut last_failure = String::new();
        let prompt = self.route_prompt(&plan.tokens);
        for attempt in 1..=attempts {
            let started = Instant::now();
            let routed = self
                .router
                .route(
                    self.router.request_id(),
                    prompt.clone(),
                    &exclude,
                    plan.session.as_ref(),
                    self.model.disaggregation,
                )
                .await;
            let (decision, booking) = match routed {
                Ok(routed) => routed,
                // Every worker was tried: the engines failed, not the router.
                Err(e) if !exclude.is_empty() && e.status.as_u16() == 503 => break,
                Err(e) => return Err(e),
            };
            self.metrics.stage("route", started.elapsed());
            self.metrics
                .overlap(decision.overlap_blocks, decision.request_blocks);
            self.metrics.routed(
                decision
                    .disaggregation
                    .map_or("aggregated", |d| d.reason.as_str()),
            );
            let failed = match self
                .attempt(&plan, &decision, booking, arrived, deadline)
                .await
            {
                Ok(mut response) => {
                    decision_headers(&mut response, &decision);
                    return Ok(response);
                }
                Err(failed) => failed,
            };
            let Failed {
                worker,
                half,
                failure,
            } = failed;
            match failure {
                AttemptFailure::Final(e) => return Err(e),
                AttemptFailure::Retry { reason, detail } => {
                    // The attempt's booking is gone: the router freed that load
                    // (both halves of a disaggregated attempt) before the next route.
                    let half = half.map(Half::as_str);
                    warn!(worker = %worker, half, attempt, attempts, reason, detail, "engine failed before the client saw anything");
                    if attempt < attempts {
                        self.metrics.retry(reason);
                        if let Some(half) = half {
                            self.metrics.half_retry(half, reason);
                        }
                    }
                    exclude.push(worker);
                    last_failure = detail;
                }
            }
        }
        Err(ApiError::engine_failed(format!(
            "no engine answered ({} tried): {last_failure}",
            exclude.len()
        )))
    }

    /// What the route request carries: the prompt's block hashes when the fleet has
    /// one block size (the hashes the router would compute from the token ids, at
    /// 9 bytes a block instead of 1–5 bytes a token, so the message for a 16k-token
    /// prompt shrinks from tens of KB to about 1 KB), else the token ids.
    fn route_prompt(&self, tokens: &[u32]) -> Prompt {
        match self.workers.block_size() {
            Some(block_size) => Prompt::Blocks {
                block_hashes: compute_block_hashes(tokens, block_size),
                num_tokens: tokens.len() as u64,
            },
            None => Prompt::Tokens {
                token_ids: tokens.to_vec(),
            },
        }
    }

    /// One engine attempt of `plan` on the routed worker (and its prefill worker,
    /// when the router named one), holding `booking` (dropped, and so freed, when
    /// the attempt fails).
    async fn attempt(
        &self,
        plan: &Plan,
        decision: &RouteDecision,
        mut booking: Booking,
        arrived: Instant,
        deadline: Instant,
    ) -> Result<Response, Failed> {
        let worker = decision.worker_id;
        let opened = Instant::now();
        let prefill = decision.disaggregation.and_then(|d| d.prefill);
        // Who failed when the answer breaks after its first token.
        let decode_half = prefill.map(|_| Half::Decode);
        let (first, events, url) = match prefill {
            None => self
                .open_whole(plan, decision, booking.request_id(), deadline)
                .await
                .map_err(|failure| Failed {
                    worker,
                    half: None,
                    failure,
                })?,
            Some(prefill) => {
                self.open_halves(plan, decision, prefill, &mut booking, deadline)
                    .await?
            }
        };
        booking.prefill_done();
        self.metrics.stage("engine", opened.elapsed());
        self.metrics.ttft(plan.endpoint, arrived.elapsed());
        self.metrics.prompt_tokens(plan.tokens.len());
        self.metrics.in_flight().inc();
        debug!(request_id = %booking.request_id(), worker = %worker, dp_rank = %decision.dp_rank, overlap_blocks = decision.overlap_blocks, "first token");
        // A disaggregated answer is judged on its prefill half (`halves`).
        let parity = (prefill.is_none())
            .then(|| {
                let (overlap, in_flight) = (decision.overlap_blocks, decision.in_flight_blocks);
                (self.parity).pending(worker, overlap, in_flight, plan.tokens.len())
            })
            .flatten()
            .map(|pending| pending.with_race(decision, &plan.tokens));
        let answer = Answer {
            first: Some(first),
            events,
            booking: Some(booking),
            shape: plan.request.shape(),
            stream: false,
            include_usage: plan.include_usage,
            deadline,
            idle: self.limits.stream_idle_timeout,
            metrics: self.metrics.clone(),
            endpoint: plan.endpoint,
            arrived,
            last: Instant::now(),
            roles_sent: HashSet::new(),
            finished: false,
            parity,
        };
        if plan.stream {
            return Ok((
                [
                    (header::CONTENT_TYPE, "text/event-stream"),
                    (header::CACHE_CONTROL, "no-cache"),
                ],
                answer.into_sse(),
            )
                .into_response());
        }
        // The client sees nothing until the answer is whole, so an engine that fails
        // after its first token is failed over like one that failed before it.
        let failure = match answer.collect().await {
            Ok(whole) => return Ok(Json(whole).into_response()),
            Err(_) if Instant::now() >= deadline => {
                AttemptFailure::Final(ApiError::timeout(format!("{url} did not finish in time")))
            }
            Err(message) => AttemptFailure::Retry {
                reason: "engine_error",
                detail: format!("{url} failed after its first token: {message}"),
            },
        };
        Err(Failed {
            worker,
            half: decode_half,
            failure,
        })
    }

    /// Opens the whole request on the routed worker: its first event, the rest of
    /// its stream, and its URL.
    async fn open_whole(
        &self,
        plan: &Plan,
        decision: &RouteDecision,
        request_id: &RequestId,
        deadline: Instant,
    ) -> Result<(Event, Events, String), AttemptFailure> {
        let worker = decision.worker_id;
        let Some(url) = self.workers.url(worker) else {
            return Err(AttemptFailure::Retry {
                reason: "no_url",
                detail: format!("worker {worker} registered no engine url"),
            });
        };
        let target = EngineTarget::whole(self.model.engine_api, decision.dp_rank);
        let body = plan
            .request
            .body(&plan.tokens, target)
            .map_err(AttemptFailure::Final)?;
        let call = EngineCall {
            url: &url,
            path: plan.request.path(),
            body: &body,
            dp_rank: decision.dp_rank,
            request_id,
        };
        let (first, events) = self
            .engine
            .open(call, self.first_token(Instant::now(), deadline))
            .await?;
        Ok((first, events, url))
    }

    /// When an engine request sent at `sent` must have its first token (or, for a
    /// prefill half, its whole answer).
    fn first_token(&self, sent: Instant, deadline: Instant) -> FirstTokenDeadline {
        FirstTokenDeadline {
            attempt: sent + self.limits.first_token_timeout,
            request: deadline,
        }
    }
}

/// An attempt that failed, and the worker the next route excludes for it.
struct Failed {
    /// The worker that failed: the routed one, or the prefill worker.
    worker: WorkerId,
    /// Which half of a disaggregated attempt failed; `None` for a whole request.
    half: Option<Half>,
    failure: AttemptFailure,
}

/// Response header naming the worker that served the request.
pub const WORKER_HEADER: &str = "x-kv-router-worker-id";
/// Response header naming the data-parallel rank that served the request.
pub const DP_RANK_RESPONSE_HEADER: &str = "x-kv-router-dp-rank";
/// Response header with the router's overlap for the request, in blocks.
pub const OVERLAP_HEADER: &str = "x-kv-router-overlap-blocks";
/// Response header with the router's disaggregation decision (its reason's wire
/// name), when the reply had one.
pub const DISAGGREGATION_HEADER: &str = "x-kv-router-disaggregation";
/// Response header naming the worker that prefilled a disaggregated request.
pub const PREFILL_WORKER_HEADER: &str = "x-kv-router-prefill-worker-id";
/// Response header with the router's overlap on the prefill worker, in blocks.
pub const PREFILL_OVERLAP_HEADER: &str = "x-kv-router-prefill-overlap-blocks";

/// Says where the request went, for operators and load generators: the worker, its
/// rank and the prefix overlap the router predicted there, and for a disaggregated
/// request the decision, the prefill worker and its overlap.
fn decision_headers(response: &mut Response, decision: &RouteDecision) {
    let headers = response.headers_mut();
    let prefill = decision.disaggregation.and_then(|d| d.prefill);
    let numbers = [
        Some((WORKER_HEADER, decision.worker_id.0)),
        Some((DP_RANK_RESPONSE_HEADER, u64::from(decision.dp_rank.0))),
        Some((OVERLAP_HEADER, u64::from(decision.overlap_blocks))),
        prefill.map(|p| (PREFILL_WORKER_HEADER, p.worker_id.0)),
        prefill.map(|p| (PREFILL_OVERLAP_HEADER, u64::from(p.overlap_blocks))),
    ];
    for (name, value) in numbers.into_iter().flatten() {
        headers.insert(name, axum::http::HeaderValue::from(value));
    }
    if let Some(disaggregation) = decision.disaggregation {
        let reason = axum::http::HeaderValue::from_static(disaggregation.reason.as_str());
        headers.insert(DISAGGREGATION_HEADER, reason);
    }
}
