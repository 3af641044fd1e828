//! The relay's optional HTTP endpoint: `GET /metrics` in the Prometheus text format
//! (the `kv_relay_*` counters, see [`crate::counters`]). Off unless `--http-listen` is
//! given. Served by [`kv_cluster::http::serve`], so a connection that does not send
//! its request's headers within `--http-header-read-timeout-ms` is closed and at most
//! `--http-max-connections` are served at once. Cost: one small axum server; nothing
//! per event.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use clap::Args;
use kv_cluster::http::{DEFAULT_HEADER_READ_TIMEOUT_MS, ListenAddr, ServerLimits};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use tokio_util::sync::CancellationToken;

/// The relay's HTTP flags.
#[derive(Debug, Clone, Args)]
pub struct RelayHttpArgs {
    /// Address of the relay's own HTTP endpoint (`/metrics` with the `kv_relay_*`
    /// counters), or `off`.
    #[arg(long, env = "KV_RELAY_HTTP_LISTEN", default_value = "off")]
    pub http_listen: ListenAddr,
    /// Time a connection has to deliver a request's headers, in ms, from accept, or
    /// from the head's first byte on a kept-alive connection (idle ones are closed
    /// after 600 s, or first at the cap).
    #[arg(
        long,
        env = "KV_RELAY_HTTP_HEADER_READ_TIMEOUT_MS",
        default_value_t = DEFAULT_HEADER_READ_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub http_header_read_timeout_ms: u64,
    /// Most connections served at once; more wait in the listen backlog.
    #[arg(long, env = "KV_RELAY_HTTP_MAX_CONNECTIONS", default_value = "64")]
    pub http_max_connections: NonZeroUsize,
}

/// Where and how the relay serves `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayHttpConfig {
    /// The listen address.
    pub listen: SocketAddr,
    /// Header-read, idle and body timeouts and connection cap.
    pub limits: ServerLimits,
}

impl RelayHttpArgs {
    /// The endpoint's settings; `None` with `--http-listen off`.
    pub fn to_config(&self) -> Option<RelayHttpConfig> {
        self.http_listen.0.map(|listen| RelayHttpConfig {
            listen,
            limits: ServerLimits::from_flags(
                self.http_header_read_timeout_ms,
                self.http_max_connections,
            ),
        })
    }
}

async fn metrics(State(registry): State<prometheus::Registry>) -> Response {
    match prometheus::TextEncoder::new().encode_to_string(&registry.gather()) {
        Ok(text) => text.into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {e}\n"),
        )
            .into_response(),
    }
}

/// Binds `config.listen` and serves `/metrics` from `registry` until `shutdown`;
/// returns the bound address (useful with port 0).
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve_metrics(
    config: RelayHttpConfig,
    registry: prometheus::Registry,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(registry);
    let task = tokio::spawn(kv_cluster::http::serve(
        listener,
        app,
        config.limits,
        shutdown,
    ));
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    const WAIT: Duration = Duration::from_secs(30);

    #[test]
    fn flags_give_the_limits_and_off_gives_no_endpoint() {
        let parse = |args: &[&str]| {
            kv_cluster::args::parse_flags::<RelayHttpArgs, _, _>(
                std::iter::once("relay").chain(args.iter().copied()),
            )
            .expect("flags parse")
        };
        assert_eq!(parse(&[]).to_config(), None);
        let config = parse(&[
            "--http-listen",
            "127.0.0.1:9091",
            "--http-header-read-timeout-ms",
            "250",
            "--http-max-connections",
            "3",
        ])
        .to_config()
        .expect("an endpoint");
        assert_eq!(
            config.limits.header_read_timeout,
            Duration::from_millis(250)
        );
        assert_eq!(config.limits.max_connections.get(), 3);
        let defaults = parse(&["--http-listen", "127.0.0.1:9091"]).to_config();
        let limits = defaults.expect("an endpoint").limits;
        assert_eq!(limits.header_read_timeout, Duration::from_secs(5));
        assert_eq!(limits.max_connections.get(), 64);
    }

    /// The relay's `/metrics` closes a connection that sends nothing, and still
    /// answers a scrape.
    #[tokio::test]
    async fn an_idle_connection_is_closed_and_scrapes_are_answered() {
        let config = RelayHttpConfig {
            listen: "127.0.0.1:0".parse().expect("an address"),
            limits: ServerLimits::from_flags(200, NonZeroUsize::MIN),
        };
        let shutdown = CancellationToken::new();
        let registry = prometheus::Registry::new();
        crate::counters::RelayCounters::register(&registry).expect("fresh registry");
        let (addr, task) = serve_metrics(config, registry, shutdown.clone())
            .await
            .expect("binds");
        let mut idle = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connects");
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(WAIT, idle.read(&mut buf)).await;
        assert_eq!(read.expect("closed by the relay").unwrap_or(0), 0);
        let client = kv_cluster::http::client().expect("a client");
        let url = format!("http://{addr}/metrics");
        let (status, page) =
            kv_cluster::http::get_text(&client, url, WAIT, kv_cluster::http::MAX_RESPONSE_BYTES)
                .await
                .expect("scrape");
        assert_eq!(status, 200);
        assert!(page.contains("kv_relay_published_events_total"), "{page}");
        shutdown.cancel();
        task.await.expect("server task");
    }
}
