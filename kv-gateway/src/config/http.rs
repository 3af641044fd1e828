//! The gateway's HTTP server flags: where it listens and how it bounds client
//! connections and request bodies (`kv_cluster::http::serve` enforces them).

use clap::Args;
use kv_cluster::http::{
    BodyTimeouts, DEFAULT_BODY_IDLE_TIMEOUT_MS, DEFAULT_BODY_READ_TIMEOUT_MS,
    DEFAULT_HEADER_READ_TIMEOUT_MS, DEFAULT_IDLE_TIMEOUT_S, ServerLimits,
};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

/// Listen address, body size and connection limits.
#[derive(Debug, Clone, Args)]
pub struct GatewayHttpArgs {
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
    /// Most client connections served at once (each streaming request holds one);
    /// more wait in the listen backlog. Keep it under the process's open-file limit.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_GATEWAY_MAX_CONNECTIONS",
        default_value = "4096"
    )]
    pub max_connections: NonZeroUsize,
}

impl GatewayHttpArgs {
    /// The connection limits `kv_cluster::http::serve` enforces.
    pub(super) fn server_limits(&self) -> ServerLimits {
        ServerLimits {
            idle_timeout: Duration::from_secs(self.idle_timeout_s),
            body: BodyTimeouts {
                total: Duration::from_millis(self.body_read_timeout_ms),
                idle: Duration::from_millis(self.body_idle_timeout_ms),
            },
            ..ServerLimits::from_flags(self.header_read_timeout_ms, self.max_connections)
        }
    }
}
