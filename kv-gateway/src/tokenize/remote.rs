//! Tokenization by an engine over HTTP, so the engine's own code decides the ids and
//! the gateway needs no model files. Two of vLLM's APIs:
//!
//! - **`/tokenize`** (`--tokenize-via engine`): `{"prompt"}` or `{"messages", …}` →
//!   `{"tokens"}`. The gateway picks the fields the endpoint takes from the client's
//!   body.
//! - **render** (`--tokenize-via render`): `POST /v1/completions/render` and
//!   `POST /v1/chat/completions/render` take the client's body *as it is* and answer
//!   with what the engine would feed the model (vLLM's `GenerateRequest`: a list of
//!   one for a completion, one object for a chat; only `token_ids` is read). Every
//!   request field that shapes the prompt (the chat template with `tools`,
//!   `add_generation_prompt`, `chat_template_kwargs`, `continue_final_message`,
//!   `add_special_tokens`, a request's own `chat_template`, …) is applied by the same
//!   code that will prefill it, which `/tokenize` only approximates for chats. vLLM
//!   serves them with `VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1`, and a GPU-less
//!   `vllm launch render <model>` serves them always, as llm-d and Dynamo deploy it.
//!
//! **Where.** By default any registered engine: each request asks the next one in
//! worker-id order (round robin spreads the encode work, about a millisecond per 10k
//! tokens of the engine's API-server CPU), and a request whose engine cannot be
//! reached, times out, is busy (429) or fails (5xx, a reply that is not JSON) is asked
//! of one other engine, as llm-d's token producer does: an engine that dies does not
//! fail every request until its lease expires. With `--render-url` every render goes
//! to that one server (a `vllm launch render` sidecar or service) and is not retried.
//!
//! **Bounds.** A completion's text (a chat's message text, a lower bound of what it
//! renders to) over the request's byte bound (`--max-prompt-bytes`, or derived,
//! [`crate::limit`]) is refused before anything is sent; each
//! attempt must be answered within `--first-token-timeout-ms` (504 after the last);
//! the reply is read up to what the longest allowed prompt could take, never whole
//! (a longer one is refused as too many tokens). An engine 4xx is the client's 400
//! with the engine's reason; a 404 that is no OpenAI error (the endpoint does not
//! exist) and the other failures are 502, a busy engine 503 with `Retry-After`.
//!
//! **Cost.** One HTTP round trip per text prompt, in the `tokenize` stage of
//! `kv_gateway_stage_seconds`; the gateway serializes the body once more and parses
//! the ids. No CPU of the gateway scales with the prompt beyond that.

use super::tokenizer_error;
use crate::error::ApiError;
use crate::forward::read_bounded;
use crate::workers::WorkerUrls;
use bytes::Bytes;
use kv_tokenizer::{ChatMessage, TokenizerLimits};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tracing::warn;

/// Which of vLLM's endpoints gives the token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /v1/completions/render` and `POST /v1/chat/completions/render`.
    Render,
}

/// Where the requests go.
#[derive(Debug, Clone)]
pub enum TokenizeTarget {
    /// The registered engines, in turn, each request retried once on another.
    Engines(WorkerUrls),
    /// One server (base URL without a trailing slash), e.g. `vllm launch render`.
    Server(String),
}

/// An engine-side tokenizer: the API, where it is served, and the bounds.
#[derive(Debug)]
pub struct Remote {
    client: reqwest::Client,
    api: Api,
    target: TokenizeTarget,
    /// Longest wait for one attempt's whole answer.
    timeout: Duration,
    /// Round-robin position over the engines.
    next: AtomicUsize,
}

/// Bytes of one token id in a JSON list at most: ten digits, a comma and a space.
const MAX_BYTES_PER_TOKEN_ID: usize = 12;

