//! OpenAI request bodies, as far as the gateway needs to read them, and the engine
//! requests built from them.
//!
//! The gateway reads only what routing and forwarding need (`model`, the prompt or
//! messages, `stream`, `stream_options`, chat template options) and forwards every
//! other field as the client sent it, so sampling parameters an engine supports keep
//! working without the gateway knowing them. The engine is always asked to stream
//! with usage (`stream: true`, `stream_options.include_usage: true`): the gateway
//! then sees the first token of every request — for `prefill_done`, TTFT and
//! failover — and assembles a whole answer itself for a client that did not stream.
//! The one exception is the prefill half of a disaggregated request ([`Step`]), which
//! the gateway reads whole and never shows the client. Fields that join the halves
//! (`kv_transfer_params`, `bootstrap_*`) are the gateway's alone: a client's are
//! dropped.

use crate::config::EngineApi;
use crate::error::ApiError;
use crate::session::take_prompt_cache_key;
use kv_events::DpRank;
use kv_events::routing::SessionId;
use kv_tokenizer::{ChatMessage, ChatOptions, template_value};
use serde::Deserialize as _;
use serde_json::{Map, Value, json};

/// A completion prompt as a client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Text, to tokenize.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// A `POST /v1/completions` body.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    /// The whole body, forwarded with the prompt (and streaming options) replaced.
    pub body: Map<String, Value>,
    /// The model asked for.
    pub model: String,
    /// The prompt.
    pub prompt: PromptInput,
    /// Whether the client wants server-sent events.
    pub stream: bool,
    /// Whether a streaming client asked for a final usage chunk.
    pub include_usage: bool,
    /// The body's `prompt_cache_key`, taken out of `body` ([`crate::session`]).
    pub prompt_cache_key: Option<SessionId>,
}

/// A `POST /v1/chat/completions` body.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// The whole body, forwarded as it is in pass-through mode.
    pub body: Map<String, Value>,
    /// The model asked for.
    pub model: String,
    /// The messages.
    pub messages: Vec<ChatMessage>,
    /// Template options (`add_generation_prompt`, `tools`, `chat_template_kwargs`).
    pub options: ChatOptions,
    /// Whether the client wants server-sent events.
    pub stream: bool,
    /// Whether a streaming client asked for a final usage chunk.
    pub include_usage: bool,
    /// The body's `prompt_cache_key`, taken out of `body` ([`crate::session`]).
    pub prompt_cache_key: Option<SessionId>,
}

/// Fields a chat request may carry that the completions API takes under the same
/// name and meaning, copied when a chat is forwarded as tokens.
const CHAT_SAMPLING_FIELDS: &[&str] = &[
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "user",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
];

/// Chat fields whose meaning is lost when a chat is forwarded as tokens.
const CHAT_PASSTHROUGH_ONLY: &[&str] = &["tools", "tool_choice", "response_format", "logprobs"];

fn object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(format!("malformed JSON: {e}"))),
    }
}

fn model(body: &Map<String, Value>) -> Result<String, ApiError> {
    match body.get("model") {
        Some(Value::String(m)) => Ok(m.clone()),
        _ => Err(ApiError::bad_request("`model` must be a string")),
    }
}

fn streaming(body: &Map<String, Value>) -> Result<(bool, bool), ApiError> {
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad_request("`stream` must be a boolean")),
    };
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok((stream, include_usage))
}

fn token_ids(values: &[Value]) -> Option<Vec<u32>> {
    values
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// The output tokens a request asks for at most, when it says: `max_tokens`, or for a
/// chat `max_completion_tokens` (taking precedence unless 0 or absent, as in vLLM). A
/// value that is not a non-negative integer is left to the engine to refuse.
pub fn max_output_tokens(body: &Map<String, Value>, chat: bool) -> Option<u64> {
    let field = |name: &str| body.get(name).and_then(Value::as_u64);
    chat.then(|| field("max_completion_tokens"))
        .flatten()
        .filter(|&n| n > 0)
        .or_else(|| field("max_tokens"))
}

/// Parses a completions body.
///
/// # Errors
/// 400 for malformed JSON, a missing model, a prompt that is not one text or one
/// list of token ids (batches of prompts are not routed as one request), or a bad
/// `prompt_cache_key`.
pub fn parse_completion(bytes: &[u8]) -> Result<CompletionRequest, ApiError> {
    let mut body = object(bytes)?;
    let prompt_cache_key = take_prompt_cache_key(&mut body)?;
    let model = model(&body)?;
    let (stream, include_usage) = streaming(&body)?;
    let prompt = match body.get("prompt") {
        Some(Value::String(text)) => PromptInput::Text(text.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(text)] => PromptInput::Text(text.clone()),
            [Value::Array(ids)] => PromptInput::Tokens(
                token_ids(ids).ok_or_else(|| ApiError::bad_request("token ids must be u32"))?,
            ),
            [] => return Err(ApiError::bad_request("`prompt` is empty")),
            ids if ids.iter().all(Value::is_number) => PromptInput::Tokens(
                token_ids(ids).ok_or_else(|| ApiError::bad_request("token ids must be u32"))?,
            ),
            _ => {
                return Err(ApiError::bad_request(
                    "one prompt per request: `prompt` must be a string or a list of token ids",
                ));
            }
        },
        _ => return Err(ApiError::bad_request("`prompt` is missing")),
    };
    if matches!(&prompt, PromptInput::Text(t) if t.is_empty())
        || matches!(&prompt, PromptInput::Tokens(t) if t.is_empty())
    {
        return Err(ApiError::bad_request("`prompt` is empty"));
    }
    Ok(CompletionRequest {
        body,
        model,
        prompt,
        stream,
        include_usage,
        prompt_cache_key,
    })
}

