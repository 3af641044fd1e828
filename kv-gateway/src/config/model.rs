//! The gateway's model flags: which model it serves and how prompts become token
//! ids (where, with how many threads, within which bounds).

use super::TokenizerConfig;
use crate::limit::{PromptLimitConfig, PromptTokens};
use clap::{Args, ValueEnum};
use std::num::NonZeroUsize;
use std::path::PathBuf;

/// How the gateway turns a prompt into the token ids it routes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenizeVia {
    /// With `tokenizer.json` and `tokenizer_config.json` from `--model-dir`, in
    /// process (Hugging Face `tokenizers`, chat templates with `minijinja`).
    Local,
    /// By asking an engine's `POST /tokenize` (vLLM's endpoint): no model files
    /// needed, one extra round trip per request.
    Engine,
    /// By vLLM's render endpoints (`POST /v1/completions/render`,
    /// `POST /v1/chat/completions/render`), sent the client's body as it is: the ids
    /// the engine will prefill, every template option included. On the registered
    /// engines (vLLM with `VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1`) or the server of
    /// `--render-url` (`vllm launch render`); no model files needed, one extra round
    /// trip per request.
    Render,
}

/// `--render-url`: an `http` or `https` base URL, kept without a trailing slash.
fn render_url(value: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(value).map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.query().is_some() {
        return Err("an http:// or https:// base URL without a query is needed".into());
    }
    Ok(value.trim_end_matches('/').to_owned())
}

/// The cores this process may use: the default of `--tokenizer-threads`.
fn default_tokenizer_threads() -> NonZeroUsize {
    std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
}

/// The served model and its tokenization.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Model directory holding `tokenizer.json` and `tokenizer_config.json` (the
    /// files of the model the engines serve); never downloaded at run time.
    #[arg(long, help_heading = "Model", env = "KV_GATEWAY_MODEL_DIR")]
    pub model_dir: Option<PathBuf>,
    /// The model name clients ask for (`model` in requests, `/v1/models`); default:
    /// the model directory's name.
    #[arg(long, help_heading = "Model", env = "KV_GATEWAY_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Where prompts are tokenized.
    #[arg(long, help_heading = "Model", env = "KV_GATEWAY_TOKENIZE_VIA", value_enum, default_value_t = TokenizeVia::Local)]
    pub tokenize_via: TokenizeVia,
    /// Base URL of a render server (`http://host:port`, e.g. `vllm launch render`)
    /// that every render goes to (`--tokenize-via render`); default: the registered
    /// engines, in turn.
    #[arg(long, help_heading = "Model", env = "KV_GATEWAY_RENDER_URL", value_parser = render_url)]
    pub render_url: Option<String>,
    /// Longest prompt accepted, in tokens; longer is refused with 400. Default: the
    /// engines' context length — the smallest `max_model_len` the registered workers
    /// publish, checked as vLLM does (prompt below it, prompt plus `max_tokens` within
    /// it) — else 131,072; at most `--max-route-tokens` either way.
    #[arg(long, help_heading = "Model", env = "KV_GATEWAY_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<NonZeroUsize>,
    /// Longest prompt text tokenized, in bytes (a completion's prompt, or a chat as
    /// rendered); longer is refused with 400 before it is queued or encoded. An encode
    /// holds 150–170 bytes of memory per prompt byte (docs/gateway.md,
    /// "Tokenization limits and memory"). Default: the prompt token bound × 8.
    #[arg(long, help_heading = "Model", env = "KV_GATEWAY_MAX_PROMPT_BYTES")]
    pub max_prompt_bytes: Option<NonZeroUsize>,
    /// Prompts tokenized at once (`--tokenize-via local`), each on one of the
    /// gateway's tokenizer threads. Default: the number of cores.
    #[arg(
        long,
        help_heading = "Model",
        env = "KV_GATEWAY_TOKENIZER_THREADS",
        default_value_t = default_tokenizer_threads()
    )]
    pub tokenizer_threads: NonZeroUsize,
    /// Prompts that may wait for a tokenizer thread; more are refused at once with
    /// 503 and `Retry-After`.
    #[arg(
        long,
        help_heading = "Model",
        env = "KV_GATEWAY_TOKENIZER_QUEUE",
        default_value_t = 64
    )]
    pub tokenizer_queue: usize,
    /// Memory for the token ids of prompt text between added tokens (a chat's past
    /// turns, documents behind a BOS), so a conversation's history is not encoded again
    /// each turn; the ids are exactly those of encoding the whole prompt. In MiB; 0
    /// turns the cache off.
    #[arg(
        long,
        help_heading = "Model",
        env = "KV_GATEWAY_TOKENIZER_CACHE_MIB",
        default_value_t = 128
    )]
    pub tokenizer_cache_mib: u64,
}

impl ModelArgs {
    /// The tokenizer pool.
    pub(super) fn tokenizer_config(&self) -> TokenizerConfig {
        TokenizerConfig {
            threads: self.tokenizer_threads,
            queue: self.tokenizer_queue,
            cache_bytes: self.tokenizer_cache_mib.saturating_mul(1 << 20),
        }
    }

    /// The prompt bound: `--max-prompt-tokens` if given, else the engines' context
    /// length under `route_tokens` (the cluster's `--max-route-tokens`); and
    /// `--max-prompt-bytes`.
    pub(super) fn prompt_limit(&self, route_tokens: u64) -> PromptLimitConfig {
        let tokens = match self.max_prompt_tokens {
            Some(tokens) => PromptTokens::Explicit(tokens),
            None => PromptTokens::FromEngines {
                ceiling: usize::try_from(route_tokens).unwrap_or(usize::MAX),
            },
        };
        PromptLimitConfig {
            tokens,
            bytes: self.max_prompt_bytes,
        }
    }

    /// The model name clients ask for: `--served-model-name`, else the model
    /// directory's name.
    pub(super) fn served_model_name(&self) -> Result<String, String> {
        match (&self.served_model_name, &self.model_dir) {
            (Some(name), _) if !name.trim().is_empty() => Ok(name.trim().to_owned()),
            (_, Some(dir)) => dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .ok_or_else(|| "--served-model-name is needed: --model-dir has no name".into()),
            _ => Err("--served-model-name is needed without --model-dir".into()),
        }
    }
}