/// Reply bytes beyond the ids: `/tokenize`'s other fields; a render's
/// `sampling_params` (which echo the request's, so the request body's size is added
/// too) and ids-long extras such as `assistant_tokens_mask`.
const REPLY_OVERHEAD: usize = 64 << 10;

/// Engines asked per request, at most (the first and one other).
const MAX_ATTEMPTS: usize = 2;

/// The fields of a chat body vLLM's `/tokenize` takes.
const TOKENIZE_CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
];

#[derive(Deserialize)]
struct Tokens {
    tokens: Vec<u32>,
}

/// A render's `GenerateRequest`, as far as the gateway reads it.
#[derive(Deserialize)]
struct Rendered {
    token_ids: Vec<u32>,
}

/// How one attempt failed: worth asking another engine, or not.
enum Failed {
    Retry(ApiError),
    Final(ApiError),
}

impl Remote {
    /// Tokenizes with `api` at `target`, over `client`; each attempt waits at most
    /// `timeout` for its whole answer.
    pub fn new(
        client: reqwest::Client,
        api: Api,
        target: TokenizeTarget,
        timeout: Duration,
    ) -> Self {
        Self {
            client,
            api,
            target,
            timeout,
            next: AtomicUsize::new(0),
        }
    }

    /// Token ids of the completion `prompt` of the client's `body`, within `limits`
    /// (its bytes are checked by the caller, [`super::PromptTokenizer::completion`],
    /// before anything is sent).
    ///
    /// # Errors
    /// 400 for a reply longer than its tokens could take, or an engine 4xx; 502, 503
    /// or 504 as the module says.
    pub(super) async fn completion(
        &self,
        prompt: &str,
        body: &Map<String, Value>,
        limits: TokenizerLimits,
    ) -> Result<Vec<u32>, ApiError> {
        match self.api {
            Api::Tokenize => {
                let mut request = pick(body, &["model", "add_special_tokens"]);
                request.insert("prompt".into(), Value::from(prompt));
                let reply: Tokens = self.ask("/tokenize", &request, limits).await?;
                Ok(reply.tokens)
            }
            Api::Render => {
                let replies: Vec<Rendered> =
                    self.ask("/v1/completions/render", body, limits).await?;
                let count = replies.len();
                match <[Rendered; 1]>::try_from(replies) {
                    Ok([one]) => Ok(one.token_ids),
                    Err(_) => Err(ApiError::engine_failed(format!(
                        "the completions render answered {count} prompts for one"
                    ))),
                }
            }
        }
    }

    /// Token ids of the chat of `messages` in the client's `body`.
    ///
    /// # Errors
    /// As [`Self::completion`]; the bytes checked are the messages' text.
    pub(super) async fn chat(
        &self,
        messages: &[ChatMessage],
        body: &Map<String, Value>,
        limits: TokenizerLimits,
    ) -> Result<Vec<u32>, ApiError> {
        let text: usize = messages
            .iter()
            .filter_map(|m| m.content.as_ref())
            .map(String::len)
            .sum();
        limits.check_bytes(text).map_err(tokenizer_error)?;
        match self.api {
            Api::Tokenize => {
                let request = pick(body, TOKENIZE_CHAT_FIELDS);
                let reply: Tokens = self.ask("/tokenize", &request, limits).await?;
                Ok(reply.tokens)
            }
            Api::Render => {
                let reply: Rendered = self
                    .ask("/v1/chat/completions/render", body, limits)
                    .await?;
                Ok(reply.token_ids)
            }
        }
    }