/// Parses a chat completions body.
///
/// # Errors
/// 400 for malformed JSON, a missing model, messages that are not a non-empty list
/// of `{role, content}` objects with text content, or a bad `prompt_cache_key`.
pub fn parse_chat(bytes: &[u8]) -> Result<ChatRequest, ApiError> {
    let mut body = object(bytes)?;
    let prompt_cache_key = take_prompt_cache_key(&mut body)?;
    let model = model(&body)?;
    let (stream, include_usage) = streaming(&body)?;
    let messages: Vec<ChatMessage> = match body.get("messages") {
        // Read in place: a copy of the list first would double what a body holds.
        Some(messages @ Value::Array(list)) if !list.is_empty() => {
            Vec::<ChatMessage>::deserialize(messages)
                .map_err(|e| ApiError::bad_request(format!("`messages`: {e}")))?
        }
        _ => return Err(ApiError::bad_request("`messages` must be a non-empty list")),
    };
    let mut options = ChatOptions {
        add_generation_prompt: body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        ..ChatOptions::default()
    };
    if let Some(Value::Array(tools)) = body.get("tools") {
        options.tools = Some(tools.iter().map(template_value).collect());
    }
    if let Some(Value::Object(kwargs)) = body.get("chat_template_kwargs") {
        options.template_kwargs = kwargs
            .iter()
            .map(|(k, v)| (k.clone(), template_value(v)))
            .collect();
    }
    Ok(ChatRequest {
        body,
        model,
        messages,
        options,
        stream,
        include_usage,
        prompt_cache_key,
    })
}

/// Which engine request of a routed attempt a body is for: the whole request, or one
/// half of a disaggregated one (docs/disaggregation.md, "The gateway").
#[derive(Debug, Clone, Copy)]
pub enum Step<'a> {
    /// The whole request on one worker: streamed with usage.
    Whole,
    /// vLLM's first step, on the prefill worker: not streamed, one output token
    /// (`max_tokens` 1, and for a chat sent as a chat `max_completion_tokens` 1;
    /// `min_tokens` dropped, as it may not exceed them) and `kv_transfer_params`
    /// asking for a remote decode.
    VllmPrefill,
    /// vLLM's second step, on the decode worker: the whole request, streamed, with
    /// the prefill answer's `kv_transfer_params` (an object, forwarded unchanged).
    VllmDecode(&'a Map<String, Value>),
    /// SGLang's request to the prefill worker: the request, not streamed (its answer
    /// is read and discarded), with the pair's bootstrap.
    SglangPrefill(&'a Bootstrap),
    /// SGLang's request to the decode worker: the whole request, streamed, with the
    /// pair's bootstrap.
    SglangDecode(&'a Bootstrap),
}

/// Where the two halves of an SGLang request meet: the prefill worker's bootstrap
/// server and the request's room there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// `bootstrap_host`: the host of the prefill worker's registered URL.
    pub host: String,
    /// `bootstrap_port`: the prefill worker's registered `kv_transfer.bootstrap_port`.
    pub port: u16,
    /// `bootstrap_room`: random in 0..2^63, one per attempt.
    pub room: u64,
}

/// Body fields only the gateway sets (the transfer between the halves of a
/// disaggregated request): a client's own are dropped, so no client can point a
/// decode worker at a transfer of its choosing.
const TRANSFER_FIELDS: &[&str] = &[
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
];

/// How an engine body is finished: for which step, and how the engine is told its
/// data-parallel rank.
#[derive(Debug, Clone, Copy)]
pub struct EngineTarget<'a> {
    /// vLLM names the rank in a header, SGLang in the body.
    pub api: EngineApi,
    /// The rank of the worker the body goes to.
    pub dp_rank: DpRank,
    /// The whole request or one half.
    pub step: Step<'a>,
}

