//! The small endpoints: `POST /tokenize`, `GET /v1/models`, `GET /metrics`,
//! `POST /reset_prefix_cache`, `GET /health`.

use super::EngineHttpState;
use super::openai::{EngineApiError, TokenizeRequest, parse_json};
use crate::protocol::ClearReply;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::sync::Arc;

/// `POST /tokenize` (vLLM): `{"prompt": text}` → `{"tokens", "count", "max_model_len"}`.
pub(super) async fn tokenize(
    State(state): State<Arc<EngineHttpState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || -> Result<serde_json::Value, EngineApiError> {
        let body = body.map_err(|r| EngineApiError {
            status: r.status(),
            message: r.body_text().to_lowercase(),
        })?;
        let req: TokenizeRequest = parse_json(&body)?;
        let tokenizer = state.tokenizer()?;
        let tokens = tokenizer
            .encode(&req.prompt, req.add_special_tokens)
            .map_err(|e| EngineApiError::bad_request(e.to_string()))?;
        Ok(json!({
            "tokens": tokens,
            "count": tokens.len(),
            "max_model_len": state.max_model_len,
        }))
    };
    match run() {
        Ok(body) => axum::Json(body).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models`: the one served model.
pub(super) async fn models(State(state): State<Arc<EngineHttpState>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "kv-mocker",
            "root": state.model_name,
            "parent": null,
            "max_model_len": state.max_model_len,
        }],
    }))
    .into_response()
}

/// `GET /health` (vLLM's): 200 with an empty body while the listener serves. Routers
/// that health-check their workers (SMG, vllm-router) mark a worker down without it.
pub(super) async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /metrics`: Prometheus text with vLLM's names (see `metrics`).
pub(super) async fn metrics(State(state): State<Arc<EngineHttpState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(&state.ranks),
    )
        .into_response()
}

/// `POST /reset_prefix_cache` (vLLM's development endpoint of that name): drops every
/// rank's KV cache if the worker is idle and answers 200 `{"success": true}`; with
/// requests in flight nothing changes and the answer is 200 `{"success": false}`, as
/// vLLM 0.32's. In vLLM mode the `AllBlocksCleared` KV event goes out with the next
/// engine step, as vLLM's does (see `rank::Rank::clear_locked`). The body is ignored.
pub(super) async fn reset_prefix_cache(State(state): State<Arc<EngineHttpState>>) -> Response {
    let success = matches!(
        crate::engine::rank::clear_all(&state.ranks),
        ClearReply::Cleared
    );
    axum::Json(json!({ "success": success })).into_response()
}
