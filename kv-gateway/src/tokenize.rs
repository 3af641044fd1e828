//! Prompt → token ids, the way the engine will see them: the router hashes these ids,
//! so a gateway that tokenizes differently from the engine silently gets no prefix
//! overlap. Two ways, one contract:
//!
//! - **local** (`--tokenize-via local`): `kv_tokenizer::ModelTokenizer` over the
//!   model's own `tokenizer.json` and chat template. Completions are encoded with
//!   special tokens and chats rendered then encoded without them, as vLLM does.
//!   Costs CPU in the gateway (see docs/benchmarks.md), no round trip. Encodes run on
//!   a bounded [`pool::TokenizerPool`] (`--tokenizer-threads`, `--tokenizer-queue`),
//!   never on the async workers, and a prompt over `--max-prompt-bytes` is refused
//!   before it is queued. The text between added tokens (a chat's turns, the BOS a
//!   client wrote into a completion) is encoded once and then taken from a cache
//!   (`kv_tokenizer::CachedTokenizer`, `--tokenizer-cache-mib`), with exactly the
//!   ids of encoding the whole prompt.
//! - **engine** (`--tokenize-via engine`): vLLM's `POST /tokenize` on any known
//!   engine, so the engine's own code decides. Costs one HTTP round trip per request,
//!   and needs no model files here.
//!
//! Either way, the ids are what the gateway forwards in `--forward tokens` mode, so
//! the engine prefills exactly the blocks the router priced.

pub mod pool;

use crate::error::ApiError;
use crate::forward::{error_text, read_bounded};
use crate::metrics::GatewayMetrics;
use crate::workers::WorkerUrls;
use kv_tokenizer::{CachedTokenizer, ChatMessage, ChatOptions, Encoded, TokenizerError};
use pool::{PoolError, TokenizerPool};
use prometheus::IntGauge;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Where and how prompts are tokenized, and the metrics of it.
#[derive(Clone)]
pub struct PromptTokenizer {
    via: Via,
    metrics: GatewayMetrics,
}

#[derive(Clone)]
enum Via {
    /// In process, from the model's files, on the pool's threads.
    Local {
        tokenizer: Arc<CachedTokenizer>,
        pool: Arc<TokenizerPool>,
        /// Longest a prompt may wait for and take on the pool.
        deadline: Duration,
    },
    /// By an engine's `/tokenize`.
    Engine {
        client: reqwest::Client,
        workers: WorkerUrls,
        /// Longest prompt accepted, in bytes (a completion's text) and tokens.
        limits: kv_tokenizer::Limits,
    },
}

/// Bytes of one token id in a JSON list at most: ten digits, a comma and a space.
const MAX_BYTES_PER_TOKEN_ID: usize = 12;

#[derive(Deserialize)]
struct TokenizeReply {
    tokens: Vec<u32>,
}

/// Holds one admitted prompt in the `kv_gateway_tokenize_jobs` gauge until the pool
/// drops its job (run, skipped or refused).
struct Admitted(IntGauge);

