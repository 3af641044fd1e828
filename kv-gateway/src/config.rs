//! `kv-router gateway` flags, parsed once into a [`GatewayConfig`] of typed parts.
//!
//! The NATS and etcd flags are the cluster's shared ones (`kv_cluster::args`), so the
//! gateway connects, authenticates and discovers workers exactly as the router and
//! the relay do. Every flag has a `KV_GATEWAY_*` environment variable (the namespace
//! keeps the cluster-wide `KV_ROUTER_NAMESPACE`).

use crate::error::GatewayError;
use clap::{Args, ValueEnum};
use kv_cluster::args::{EtcdArgs, NatsArgs};
use kv_cluster::etcd::EtcdConfig;
use kv_cluster::http::{
    BodyTimeouts, DEFAULT_BODY_IDLE_TIMEOUT_MS, DEFAULT_BODY_READ_TIMEOUT_MS,
    DEFAULT_HEADER_READ_TIMEOUT_MS, DEFAULT_IDLE_TIMEOUT_S, ServerLimits,
};
use kv_cluster::nats::NatsConfig;
use kv_events::{Namespace, Subjects};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

/// How the gateway turns a prompt into the token ids it routes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenizeVia {
    /// With `tokenizer.json` and `tokenizer_config.json` from `--model-dir`, in
    /// process (Hugging Face `tokenizers`, chat templates with `minijinja`).
    Local,
    /// By asking an engine's `POST /tokenize` (vLLM's endpoint): no model files
    /// needed, one extra round trip per request.
    Engine,
}

/// What the engine receives as the prompt of a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PromptForward {
    /// The token ids the router hashed (vLLM accepts a list of ints as `prompt`), so
    /// the engine caches exactly the blocks the router predicted: parity by
    /// construction.
    Tokens,
    /// The client's text, re-tokenized by the engine; parity then rests on both
    /// sides using the same tokenizer.
    Text,
}

/// How a chat completion reaches the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChatForward {
    /// Rendered and tokenized here, sent to the engine's `/v1/completions` as token
    /// ids, and the answer turned back into chat shape. Parity by construction; gives
    /// up the engine's tool-call and reasoning parsers (a request with `tools` is
    /// refused in this mode).
    Tokens,
    /// Sent unchanged to the engine's `/v1/chat/completions`: everything the engine
    /// does for chats keeps working; parity rests on the engine rendering the same
    /// template as the gateway.
    Passthrough,
}

/// How the chosen data-parallel rank is named to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineApi {
    /// vLLM: the `X-data-parallel-rank` request header.
    Vllm,
    /// SGLang: the `data_parallel_rank` field of the request body.
    Sglang,
}

