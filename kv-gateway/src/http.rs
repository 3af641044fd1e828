//! The HTTP surface: OpenAI's endpoints, health and metrics.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/completions` | completions, streamed (SSE) or not |
//! | `POST /v1/chat/completions` | chat completions, streamed or not |
//! | `GET /v1/models` | the one served model |
//! | `GET /health/livez` | 200 while the process serves HTTP |
//! | `GET /health/readyz` | 200 when NATS is connected, a router answers and a worker is known; else 503 with the failing checks |
//! | `GET /metrics` | Prometheus text |
//!
//! Both POST routes read an optional `x-session-id` header ([`crate::session`]).
//!
//! Bodies are bounded (`--max-body-bytes`, 413 above) before they are read, and must
//! arrive within `--body-read-timeout-ms` with no pause over `--body-idle-timeout-ms`
//! (408 and the connection closed); every error is OpenAI's JSON error shape.
//! Connections are served by [`kv_cluster::http::serve`]: one that has not delivered a
//! request's headers within `--header-read-timeout-ms` (from accept, or from the
//! head's first byte on a kept-alive connection) is closed; one idle for
//! `--idle-timeout-s` is closed between requests; at most `--max-connections` are
//! served at once, idle ones closed first to make room.

use crate::error::ApiError;
use crate::flow::Flow;
use crate::session::session_of;
use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kv_cluster::http::BodyTimeout;
use prometheus::{Encoder, Registry, TextEncoder};
use serde_json::json;
use std::sync::Arc;
use tokio::time::Instant;

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The request path.
    pub flow: Flow,
    /// The registry `/metrics` exports.
    pub registry: Arc<Registry>,
}

/// The gateway's routes over `state`.
pub fn router(state: AppState) -> Router {
    let limit = state.flow.limits.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health/livez", get(livez))
        .route("/health/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

fn body_of(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if let Some(timeout) = BodyTimeout::find(&rejection) {
            ApiError::body_too_slow(timeout.to_string())
        } else if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_request(rejection.body_text())
        }
    })
}

fn finish(state: &AppState, endpoint: &str, result: Result<Response, ApiError>) -> Response {
    let response = result.unwrap_or_else(IntoResponse::into_response);
    state
        .flow
        .metrics
        .answered(endpoint, response.status().as_u16());
    response
}

async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let result = match (
        body_of(body, state.flow.limits.max_body_bytes),
        session_of(&headers),
    ) {
        (Ok(body), Ok(session)) => state.flow.completion(&body, session, arrived).await,
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    finish(&state, "completions", result)
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let result = match (
        body_of(body, state.flow.limits.max_body_bytes),
        session_of(&headers),
    ) {
        (Ok(body), Ok(session)) => state.flow.chat(&body, session, arrived).await,
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    finish(&state, "chat_completions", result)
}

async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.flow.model.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kv-router",
        }],
    }))
}

async fn livez() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<serde_json::Value>) {
    let flow = &state.flow;
    let nats = flow.router.nats().connection_state() == async_nats::connection::State::Connected;
    let router = nats && flow.router.probe().await;
    let workers = flow.workers.len();
    let ready = nats && router && workers > 0;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({
            "ready": ready,
            "checks": {
                "nats": nats,
                "router": router,
                "workers": workers,
            },
        })),
    )
}

async fn metrics(State(state): State<AppState>) -> Response {
    let mut text = Vec::new();
    match TextEncoder::new().encode(&state.registry.gather(), &mut text) {
        Ok(()) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4",
            )],
            text,
        )
            .into_response(),
        Err(e) => ApiError::internal(format!("encoding metrics: {e}")).into_response(),
    }
}