impl Admitted {
    fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl PromptTokenizer {
    /// In process with `tokenizer` (its [`kv_tokenizer::Limits`] are the prompt
    /// bounds) on `pool`; a prompt must be encoded within `deadline` of its arrival at
    /// the pool (504 otherwise).
    pub fn local(
        tokenizer: Arc<CachedTokenizer>,
        pool: Arc<TokenizerPool>,
        deadline: Duration,
        metrics: GatewayMetrics,
    ) -> Self {
        let via = Via::Local {
            tokenizer,
            pool,
            deadline,
        };
        Self { via, metrics }
    }

    /// By the `/tokenize` of any engine of `workers`; completion prompts over
    /// `limits.max_prompt_bytes` are refused before they are sent, replies longer
    /// than `limits.max_prompt_tokens` could be are not read.
    pub fn engine(
        client: reqwest::Client,
        workers: WorkerUrls,
        limits: kv_tokenizer::Limits,
        metrics: GatewayMetrics,
    ) -> Self {
        let via = Via::Engine {
            client,
            workers,
            limits,
        };
        Self { via, metrics }
    }

    /// Token ids of a completion prompt (special tokens added, as vLLM's
    /// `/v1/completions` does by default).
    ///
    /// # Errors
    /// 400 for a prompt over the limits (over `--max-prompt-bytes` before anything is
    /// queued or encoded); 503 with `Retry-After` when the tokenizer pool is full;
    /// 504 past the deadline; 503 or 502 when no engine can tokenize.
    pub async fn completion(&self, prompt: &str) -> Result<Vec<u32>, ApiError> {
        match &self.via {
            Via::Local { tokenizer, .. } => {
                tokenizer
                    .limits()
                    .check_bytes(prompt.len())
                    .map_err(tokenizer_error)?;
                let tokenizer = Arc::clone(tokenizer);
                let prompt = prompt.to_owned();
                self.on_pool(tokenizer, move |t| t.completion(&prompt))
                    .await
            }
            Via::Engine {
                client,
                workers,
                limits,
            } => {
                limits.check_bytes(prompt.len()).map_err(tokenizer_error)?;
                let started = Instant::now();
                let body = json!({ "prompt": prompt });
                let ids = remote(client, workers, limits.max_prompt_tokens, body).await?;
                self.metrics.stage("tokenize", started.elapsed());
                Ok(ids)
            }
        }
    }

    /// Token ids of a chat: the chat template rendered with the generation prompt,
    /// then encoded without adding special tokens (the template has them). A rendered
    /// chat over `--max-prompt-bytes` is refused before it is encoded.
    ///
    /// # Errors
    /// As [`Self::completion`]; 400 also for a model without a chat template.
    pub async fn chat(
        &self,
        messages: Vec<ChatMessage>,
        options: ChatOptions,
    ) -> Result<Vec<u32>, ApiError> {
        match &self.via {
            Via::Local { tokenizer, .. } => {
                let tokenizer = Arc::clone(tokenizer);
                self.on_pool(tokenizer, move |t| t.chat(&messages, &options))
                    .await
            }
            Via::Engine {
                client,
                workers,
                limits,
            } => {
                let started = Instant::now();
                let body = json!({
                    "messages": messages,
                    "add_generation_prompt": options.add_generation_prompt,
                    "tools": options.tools,
                });
                let ids = remote(client, workers, limits.max_prompt_tokens, body).await?;
                self.metrics.stage("tokenize", started.elapsed());
                Ok(ids)
            }
        }
    }

    /// Runs `encode` with `tokenizer` on the pool, recording the wait
    /// (`tokenize_queue`), and when the tokenizer ran, the encode (`tokenize`) and
    /// where its tokens came from.
    async fn on_pool(
        &self,
        tokenizer: Arc<CachedTokenizer>,
        encode: impl FnOnce(&CachedTokenizer) -> Result<Encoded, TokenizerError> + Send + 'static,
    ) -> Result<Vec<u32>, ApiError> {
        let Via::Local { pool, deadline, .. } = &self.via else {
            return Err(ApiError::internal("no tokenizer pool"));
        };
        let admitted = Admitted::new(self.metrics.tokenize_jobs());
        let metrics = self.metrics.clone();
        let job = move || {
            let _admitted = admitted;
            let encoded = encode(&tokenizer)?;
            let fresh = encoded.ids.len().saturating_sub(encoded.cached_tokens);
            metrics.tokenized(encoded.cached_tokens, fresh, tokenizer.cached_bytes());
            Ok(encoded.ids)
        };
        let ran = match pool.run(Instant::now() + *deadline, job).await {
            Ok(ran) => ran,
            Err(e) => return Err(self.refused(pool, e)),
        };
        self.metrics.stage("tokenize_queue", ran.waited);
        // A prompt refused for its bytes was not encoded.
        if !matches!(ran.value, Err(TokenizerError::PromptTooLarge { .. })) {
            self.metrics.stage("tokenize", ran.ran);
        }
        ran.value.map_err(tokenizer_error)
    }

    fn refused(&self, pool: &TokenizerPool, e: PoolError) -> ApiError {
        match e {
            PoolError::Full => {
                self.metrics.tokenize_rejected("queue_full");
                ApiError {
                    retry_after_s: Some(1),
                    ..ApiError::unavailable(format!(
                        "the gateway's tokenizer is busy ({} prompts encoding, {} waiting, \
                         none more accepted); retry shortly",
                        pool.threads(),
                        pool.queue()
                    ))
                }
            }
            PoolError::Deadline => {
                self.metrics.tokenize_rejected("deadline");
                ApiError::timeout("the prompt was not tokenized before the request deadline")
            }
            PoolError::Panicked => ApiError::internal("the tokenizer failed on this prompt"),
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