/// `kv-router gateway`: an OpenAI-compatible HTTP front door for a kv-router cluster.
#[derive(Debug, Clone, Args)]
pub struct GatewayArgs {
    /// NATS servers, authentication and TLS (shared with `serve` and `relay`).
    #[command(flatten)]
    pub nats: NatsArgs,
    /// etcd endpoints and connect timeout (shared with `serve` and `relay`).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Bounds on registrations read from etcd (shared with `serve`; the gateway uses
    /// `--max-message-bytes`, `--max-dp-size` and `--max-kv-blocks`).
    #[command(flatten)]
    pub wire_limits: kv_cluster::limits::LimitArgs,
    /// Namespace of every subject and etcd key.
    #[arg(
        long,
        help_heading = "Cluster",
        env = "KV_ROUTER_NAMESPACE",
        default_value = "kv-router"
    )]
    pub namespace: String,
    /// Address the OpenAI-compatible HTTP server listens on.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_GATEWAY_LISTEN",
        default_value = "0.0.0.0:8000"
    )]
    pub listen: SocketAddr,
    /// Largest request body accepted, in bytes; more is refused with 413.
    #[arg(long, help_heading = "HTTP", env = "KV_GATEWAY_MAX_BODY_BYTES", default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Time a client connection has to deliver a request's headers, in ms: from
    /// accept for its first request, from the head's first byte on a kept-alive
    /// connection; then it is closed unanswered. Streams already answering are not cut.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_GATEWAY_HEADER_READ_TIMEOUT_MS",
        default_value_t = DEFAULT_HEADER_READ_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub header_read_timeout_ms: u64,
    /// How long a client connection stays open with no request in flight and no bytes
    /// received, in seconds; then it is closed between requests (advertised as
    /// `Keep-Alive: timeout=N`). Above common clients' pools (aiperf 300 s, Go and
    /// reqwest 90 s), so they retire idle connections first; at `--max-connections`
    /// idle connections are closed first anyway.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_GATEWAY_IDLE_TIMEOUT_S",
        default_value_t = DEFAULT_IDLE_TIMEOUT_S,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub idle_timeout_s: u64,
    /// Time a request body has to arrive whole, in ms, from its request's headers;
    /// then it is answered 408 and the connection closed.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_GATEWAY_BODY_READ_TIMEOUT_MS",
        default_value_t = DEFAULT_BODY_READ_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub body_read_timeout_ms: u64,
    /// Longest pause between two chunks of a request body (or before the first), in
    /// ms; then it is answered 408 and the connection closed.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_GATEWAY_BODY_IDLE_TIMEOUT_MS",
        default_value_t = DEFAULT_BODY_IDLE_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub body_idle_timeout_ms: u64,
    /// How long an idle connection to an engine is kept for reuse, in ms: below the
    /// engine's own keep-alive (vLLM's and SGLang's uvicorn: 5 s), so the gateway never
    /// sends a request onto a connection the engine is closing.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ENGINE_IDLE_TIMEOUT_MS",
        default_value_t = 4_000,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub engine_idle_timeout_ms: u64,
    /// Most client connections served at once (each streaming request holds one);
    /// more wait in the listen backlog. Keep it under the process's open-file limit.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_GATEWAY_MAX_CONNECTIONS",
        default_value = "4096"
    )]
    pub max_connections: NonZeroUsize,
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
    /// Longest prompt accepted, in tokens; longer is refused with 400.
    #[arg(
        long,
        help_heading = "Model",
        env = "KV_GATEWAY_MAX_PROMPT_TOKENS",
        default_value_t = 131_072
    )]
    pub max_prompt_tokens: usize,
    /// Longest prompt text tokenized, in bytes (a completion's prompt, or a chat as
    /// rendered); longer is refused with 400 before it is queued or encoded. An encode
    /// holds 150–170 bytes of memory per prompt byte (docs/gateway.md,
    /// "Tokenization limits and memory"). Default: `--max-prompt-tokens` × 8.
    #[arg(
        long,
        help_heading = "Model",
        env = "KV_GATEWAY_MAX_PROMPT_BYTES",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub max_prompt_bytes: Option<u64>,
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
    /// What a completion's engine request carries as its prompt.
    #[arg(long, help_heading = "Forwarding", env = "KV_GATEWAY_FORWARD", value_enum, default_value_t = PromptForward::Tokens)]
    pub forward: PromptForward,
    /// How chat completions reach the engine.
    #[arg(long, help_heading = "Forwarding", env = "KV_GATEWAY_CHAT_FORWARD", value_enum, default_value_t = ChatForward::Tokens)]
    pub chat_forward: ChatForward,
    /// The engines' API, for naming the data-parallel rank.
    #[arg(long, help_heading = "Forwarding", env = "KV_GATEWAY_ENGINE_API", value_enum, default_value_t = EngineApi::Vllm)]
    pub engine_api: EngineApi,
    /// Other workers tried when the chosen engine refuses the connection or fails
    /// before its first token.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_MAX_RETRIES",
        default_value_t = 2
    )]
    pub max_retries: u32,
    /// How long a routing query may take, in ms (above the router's queue wait,
    /// 5000 ms by default, so a queued request is answered rather than timed out).
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ROUTE_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub route_timeout_ms: u64,
    /// How long connecting to an engine may take, in ms.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ENGINE_CONNECT_TIMEOUT_MS",
        default_value_t = 2_000
    )]
    pub engine_connect_timeout_ms: u64,
    /// How long an engine may take to send a request's first token, in ms, from
    /// when it is sent there. Then the request is routed again without that worker
    /// (up to `--max-retries`), as for an engine that refused it; nothing has reached
    /// the client yet. Raise it for prompts whose prefill alone takes longer.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_FIRST_TOKEN_TIMEOUT_MS",
        default_value_t = 60_000
    )]
    pub first_token_timeout_ms: u64,
    /// Longest silence between two events of an engine's stream after its first
    /// token, in ms. Then the engine is taken as hung: a streaming client gets an
    /// error event and `[DONE]`; a client that did not stream (and so has seen
    /// nothing) gets its request routed again without that worker.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_STREAM_IDLE_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub stream_idle_timeout_ms: u64,
    /// How long one request may take from routing to its last token, in seconds.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_REQUEST_TIMEOUT_S",
        default_value_t = 600
    )]
    pub request_timeout_s: u64,
    /// Interval of `keep_alive` lifecycle messages for a running request, in seconds
    /// (well under the router's `--request-ttl-ms`, 600 s by default).
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_KEEP_ALIVE_S",
        default_value_t = 120
    )]
    pub keep_alive_s: u64,
}

