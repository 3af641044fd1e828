//! `kv-router epp` flags: the gateway's flag groups (NATS, etcd, namespace, model and
//! tokenization, route timeout, body size; `KV_GATEWAY_*`, declared once in
//! `kv-gateway`) plus the picker's own (`KV_EPP_*`). The gateway's `--listen` serves
//! the picker's metrics; its `--max-body-bytes` bounds the buffered request body; its
//! `--request-timeout-s` bounds a whole ext_proc stream.

use clap::Args;
use kv_events::routing::MAX_FALLBACKS;
use kv_gateway::{GatewayArgs, GatewayConfig, GatewayError};
use std::net::SocketAddr;
use std::time::Duration;

/// `kv-router epp`: the Gateway API Inference Extension endpoint picker.
#[derive(Debug, Clone, Args)]
pub struct EppArgs {
    /// The gateway's flags (connection, model, tokenization, limits).
    #[command(flatten)]
    pub gateway: GatewayArgs,
    /// Address of the ext_proc and gRPC health server (the `InferencePool`'s
    /// `endpointPickerRef` port).
    #[arg(
        long,
        env = "KV_EPP_GRPC_LISTEN",
        default_value = "0.0.0.0:9002",
        help_heading = "Endpoint picker"
    )]
    pub grpc_listen: SocketAddr,
    /// Longest wait for the proxy's next message on a stream before the request body
    /// is whole, in ms (a proxy that stalls mid-body is answered 408).
    #[arg(
        long,
        env = "KV_EPP_BODY_TIMEOUT_MS",
        default_value_t = 10_000,
        help_heading = "Endpoint picker"
    )]
    pub body_timeout_ms: u64,
    /// Alternate endpoints named after the picked one (`primary,fb1,fb2` in the
    /// header and metadata), for a proxy that retries down the list: the router's
    /// next lowest-cost workers, one pod each, not booked until the proxy serves
    /// there. 0 names one endpoint; at most 4 (the protocol's `MAX_FALLBACKS`).
    #[arg(
        long,
        env = "KV_EPP_FALLBACKS",
        default_value_t = 2,
        help_heading = "Endpoint picker"
    )]
    pub fallbacks: u8,
}

/// Bounds on one ext_proc stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Largest request body buffered, in bytes (the gateway's `--max-body-bytes`).
    pub max_body_bytes: usize,
    /// Longest wait for the next message while the body is incomplete.
    pub body_timeout: Duration,
    /// Longest life of a stream, from its first message (the gateway's
    /// `--request-timeout-s`); then the booking is freed and the stream closed.
    pub stream_timeout: Duration,
}

/// The picker's validated settings.
#[derive(Debug, Clone)]
pub struct EppConfig {
    /// What the picker shares with the gateway.
    pub gateway: GatewayConfig,
    /// ext_proc and health listen address.
    pub grpc_listen: SocketAddr,
    /// Per-stream bounds.
    pub limits: StreamLimits,
    /// Alternate endpoints asked of the router per pick (0 to
    /// [`MAX_FALLBACKS`]).
    pub fallbacks: u8,
}

impl EppArgs {
    /// Validates the flags.
    ///
    /// # Errors
    /// [`GatewayError::Config`] for a bad gateway flag, a zero body timeout or more
    /// than [`MAX_FALLBACKS`] fallbacks.
    pub fn to_config(&self) -> Result<EppConfig, GatewayError> {
        let gateway = self.gateway.to_config()?;
        if self.body_timeout_ms == 0 {
            return Err(GatewayError::Config(
                "--body-timeout-ms must be above 0".into(),
            ));
        }
        if self.fallbacks > MAX_FALLBACKS {
            return Err(GatewayError::Config(format!(
                "--fallbacks is at most {MAX_FALLBACKS}, got {}",
                self.fallbacks
            )));
        }
        Ok(EppConfig {
            fallbacks: self.fallbacks,
            limits: StreamLimits {
                max_body_bytes: gateway.limits.max_body_bytes,
                body_timeout: Duration::from_millis(self.body_timeout_ms),
                stream_timeout: gateway.limits.request_timeout,
            },
            grpc_listen: self.grpc_listen,
            gateway,
        })
    }
}
