//! The engine's answer on its way to the client: relayed event by event as
//! server-sent events, or assembled into one JSON body for a client that did not ask
//! to stream.
//!
//! An [`Answer`] owns the request's [`Booking`], so its end — the last event, an
//! engine error, the deadline, or the client going away (axum drops the body stream)
//! — frees the booking. An engine silent for longer than the stream idle timeout
//! (`--stream-idle-timeout-ms`) after its first token is taken as hung: the answer
//! ends with an error. A streamed chunk the client gets as the engine sent it
//! (completions, pass-through chats) is only peeked at — errors, usage, an empty
//! `choices` — and its text passed on unchanged: no JSON tree is built and nothing is
//! re-serialized. The usage's cached prompt tokens go to the parity monitor
//! ([`crate::parity`]). Other chunks (a chat forwarded as tokens, rewritten from completion
//! chunks; a non-streamed answer, assembled) are parsed once. Nothing is buffered
//! beyond one event.

use crate::forward::Events;
use crate::metrics::GatewayMetrics;
use crate::parity::{Pending, Reported};
use crate::router::Booking;
use axum::body::Body;
use bytes::Bytes;
use eventsource_stream::Event;
use futures::StreamExt;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, HashSet};
use std::convert::Infallible;
use std::time::Duration;
use tokio::time::Instant;

/// What the client gets, given what the engine sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Completion chunks, as the engine sent them.
    Completion,
    /// Completion chunks from the engine, turned into chat chunks (a chat forwarded
    /// as tokens).
    ChatFromCompletion,
    /// Chat chunks, as the engine sent them (pass-through).
    Chat,
}

/// One request's answer in flight.
pub struct Answer {
    /// The first event, already received.
    pub(crate) first: Option<Event>,
    pub(crate) events: Events,
    pub(crate) booking: Option<Booking>,
    pub(crate) shape: Shape,
    /// Whether the answer is streamed to the client (set by [`Answer::into_sse`]).
    pub(crate) stream: bool,
    /// Whether a streaming client asked for the final usage chunk.
    pub(crate) include_usage: bool,
    pub(crate) deadline: Instant,
    /// Longest silence between two engine events.
    pub(crate) idle: Duration,
    pub(crate) metrics: GatewayMetrics,
    pub(crate) endpoint: &'static str,
    /// When the request arrived.
    pub(crate) arrived: Instant,
    /// When the last event arrived.
    pub(crate) last: Instant,
    /// Choice indices that already got their chat `role`.
    pub(crate) roles_sent: HashSet<u64>,
    pub(crate) finished: bool,
    /// The router's prediction, judged against the engine's usage when it arrives
    /// (or as unreported at `[DONE]` without one); `None` once judged, or when this
    /// answer is not judged (a disaggregated request's decode half).
    pub(crate) parity: Option<Pending>,
}

/// A chunk on its way to the client.
enum Chunk {
    /// The engine's own JSON text, passed on unchanged.
    Raw(String),
    /// A parsed (and possibly rewritten) chunk.
    Parsed(Value),
}

/// What the gateway must see of a chunk it passes on unchanged; the rest is skipped
/// without being built (no map, no string is allocated for it).
#[derive(Deserialize)]
struct Peek {
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(default)]
    usage: Option<PeekUsage>,
    #[serde(default)]
    choices: Option<Vec<IgnoredAny>>,
}

/// The `usage` fields the gateway reads.
#[derive(Deserialize)]
pub(crate) struct PeekUsage {
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PeekDetails>,
}

#[derive(Deserialize)]
struct PeekDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl PeekUsage {
    fn reported(&self) -> Reported {
        Reported {
            cached_tokens: (self.prompt_tokens_details.as_ref()).and_then(|d| d.cached_tokens),
            prompt_tokens: self.prompt_tokens,
        }
    }
}

/// What the `usage` of a whole engine answer (a prefill half's) reports; nothing when
/// the answer is not JSON or has no usage.
pub(crate) fn answer_usage(answer: &[u8]) -> Reported {
    #[derive(Deserialize)]
    struct Whole {
        #[serde(default)]
        usage: Option<PeekUsage>,
    }
    serde_json::from_slice::<Whole>(answer)
        .ok()
        .and_then(|w| w.usage)
        .map_or_else(Reported::default, |u| u.reported())
}

/// An engine event, read.
enum Read {
    /// A chunk to pass on (rewritten if needed), or `None` to drop it.
    Chunk(Option<Chunk>),
    /// The engine said `[DONE]`.
    Done,
    /// The engine reported an error in its stream.
    Error(String),
}