/// Timeouts and retry budget of the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Longest prompt, in tokens.
    pub max_prompt_tokens: usize,
    /// Other workers tried after an engine failure before the first token.
    pub max_retries: u32,
    /// Routing query timeout.
    pub route_timeout: Duration,
    /// Engine connect timeout.
    pub engine_connect_timeout: Duration,
    /// Longest wait for an engine's first token, per attempt.
    pub first_token_timeout: Duration,
    /// Longest silence between two events of an engine's stream.
    pub stream_idle_timeout: Duration,
    /// How long an idle engine connection is kept for reuse.
    pub engine_idle_timeout: Duration,
    /// Whole-request timeout, from routing to the last token.
    pub request_timeout: Duration,
    /// Interval of `keep_alive` lifecycle messages.
    pub keep_alive: Duration,
}

/// The cores this process may use: the default of `--tokenizer-threads`.
fn default_tokenizer_threads() -> NonZeroUsize {
    std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
}

/// Local tokenization: the thread pool and the prompt bound that bound its CPU and
/// memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// Encodes at once, one per thread.
    pub threads: NonZeroUsize,
    /// Prompts that may wait for a thread.
    pub queue: usize,
    /// Longest prompt text tokenized, in bytes.
    pub max_prompt_bytes: usize,
}

/// How requests are tokenized and forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// Model directory with the tokenizer files.
    pub model_dir: Option<PathBuf>,
    /// The one model name served.
    pub served_model_name: String,
    /// Where prompts are tokenized.
    pub tokenize_via: TokenizeVia,
    /// Tokenizer threads, queue and prompt byte bound.
    pub tokenizer: TokenizerConfig,
    /// The prompt a completion's engine request carries.
    pub forward: PromptForward,
    /// How chats reach the engine.
    pub chat_forward: ChatForward,
    /// How the dp_rank is named to the engine.
    pub engine_api: EngineApi,
}

/// The gateway's validated settings.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// NATS connection.
    pub nats: NatsConfig,
    /// etcd connection.
    pub etcd: EtcdConfig,
    /// Subjects and keys of the namespace.
    pub subjects: Subjects,
    /// HTTP listen address.
    pub listen: SocketAddr,
    /// Header-read, idle and body timeouts and connection cap of the HTTP server.
    pub http: ServerLimits,
    /// Model, tokenization and forwarding.
    pub model: ModelConfig,
    /// Timeouts, sizes and retries.
    pub limits: Limits,
    /// Bounds on registrations read from etcd.
    pub wire_limits: kv_events::limits::Limits,
}

impl GatewayArgs {
    /// The tokenizer pool and byte bound (`--max-prompt-bytes` defaults to
    /// `--max-prompt-tokens` × [`kv_tokenizer::MAX_BYTES_PER_TOKEN`]).
    fn tokenizer_config(&self) -> TokenizerConfig {
        let derived = kv_tokenizer::Limits::for_tokens(self.max_prompt_tokens).max_prompt_bytes;
        TokenizerConfig {
            threads: self.tokenizer_threads,
            queue: self.tokenizer_queue,
            max_prompt_bytes: self
                .max_prompt_bytes
                .map_or(derived, |b| usize::try_from(b).unwrap_or(usize::MAX)),
        }
    }

