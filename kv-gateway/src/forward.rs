//! Sending one request to one engine and waiting for its first token.
//!
//! Failover is possible only while the client has seen nothing, so the gateway holds
//! the client's response until the engine's first server-sent event arrives. Anything
//! that goes wrong before it — a refused or reset connection, a 5xx, a stream that
//! closes empty — is [`Failure::Retry`]: the caller frees the booking and routes
//! again without that worker. A 4xx is the engine's verdict on the request itself and
//! is passed to the client ([`Failure::Final`]), as is running out of time.

use crate::config::EngineApi;
use crate::error::ApiError;
use axum::http::StatusCode;
use eventsource_stream::{Event, Eventsource};
use futures::{Stream, StreamExt};
use kv_events::DpRank;
use serde_json::{Map, Value};
use std::pin::Pin;
use tokio::time::Instant;

/// vLLM's header naming the data-parallel rank a request must run on.
pub const DP_RANK_HEADER: &str = "X-data-parallel-rank";

/// Largest error body read from an engine, in bytes.
const MAX_ERROR_BODY: usize = 64 << 10;

/// The engine's remaining server-sent events.
pub type Events = Pin<Box<dyn Stream<Item = Result<Event, String>> + Send>>;

/// Why an engine attempt did not produce a first token.
#[derive(Debug)]
pub enum Failure {
    /// Nothing reached the client: free the booking and try another worker.
    Retry {
        /// `connect` or `engine_error`, the retry metric's reason.
        reason: &'static str,
        /// What happened, for the log and the final 502.
        detail: String,
    },
    /// Answer the client with this.
    Final(ApiError),
}

/// The HTTP client for engines.
#[derive(Clone)]
pub struct EngineClient {
    client: reqwest::Client,
    api: EngineApi,
}

impl EngineClient {
    /// Engines are called with `client` and told the dp_rank the `api` way.
    pub fn new(client: reqwest::Client, api: EngineApi) -> Self {
        Self { client, api }
    }

    /// The underlying HTTP client.
    pub fn http(&self) -> &reqwest::Client {
        &self.client
    }

    /// POSTs `body` to `{url}{path}` on `dp_rank` and waits until `deadline` for the
    /// first server-sent event. Returns it with the rest of the stream.
    ///
    /// # Errors
    /// [`Failure`], see the module docs.
    pub async fn open(
        &self,
        url: &str,
        path: &str,
        body: &Map<String, Value>,
        dp_rank: DpRank,
        deadline: Instant,
    ) -> Result<(Event, Events), Failure> {
        let mut request = self
            .client
            .post(format!("{url}{path}"))
            .header("accept", "text/event-stream")
            .json(body);
        if self.api == EngineApi::Vllm {
            request = request.header(DP_RANK_HEADER, dp_rank.0);
        }
        let timed_out =
            || Failure::Final(ApiError::timeout(format!("{url} did not answer in time")));
        let response = match tokio::time::timeout_at(deadline, request.send()).await {
            Err(_) => return Err(timed_out()),
            Ok(Err(e)) => {
                return Err(Failure::Retry {
                    reason: "connect",
                    detail: format!("{url}: {e}"),
                });
            }
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        if !status.is_success() {
            let detail = error_text(response).await;
            return Err(if status.is_server_error() {
                Failure::Retry {
                    reason: "engine_error",
                    detail: format!("{url} answered {status}: {detail}"),
                }
            } else {
                Failure::Final(engine_refused(status, detail))
            });
        }
        let mut events: Events = Box::pin(
            response
                .bytes_stream()
                .eventsource()
                .map(|item| item.map_err(|e| e.to_string())),
        );
        match tokio::time::timeout_at(deadline, events.next()).await {
            Err(_) => Err(timed_out()),
            Ok(Some(Ok(first))) => Ok((first, events)),
            Ok(Some(Err(e))) => Err(Failure::Retry {
                reason: "engine_error",
                detail: format!("{url} broke its stream before the first token: {e}"),
            }),
            Ok(None) => Err(Failure::Retry {
                reason: "engine_error",
                detail: format!("{url} closed its stream before the first token"),
            }),
        }
    }
}

/// At most `limit` bytes of `response`'s body, and whether it was longer (the rest is
/// not read); a body that breaks off ends what is read.
pub(crate) async fn read_bounded(response: reqwest::Response, limit: usize) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(Ok(chunk)) = chunks.next().await {
        let room = limit.saturating_sub(body.len());
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return (body, true);
        }
        body.extend_from_slice(&chunk);
    }
    (body, false)
}

/// The engine's error message: `error.message` of an OpenAI error body, else the
/// first bytes of the body (at most [`MAX_ERROR_BODY`] are read).
pub(crate) async fn error_text(response: reqwest::Response) -> String {
    let (body, _) = read_bounded(response, MAX_ERROR_BODY).await;
    serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| {
            v.get("error")
                .and_then(|e| e.get("message").or(Some(e)))
                .map(|m| m.as_str().map_or_else(|| m.to_string(), str::to_owned))
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned())
}

/// A 4xx from the engine, passed on with its status.
fn engine_refused(status: reqwest::StatusCode, message: String) -> ApiError {
    let status = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_REQUEST);
    ApiError {
        status,
        kind: "invalid_request_error",
        message: format!("the engine refused the request: {message}"),
        retry_after_s: None,
    }
}