    /// POSTs `request` to `path` of the target, asking one other engine after a
    /// failure worth retrying, and parses the reply as `T` (read no further than a
    /// prompt within `limits` could take).
    async fn ask<T: DeserializeOwned>(
        &self,
        path: &str,
        request: &Map<String, Value>,
        limits: TokenizerLimits,
    ) -> Result<T, ApiError> {
        let body: Bytes = serde_json::to_vec(request)
            .map_err(|e| ApiError::internal(format!("the request body: {e}")))?
            .into();
        let urls = match &self.target {
            TokenizeTarget::Server(url) => vec![url.clone()],
            TokenizeTarget::Engines(workers) => {
                let mut urls = workers.urls();
                if urls.is_empty() {
                    return Err(ApiError::unavailable("no engine is registered to tokenize"));
                }
                let start = self.next.fetch_add(1, Ordering::Relaxed) % urls.len();
                urls.rotate_left(start);
                urls.truncate(MAX_ATTEMPTS);
                urls
            }
        };
        let mut last = None;
        for url in &urls {
            let attempt = tokio::time::timeout(
                self.timeout,
                self.attempt(url, path, &body, limits.max_prompt_tokens),
            );
            let failed = match attempt.await {
                Ok(Ok(reply)) => return Ok(reply),
                Ok(Err(failed)) => failed,
                Err(_) => Failed::Retry(ApiError::timeout(format!(
                    "{url}{path} did not answer within {} ms",
                    self.timeout.as_millis()
                ))),
            };
            match failed {
                Failed::Final(e) => return Err(e),
                Failed::Retry(e) => {
                    warn!(url, path, error = %e, "engine-side tokenization failed");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| ApiError::internal("no tokenization attempt")))
    }

    /// One attempt at `url`, reading a reply of at most `max_tokens` ids.
    async fn attempt<T: DeserializeOwned>(
        &self,
        url: &str,
        path: &str,
        body: &Bytes,
        max_tokens: usize,
    ) -> Result<T, Failed> {
        let response = self
            .client
            .post(format!("{url}{path}"))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.clone())
            .send()
            .await
            .map_err(|e| {
                Failed::Retry(ApiError::engine_failed(format!("tokenizing at {url}: {e}")))
            })?;
        let status = response.status();
        if !status.is_success() {
            return Err(refused(
                url,
                path,
                status,
                EngineError::read(response).await,
            ));
        }
        // A reply longer than the allowed prompt could possibly be is not read further.
        let per_token = match self.api {
            Api::Tokenize => MAX_BYTES_PER_TOKEN_ID,
            Api::Render => 2 * MAX_BYTES_PER_TOKEN_ID,
        };
        let limit = max_tokens
            .saturating_mul(per_token)
            .saturating_add(body.len())
            .saturating_add(REPLY_OVERHEAD);
        let (bytes, cut) = read_bounded(response, limit).await;
        if cut {
            return Err(Failed::Final(ApiError::bad_request(format!(
                "the prompt has more than the {max_tokens} tokens allowed"
            ))));
        }
        // The token count itself is checked by the request path, for every tokenizer.
        serde_json::from_slice(&bytes).map_err(|e| {
            Failed::Retry(ApiError::engine_failed(format!(
                "the reply of {url}{path}: {e}"
            )))
        })
    }
}

/// An engine's error answer.
struct EngineError {
    /// Whether the body was OpenAI's error JSON: the endpoint's own refusal (e.g. of
    /// an unknown model), not a route the engine lacks.
    openai: bool,
    /// `error.message`, else the body's first bytes.
    message: String,
}

impl EngineError {
    /// Largest error body read, in bytes.
    const MAX_BYTES: usize = 64 << 10;

    async fn read(response: reqwest::Response) -> Self {
        let (body, _) = read_bounded(response, Self::MAX_BYTES).await;
        let error = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|mut v| v.get_mut("error").map(Value::take));
        match error {
            Some(Value::Object(mut error)) => Self {
                openai: true,
                message: match error.remove("message") {
                    Some(Value::String(message)) => message,
                    other => other.unwrap_or_default().to_string(),
                },
            },
            _ => Self {
                openai: false,
                message: String::from_utf8_lossy(&body).into_owned(),
            },
        }
    }
}

