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
//!
//! The prefill half of a disaggregated request ([`EngineClient::prefill`]) is one
//! non-streamed answer, read whole within the same deadline as a first token and at
//! most [`MAX_PREFILL_ANSWER_BYTES`]; a longer or broken one fails like a 5xx.

use crate::config::EngineApi;
use crate::error::ApiError;
use axum::http::StatusCode;
use bytes::Bytes;
use eventsource_stream::{Event, Eventsource};
use futures::{Stream, StreamExt};
use kv_events::{DpRank, RequestId};
use serde_json::{Map, Value};
use std::pin::Pin;
use tokio::time::Instant;

/// vLLM's header naming the data-parallel rank a request must run on.
pub const DP_RANK_HEADER: &str = "X-data-parallel-rank";

/// The header naming the request to the engine: the router's request id, the same on
/// both halves of a disaggregated request, as vLLM's own disaggregation proxy does
/// (vLLM then uses it as its request id).
pub const REQUEST_ID_HEADER: &str = "X-Request-Id";

/// Largest answer read from a prefill worker, in bytes: vLLM's carries one token and
/// `kv_transfer_params` with one block id per prompt block (about 0.5 MiB for a
/// 1M-token prompt at 16 tokens a block); a longer one fails the prefill half.
pub const MAX_PREFILL_ANSWER_BYTES: usize = 4 << 20;

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

    /// `url` did not do `what` in time: fail over, or, past the request's deadline,
    /// a 504.
    fn missed(self, url: &str, what: &str) -> AttemptFailure {
        if self.attempt < self.request {
            AttemptFailure::Retry {
                reason: "first_token_timeout",
                detail: format!("{url} {what} in time"),
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

/// One request to one engine.
#[derive(Debug, Clone, Copy)]
pub struct EngineCall<'a> {
    /// The engine's base URL.
    pub url: &'a str,
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'a str,
    /// The body, built by [`crate::openai`].
    pub body: &'a Map<String, Value>,
    /// The rank it must run on (a header for vLLM; SGLang's is in the body).
    pub dp_rank: DpRank,
    /// The router's request id, sent as [`REQUEST_ID_HEADER`].
    pub request_id: &'a RequestId,
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

    /// POSTs `call` and waits until `deadline` for the first server-sent event, which
    /// must be a JSON chunk without an error. Returns it with the rest of the stream.
    ///
    /// # Errors
    /// [`AttemptFailure`], see the module docs.
    pub async fn open(
        &self,
        call: EngineCall<'_>,
        deadline: FirstTokenDeadline,
    ) -> Result<(Event, Events), AttemptFailure> {
        let url = call.url;
        let response = self.send(call, "text/event-stream", deadline).await?;
        let mut events: Events = Box::pin(
            bounded_lines(response.bytes_stream(), MAX_SSE_LINE_BYTES)
                .eventsource()
                .map(|item| item.map_err(|e| e.to_string())),
        );
        match tokio::time::timeout_at(deadline.at(), events.next()).await {
            Err(_) => Err(deadline.missed(url, "sent no first token")),
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

    /// POSTs `call`, a prefill half's non-streamed request, and reads its answer
    /// whole (at most [`MAX_PREFILL_ANSWER_BYTES`]) by `deadline`.
    ///
    /// # Errors
    /// [`AttemptFailure`] as for [`EngineClient::open`]; an answer that is longer,
    /// breaks off or comes too late fails over too.
    pub async fn prefill(
        &self,
        call: EngineCall<'_>,
        deadline: FirstTokenDeadline,
    ) -> Result<Vec<u8>, AttemptFailure> {
        let url = call.url;
        let response = self.send(call, "application/json", deadline).await?;
        let read = read_body(response, MAX_PREFILL_ANSWER_BYTES);
        let (body, end) = match tokio::time::timeout_at(deadline.at(), read).await {
            Err(_) => return Err(deadline.missed(url, "did not finish its prefill")),
            Ok(read) => read,
        };
        let broken = match end {
            BodyEnd::Whole => return Ok(body),
            BodyEnd::Over => {
                format!("answered its prefill with over {MAX_PREFILL_ANSWER_BYTES} bytes")
            }
            BodyEnd::Broken(e) => format!("broke its prefill answer off: {e}"),
        };
        Err(AttemptFailure::Retry {
            reason: "engine_error",
            detail: format!("{url} {broken}"),
        })
    }

    /// POSTs `call` by `deadline`; a 5xx fails over, a 4xx is the client's answer.
    async fn send(
        &self,
        call: EngineCall<'_>,
        accept: &str,
        deadline: FirstTokenDeadline,
    ) -> Result<reqwest::Response, AttemptFailure> {
        let url = call.url;
        let mut request = self
            .client
            .post(format!("{url}{}", call.path))
            .header("accept", accept)
            .header(REQUEST_ID_HEADER, call.request_id.0.as_str())
            .json(call.body);
        if self.api == EngineApi::Vllm {
            request = request.header(DP_RANK_HEADER, call.dp_rank.0);
        }
        let response = match tokio::time::timeout_at(deadline.at(), request.send()).await {
            Err(_) => return Err(deadline.missed(url, "did not answer")),
            Ok(Err(e)) => {
                return Err(AttemptFailure::Retry {
                    reason: "connect",
                    detail: format!("{url}: {e}"),
                });
            }
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let detail = error_text(response).await;
        Err(if status.is_server_error() {
            AttemptFailure::Retry {
                reason: "engine_error",
                detail: format!("{url} answered {status}: {detail}"),
            }
        } else {
            AttemptFailure::Final(engine_refused(status, detail))
        })
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

/// How a bounded read of a body ended.
enum BodyEnd {
    /// The body ended within the bound.
    Whole,
    /// More than the bound arrived; the rest was not read.
    Over,
    /// The body broke off.
    Broken(String),
}

/// At most `limit` bytes of `response`'s body, and how the read ended.
async fn read_body(response: reqwest::Response, limit: usize) -> (Vec<u8>, BodyEnd) {
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => return (body, BodyEnd::Broken(e.to_string())),
        };
        let room = limit.saturating_sub(body.len());
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return (body, BodyEnd::Over);
        }
        body.extend_from_slice(&chunk);
    }
    (body, BodyEnd::Whole)
}

/// At most `limit` bytes of `response`'s body, and whether it was longer (the rest is
/// not read); a body that breaks off ends what is read.
pub(crate) async fn read_bounded(response: reqwest::Response, limit: usize) -> (Vec<u8>, bool) {
    let (body, end) = read_body(response, limit).await;
    (body, matches!(end, BodyEnd::Over))
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
