//! The streaming answer of `/v1/completions` and `/v1/chat/completions`: server-sent
//! events in OpenAI's completion-chunk (or chat-completion-chunk) shape, one
//! `data: {…}` event per generated token as the engine produces it, an optional usage
//! chunk, and `data: [DONE]`.
//!
//! The body is a stream that owns the request's [`AbortOnDrop`] guard: when the client
//! disconnects, hyper drops the body, the guard aborts the request and its KV space is
//! freed at once, not when generation would have ended. Between engine steps the
//! stream sleeps on the request's watch channel; each wake-up writes the tokens
//! produced since the last one (the step loop never waits for a slow client).

use super::EngineHttpState;
use super::accepted::{Accepted, EndpointShape, engine_error};
use super::openai::Usage;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

struct Stream {
    state: Arc<EngineHttpState>,
    req: Accepted,
    /// Token chunks written so far.
    sent: u64,
    pending: VecDeque<Bytes>,
    done: bool,
}

/// The `text/event-stream` response for an accepted streaming request.
pub(super) fn response(state: Arc<EngineHttpState>, req: Accepted) -> Response {
    let stream = Stream {
        state,
        req,
        sent: 0,
        pending: VecDeque::new(),
        done: false,
    };
    let body = futures::stream::unfold(stream, |mut s| async move {
        loop {
            if let Some(chunk) = s.pending.pop_front() {
                return Some((Ok::<Bytes, Infallible>(chunk), s));
            }
            if s.done {
                return None;
            }
            if !s.advance() && s.req.rx.changed().await.is_err() {
                s.fail("engine stopped");
            }
        }
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

impl Stream {
    /// Queues chunks for whatever progressed since the last call; false if nothing did.
    fn advance(&mut self) -> bool {
        let p = self.req.rx.borrow_and_update().clone();
        if let Some(e) = &p.error {
            self.fail(e);
            return true;
        }
        let before = self.pending.len();
        let upto = p.output_tokens.min(self.req.max_tokens);
        while self.sent < upto {
            let last = p.finished && self.sent + 1 == upto;
            let text = self.state.token_text(self.sent);
            let finish_reason = if last { Some("length") } else { None };
            let choice = match self.req.shape {
                EndpointShape::Completion => json!({
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": finish_reason,
                    "stop_reason": null,
                }),
                // The role comes with the first delta only, as vLLM sends it.
                EndpointShape::Chat if self.sent == 0 => json!({
                    "index": 0,
                    "delta": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }),
                EndpointShape::Chat => json!({
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }),
            };
            self.push(self.chunk(json!([choice]), None));
            self.sent += 1;
        }
        if p.finished {
            if self.req.include_usage {
                let cached = p.cached_tokens.unwrap_or(0);
                let usage = Usage::new(self.req.prompt_tokens, cached, p.output_tokens);
                self.push(self.chunk(json!([]), Some(usage)));
            }
            self.pending
                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            self.done = true;
        }
        self.pending.len() > before || self.done
    }

    /// Ends the stream with an error event, as vLLM does after the headers are sent.
    fn fail(&mut self, message: &str) {
        self.push(engine_error(message).body());
        self.pending
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.done = true;
    }

    fn chunk(&self, choices: serde_json::Value, usage: Option<Usage>) -> serde_json::Value {
        let object = match self.req.shape {
            EndpointShape::Completion => "text_completion",
            EndpointShape::Chat => "chat.completion.chunk",
        };
        let mut c = json!({
            "id": self.req.id,
            "object": object,
            "created": self.state.created,
            "model": self.state.model_name,
            "choices": choices,
        });
        if let Some(usage) = usage {
            c["usage"] = json!(usage);
        }
        c
    }

    fn push(&mut self, event: serde_json::Value) {
        self.pending
            .push_back(Bytes::from(format!("data: {event}\n\n")));
    }
}
