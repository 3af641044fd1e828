//! The OpenAI (vLLM-flavoured) JSON shapes the mock engine reads and writes, and its
//! error type. Field names and defaults follow vLLM's OpenAI server: `prompt` is text
//! or a list of token ids, `max_tokens` defaults to 16, errors are
//! `{"error": {"message", "type", "param", "code"}}` with the HTTP status as `code`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// vLLM's default `max_tokens` for `/v1/completions`, in tokens.
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// The prompt of a completion: text (tokenized by the engine) or token ids as given.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum EnginePrompt {
    /// Text, tokenized with special tokens like vLLM does.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// `stream_options` of a streaming request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` and no choices before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields `/v1/completions` and `/v1/chat/completions` share.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RequestOptions {
    /// Model name; when set it must be the served name.
    #[serde(default)]
    pub model: Option<String>,
    /// Tokens to generate, in tokens (default [`DEFAULT_MAX_TOKENS`]). The mock always
    /// generates exactly this many (no stop conditions), `finish_reason` `length`.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// SGLang's way of choosing the data-parallel rank (vLLM's is the
    /// `X-data-parallel-rank` header, which wins when both are given).
    #[serde(default)]
    pub data_parallel_rank: Option<u32>,
    /// The two halves of a disaggregated request (vLLM's and SGLang's fields).
    #[serde(flatten)]
    pub transfer: TransferFields,
}

/// The fields that join the halves of a disaggregated request, kept as raw JSON:
/// an engine in role `both` ignores them (as vLLM without a KV connector does), a
/// prefill or decode engine checks them against its protocol (`transfer`), so a
/// malformed one is a 400 there and nothing anywhere else.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct TransferFields {
    /// vLLM: `{"do_remote_decode": true, …}` to a prefill worker, the prefill
    /// worker's answer's object to a decode worker.
    #[serde(default)]
    pub kv_transfer_params: Option<serde_json::Value>,
    /// SGLang: the prefill worker's host.
    #[serde(default)]
    pub bootstrap_host: Option<serde_json::Value>,
    /// SGLang: the prefill worker's bootstrap port.
    #[serde(default)]
    pub bootstrap_port: Option<serde_json::Value>,
    /// SGLang: the request's room, an integer in 0..2^63 shared by both halves.
    #[serde(default)]
    pub bootstrap_room: Option<serde_json::Value>,
}

/// The body of `POST /v1/completions` and `POST /v1/completions/render` (fields the
/// mock does not model are ignored).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct EngineCompletionRequest {
    /// The prompt.
    pub prompt: EnginePrompt,
    /// Add the tokenizer's special tokens to a text prompt (vLLM's default for
    /// completions: true).
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    /// Model, length, streaming and rank.
    #[serde(flatten)]
    pub options: RequestOptions,
}

/// The body of `POST /v1/chat/completions` and `POST /v1/chat/completions/render`
/// (fields the mock does not model, such as sampling parameters and tool choice, are
/// ignored; the template options below shape the prompt as vLLM's do).
#[derive(Debug, Clone, Deserialize)]
pub struct EngineChatRequest {
    /// The conversation, rendered with the model's chat template.
    pub messages: Vec<kv_tokenizer::ChatMessage>,
    /// End the prompt with the header of an assistant turn (vLLM's default: true).
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    /// Tool schemas, passed to the template as `tools`.
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// Retrieval documents, passed to the template as `documents`.
    #[serde(default)]
    pub documents: Option<Vec<serde_json::Value>>,
    /// Extra template variables (e.g. `enable_thinking`).
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Add the tokenizer's special tokens to the rendered text (vLLM's default for
    /// chats: false, the template writes them).
    #[serde(default)]
    pub add_special_tokens: bool,
    /// Tokens to generate (OpenAI's newer name); wins over `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Model, length, streaming and rank.
    #[serde(flatten)]
    pub options: RequestOptions,
}

/// The body of `POST /tokenize` (vLLM's completion form).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TokenizeRequest {
    /// Text to encode.
    pub prompt: String,
    /// Add the tokenizer's special tokens (vLLM's default: true).
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
}

fn yes() -> bool {
    true
}

/// Token counts of one request (OpenAI's `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt length, in tokens.
    pub prompt_tokens: u64,
    /// Generated tokens, in tokens.
    pub completion_tokens: u64,
    /// Their sum, in tokens.
    pub total_tokens: u64,
    /// `{"cached_tokens": n}`: prompt tokens served from the prefix cache.
    pub prompt_tokens_details: CachedTokens,
}

/// OpenAI's `prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CachedTokens {
    /// Prompt tokens served from the prefix cache, in tokens.
    pub cached_tokens: u64,
}

impl Usage {
    /// Usage of a prompt of `prompt` tokens (`cached` of them cached) that generated
    /// `completion` tokens.
    pub fn new(prompt: u64, cached: u64, completion: u64) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: CachedTokens {
                cached_tokens: cached,
            },
        }
    }
}

/// An error answered as OpenAI's error JSON with a matching status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// Lowercase explanation for the client.
    pub message: String,
}

impl EngineApiError {
    /// 400: the request is malformed or cannot be served as asked.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    /// The error body, `{"error": {"message", "type", "param": null, "code": status}}`.
    pub fn body(&self) -> serde_json::Value {
        let kind = match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::CONFLICT => "ConflictError",
            StatusCode::PAYLOAD_TOO_LARGE => "RequestTooLargeError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        };
        json!({"error": {
            "message": self.message,
            "type": kind,
            "param": null,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for EngineApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Parses a JSON body, mapping any failure to a 400 that quotes serde's reason.
///
/// # Errors
/// [`EngineApiError`] 400 `malformed request: …`.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, EngineApiError> {
    serde_json::from_slice(body)
        .map_err(|e| EngineApiError::bad_request(format!("malformed request: {e}")))
}