/// What an engine's non-success `status` with `error` means.
fn refused(url: &str, path: &str, status: reqwest::StatusCode, error: EngineError) -> Failed {
    let code = status.as_u16();
    let detail = error.message;
    // FastAPI's `{"detail": "Not Found"}` or an empty 404: no such route here.
    let no_route = code == 404 && !error.openai;
    if no_route || code == 405 || code == 501 {
        let hint = if path == "/tokenize" {
            "the engine has no `/tokenize` (SGLang has none): use --tokenize-via local"
        } else {
            "the engine does not serve vLLM's render endpoints: start vLLM with \
             VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1, or run `vllm launch render <model>` and \
             pass its URL as --render-url"
        };
        warn!(url, path, code, "engine-side tokenization is not served");
        return Failed::Final(ApiError::engine_failed(format!(
            "{url}{path} answered {status}: {hint}"
        )));
    }
    if code == 429 {
        return Failed::Retry(ApiError {
            retry_after_s: Some(1),
            ..ApiError::unavailable(format!(
                "the engine is busy tokenizing ({status}): {detail}"
            ))
        });
    }
    if status.is_client_error() {
        return Failed::Final(ApiError::bad_request(format!(
            "the engine refused to tokenize the prompt ({status}): {detail}"
        )));
    }
    Failed::Retry(ApiError::engine_failed(format!(
        "tokenizing at {url}{path}: {status}: {detail}"
    )))
}

/// The `fields` of `body` that it has.
fn pick(body: &Map<String, Value>, fields: &[&str]) -> Map<String, Value> {
    fields
        .iter()
        .filter_map(|f| Some(((*f).to_owned(), body.get(*f)?.clone())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::StatusCode;

    fn error(openai: bool, message: &str) -> EngineError {
        let message = message.to_owned();
        EngineError { openai, message }
    }

    /// (retried, client status, message) of `refused`.
    fn outcome(path: &str, status: u16, engine: EngineError) -> (bool, u16, String) {
        let status = StatusCode::from_u16(status).unwrap();
        match refused("http://e:8000", path, status, engine) {
            Failed::Retry(e) => (true, e.status.as_u16(), e.message),
            Failed::Final(e) => (false, e.status.as_u16(), e.message),
        }
    }

    #[test]
    fn engine_answers_map_to_a_clear_status_and_retry_only_what_another_engine_may_fix() {
        let render = "/v1/completions/render";
        let (retried, status, message) = outcome(render, 404, error(false, ""));
        assert!(!retried && status == 502, "{message}");
        assert!(
            message.contains("VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1"),
            "{message}"
        );
        let (_, status, message) = outcome("/tokenize", 404, error(false, "Not Found"));
        assert_eq!(status, 502);
        assert!(message.contains("--tokenize-via local"), "{message}");
        // vLLM's own 404, an unknown model: the endpoint's answer, passed on.
        let unknown = error(true, "The model `m` does not exist.");
        let (retried, status, message) = outcome(render, 404, unknown);
        assert!(!retried && status == 400, "{message}");
        assert!(message.contains("does not exist"), "{message}");
        let (retried, status, _) = outcome(render, 501, error(true, "not supported"));
        assert!(!retried && status == 502);
        let (retried, status, _) = outcome(render, 422, error(false, "bad"));
        assert!(!retried && status == 400);
        let (retried, status, _) = outcome(render, 429, error(true, "busy"));
        assert!(retried && status == 503);
        let (retried, status, message) = outcome(render, 500, error(true, "boom"));
        assert!(
            retried && status == 502 && message.contains("boom"),
            "{message}"
        );
    }

    #[test]
    fn tokenize_requests_keep_only_the_fields_it_takes() {
        let body = serde_json::json!({"model": "m", "messages": [], "tools": [1],
                                      "temperature": 0.5, "stream": true});
        let picked = pick(body.as_object().unwrap(), TOKENIZE_CHAT_FIELDS);
        let mut keys: Vec<_> = picked.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["messages", "model", "tools"]);
    }
}
