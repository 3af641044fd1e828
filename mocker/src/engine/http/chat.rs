//! `POST /v1/chat/completions`: the conversation is rendered with the model's chat
//! template and encoded as vLLM does (with the request's `add_generation_prompt`,
//! `tools`, `documents`, `chat_template_kwargs` and `add_special_tokens`), then
//! submitted and answered like a completion, in the chat shapes. It lets a gateway in
//! `--chat-forward passthrough` mode be tested end to end against the mock; tool
//! calls, response formats and sampling are not modelled. [`prompt`] is also what
//! `POST /v1/chat/completions/render` answers with, so a render's ids are exactly the
//! ids this endpoint prefills.

use super::EngineHttpState;
use super::accepted::EndpointShape;
use super::completions::{Submission, read_body};
use super::openai::{EngineApiError, EngineChatRequest, parse_json};
use super::transfer;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use kv_tokenizer::{ChatOptions, template_value};
use std::sync::Arc;

/// The handler.
pub(super) async fn chat_completions(
    State(state): State<Arc<EngineHttpState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match accept(&state, body) {
        Ok(submission) => transfer::serve(state, headers, submission).await,
        Err(e) => e.into_response(),
    }
}

/// Renders and encodes the chat into a submission.
fn accept(
    state: &EngineHttpState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Submission, EngineApiError> {
    let body = read_body(body)?;
    let req: EngineChatRequest = parse_json(&body)?;
    state.check_model(req.options.model.as_deref())?;
    let tokens = prompt(state, &req)?;
    let max_tokens = req.max_completion_tokens.or(req.options.max_tokens);
    let mut submission = Submission::new(tokens, req.options, EndpointShape::Chat);
    submission.max_tokens = max_tokens;
    Ok(submission)
}

/// The prompt's token ids: the messages rendered with the model's chat template and
/// the request's template options, encoded with special tokens only if the request
/// asks (`add_special_tokens`, false by default: the template writes them).
///
/// # Errors
/// 400 without a tokenizer or chat template, for a template error (e.g. a role it
/// refuses) or an encode error.
pub(super) fn prompt(
    state: &EngineHttpState,
    req: &EngineChatRequest,
) -> Result<Vec<u32>, EngineApiError> {
    let options = ChatOptions {
        add_generation_prompt: req.add_generation_prompt,
        tools: req
            .tools
            .as_ref()
            .map(|tools| tools.iter().map(template_value).collect()),
        documents: req
            .documents
            .as_ref()
            .map(|docs| docs.iter().map(template_value).collect()),
        template_kwargs: req
            .chat_template_kwargs
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), template_value(v)))
            .collect(),
    };
    let tokenizer = state.tokenizer()?;
    let text = tokenizer
        .render_chat(&req.messages, &options)
        .map_err(|e| EngineApiError::bad_request(e.to_string()))?;
    tokenizer
        .encode(&text, req.add_special_tokens)
        .map_err(|e| EngineApiError::bad_request(e.to_string()))
}