impl Answer {
    /// The next engine event, translated, or `None` at the end (after which the
    /// booking is freed).
    async fn next(&mut self) -> Option<Read> {
        if self.finished {
            return None;
        }
        let event = match self.first.take() {
            Some(event) => event,
            None => match tokio::time::timeout_at(
                self.deadline.min(self.last + self.idle),
                self.events.next(),
            )
            .await
            {
                Ok(Some(Ok(event))) => {
                    let now = Instant::now();
                    self.metrics.itl(self.endpoint, now - self.last);
                    self.last = now;
                    event
                }
                Ok(Some(Err(e))) => return Some(Read::Error(format!("engine stream broke: {e}"))),
                Ok(None) => return Some(Read::Error("engine closed the stream early".into())),
                Err(_) if Instant::now() >= self.deadline => {
                    return Some(Read::Error("request timed out".into()));
                }
                Err(_) => {
                    return Some(Read::Error(format!(
                        "the engine sent nothing for {} ms",
                        self.idle.as_millis()
                    )));
                }
            },
        };
        if event.data.trim() == "[DONE]" {
            self.judge(Reported::default());
            return Some(Read::Done);
        }
        if self.pass_through() {
            // Streamed as the engine sent it: only peek at what the gateway needs.
            if let Ok(peek) = serde_json::from_str::<Peek>(&event.data)
                && peek.error.is_none()
            {
                if let Some(usage) = peek.usage {
                    self.usage(&usage);
                }
                let usage_only = peek.choices.is_some_and(|c| c.is_empty());
                return Some(Read::Chunk(
                    (!usage_only || self.include_usage).then_some(Chunk::Raw(event.data)),
                ));
            }
            // Not JSON, or an error: the full read below says which.
        }
        let Ok(mut chunk) = serde_json::from_str::<Value>(&event.data) else {
            return Some(Read::Error("engine sent a chunk that is not JSON".into()));
        };
        if let Some(error) = chunk.get("error") {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned);
            return Some(Read::Error(message));
        }
        if let Some(Ok(usage)) = chunk.get("usage").map(PeekUsage::deserialize) {
            self.usage(&usage);
        }
        let usage_only = chunk
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty);
        if self.shape == Shape::ChatFromCompletion {
            chunk = self.chat_chunk(chunk);
        }
        Some(Read::Chunk(
            (!usage_only || self.include_usage).then_some(Chunk::Parsed(chunk)),
        ))
    }

    /// Counts an engine usage's generated tokens and judges its cached tokens.
    fn usage(&mut self, usage: &PeekUsage) {
        if let Some(tokens) = usage.completion_tokens {
            self.metrics.completion_tokens(tokens);
        }
        self.judge(usage.reported());
    }

    /// Judges the answer's parity once, by the first usage it carries.
    fn judge(&mut self, reported: Reported) {
        if let Some(pending) = self.parity.take() {
            pending.judge(reported);
        }
    }

    /// Whether chunks go to the client as the engine sent them: streamed, and not
    /// turned from completion chunks into chat chunks.
    fn pass_through(&self) -> bool {
        self.stream && self.shape != Shape::ChatFromCompletion
    }

    /// A completion chunk as a chat chunk: `text` becomes `delta.content`, the first
    /// chunk of each choice also carries `delta.role`.
    fn chat_chunk(&mut self, chunk: Value) -> Value {
        let choices: Vec<Value> =
            chunk
                .get("choices")
                .and_then(Value::as_array)
                .map(|choices| {
                    choices
                    .iter()
                    .map(|c| {
                        let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
                        let mut delta = Map::new();
                        if self.roles_sent.insert(index) {
                            delta.insert("role".into(), json!("assistant"));
                        }
                        delta.insert("content".into(), c.get("text").cloned().unwrap_or(json!("")));
                        json!({
                            "index": index,
                            "delta": delta,
                            "logprobs": null,
                            "finish_reason": c.get("finish_reason").cloned().unwrap_or(Value::Null),
                        })
                    })
                    .collect()
                })
                .unwrap_or_default();
        let mut out = json!({
            "id": chat_id(&chunk),
            "object": "chat.completion.chunk",
            "created": chunk.get("created").cloned().unwrap_or(json!(0)),
            "model": chunk.get("model").cloned().unwrap_or(Value::Null),
            "choices": choices,
        });
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            out["usage"] = usage.clone();
        }
        out
    }

    /// Ends the request: frees the booking, records the end-to-end latency.
    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            if let Some(booking) = self.booking.take() {
                booking.free();
            }
            self.metrics.in_flight().dec();
            self.metrics.e2e(self.endpoint, self.arrived.elapsed());
        }
    }

    /// The answer as a server-sent event body: `data: {...}\n\n` per chunk, then
    /// `data: [DONE]\n\n`; an engine failure mid-stream becomes an `error` event.
    pub fn into_sse(mut self) -> Body {
        self.stream = true;
        let stream = futures::stream::unfold(self, |mut answer| async move {
            loop {
                match answer.next().await? {
                    Read::Chunk(None) => continue,
                    Read::Chunk(Some(Chunk::Raw(data))) => {
                        return Some((Ok::<_, Infallible>(sse(&data)), answer));
                    }
                    Read::Chunk(Some(Chunk::Parsed(chunk))) => {
                        return Some((Ok(sse(&chunk.to_string())), answer));
                    }
                    Read::Done => {
                        answer.finish();
                        return Some((Ok(sse("[DONE]")), answer));
                    }
                    Read::Error(message) => {
                        answer.finish();
                        let error = json!({"error": {"message": message, "type": "engine_error", "param": null, "code": 502}});
                        let bytes = [sse(&error.to_string()), sse("[DONE]")].concat();
                        return Some((Ok(Bytes::from(bytes)), answer));
                    }
                }
            }
        });
        Body::from_stream(stream)
    }

    /// The whole answer as one JSON body, assembled from the engine's chunks.
    ///
    /// # Errors
    /// The engine's error, or a timeout, as a message.
    pub async fn collect(mut self) -> Result<Value, String> {
        // The assembled answer always carries usage, as OpenAI's does.
        self.include_usage = true;
        let mut assembly = Assembly::default();
        let result = loop {
            match self.next().await {
                None | Some(Read::Done) => break Ok(()),
                Some(Read::Chunk(Some(Chunk::Parsed(chunk)))) => assembly.add(&chunk),
                // Only a stream passes chunks through unparsed.
                Some(Read::Chunk(Some(Chunk::Raw(_)))) => {}
                Some(Read::Chunk(None)) => {}
                Some(Read::Error(message)) => break Err(message),
            }
        };
        self.finish();
        result.map(|()| assembly.build(self.shape))
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        // The client went away mid-stream, or the answer was never read: same end.
        self.finish();
    }
}