impl EngineTarget<'_> {
    /// The whole request on `dp_rank`, told the `api` way.
    pub fn whole(api: EngineApi, dp_rank: DpRank) -> Self {
        Self {
            api,
            dp_rank,
            step: Step::Whole,
        }
    }
}

/// Finishes an engine body for `target`: streaming (with usage) or not, the transfer
/// fields of its step, and the dp_rank where the engine expects it (vLLM takes a
/// header, see [`EngineApi`]). `chat_api`: the body goes to `/v1/chat/completions`.
fn for_engine(body: &mut Map<String, Value>, target: EngineTarget<'_>, chat_api: bool) {
    for field in TRANSFER_FIELDS {
        body.remove(*field);
    }
    let streamed = match target.step {
        Step::Whole => true,
        Step::VllmPrefill => {
            body.insert("max_tokens".into(), json!(1));
            if chat_api {
                body.insert("max_completion_tokens".into(), json!(1));
            }
            body.remove("min_tokens");
            body.insert(
                "kv_transfer_params".into(),
                json!({
                    "do_remote_decode": true,
                    "do_remote_prefill": false,
                    "remote_engine_id": null,
                    "remote_block_ids": null,
                    "remote_host": null,
                    "remote_port": null,
                }),
            );
            false
        }
        Step::VllmDecode(params) => {
            body.insert("kv_transfer_params".into(), Value::Object(params.clone()));
            true
        }
        Step::SglangPrefill(bootstrap) | Step::SglangDecode(bootstrap) => {
            body.insert("bootstrap_host".into(), json!(bootstrap.host));
            body.insert("bootstrap_port".into(), json!(bootstrap.port));
            body.insert("bootstrap_room".into(), json!(bootstrap.room));
            matches!(target.step, Step::SglangDecode(_))
        }
    };
    body.insert("stream".into(), Value::Bool(streamed));
    if streamed {
        body.insert("stream_options".into(), json!({ "include_usage": true }));
    } else {
        body.remove("stream_options");
    }
    if target.api == EngineApi::Sglang {
        body.insert("data_parallel_rank".into(), json!(target.dp_rank.0));
    }
}

/// The engine's `/v1/completions` body for a completion, for `target`: the client's
/// body with `prompt` replaced by `tokens` when given (token forwarding).
pub fn completion_for_engine(
    request: &CompletionRequest,
    tokens: Option<&[u32]>,
    target: EngineTarget<'_>,
) -> Map<String, Value> {
    let mut body = request.body.clone();
    if let Some(tokens) = tokens {
        body.insert("prompt".into(), json!(tokens));
    }
    for_engine(&mut body, target, false);
    body
}

/// The engine's `/v1/completions` body for a chat forwarded as tokens, for `target`:
/// the rendered, tokenized chat as `prompt`, and the sampling fields both APIs share.
///
/// # Errors
/// 400 when the chat uses what only the engine's chat endpoint can do (tools,
/// structured output, chat logprobs): use `--chat-forward passthrough`.
pub fn chat_as_completion(
    request: &ChatRequest,
    tokens: &[u32],
    target: EngineTarget<'_>,
) -> Result<Map<String, Value>, ApiError> {
    if let Some(field) = CHAT_PASSTHROUGH_ONLY.iter().find(|f| {
        request
            .body
            .get(**f)
            .is_some_and(|v| !v.is_null() && v != &json!(false))
    }) {
        return Err(ApiError::bad_request(format!(
            "`{field}` needs the gateway's --chat-forward passthrough mode"
        )));
    }
    let mut body = Map::new();
    body.insert("model".into(), json!(request.model));
    body.insert("prompt".into(), json!(tokens));
    for field in CHAT_SAMPLING_FIELDS {
        if let Some(value) = request.body.get(*field) {
            body.insert((*field).into(), value.clone());
        }
    }
    if let Some(value) = request.body.get("max_completion_tokens") {
        body.insert("max_tokens".into(), value.clone());
    }
    for_engine(&mut body, target, false);
    Ok(body)
}

/// The engine's `/v1/chat/completions` body in pass-through mode, for `target`.
pub fn chat_for_engine(request: &ChatRequest, target: EngineTarget<'_>) -> Map<String, Value> {
    let mut body = request.body.clone();
    for_engine(&mut body, target, true);
    body
}

#[cfg(test)]
mod tests;
