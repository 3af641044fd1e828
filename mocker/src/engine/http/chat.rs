//! `POST /v1/chat/completions`: the conversation is rendered with the model's chat
//! template and encoded as vLLM does (`kv_tokenizer::ModelTokenizer::encode_chat`,
//! with the generation prompt), then submitted and answered like a completion, in the
//! chat shapes. It lets a gateway in `--chat-forward passthrough` mode be tested end
//! to end against the mock; tools, response formats and sampling are not modelled.

use super::HttpState;
use super::accepted::{Accepted, Shape};
use super::completions::{Submission, answer, read_body, submit};
use super::openai::{ApiError, ChatRequest, parse_json};
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use kv_tokenizer::ChatOptions;
use std::sync::Arc;

/// The handler.
pub(super) async fn chat_completions(
    State(state): State<Arc<HttpState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match accept(&state, &headers, body) {
        Ok((accepted, stream)) => answer(state, accepted, stream).await,
        Err(e) => e.into_response(),
    }
}

/// Renders and encodes the chat, then submits it. Returns the accepted request and
/// whether to stream.
fn accept(
    state: &HttpState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Accepted, bool), ApiError> {
    let body = read_body(body)?;
    let req: ChatRequest = parse_json(&body)?;
    state.check_model(req.options.model.as_deref())?;
    let options = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    let tokens = state
        .tokenizer()?
        .encode_chat(&req.messages, &options)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let submission = Submission {
        tokens,
        max_tokens: req.max_completion_tokens.or(req.options.max_tokens),
        body_rank: req.options.data_parallel_rank,
        include_usage: req.options.stream_options.is_some_and(|o| o.include_usage),
        shape: Shape::Chat,
    };
    Ok((submit(state, headers, submission)?, req.options.stream))
}