fn sse(data: &str) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

fn chat_id(chunk: &Value) -> String {
    let id = chunk.get("id").and_then(Value::as_str).unwrap_or("");
    format!("chatcmpl-{}", id.trim_start_matches("cmpl-"))
}

/// Chunks added up into one answer.
#[derive(Default)]
struct Assembly {
    head: Option<Value>,
    choices: BTreeMap<u64, Choice>,
    usage: Option<Value>,
}

#[derive(Default)]
struct Choice {
    text: String,
    reasoning: String,
    finish_reason: Value,
    /// Tool calls by index: id, name, arguments (pieces concatenated).
    tool_calls: BTreeMap<u64, (Value, String, String)>,
}

impl Assembly {
    fn add(&mut self, chunk: &Value) {
        if self.head.is_none() {
            self.head = Some(chunk.clone());
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(usage.clone());
        }
        for c in chunk
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            let choice = self.choices.entry(index).or_default();
            let delta = c.get("delta");
            let text = c
                .get("text")
                .or_else(|| delta.and_then(|d| d.get("content")));
            if let Some(t) = text.and_then(Value::as_str) {
                choice.text.push_str(t);
            }
            if let Some(r) = delta
                .and_then(|d| d.get("reasoning_content"))
                .and_then(Value::as_str)
            {
                choice.reasoning.push_str(r);
            }
            for call in delta
                .and_then(|d| d.get("tool_calls"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let i = call.get("index").and_then(Value::as_u64).unwrap_or(0);
                let entry = choice.tool_calls.entry(i).or_default();
                if let Some(id) = call.get("id").filter(|v| !v.is_null()) {
                    entry.0 = id.clone();
                }
                let function = call.get("function");
                let piece = |k: &str| {
                    function
                        .and_then(|f| f.get(k))
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned()
                };
                entry.1.push_str(&piece("name"));
                entry.2.push_str(&piece("arguments"));
            }
            if let Some(reason) = c.get("finish_reason").filter(|r| !r.is_null()) {
                choice.finish_reason = reason.clone();
            }
        }
    }

    fn build(self, shape: Shape) -> Value {
        let head = self.head.unwrap_or(Value::Null);
        let field = |k: &str| head.get(k).cloned().unwrap_or(Value::Null);
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|(index, c)| match shape {
                Shape::Completion => json!({
                    "index": index,
                    "text": c.text,
                    "logprobs": null,
                    "finish_reason": c.finish_reason,
                }),
                Shape::Chat | Shape::ChatFromCompletion => {
                    let mut message = json!({"role": "assistant", "content": c.text});
                    if !c.reasoning.is_empty() {
                        message["reasoning_content"] = json!(c.reasoning);
                    }
                    if !c.tool_calls.is_empty() {
                        message["tool_calls"] = c
                            .tool_calls
                            .into_values()
                            .map(|(id, name, arguments)| {
                                json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
                            })
                            .collect();
                    }
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": null,
                        "finish_reason": c.finish_reason,
                    })
                }
            })
            .collect();
        let (id, object) = match shape {
            Shape::Completion => (field("id"), "text_completion"),
            Shape::ChatFromCompletion => (json!(chat_id(&head)), "chat.completion"),
            Shape::Chat => (field("id"), "chat.completion"),
        };
        json!({
            "id": id,
            "object": object,
            "created": field("created"),
            "model": field("model"),
            "choices": choices,
            "usage": self.usage.unwrap_or(Value::Null),
        })
    }
}

#[cfg(test)]
mod tests;
