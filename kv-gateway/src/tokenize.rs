//! Prompt → token ids, the way the engine will see them: the router hashes these ids,
//! so a gateway that tokenizes differently from the engine silently gets no prefix
//! overlap. Two ways, one contract:
//!
//! - **local** (`--tokenize-via local`): `kv_tokenizer::ModelTokenizer` over the
//!   model's own `tokenizer.json` and chat template. Completions are encoded with
//!   special tokens and chats rendered then encoded without them, as vLLM does.
//!   Costs CPU in the gateway (see docs/benchmarks.md), no round trip.
//! - **engine** (`--tokenize-via engine`): vLLM's `POST /tokenize` on any known
//!   engine, so the engine's own code decides. Costs one HTTP round trip per request,
//!   and needs no model files here.
//!
//! Either way, the ids are what the gateway forwards in `--forward tokens` mode, so
//! the engine prefills exactly the blocks the router priced.

use crate::error::ApiError;
use crate::forward::{error_text, read_bounded};
use crate::workers::WorkerUrls;
use kv_tokenizer::{ChatMessage, ChatOptions, ModelTokenizer, TokenizerError};
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;

/// Where prompts are tokenized.
#[derive(Clone)]
pub enum PromptTokenizer {
    /// In process, from the model's files.
    Local(Arc<ModelTokenizer>),
    /// By an engine's `/tokenize`.
    Engine {
        /// The HTTP client for engines.
        client: reqwest::Client,
        /// Where the engines are.
        workers: WorkerUrls,
        /// Longest prompt accepted, in tokens.
        max_prompt_tokens: usize,
    },
}

/// Bytes of one token id in a JSON list at most: ten digits, a comma and a space.
const MAX_BYTES_PER_TOKEN_ID: usize = 12;

#[derive(Deserialize)]
struct TokenizeReply {
    tokens: Vec<u32>,
}

impl PromptTokenizer {
    /// Token ids of a completion prompt (special tokens added, as vLLM's
    /// `/v1/completions` does by default).
    ///
    /// # Errors
    /// 400 for a prompt over the limits; 503 or 502 when no engine can tokenize.
    pub async fn completion(&self, prompt: &str) -> Result<Vec<u32>, ApiError> {
        match self {
            Self::Local(tokenizer) => {
                let tokenizer = Arc::clone(tokenizer);
                let prompt = prompt.to_owned();
                // Encoding a long prompt takes milliseconds of CPU: off the async
                // workers, so streams of other requests keep flowing.
                tokio::task::spawn_blocking(move || tokenizer.encode_completion(&prompt))
                    .await
                    .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))?
                    .map_err(tokenizer_error)
            }
            Self::Engine {
                client,
                workers,
                max_prompt_tokens,
            } => {
                remote(
                    client,
                    workers,
                    *max_prompt_tokens,
                    json!({ "prompt": prompt }),
                )
                .await
            }
        }
    }

    /// Token ids of a chat: the chat template rendered with the generation prompt,
    /// then encoded without adding special tokens (the template has them).
    ///
    /// # Errors
    /// As [`Self::completion`]; 400 also for a model without a chat template.
    pub async fn chat(
        &self,
        messages: Vec<ChatMessage>,
        options: ChatOptions,
    ) -> Result<Vec<u32>, ApiError> {
        match self {
            Self::Local(tokenizer) => {
                let tokenizer = Arc::clone(tokenizer);
                tokio::task::spawn_blocking(move || tokenizer.encode_chat(&messages, &options))
                    .await
                    .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))?
                    .map_err(tokenizer_error)
            }
            Self::Engine {
                client,
                workers,
                max_prompt_tokens,
            } => {
                let body = json!({
                    "messages": messages,
                    "add_generation_prompt": options.add_generation_prompt,
                    "tools": options.tools,
                });
                remote(client, workers, *max_prompt_tokens, body).await
            }
        }
    }
}

/// Asks some engine's `/tokenize` for the token ids of `body` (vLLM's request shape).
async fn remote(
    client: &reqwest::Client,
    workers: &WorkerUrls,
    max_prompt_tokens: usize,
    body: serde_json::Value,
) -> Result<Vec<u32>, ApiError> {
    let url = workers
        .any_url()
        .ok_or_else(|| ApiError::unavailable("no engine is registered to tokenize"))?;
    let response = client
        .post(format!("{url}/tokenize"))
        .json(&body)
        .send()
        .await
        .map_err(|e| ApiError::engine_failed(format!("tokenizing at {url}: {e}")))?;
    let status = response.status();
    if status.is_client_error() {
        let detail = error_text(response).await;
        return Err(ApiError::bad_request(format!(
            "the engine refused to tokenize the prompt ({status}): {detail}"
        )));
    }
    if !status.is_success() {
        return Err(ApiError::engine_failed(format!(
            "tokenizing at {url}: {status}"
        )));
    }
    // A reply longer than the allowed prompt could possibly be is not read further.
    let limit = max_prompt_tokens.saturating_mul(MAX_BYTES_PER_TOKEN_ID) + 1024;
    let (bytes, cut) = read_bounded(response, limit).await;
    if cut {
        return Err(ApiError::bad_request(format!(
            "the prompt has more than the {max_prompt_tokens} tokens allowed"
        )));
    }
    let reply: TokenizeReply = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::engine_failed(format!("tokenize reply from {url}: {e}")))?;
    // The token count itself is checked by the request path, for every tokenizer.
    Ok(reply.tokens)
}

/// 400 for a prompt of `tokens` tokens over the `limit`.
pub(crate) fn too_many(tokens: usize, limit: usize) -> ApiError {
    ApiError::bad_request(format!(
        "the prompt has {tokens} tokens, more than the {limit} allowed"
    ))
}

fn tokenizer_error(e: TokenizerError) -> ApiError {
    match e {
        TokenizerError::TooManyTokens { tokens, max } => too_many(tokens, max),
        TokenizerError::PromptTooLarge { .. }
        | TokenizerError::NoChatTemplate
        | TokenizerError::Render(_)
        | TokenizerError::Encode(_) => ApiError::bad_request(e.to_string()),
        other => ApiError::internal(other.to_string()),
    }
}
