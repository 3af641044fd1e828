//! The small endpoints: `POST /tokenize`, `GET /v1/models`, `GET /metrics`.

use super::HttpState;
use super::openai::{ApiError, TokenizeRequest, parse_json};
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::sync::Arc;

/// `POST /tokenize` (vLLM): `{"prompt": text}` → `{"tokens", "count", "max_model_len"}`.
pub(super) async fn tokenize(
    State(state): State<Arc<HttpState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || -> Result<serde_json::Value, ApiError> {
        let body = body.map_err(|r| ApiError {
            status: r.status(),
            message: r.body_text().to_lowercase(),
        })?;
        let req: TokenizeRequest = parse_json(&body)?;
        let tokenizer = state.tokenizer()?;
        let tokens = tokenizer
            .encode(&req.prompt, req.add_special_tokens)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
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
pub(super) async fn models(State(state): State<Arc<HttpState>>) -> Response {
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

/// `GET /metrics`: Prometheus text with vLLM's names (see `metrics`).
pub(super) async fn metrics(State(state): State<Arc<HttpState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(&state.ranks),
    )
        .into_response()
}
