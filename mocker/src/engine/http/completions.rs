//! `POST /v1/completions`: validate, pick the dp rank, tokenize if needed, submit to
//! the rank's engine core, then answer as one JSON or as server-sent events. The
//! submission and the answer are shared with `/v1/chat/completions` (`chat.rs`),
//! which differs only in how the prompt becomes tokens and in the answer's shape.
//!
//! The request runs on the same [`Rank`] and [`EngineCore`] as NATS requests, so its
//! timing, batching and KV cache (and the KV events the router sees) are the engine
//! model's. An [`AbortOnDrop`] guard travels with the response: if the client goes
//! away (hyper drops the handler future or the streaming body), the request is
//! aborted in the core and its KV space freed, as vLLM aborts on disconnect.
//!
//! [`EngineCore`]: crate::engine::EngineCore

use super::EngineHttpState;
use super::accepted::{AbortOnDrop, Accepted, CountOnDrop, EndpointShape, engine_error};
use super::metrics::KvConnector;
use super::openai::{
    DEFAULT_MAX_TOKENS, EngineApiError, EngineCompletionRequest, EnginePrompt, RequestOptions,
    TransferFields, Usage, parse_json,
};
use super::{sse, transfer};
use crate::engine::progress::Progress;
use crate::engine::rank::SHUTTING_DOWN;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use engine_model::EngineRequest;
use kv_events::RequestId;
use serde_json::json;
use std::sync::Arc;
use tokio::sync::watch;

/// vLLM's header naming the data-parallel rank of a request.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// The handler.
pub(super) async fn completions(
    State(state): State<Arc<EngineHttpState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match accept(&state, body) {
        Ok(submission) => transfer::serve(state, headers, submission).await,
        Err(e) => e.into_response(),
    }
}

