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
//! - **engine** (`--tokenize-via engine`) and **render** (`--tokenize-via render`):
//!   vLLM's `POST /tokenize`, or its render endpoints (which take the client's body as
//!   it is, so every field that shapes the prompt counts), on the engines or a render
//!   server (`remote`), so the engine's own code decides. Costs one HTTP round trip
//!   per request, and needs no model files here.
//!
//! Either way, the ids are what the gateway forwards in `--forward tokens` mode, so
//! the engine prefills exactly the blocks the router priced.

pub mod pool;
pub(crate) mod remote;

use crate::error::ApiError;
use crate::limit::too_many;
use crate::metrics::GatewayMetrics;
use kv_tokenizer::{
    CachedTokenizer, ChatMessage, ChatOptions, Encoded, TokenizerError, TokenizerLimits,
};
use pool::{PoolError, TokenizerPool};
use prometheus::IntGauge;
use remote::Remote;
use serde_json::{Map, Value};
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
    /// By an engine's `/tokenize` or render endpoints.
    Remote(Arc<Remote>),
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
    /// In process with `tokenizer` (its [`kv_tokenizer::TokenizerLimits`] are the largest
    /// bound there can be; each prompt is checked against its own too) on `pool`; a
    /// prompt must be encoded within `deadline` of its arrival at the pool (504
    /// otherwise).
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

    /// By an engine's HTTP endpoint ([`Remote`]: `/tokenize` or the render
    /// endpoints, on the engines or a render server, with its bounds).
    pub(crate) fn remote(remote: Remote, metrics: GatewayMetrics) -> Self {
        let via = Via::Remote(Arc::new(remote));
        Self { via, metrics }
    }

    /// Token ids of a completion prompt (special tokens added, as vLLM's
    /// `/v1/completions` does by default), from the client's `body` (which an engine's
    /// render endpoint takes as it is), within `limits` (the token count itself is the
    /// caller's to check: `crate::limit::PromptBound::check`).
    ///
    /// # Errors
    /// 400 for a prompt over the limits (over their bytes before anything is queued
    /// or encoded); 503 with `Retry-After` when the tokenizer pool is full; 504 past
    /// the deadline; 503 or 502 when no engine can tokenize.
    pub async fn completion(
        &self,
        prompt: &str,
        body: &Map<String, Value>,
        limits: TokenizerLimits,
    ) -> Result<Vec<u32>, ApiError> {
        limits.check_bytes(prompt.len()).map_err(tokenizer_error)?;
        match &self.via {
            Via::Local { tokenizer, .. } => {
                let tokenizer = Arc::clone(tokenizer);
                let prompt = prompt.to_owned();
                self.on_pool(tokenizer, move |t| t.completion(&prompt))
                    .await
            }
            Via::Remote(remote) => {
                let started = Instant::now();
                let ids = remote.completion(prompt, body, limits).await?;
                self.metrics.stage("tokenize", started.elapsed());
                Ok(ids)
            }
        }
    }

    /// Token ids of a chat: the chat template rendered with the generation prompt,
    /// then encoded without adding special tokens (the template has them). A rendered
    /// chat over the bytes of `limits` is refused before it is encoded (by an engine:
    /// one whose messages' text alone is over it, before it is sent). `body` is the
    /// client's, which an engine's render endpoint takes as it is.
    ///
    /// # Errors
    /// As [`Self::completion`]; 400 also for a model without a chat template.
    pub async fn chat(
        &self,
        messages: Vec<ChatMessage>,
        options: ChatOptions,
        body: &Map<String, Value>,
        limits: TokenizerLimits,
    ) -> Result<Vec<u32>, ApiError> {
        match &self.via {
            Via::Local { tokenizer, .. } => {
                let tokenizer = Arc::clone(tokenizer);
                self.on_pool(tokenizer, move |t| {
                    let text = t.tokenizer().render_chat(&messages, &options)?;
                    limits.check_bytes(text.len())?;
                    t.encode(&text, false)
                })
                .await
            }
            Via::Remote(remote) => {
                let started = Instant::now();
                let ids = remote.chat(&messages, body, limits).await?;
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
