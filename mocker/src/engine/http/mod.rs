//! The mock engine's OpenAI-compatible HTTP front end, one listener per worker, so a
//! gateway (or any OpenAI client) can drive the mock exactly as it drives vLLM.
//!
//! Endpoints: `POST /v1/completions` (token-id or text prompts, streaming or not),
//! `POST /v1/chat/completions`, `POST /tokenize`, vLLM's render endpoints
//! (`POST /v1/completions/render`, `POST /v1/chat/completions/render`: the token ids
//! a request would prefill, see `render`), `GET /v1/models`, `GET /metrics` (vLLM metric names),
//! `POST /reset_prefix_cache` (vLLM's development endpoint: drops an idle worker's KV
//! cache; served only with `--vllm-dev-mode` / `VLLM_SERVER_DEV_MODE=1`, as vLLM's), `GET /health`
//! (vLLM's liveness probe, which SMG and vllm-router poll on every worker). The dp rank
//! comes from vLLM's `X-data-parallel-rank` header or SGLang's `data_parallel_rank`
//! body field. A worker in the `prefill` or `decode` role serves its half of
//! disaggregated requests (vLLM's `kv_transfer_params`, SGLang's bootstrap fields;
//! see `transfer`). Requests run on the same engine core as the NATS protocol — same
//! timing, same KV cache, same KV events — and a client disconnect aborts the request
//! and frees its blocks.
//!
//! Bounds: bodies over [`MAX_BODY_BYTES`] are refused with 413 before they are read;
//! a prompt plus `max_tokens` over `--max-model-len` is a 400; text prompts are bounded
//! by the tokenizer's limits. Malformed JSON is a 400 in OpenAI's error shape.
//! Connections are served by [`kv_cluster::http::serve`]: one that has not delivered a
//! request's headers within `--http-header-read-timeout-ms` is closed, and each
//! listener serves at most `--http-max-connections` at once.
//! Cost: one tokio task per connection, one watch channel per request.

mod accepted;
mod chat;
mod completions;
pub mod faults;
mod info;
mod metrics;
pub mod openai;
mod render;
mod sse;
#[cfg(test)]
mod tests;
pub(super) mod transfer;

pub use completions::DP_RANK_HEADER;

use super::rank::Rank;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use kv_cluster::http::{DEFAULT_HEADER_READ_TIMEOUT_MS, ServerLimits};
use kv_events::WorkerId;
use kv_tokenizer::ModelTokenizer;
use metrics::EngineMetrics;
use openai::EngineApiError;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Largest accepted request body, in bytes (4 MiB: a 128k-token prompt as token ids
/// is under 1 MiB of JSON).
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// Default `--served-model-name`.
pub const DEFAULT_MODEL_NAME: &str = "kv-mocker";

/// Flags of the HTTP front end of `kv-mocker engines`.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct EngineHttpArgs {
    /// Address the workers' HTTP listeners bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub http_host: String,
    /// Port of the first worker's listener; worker i listens on this port + i. 0: each
    /// worker gets an ephemeral port (the registration carries the real one).
    #[arg(long, default_value_t = 0)]
    pub http_port: u16,
    /// Host written in the registered URL (`http://{host}:{port}`); defaults to
    /// `--http-host`. Set it when binding 0.0.0.0.
    #[arg(long)]
    pub http_advertise_host: Option<String>,
    /// Model directory with `tokenizer.json` (and `tokenizer_config.json`): text
    /// prompts are tokenized with it and generated tokens decoded. Without it only
    /// token-id prompts are served.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// The model name served on `/v1/models` and required (when given) in requests.
    #[arg(long, default_value = DEFAULT_MODEL_NAME)]
    pub served_model_name: String,
    /// Longest prompt plus `max_tokens`, in tokens. Default: one rank's whole KV cache
    /// (`num_gpu_blocks × block_size`).
    #[arg(long)]
    pub max_model_len: Option<u64>,
    /// Time a connection has to deliver a request's headers, in ms, from accept, or
    /// from the head's first byte on a kept-alive connection (idle ones are closed
    /// after [`ENGINE_IDLE_TIMEOUT`]).
    #[arg(
        long,
        default_value_t = DEFAULT_HEADER_READ_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub http_header_read_timeout_ms: u64,
    /// Most connections one worker's listener serves at once; more wait in the
    /// listen backlog.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub http_max_connections: NonZeroUsize,
    /// Serve vLLM's development endpoints (`POST /reset_prefix_cache`), as vLLM does
    /// only when started with `VLLM_SERVER_DEV_MODE=1`; without, they answer 404, as
    /// vLLM's do.
    #[arg(long, env = "VLLM_SERVER_DEV_MODE")]
    pub vllm_dev_mode: bool,
    /// Deliberate misconfigurations, for tests of the gateway's cache-parity monitor.
    #[command(flatten)]
    pub faults: faults::FaultArgs,
}

/// How long a worker's listener keeps an idle connection: uvicorn's
/// `timeout_keep_alive` default, which vLLM and SGLang serve with, so clients of the
/// mock engine (the gateway's engine pool among them) meet what a real engine does.
pub const ENGINE_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Default `--http-max-connections` of each worker's listener.
// A non-zero literal: the `expect` cannot fail (and is checked at compile time).
pub const DEFAULT_MAX_CONNECTIONS: NonZeroUsize = NonZeroUsize::new(4096).expect("4096 is not 0");