/// Answers an accepted request: server-sent events, or one JSON once it finished.
pub(super) async fn answer(
    state: Arc<EngineHttpState>,
    accepted: Accepted,
    stream: bool,
) -> Response {
    if stream {
        return sse::response(state, accepted);
    }
    match wait_finished(accepted.rx.clone()).await {
        Ok(progress) => {
            let text: String = (0..progress.output_tokens)
                .map(|i| state.token_text(i))
                .collect();
            let usage = Usage::new(
                accepted.prompt_tokens,
                progress.cached_tokens.unwrap_or(0),
                progress.output_tokens,
            );
            let (object, choice) = match accepted.shape {
                EndpointShape::Completion => (
                    "text_completion",
                    json!({
                        "index": 0,
                        "text": text,
                        "logprobs": null,
                        "finish_reason": "length",
                        "stop_reason": null,
                    }),
                ),
                EndpointShape::Chat => (
                    "chat.completion",
                    json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null,
                        "finish_reason": "length",
                        "stop_reason": null,
                    }),
                ),
            };
            let mut body = json!({
                "id": accepted.id,
                "object": object,
                "created": state.created,
                "model": state.model_name,
                "choices": [choice],
                "usage": usage,
            });
            if let Some(params) = &accepted.kv_transfer_params {
                body["kv_transfer_params"] = params.clone();
            }
            drop(accepted.guard);
            (StatusCode::OK, axum::Json(body)).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// Waits until the request finished (or failed).
async fn wait_finished(mut rx: watch::Receiver<Progress>) -> Result<Progress, EngineApiError> {
    loop {
        {
            let p = rx.borrow_and_update();
            if p.finished {
                return Ok(p.clone());
            }
            if let Some(e) = &p.error {
                return Err(engine_error(e));
            }
        }
        if rx.changed().await.is_err() {
            return Err(engine_error(SHUTTING_DOWN));
        }
    }
}

/// Reads and validates the request into a submission.
fn accept(
    state: &EngineHttpState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Submission, EngineApiError> {
    let body = read_body(body)?;
    let req: EngineCompletionRequest = parse_json(&body)?;
    state.check_model(req.options.model.as_deref())?;
    let tokens = prompt(state, &req)?;
    Ok(Submission::new(
        tokens,
        req.options,
        EndpointShape::Completion,
    ))
}

/// The prompt's token ids: token ids as given, or the text encoded (with special
/// tokens unless the request says `add_special_tokens: false`, as vLLM does).
/// `POST /v1/completions/render` answers with the same ids.
///
/// # Errors
/// 400 for a text prompt without a tokenizer, or one the tokenizer refuses.
pub(super) fn prompt(
    state: &EngineHttpState,
    req: &EngineCompletionRequest,
) -> Result<Vec<u32>, EngineApiError> {
    match &req.prompt {
        EnginePrompt::Tokens(ids) => Ok(ids.clone()),
        EnginePrompt::Text(text) => state.encode(text, req.add_special_tokens),
    }
}

/// The body, or the extractor's rejection as an OpenAI error.
pub(super) fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, EngineApiError> {
    body.map_err(|rejection| EngineApiError {
        status: rejection.status(),
        message: rejection.body_text().to_lowercase(),
    })
}

/// A prompt ready for a rank, from either endpoint.
pub(super) struct Submission {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// Tokens to generate (default [`DEFAULT_MAX_TOKENS`]).
    pub max_tokens: Option<u64>,
    /// SGLang's body field naming the dp rank.
    pub body_rank: Option<u32>,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Stream a final usage chunk.
    pub include_usage: bool,
    /// The answer's shape.
    pub shape: EndpointShape,
    /// The disaggregation fields, for `transfer`.
    pub transfer: TransferFields,
}

impl Submission {
    /// The submission of `tokens` with the request's `options` (a chat request sets
    /// `max_tokens` from its own fields afterwards).
    pub fn new(tokens: Vec<u32>, options: RequestOptions, shape: EndpointShape) -> Self {
        Self {
            tokens,
            max_tokens: options.max_tokens,
            body_rank: options.data_parallel_rank,
            stream: options.stream,
            include_usage: options.stream_options.is_some_and(|o| o.include_usage),
            shape,
            transfer: options.transfer,
        }
    }
}

/// A submission checked against the engine: its rank and its engine request.
pub(super) struct Admission {
    /// The dp rank.
    pub rank: usize,
    /// What the rank's core runs.
    pub request: EngineRequest,
    /// Stream a final usage chunk.
    pub include_usage: bool,
    /// The answer's shape.
    pub shape: EndpointShape,
}

/// Checks the prompt against the context length and picks the rank.
///
/// # Errors
/// 400 for a bad rank or a prompt the engine cannot serve.
pub(super) fn admit(
    state: &EngineHttpState,
    headers: &HeaderMap,
    submission: Submission,
) -> Result<Admission, EngineApiError> {
    let rank = dp_rank(headers, submission.body_rank, state.ranks.len())?;
    let max_tokens = fits(state, &submission.tokens, submission.max_tokens)?;
    let tokens = submission.tokens;
    Ok(Admission {
        rank,
        request: EngineRequest {
            request_id: RequestId::from(state.next_request_id()),
            block_hashes: state.faults.block_hashes(&tokens, state.block_size),
            prompt_tokens: tokens.len() as u64,
            max_tokens,
            token_ids: Some(tokens),
        },
        include_usage: submission.include_usage,
        shape: submission.shape,
    })
}

/// Submits an admitted request to its rank: prefilled there, or (`kv`
/// [`KvConnector::Loaded`]) with its prompt KV pulled over a transfer.
///
/// # Errors
/// 400 when the core refuses the request, 503 while the engines stop.
pub(super) fn submit(
    state: &EngineHttpState,
    admission: Admission,
    kv: KvConnector,
) -> Result<Accepted, EngineApiError> {
    let Admission {
        rank: dp_rank,
        request,
        include_usage,
        shape,
    } = admission;
    let (request_id, prompt_tokens, max_tokens) = (
        request.request_id.clone(),
        request.prompt_tokens,
        request.max_tokens,
    );
    let rank = state.ranks[dp_rank].clone();
    let submitted = match kv {
        KvConnector::Loaded => rank.submit_transferred(request),
        KvConnector::Absent | KvConnector::Queried => rank.submit_stream(request),
    };
    let rx = submitted.map_err(|message| {
        if message == SHUTTING_DOWN {
            engine_error(&message)
        } else {
            EngineApiError::bad_request(message)
        }
    })?;
    let prefix = match shape {
        EndpointShape::Completion => "cmpl",
        EndpointShape::Chat => "chatcmpl",
    };
    let count = CountOnDrop {
        counters: state.metrics.rank_counters(dp_rank),
        rx: rx.clone(),
        prompt_tokens,
        kv,
    };
    Ok(Accepted {
        rx,
        _count: count,
        guard: AbortOnDrop {
            rank,
            request_id: request_id.clone(),
        },
        id: format!("{prefix}-{request_id}"),
        prompt_tokens,
        max_tokens,
        include_usage,
        shape,
        kv_transfer_params: None,
    })
}

/// Checks a prompt of `tokens` and `max_tokens` (default [`DEFAULT_MAX_TOKENS`])
/// against the context length, as vLLM does before it schedules (or renders) a
/// request; returns the tokens to generate.
///
/// # Errors
/// 400 for an empty prompt, `max_tokens` 0, or a prompt plus `max_tokens` over
/// `--max-model-len`.
pub(super) fn fits(
    state: &EngineHttpState,
    tokens: &[u32],
    max_tokens: Option<u64>,
) -> Result<u64, EngineApiError> {
    if tokens.is_empty() {
        return Err(EngineApiError::bad_request("prompt is empty"));
    }
    let max_tokens = max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if max_tokens == 0 {
        return Err(EngineApiError::bad_request("max_tokens must be at least 1"));
    }
    let prompt_tokens = tokens.len() as u64;
    let total = prompt_tokens.saturating_add(max_tokens);
    if total > state.max_model_len {
        return Err(EngineApiError::bad_request(format!(
            "this model's maximum context length is {} tokens, but {total} were requested \
             ({prompt_tokens} in the prompt, {max_tokens} to generate)",
            state.max_model_len
        )));
    }
    Ok(max_tokens)
}

/// The dp rank: vLLM's `X-data-parallel-rank` header, else SGLang's body field, else 0.
fn dp_rank(
    headers: &HeaderMap,
    body: Option<u32>,
    dp_size: usize,
) -> Result<usize, EngineApiError> {
    let rank = match headers.get(DP_RANK_HEADER) {
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .ok_or_else(|| {
                EngineApiError::bad_request(format!(
                    "{DP_RANK_HEADER} must be a non-negative integer"
                ))
            })?,
        None => body.unwrap_or(0),
    };
    let rank = rank as usize;
    if rank >= dp_size {
        return Err(EngineApiError::bad_request(format!(
            "data parallel rank {rank} out of range (dp size {dp_size})"
        )));
    }
    Ok(rank)
}
