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

/// Streams with usage, and the dp_rank where the engine expects it (vLLM takes a
/// header, see [`EngineApi`]).
fn engine_streaming(body: &mut Map<String, Value>, api: EngineApi, dp_rank: DpRank) {
    body.insert("stream".into(), Value::Bool(true));
    body.insert("stream_options".into(), json!({ "include_usage": true }));
    if api == EngineApi::Sglang {
        body.insert("data_parallel_rank".into(), json!(dp_rank.0));
    }
}

/// The engine's `/v1/completions` body for a completion: the client's body with
/// `prompt` replaced by `tokens` when given (token forwarding).
pub fn completion_for_engine(
    request: &CompletionRequest,
    tokens: Option<&[u32]>,
    api: EngineApi,
    dp_rank: DpRank,
) -> Map<String, Value> {
    let mut body = request.body.clone();
    if let Some(tokens) = tokens {
        body.insert("prompt".into(), json!(tokens));
    }
    engine_streaming(&mut body, api, dp_rank);
    body
}

/// The engine's `/v1/completions` body for a chat forwarded as tokens: the rendered,
/// tokenized chat as `prompt`, and the sampling fields both APIs share.
///
/// # Errors
/// 400 when the chat uses what only the engine's chat endpoint can do (tools,
/// structured output, chat logprobs): use `--chat-forward passthrough`.
pub fn chat_as_completion(
    request: &ChatRequest,
    tokens: &[u32],
    api: EngineApi,
    dp_rank: DpRank,
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
    engine_streaming(&mut body, api, dp_rank);
    Ok(body)
}

/// The engine's `/v1/chat/completions` body in pass-through mode.
pub fn chat_for_engine(
    request: &ChatRequest,
    api: EngineApi,
    dp_rank: DpRank,
) -> Map<String, Value> {
    let mut body = request.body.clone();
    engine_streaming(&mut body, api, dp_rank);
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_output_bound_is_max_tokens_or_a_chats_max_completion_tokens() {
        let body = |v: Value| v.as_object().cloned().unwrap();
        let both = body(json!({"max_tokens": 7, "max_completion_tokens": 5}));
        assert_eq!(max_output_tokens(&both, true), Some(5));
        assert_eq!(max_output_tokens(&both, false), Some(7));
        let zero = body(json!({"max_tokens": 7, "max_completion_tokens": 0}));
        assert_eq!(max_output_tokens(&zero, true), Some(7));
        for none in [
            json!({}),
            json!({"max_tokens": null}),
            json!({"max_tokens": "9"}),
        ] {
            assert_eq!(max_output_tokens(&body(none.clone()), true), None, "{none}");
        }
    }

    #[test]
    fn completion_prompts_are_one_text_or_one_list_of_ids() {
        let text = parse_completion(br#"{"model":"m","prompt":"hi","stream":true}"#).unwrap();
        assert_eq!(text.prompt, PromptInput::Text("hi".into()));
        assert!(text.stream && !text.include_usage);
        let ids = parse_completion(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(ids.prompt, PromptInput::Tokens(vec![1, 2, 3]));
        let nested = parse_completion(br#"{"model":"m","prompt":[[4,5]]}"#).unwrap();
        assert_eq!(nested.prompt, PromptInput::Tokens(vec![4, 5]));
        for bad in [
            &br#"{"model":"m","prompt":["a","b"]}"#[..],
            br#"{"model":"m","prompt":[]}"#,
            br#"{"model":"m","prompt":[-1]}"#,
            br#"{"model":"m"}"#,
            br#"{"prompt":"x"}"#,
            br#"{"model":"m","prompt":"x","stream":"yes"}"#,
            br#"[1]"#,
            br#"{"model": "m", "prompt": "#,
        ] {
            let err = parse_completion(bad).unwrap_err();
            assert_eq!(err.status.as_u16(), 400, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_engine_gets_token_ids_streaming_with_usage_and_the_rank_its_way() {
        let request = parse_completion(
            br#"{"model":"m","prompt":"hi","max_tokens":7,"stream":false,"custom":1}"#,
        )
        .unwrap();
        let body = completion_for_engine(&request, Some(&[9, 8]), EngineApi::Sglang, DpRank(3));
        assert_eq!(body["prompt"], json!([9, 8]));
        assert_eq!(body["stream"], json!(true));
        assert_eq!(body["stream_options"]["include_usage"], json!(true));
        assert_eq!(body["data_parallel_rank"], json!(3));
        assert_eq!(body["max_tokens"], json!(7));
        assert_eq!(body["custom"], json!(1), "unknown fields are forwarded");
        let vllm = completion_for_engine(&request, None, EngineApi::Vllm, DpRank(3));
        assert_eq!(vllm["prompt"], json!("hi"));
        assert!(
            vllm.get("data_parallel_rank").is_none(),
            "vLLM takes a header"
        );
    }

    #[test]
    fn a_chat_as_tokens_keeps_sampling_and_refuses_tools() {
        let chat = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5,"temperature":0.5,"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert!(chat.stream && chat.include_usage);
        assert!(chat.options.add_generation_prompt);
        let body = chat_as_completion(&chat, &[1, 2], EngineApi::Vllm, DpRank(0)).unwrap();
        assert_eq!(body["prompt"], json!([1, 2]));
        assert_eq!(body["max_tokens"], json!(5));
        assert_eq!(body["temperature"], json!(0.5));
        assert!(body.get("messages").is_none());
        let tools = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}"#,
        )
        .unwrap();
        assert_eq!(tools.options.tools.as_ref().map(Vec::len), Some(1));
        let err = chat_as_completion(&tools, &[1], EngineApi::Vllm, DpRank(0)).unwrap_err();
        assert!(err.message.contains("passthrough"), "{err}");
        for bad in [
            &br#"{"model":"m","messages":[]}"#[..],
            br#"{"model":"m","messages":[{"content":"no role"}]}"#,
        ] {
            assert_eq!(parse_chat(bad).unwrap_err().status.as_u16(), 400);
        }
    }
}