impl EngineHttpArgs {
    /// The context length served, in tokens: `--max-model-len`, else the largest
    /// request one rank's KV cache can hold (`max_request_blocks` × `block_size`
    /// tokens: the whole cache of a dense model, see
    /// [`engine_model::HybridConfig::max_request_blocks`]). Answered on `/v1/models`
    /// and registered as the worker's `max_model_len`.
    pub fn max_model_len_or_cache(&self, block_size: u32, max_request_blocks: u64) -> u64 {
        self.max_model_len
            .unwrap_or_else(|| max_request_blocks.saturating_mul(u64::from(block_size)))
    }

    /// The listeners' limits: header-read timeout and connection cap from the flags,
    /// and a real engine's idle keep-alive ([`ENGINE_IDLE_TIMEOUT`]).
    pub fn limits(&self) -> ServerLimits {
        ServerLimits {
            idle_timeout: ENGINE_IDLE_TIMEOUT,
            ..ServerLimits::from_flags(self.http_header_read_timeout_ms, self.http_max_connections)
        }
    }
}

impl Default for EngineHttpArgs {
    fn default() -> Self {
        Self {
            http_host: "127.0.0.1".to_owned(),
            http_port: 0,
            http_advertise_host: None,
            model_dir: None,
            served_model_name: DEFAULT_MODEL_NAME.to_owned(),
            max_model_len: None,
            http_header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT_MS,
            http_max_connections: DEFAULT_MAX_CONNECTIONS,
            vllm_dev_mode: false,
            faults: faults::FaultArgs::default(),
        }
    }
}

/// What the handlers of one worker share.
#[derive(Debug)]
pub(super) struct EngineHttpState {
    worker_id: WorkerId,
    ranks: Vec<Arc<Rank>>,
    block_size: u32,
    model_name: String,
    max_model_len: u64,
    tokenizer: Option<Arc<ModelTokenizer>>,
    metrics: EngineMetrics,
    /// Deliberate misconfigurations (`--block-hash-salt`).
    faults: faults::FaultArgs,
    /// Its half of disaggregated requests (role, protocol, transfer cost).
    transfer: transfer::TransferSide,
    next_id: AtomicU64,
    /// Unix time of start-up, in seconds (the `created` of responses).
    created: u64,
}

/// Everything needed to build one worker's [`EngineHttpState`].
#[derive(Debug)]
pub(super) struct WorkerHttp {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its ranks, index = dp rank.
    pub ranks: Vec<Arc<Rank>>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Blocks per rank.
    pub num_gpu_blocks: u64,
    /// The largest request one rank can hold, in blocks (`num_gpu_blocks` for a
    /// dense model).
    pub max_request_blocks: u64,
    /// The shared tokenizer, if a model directory was given.
    pub tokenizer: Option<Arc<ModelTokenizer>>,
    /// Its half of disaggregated requests.
    pub transfer: transfer::TransferSide,
}

impl EngineHttpState {
    /// The state of one worker's server.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if the metrics cannot be registered.
    pub fn new(args: &EngineHttpArgs, w: WorkerHttp) -> Result<Self, prometheus::Error> {
        let metrics = EngineMetrics::new(
            &args.served_model_name,
            w.block_size,
            w.num_gpu_blocks,
            w.ranks.len(),
        )?;
        Ok(Self {
            worker_id: w.worker_id,
            ranks: w.ranks,
            block_size: w.block_size,
            model_name: args.served_model_name.clone(),
            max_model_len: args.max_model_len_or_cache(w.block_size, w.max_request_blocks),
            tokenizer: w.tokenizer,
            metrics,
            faults: args.faults,
            transfer: w.transfer,
            next_id: AtomicU64::new(0),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        })
    }

    fn next_request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("http-{}-{n}", self.worker_id)
    }

    fn check_model(&self, model: Option<&str>) -> Result<(), EngineApiError> {
        match model {
            Some(m) if m != self.model_name => Err(EngineApiError {
                status: axum::http::StatusCode::NOT_FOUND,
                message: format!("the model `{m}` does not exist"),
            }),
            _ => Ok(()),
        }
    }

    fn tokenizer(&self) -> Result<&ModelTokenizer, EngineApiError> {
        self.tokenizer.as_deref().ok_or_else(|| {
            EngineApiError::bad_request(
                "text prompts need a tokenizer: start kv-mocker engines with --model-dir, \
                 or send the prompt as a list of token ids",
            )
        })
    }

    /// Encodes a completion prompt as vLLM does (with special tokens unless
    /// `add_special_tokens` is false).
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineApiError> {
        self.tokenizer()?
            .encode(text, add_special_tokens)
            .map_err(|e| EngineApiError::bad_request(e.to_string()))
    }

    /// The text of generated token `i` (0-based): with a tokenizer, the decoded text of
    /// a deterministic token id; without one, the placeholder `" tok{i}"`.
    fn token_text(&self, i: u64) -> String {
        match &self.tokenizer {
            Some(t) => {
                let vocab = t.vocab_size().max(1) as u64;
                // In range by the modulo; ids are u32 in every tokenizer.
                let id = u32::try_from((i * 7 + 11) % vocab).unwrap_or(0);
                t.decode(&[id], true).unwrap_or_default()
            }
            None => format!(" tok{i}"),
        }
    }
}

/// The routes of one worker's server, with the body limit; the development
/// endpoints only with `dev_mode`.
pub(super) fn router(state: Arc<EngineHttpState>, dev_mode: bool) -> Router {
    let router = if dev_mode {
        Router::new().route("/reset_prefix_cache", post(info::reset_prefix_cache))
    } else {
        Router::new()
    };
    router
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions/render", post(render::completion))
        .route("/v1/chat/completions/render", post(render::chat))
        .route("/tokenize", post(info::tokenize))
        .route("/v1/models", get(info::models))
        .route("/metrics", get(info::metrics))
        .route("/health", get(info::health))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}
