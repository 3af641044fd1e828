//! `kv-router gateway` flags, parsed once into a [`GatewayConfig`] of typed parts.
//!
//! The NATS and etcd flags are the cluster's shared ones (`kv_cluster::args`), so the
//! gateway connects, authenticates and discovers workers exactly as the router and
//! the relay do. The gateway's own flags come in three groups, one file each: HTTP
//! ([`GatewayHttpArgs`]), model and tokenization ([`ModelArgs`]), forwarding
//! ([`ForwardArgs`]). Every flag has a `KV_GATEWAY_*` environment variable (the
//! namespace keeps the cluster-wide `KV_ROUTER_NAMESPACE`).

mod forward;
mod http;
mod model;

pub use forward::{ChatForward, EngineApi, ForwardArgs, PromptForward};
pub use http::GatewayHttpArgs;
pub use model::{ModelArgs, TokenizeVia};

use crate::error::GatewayError;
use crate::limit::PromptLimitConfig;
use clap::Args;
use kv_cluster::args::{EtcdArgs, NatsArgs};
use kv_cluster::etcd::EtcdConfig;
use kv_cluster::http::ServerLimits;
use kv_cluster::nats::NatsConfig;
use kv_events::Subjects;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

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
    /// `--max-message-bytes`, `--max-dp-size` and `--max-kv-blocks`, and
    /// `--max-route-tokens` as the most its default prompt bound can be).
    #[command(flatten)]
    pub wire_limits: kv_cluster::limits::LimitArgs,
    /// The cluster's namespace (shared with every participant).
    #[command(flatten, next_help_heading = "Cluster")]
    pub namespace: kv_cluster::args::NamespaceArgs,
    /// Listen address, body size and connection limits.
    #[command(flatten)]
    pub http: GatewayHttpArgs,
    /// The served model and its tokenization.
    #[command(flatten)]
    pub model: ModelArgs,
    /// What engines receive, retries and deadlines.
    #[command(flatten)]
    pub forwarding: ForwardArgs,
}

/// Timeouts and retry budget of the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Longest prompt, in tokens and bytes: fixed, or the engines' context length.
    pub prompt: PromptLimitConfig,
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
    /// Most lifecycle messages per NATS message (1: each on its own).
    pub lifecycle_batch: usize,
    /// How route queries arriving together are grouped into one NATS message.
    pub route_grouping: crate::router::Grouping,
    /// Replica affinity (`None`: off).
    pub route_affinity: Option<crate::router::ReplicaAffinity>,
}

/// Local tokenization: the thread pool that bounds its CPU (the prompt bound,
/// [`RequestLimits::prompt`], bounds its memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// Encodes at once, one per thread.
    pub threads: NonZeroUsize,
    /// Prompts that may wait for a thread.
    pub queue: usize,
    /// Capacity of the cache of text pieces' token ids, in bytes; 0: no cache.
    pub cache_bytes: u64,
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
    /// The render server of `--tokenize-via render`, if not the engines.
    pub render_url: Option<String>,
    /// Tokenizer threads and queue.
    pub tokenizer: TokenizerConfig,
    /// The prompt a completion's engine request carries.
    pub forward: PromptForward,
    /// How chats reach the engine.
    pub chat_forward: ChatForward,
    /// How the dp_rank is named to the engine.
    pub engine_api: EngineApi,
    /// Whether the router may split a request into a prefill and a decode half.
    pub disaggregation: bool,
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
    pub limits: RequestLimits,
    /// Bounds on registrations read from etcd.
    pub wire_limits: kv_events::limits::Limits,
}

impl GatewayArgs {
    /// Validates the flags.
    ///
    /// # Errors
    /// [`GatewayError::Config`] for a bad namespace, connection flag or combination
    /// (local tokenization without `--model-dir`, no model name, a zero interval).
    pub fn to_config(&self) -> Result<GatewayConfig, GatewayError> {
        let bad = |message: String| GatewayError::Config(message);
        let (http, model, fwd) = (&self.http, &self.model, &self.forwarding);
        let namespace = self
            .namespace
            .get()
            .map_err(|e| bad(format!("--namespace: {e}")))?;
        if model.tokenize_via == TokenizeVia::Local && model.model_dir.is_none() {
            return Err(bad(
                "--tokenize-via local needs --model-dir (or use --tokenize-via engine)".into(),
            ));
        }
        if model.render_url.is_some() && model.tokenize_via != TokenizeVia::Render {
            return Err(bad("--render-url needs --tokenize-via render".into()));
        }
        let served_model_name = model.served_model_name().map_err(bad)?;
        for (flag, value) in [
            ("--route-timeout-ms", fwd.route_timeout_ms),
            ("--engine-connect-timeout-ms", fwd.engine_connect_timeout_ms),
            ("--first-token-timeout-ms", fwd.first_token_timeout_ms),
            ("--stream-idle-timeout-ms", fwd.stream_idle_timeout_ms),
            ("--request-timeout-s", fwd.request_timeout_s),
            ("--keep-alive-s", fwd.keep_alive_s),
        ] {
            if value == 0 {
                return Err(bad(format!("{flag} must be above 0")));
            }
        }
        if http.max_body_bytes == 0 {
            return Err(bad("--max-body-bytes must be above 0".into()));
        }
        let wire_limits = self
            .wire_limits
            .to_limits()
            .map_err(|e| bad(e.to_string()))?;
        Ok(GatewayConfig {
            nats: self.nats.to_config().map_err(|e| bad(e.to_string()))?,
            etcd: self.etcd.to_config().map_err(|e| bad(e.to_string()))?,
            subjects: Subjects::new(namespace),
            listen: http.listen,
            http: http.server_limits(),
            model: ModelConfig {
                model_dir: model.model_dir.clone(),
                served_model_name,
                tokenize_via: model.tokenize_via,
                render_url: model.render_url.clone(),
                tokenizer: model.tokenizer_config(),
                forward: fwd.forward,
                chat_forward: fwd.chat_forward,
                engine_api: fwd.engine_api,
                disaggregation: fwd.disaggregation,
            },
            limits: RequestLimits {
                max_body_bytes: http.max_body_bytes,
                prompt: model.prompt_limit(wire_limits.max_route_tokens),
                max_retries: fwd.max_retries,
                route_timeout: Duration::from_millis(fwd.route_timeout_ms),
                engine_connect_timeout: Duration::from_millis(fwd.engine_connect_timeout_ms),
                first_token_timeout: Duration::from_millis(fwd.first_token_timeout_ms),
                stream_idle_timeout: Duration::from_millis(fwd.stream_idle_timeout_ms),
                engine_idle_timeout: Duration::from_millis(fwd.engine_idle_timeout_ms),
                request_timeout: Duration::from_secs(fwd.request_timeout_s),
                keep_alive: Duration::from_secs(fwd.keep_alive_s),
                lifecycle_batch: fwd.lifecycle_batch,
                route_grouping: crate::router::Grouping {
                    max: fwd.route_batch,
                    hold: Duration::from_millis(fwd.route_batch_hold_ms),
                },
                route_affinity: (fwd.route_affinity_ms > 0).then(|| {
                    crate::router::ReplicaAffinity {
                        window: Duration::from_millis(fwd.route_affinity_ms),
                        patience: Duration::from_millis(fwd.route_affinity_patience_ms),
                        target: fwd.route_affinity_target,
                    }
                }),
            },
            wire_limits,
        })
    }
}

#[cfg(test)]
mod tests;
