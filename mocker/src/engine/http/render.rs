//! vLLM's render endpoints, `POST /v1/completions/render` and
//! `POST /v1/chat/completions/render`: they take the body of `/v1/completions` or
//! `/v1/chat/completions` and answer with what the engine would feed the model,
//! without running it. A router that hashes these ids (kv-router's gateway with
//! `--tokenize-via render`, llm-d's token producer) sees exactly the blocks the engine
//! will prefill, with no model files of its own.
//!
//! Shapes (vLLM's `GenerateRequest`, as its render server returns it): the chat render
//! is one object, the completions render a list with one object per prompt (the mock
//! takes one prompt per request, so a list of one):
//!
//! ```text
//! {"request_id": "cmpl-…" | "chatcmpl-…", "token_ids": [u32…], "features": null,
//!  "sampling_params": {"max_tokens": n}, "model": name, "stream": bool,
//!  "stream_options": {…} | null, "cache_salt": null, "priority": 0,
//!  "kv_transfer_params": null}
//! ```
//!
//! The ids come from the same code as the generating endpoints' ([`completions::prompt`],
//! [`chat::prompt`]), and the same checks apply: unknown model 404, a prompt plus
//! `max_tokens` over `--max-model-len` 400, template errors 400, each in OpenAI's error
//! JSON. `sampling_params` carries only what the mock models (`max_tokens`). Nothing
//! is scheduled, so a render costs the engine one encode and no KV blocks.
//!
//! [`completions::prompt`]: super::completions::prompt
//! [`chat::prompt`]: super::chat::prompt

use super::EngineHttpState;
use super::completions::{fits, read_body};
use super::openai::{
    EngineApiError, EngineChatRequest, EngineCompletionRequest, RequestOptions, parse_json,
};
use super::{chat, completions};
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::sync::Arc;

/// `POST /v1/completions/render`: `[GenerateRequest]`.
pub(super) async fn completion(
    State(state): State<Arc<EngineHttpState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&state, body, |state, req: EngineCompletionRequest| {
        state.check_model(req.options.model.as_deref())?;
        let tokens = completions::prompt(state, &req)?;
        let max_tokens = fits(state, &tokens, req.options.max_tokens)?;
        let rendered = generate_request(state, "cmpl", tokens, max_tokens, &req.options);
        Ok(json!([rendered]))
    })
}

/// `POST /v1/chat/completions/render`: one `GenerateRequest`.
pub(super) async fn chat(
    State(state): State<Arc<EngineHttpState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&state, body, |state, req: EngineChatRequest| {
        state.check_model(req.options.model.as_deref())?;
        let tokens = chat::prompt(state, &req)?;
        let max_tokens = req.max_completion_tokens.or(req.options.max_tokens);
        let max_tokens = fits(state, &tokens, max_tokens)?;
        Ok(generate_request(
            state,
            "chatcmpl",
            tokens,
            max_tokens,
            &req.options,
        ))
    })
}

/// Parses `body` as `R` and answers what `render` makes of it, or the error.
fn answer<R: DeserializeOwned>(
    state: &EngineHttpState,
    body: Result<Bytes, BytesRejection>,
    render: impl FnOnce(&EngineHttpState, R) -> Result<Value, EngineApiError>,
) -> Response {
    let rendered = read_body(body)
        .and_then(|body| parse_json(&body))
        .and_then(|req| render(state, req));
    match rendered {
        Ok(body) => axum::Json(body).into_response(),
        Err(e) => e.into_response(),
    }
}

/// vLLM's `GenerateRequest` for a rendered prompt of `tokens`.
fn generate_request(
    state: &EngineHttpState,
    prefix: &str,
    tokens: Vec<u32>,
    max_tokens: u64,
    options: &RequestOptions,
) -> Value {
    json!({
        "request_id": format!("{prefix}-{}", state.next_request_id()),
        "token_ids": tokens,
        "features": null,
        "sampling_params": {"max_tokens": max_tokens},
        "model": options.model.as_deref().unwrap_or(&state.model_name),
        "stream": options.stream,
        "stream_options": options.stream_options.filter(|_| options.stream),
        "cache_salt": null,
        "priority": 0,
        "kv_transfer_params": null,
    })
}
