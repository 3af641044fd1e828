//! An accepted completion request, shared by the JSON and the server-sent-event
//! answers: its progress channel, the guard that aborts it in its rank when the
//! client goes away, and the one that adds it to the rank's request counters. A leaf
//! below both answer modules, so neither imports the other.

use super::metrics::{KvConnector, RankCounters};
use super::openai::EngineApiError;
use crate::engine::progress::Progress;
use crate::engine::rank::Rank;
use axum::http::StatusCode;
use kv_events::RequestId;
use std::sync::Arc;
use tokio::sync::watch;

/// Aborts the request in its rank when dropped before the request finished.
#[derive(Debug)]
pub(super) struct AbortOnDrop {
    pub(super) rank: Arc<Rank>,
    pub(super) request_id: RequestId,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        // A no-op when the request already finished (its reply entry is gone).
        self.rank.abort(&self.request_id);
    }
}

/// Adds the request to its rank's counters when dropped, with the request's last
/// progress: however the answer ended (finished, failed, client gone), it is counted
/// once.
#[derive(Debug)]
pub(super) struct CountOnDrop {
    pub(super) counters: RankCounters,
    pub(super) rx: watch::Receiver<Progress>,
    /// Prompt length, in tokens.
    pub(super) prompt_tokens: u64,
    /// Whether (and how) a KV connector saw the request.
    pub(super) kv: KvConnector,
}

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.counters
            .record(&self.rx.borrow(), self.prompt_tokens, self.kv);
    }
}

/// An accepted request and what its response needs.
#[derive(Debug)]
pub(super) struct Accepted {
    /// The request's progress, as its rank reports it.
    pub rx: watch::Receiver<Progress>,
    /// Keeps the request alive; dropping it aborts the request.
    pub guard: AbortOnDrop,
    /// Counts the request when the answer is dropped (held only to be dropped).
    pub _count: CountOnDrop,
    /// The response id (`cmpl-…`).
    pub id: String,
    /// Prompt length, in tokens.
    pub prompt_tokens: u64,
    /// Tokens to generate, in tokens.
    pub max_tokens: u64,
    /// Stream with a final usage chunk.
    pub include_usage: bool,
    /// Which endpoint's JSON shapes the answer takes.
    pub shape: EndpointShape,
    /// vLLM prefill for a remote decode: the `kv_transfer_params` its JSON answer
    /// carries at the top level.
    pub kv_transfer_params: Option<serde_json::Value>,
}

/// The endpoint an answer is shaped for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EndpointShape {
    /// `/v1/completions`: `text_completion` objects, `choices[].text`.
    Completion,
    /// `/v1/chat/completions`: `chat.completion(.chunk)` objects, `choices[].message`
    /// or `choices[].delta` with the assistant's role and content.
    Chat,
}

/// A failure reported by the engine after the request was accepted.
pub(super) fn engine_error(message: &str) -> EngineApiError {
    EngineApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: message.to_owned(),
    }
}