    /// Validates the flags.
    ///
    /// # Errors
    /// [`GatewayError::Config`] for a bad namespace, connection flag or combination
    /// (local tokenization without `--model-dir`, no model name, a zero interval).
    pub fn to_config(&self) -> Result<GatewayConfig, GatewayError> {
        let bad = |message: String| GatewayError::Config(message);
        let namespace =
            Namespace::new(&self.namespace).map_err(|e| bad(format!("--namespace: {e}")))?;
        if self.tokenize_via == TokenizeVia::Local && self.model_dir.is_none() {
            return Err(bad(
                "--tokenize-via local needs --model-dir (or use --tokenize-via engine)".into(),
            ));
        }
        let served_model_name = match (&self.served_model_name, &self.model_dir) {
            (Some(name), _) if !name.trim().is_empty() => name.trim().to_owned(),
            (_, Some(dir)) => dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .ok_or_else(|| {
                    bad("--served-model-name is needed: --model-dir has no name".into())
                })?,
            _ => {
                return Err(bad(
                    "--served-model-name is needed without --model-dir".into()
                ));
            }
        };
        for (flag, value) in [
            ("--route-timeout-ms", self.route_timeout_ms),
            (
                "--engine-connect-timeout-ms",
                self.engine_connect_timeout_ms,
            ),
            ("--first-token-timeout-ms", self.first_token_timeout_ms),
            ("--stream-idle-timeout-ms", self.stream_idle_timeout_ms),
            ("--request-timeout-s", self.request_timeout_s),
            ("--keep-alive-s", self.keep_alive_s),
        ] {
            if value == 0 {
                return Err(bad(format!("{flag} must be above 0")));
            }
        }
        if self.max_prompt_tokens == 0 || self.max_body_bytes == 0 {
            return Err(bad(
                "--max-prompt-tokens and --max-body-bytes must be above 0".into(),
            ));
        }
        Ok(GatewayConfig {
            nats: self.nats.to_config().map_err(|e| bad(e.to_string()))?,
            etcd: self.etcd.to_config().map_err(|e| bad(e.to_string()))?,
            subjects: Subjects::new(namespace),
            listen: self.listen,
            http: ServerLimits {
                idle_timeout: Duration::from_secs(self.idle_timeout_s),
                body: BodyTimeouts {
                    total: Duration::from_millis(self.body_read_timeout_ms),
                    idle: Duration::from_millis(self.body_idle_timeout_ms),
                },
                ..ServerLimits::from_flags(self.header_read_timeout_ms, self.max_connections)
            },
            model: ModelConfig {
                model_dir: self.model_dir.clone(),
                served_model_name,
                tokenize_via: self.tokenize_via,
                tokenizer: self.tokenizer_config(),
                forward: self.forward,
                chat_forward: self.chat_forward,
                engine_api: self.engine_api,
            },
            limits: Limits {
                max_body_bytes: self.max_body_bytes,
                max_prompt_tokens: self.max_prompt_tokens,
                max_retries: self.max_retries,
                route_timeout: Duration::from_millis(self.route_timeout_ms),
                engine_connect_timeout: Duration::from_millis(self.engine_connect_timeout_ms),
                first_token_timeout: Duration::from_millis(self.first_token_timeout_ms),
                stream_idle_timeout: Duration::from_millis(self.stream_idle_timeout_ms),
                engine_idle_timeout: Duration::from_millis(self.engine_idle_timeout_ms),
                request_timeout: Duration::from_secs(self.request_timeout_s),
                keep_alive: Duration::from_secs(self.keep_alive_s),
            },
            wire_limits: self
                .wire_limits
                .to_limits()
                .map_err(|e| bad(e.to_string()))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_cluster::args::parse_flags;

    fn parse(extra: &[&str]) -> GatewayArgs {
        let mut args = vec!["gateway"];
        args.extend_from_slice(extra);
        parse_flags::<GatewayArgs, _, _>(args).unwrap()
    }

    #[test]
    fn the_model_name_defaults_to_the_model_directory() {
        let config = parse(&["--model-dir", "/models/Qwen3-8B"])
            .to_config()
            .unwrap();
        assert_eq!(config.model.served_model_name, "Qwen3-8B");
        assert_eq!(config.model.forward, PromptForward::Tokens);
        assert_eq!(config.model.engine_api, EngineApi::Vllm);
        assert_eq!(config.limits.max_retries, 2);
    }

    #[test]
    fn connection_timeouts_have_defaults_and_refuse_zero() {
        let config = parse(&["--model-dir", "/m/x"]).to_config().unwrap();
        assert_eq!(config.http.header_read_timeout, Duration::from_secs(5));
        assert_eq!(config.http.idle_timeout, Duration::from_secs(600));
        assert_eq!(config.http.body.total, Duration::from_secs(30));
        assert_eq!(config.http.body.idle, Duration::from_secs(5));
        assert_eq!(config.limits.engine_idle_timeout, Duration::from_secs(4));
        let config = parse(&[
            "--model-dir=/m/x",
            "--idle-timeout-s=7",
            "--body-read-timeout-ms=900",
            "--body-idle-timeout-ms=300",
            "--engine-idle-timeout-ms=1500",
        ])
        .to_config()
        .unwrap();
        assert_eq!(config.http.idle_timeout, Duration::from_secs(7));
        assert_eq!(config.http.body.total, Duration::from_millis(900));
        assert_eq!(config.http.body.idle, Duration::from_millis(300));
        assert_eq!(
            config.limits.engine_idle_timeout,
            Duration::from_millis(1500)
        );
        for flag in [
            "--idle-timeout-s",
            "--body-read-timeout-ms",
            "--body-idle-timeout-ms",
            "--engine-idle-timeout-ms",
        ] {
            let args = ["gateway", "--model-dir=/m/x", flag, "0"];
            assert!(parse_flags::<GatewayArgs, _, _>(args).is_err(), "{flag} 0");
        }
    }

    #[test]
    fn local_tokenization_needs_a_model_directory() {
        let err = parse(&[]).to_config().unwrap_err().to_string();
        assert!(err.contains("--model-dir"), "{err}");
        let config = parse(&["--tokenize-via", "engine", "--served-model-name", "m"])
            .to_config()
            .unwrap();
        assert_eq!(config.model.served_model_name, "m");
        let err = parse(&["--tokenize-via", "engine"])
            .to_config()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--served-model-name"), "{err}");
    }

    #[test]
    fn the_prompt_byte_bound_follows_the_token_bound_unless_given() {
        let config = parse(&["--model-dir", "/m/x"]).to_config().unwrap();
        let cores = std::thread::available_parallelism().unwrap();
        assert_eq!(
            config.model.tokenizer,
            TokenizerConfig {
                threads: cores,
                queue: 64,
                max_prompt_bytes: 131_072 * 8,
            }
        );
        let config = parse(&["--model-dir", "/m/x", "--max-prompt-tokens", "1000"])
            .to_config()
            .unwrap();
        assert_eq!(config.model.tokenizer.max_prompt_bytes, 8000);
        let config = parse(&[
            "--model-dir",
            "/m/x",
            "--max-prompt-bytes",
            "5000",
            "--tokenizer-threads",
            "3",
            "--tokenizer-queue",
            "0",
        ])
        .to_config()
        .unwrap();
        assert_eq!(config.model.tokenizer.max_prompt_bytes, 5000);
        assert_eq!(config.model.tokenizer.threads.get(), 3);
        assert_eq!(config.model.tokenizer.queue, 0);
        for bad in [["--max-prompt-bytes", "0"], ["--tokenizer-threads", "0"]] {
            let mut args = vec!["gateway", "--model-dir", "/m/x"];
            args.extend(bad);
            assert!(parse_flags::<GatewayArgs, _, _>(args).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn zero_timeouts_and_bad_namespaces_are_refused() {
        let base = ["--model-dir", "/m/x"];
        for extra in [
            &["--keep-alive-s", "0"][..],
            &["--route-timeout-ms", "0"][..],
            &["--namespace", "a.b"][..],
        ] {
            let mut args = base.to_vec();
            args.extend_from_slice(extra);
            assert!(parse(&args).to_config().is_err(), "{extra:?}");
        }
    }
}
