//! Sending one request to one engine and waiting for its first token.
//!
//! Failover is possible only while the client has seen nothing, so the gateway holds
//! the client's response until the engine's first server-sent event has arrived and
//! been read. Anything that goes wrong before it — a refused or reset connection, a
//! 5xx, a stream that closes empty, no first token within the first-token timeout, a
//! first event that is not a JSON chunk or reports an error — is [`AttemptFailure::Retry`]:
//! the caller frees the booking and routes again without that worker. A 4xx is the
//! engine's verdict on the request itself and is passed to the client
//! ([`AttemptFailure::Final`]), as is running out of the whole request's time.
//!
//! The engine's stream is bounded before it is parsed: a line longer than
//! [`MAX_SSE_LINE_BYTES`] breaks the stream, so an engine that sends garbage without
//! newlines cannot make the gateway buffer it.

use crate::config::EngineApi;
use crate::error::ApiError;
use axum::http::StatusCode;
use bytes::Bytes;
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

/// Longest line of an engine's event stream, in bytes (a chunk with logprobs of many
/// candidates stays far below); a longer one breaks the stream.
pub const MAX_SSE_LINE_BYTES: usize = 4 << 20;

/// When one attempt must have its first token: the earlier of the attempt's
/// first-token timeout and the whole request's deadline.
#[derive(Debug, Clone, Copy)]
pub struct FirstTokenDeadline {
    /// The attempt's first-token deadline; missing it fails over.
    pub attempt: Instant,
    /// The whole request's deadline; missing it is a 504.
    pub request: Instant,
}

impl FirstTokenDeadline {
    fn at(self) -> Instant {
        self.attempt.min(self.request)
    }

    fn missed(self, url: &str) -> AttemptFailure {
        if self.attempt < self.request {
            AttemptFailure::Retry {
                reason: "first_token_timeout",
                detail: format!("{url} sent no first token in time"),
            }
        } else {
            AttemptFailure::Final(ApiError::timeout(format!("{url} did not answer in time")))
        }
    }
}

/// The engine's remaining server-sent events.
pub type Events = Pin<Box<dyn Stream<Item = Result<Event, String>> + Send>>;

/// Why an engine attempt did not produce a first token.
#[derive(Debug)]
pub enum AttemptFailure {
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
    /// first server-sent event, which must be a JSON chunk without an error. Returns
    /// it with the rest of the stream.
    ///
    /// # Errors
    /// [`AttemptFailure`], see the module docs.
    pub async fn open(
        &self,
        url: &str,
        path: &str,
        body: &Map<String, Value>,
        dp_rank: DpRank,
        deadline: FirstTokenDeadline,
    ) -> Result<(Event, Events), AttemptFailure> {
        let mut request = self
            .client
            .post(format!("{url}{path}"))
            .header("accept", "text/event-stream")
            .json(body);
        if self.api == EngineApi::Vllm {
            request = request.header(DP_RANK_HEADER, dp_rank.0);
        }
        let response = match tokio::time::timeout_at(deadline.at(), request.send()).await {
            Err(_) => return Err(deadline.missed(url)),
            Ok(Err(e)) => {
                return Err(AttemptFailure::Retry {
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
                AttemptFailure::Retry {
                    reason: "engine_error",
                    detail: format!("{url} answered {status}: {detail}"),
                }
            } else {
                AttemptFailure::Final(engine_refused(status, detail))
            });
        }
        let mut events: Events = Box::pin(
            bounded_lines(response.bytes_stream(), MAX_SSE_LINE_BYTES)
                .eventsource()
                .map(|item| item.map_err(|e| e.to_string())),
        );
        match tokio::time::timeout_at(deadline.at(), events.next()).await {
            Err(_) => Err(deadline.missed(url)),
            Ok(Some(Ok(first))) => match unusable_first(&first) {
                None => Ok((first, events)),
                Some(why) => Err(AttemptFailure::Retry {
                    reason: "engine_error",
                    detail: format!("{url} {why}"),
                }),
            },
            Ok(Some(Err(e))) => Err(AttemptFailure::Retry {
                reason: "engine_error",
                detail: format!("{url} broke its stream before the first token: {e}"),
            }),
            Ok(None) => Err(AttemptFailure::Retry {
                reason: "engine_error",
                detail: format!("{url} closed its stream before the first token"),
            }),
        }
    }
}

/// Why an engine's first event cannot start an answer, if it cannot: the end of the
/// stream, a chunk that is not JSON, or an error. Nothing has reached the client then,
/// so the request can go to another worker.
fn unusable_first(event: &Event) -> Option<String> {
    let data = event.data.trim();
    if data == "[DONE]" {
        return Some("ended its stream before the first token".into());
    }
    match serde_json::from_str::<Value>(data) {
        Err(_) => Some("sent a first event that is not a JSON chunk".into()),
        Ok(chunk) => chunk.get("error").map(|error| {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned);
            format!("reported an error before the first token: {message}")
        }),
    }
}

/// `chunks` with a bound on line length: once more than `max_line` bytes arrive
/// without a newline, the stream yields an error (and the caller drops it).
fn bounded_lines<S>(chunks: S, max_line: usize) -> impl Stream<Item = Result<Bytes, String>>
where
    S: Stream<Item = reqwest::Result<Bytes>>,
{
    let mut open_line = 0usize;
    chunks.map(move |chunk| {
        let chunk = chunk.map_err(|e| e.to_string())?;
        open_line = match chunk.iter().rposition(|&b| b == b'\n') {
            Some(at) => chunk.len() - at - 1,
            None => open_line.saturating_add(chunk.len()),
        };
        if open_line > max_line {
            return Err(format!("a line of the stream is over {max_line} bytes"));
        }
        Ok(chunk)
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn event(data: &str) -> Event {
        Event {
            data: data.into(),
            ..Event::default()
        }
    }

    #[test]
    fn only_a_json_chunk_without_an_error_starts_an_answer() {
        let chunk = r#"{"choices":[{"index":0,"text":" a"}]}"#;
        assert_eq!(unusable_first(&event(chunk)), None);
        for (data, why) in [
            ("[DONE]", "before the first token"),
            ("<html>oops</html>", "not a JSON chunk"),
            (r#"{"error":{"message":"CUDA error"}}"#, "CUDA error"),
        ] {
            let found = unusable_first(&event(data)).expect(data);
            assert!(found.contains(why), "{data}: {found}");
        }
    }

    #[tokio::test]
    async fn a_line_over_the_bound_breaks_the_stream() {
        let chunks = ["data: 12", "345678\n\ndata: x", "yyyyyyyyyy"]
            .map(|c| Ok::<_, reqwest::Error>(Bytes::from(c)));
        let out: Vec<_> = bounded_lines(futures::stream::iter(chunks), 8)
            .collect()
            .await;
        assert!(out[0].is_ok() && out[1].is_ok(), "{out:?}");
        assert!(out[2].as_ref().unwrap_err().contains("over 8 bytes"));
    }
}
