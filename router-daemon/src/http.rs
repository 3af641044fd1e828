//! The operator's HTTP endpoint (axum, HTTP/1.1, plain text and JSON):
//!
//! | path | answer |
//! |---|---|
//! | `GET /metrics` | Prometheus text format of the injected registry |
//! | `GET /health/livez` | `200` while the process serves HTTP at all |
//! | `GET /health/readyz` | `200` when ready, `503` otherwise; JSON [`Readiness`] body |
//! | `GET /debug/workers` | JSON [`WorkersView`]: workers, leases, ranks, load |
//!
//! The server runs from the start of the daemon (so probes see "starting, not ready"
//! while etcd is retried) until the very end of shutdown. A scrape costs one sampling
//! pass ([`crate::metrics::Metrics::refresh`]: one round trip to every indexer shard, one
//! scheduler lock) plus encoding the registry; `/debug/workers` costs one scheduler
//! lock and one copy of the worker directory.
//!
//! [`get`] is a minimal HTTP/1.1 client for these endpoints, used by
//! `kv-router probe` (container health checks need no curl) and by tests.

use crate::health::{Check, Readiness};
use crate::state::RouterState;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get as get_route;
use indexer::IndexerApi as _;
use kv_events::LoadMetrics;
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Where the HTTP endpoint listens: a socket address, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddr(pub Option<SocketAddr>);

impl std::str::FromStr for ListenAddr {
    type Err = std::net::AddrParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("off") {
            Ok(Self(None))
        } else {
            s.trim().parse().map(|a| Self(Some(a)))
        }
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(addr) => write!(f, "{addr}"),
            None => f.write_str("off"),
        }
    }
}

/// Settings of the HTTP endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpConfig {
    /// Listen address (`off`: no endpoint). Default `0.0.0.0:9090`.
    pub listen: ListenAddr,
}

/// What the handlers read.
#[derive(Clone)]
pub struct HttpState {
    /// The registry `/metrics` encodes.
    pub registry: prometheus::Registry,
    /// The router state (indexer, scheduler, counters, worker directory, health).
    pub router: Arc<RouterState>,
}

/// Errors of the HTTP endpoint.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The listen address could not be bound.
    #[error("cannot listen for http on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// A client request failed (connect, write, read or timeout).
    #[error("http request to {target} failed: {reason}")]
    Request {
        /// `host:port/path`.
        target: String,
        /// What went wrong, lowercase.
        reason: String,
    },
}

/// The routes, for embedding or testing.
pub fn app(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get_route(metrics))
        .route("/health/livez", get_route(livez))
        .route("/health/readyz", get_route(readyz))
        .route("/debug/workers", get_route(workers))
        .with_state(state)
}

async fn metrics(State(s): State<HttpState>) -> Response {
    let router = &s.router;
    router
        .counters
        .metrics
        .refresh(&router.indexer, || router.scheduler())
        .await;
    let families = s.registry.gather();
    match prometheus::TextEncoder::new().encode_to_string(&families) {
        Ok(text) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {e}\n"),
        )
            .into_response(),
    }
}

async fn livez() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<HttpState>) -> (StatusCode, Json<Readiness>) {
    let report = s.router.health.report();
    let status = if report.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(report))
}

/// The body of `GET /debug/workers`.
#[derive(Debug, Clone, Serialize)]
pub struct WorkersView {
    /// etcd reachability; when not ok, `workers` are the last known ones.
    pub etcd: Check,
    /// Registered workers by id.
    pub workers: Vec<WorkerView>,
}

/// One registered worker.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    /// Worker id.
    pub worker_id: u64,
    /// etcd lease id of its registration key (0: no lease).
    pub lease_id: i64,
    /// etcd revision that last modified its key.
    pub mod_revision: i64,
    /// Data-parallel ranks.
    pub dp_size: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV capacity of each rank, in blocks.
    pub total_kv_blocks: u64,
    /// One entry per dp_rank.
    pub ranks: Vec<RankView>,
}

/// Load of one (worker, dp_rank).
#[derive(Debug, Clone, Serialize)]
pub struct RankView {
    /// The rank.
    pub dp_rank: u32,
    /// Prompt tokens booked here whose prefill is not done, in tokens.
    pub active_prefill_tokens: u64,
    /// KV blocks booked here until freed, in blocks.
    pub active_decode_blocks: u64,
    /// Requests booked here and not freed.
    pub active_requests: usize,
    /// Blocks the index holds for this rank (`None` when the indexer did not answer).
    pub indexed_blocks: Option<usize>,
    /// The engine's last load report, if any.
    pub engine: Option<LoadMetrics>,
}

/// Builds the workers view from the directory, the scheduler and the indexer's
/// blocks per rank (one round trip to every shard).
pub async fn workers_view(router: &RouterState) -> WorkersView {
    let indexed: Option<std::collections::HashMap<kv_events::WorkerRank, usize>> = router
        .indexer
        .report()
        .await
        .ok()
        .map(|r| r.blocks_per_rank.into_iter().collect());
    let entries = router.directory.snapshot();
    let scheduler = router.scheduler();
    let workers = entries
        .into_iter()
        .map(|e| {
            let reg = e.registration;
            let ranks = (0..reg.dp_size)
                .map(|r| {
                    let rank = kv_events::WorkerRank::new(reg.worker_id, kv_events::DpRank(r));
                    let load = scheduler.rank_load(rank);
                    RankView {
                        dp_rank: r,
                        active_prefill_tokens: load.active_prefill_tokens,
                        active_decode_blocks: load.active_decode_blocks,
                        active_requests: load.active_requests,
                        indexed_blocks: indexed
                            .as_ref()
                            .map(|m| m.get(&rank).copied().unwrap_or(0)),
                        engine: scheduler.load_metrics(rank).copied(),
                    }
                })
                .collect();
            WorkerView {
                worker_id: reg.worker_id.0,
                lease_id: e.lease_id,
                mod_revision: e.mod_revision,
                dp_size: reg.dp_size,
                block_size: reg.block_size,
                total_kv_blocks: reg.total_kv_blocks,
                ranks,
            }
        })
        .collect();
    drop(scheduler);
    WorkersView {
        etcd: router.health.report().checks.etcd,
        workers,
    }
}

async fn workers(State(s): State<HttpState>) -> Json<WorkersView> {
    Json(workers_view(&s.router).await)
}

/// A running HTTP endpoint. Dropping it stops it without waiting; [`HttpServer::stop`]
/// also waits for open requests to finish.
pub struct HttpServer {
    local_addr: SocketAddr,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl HttpServer {
    /// Binds `addr` (port 0 picks a free port) and serves [`app`] until
    /// [`HttpServer::stop`].
    ///
    /// # Errors
    /// [`HttpError::Bind`] when the address cannot be bound.
    pub async fn start(addr: SocketAddr, state: HttpState) -> Result<Self, HttpError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| HttpError::Bind { addr, source })?;
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone().cancelled_owned();
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app(state))
                .with_graceful_shutdown(stop)
                .await;
            if let Err(e) = served {
                warn!(error = %e, "http server failed");
            }
        });
        info!(%local_addr, "http endpoint listening (/metrics, /health/livez, /health/readyz, /debug/workers)");
        Ok(Self {
            local_addr,
            shutdown,
            task: Some(task),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, lets open requests finish, and waits for the server task.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            warn!(error = %e, "http server task ended abnormally");
        }
    }
}

/// A response of [`get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Body, decoded as UTF-8 (lossily).
    pub body: String,
}

/// The value of the sample `name` with exactly `labels` (`k="v"` pairs, comma-separated
/// in exposition order; empty for an unlabelled metric) in Prometheus text `text`, as
/// `/metrics` serves it; for probes, measurement tools and tests.
pub fn metric_sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() {
        name.to_owned()
    } else {
        format!("{name}{{{labels}}}")
    };
    text.lines()
        .find_map(|l| l.strip_prefix(&key)?.strip_prefix(' ')?.parse().ok())
}

/// `GET http://{addr}{path}` with HTTP/1.1 and `Connection: close`, within `timeout`.
/// Handles `Content-Length` and chunked bodies; enough for the daemon's own endpoints.
///
/// # Errors
/// [`HttpError::Request`] on connect, I/O or parse failure or timeout.
pub async fn get(addr: &str, path: &str, timeout: Duration) -> Result<HttpResponse, HttpError> {
    let target = format!("{addr}{path}");
    let fail = |reason: String| HttpError::Request {
        target: target.clone(),
        reason,
    };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut raw = Vec::new();
        stream
            .read_to_end(&mut raw)
            .await
            .map_err(|e| format!("read: {e}"))?;
        parse_response(&raw)
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result.map_err(fail),
        Err(_) => Err(fail(format!("no answer within {timeout:?}"))),
    }
}

fn parse_response(raw: &[u8]) -> Result<HttpResponse, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or("bad status line")?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(HttpResponse {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("bad chunk header")?;
        let size_text = String::from_utf8_lossy(&rest[..eol]);
        let size_hex = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16).map_err(|_| "bad chunk size")?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = rest.get(..size).ok_or("truncated chunk")?;
        out.extend_from_slice(chunk);
        rest = rest.get(size + 2..).ok_or("truncated chunk")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addr_parses_addresses_and_off() {
        let on: ListenAddr = "127.0.0.1:9090".parse().unwrap();
        assert_eq!(on.to_string(), "127.0.0.1:9090");
        let off: ListenAddr = "OFF".parse().unwrap();
        assert_eq!(off, ListenAddr(None));
        assert_eq!(off.to_string(), "off");
        assert!("nine-thousand".parse::<ListenAddr>().is_err());
    }

    #[test]
    fn parses_length_and_chunked_bodies() {
        let plain = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\nno";
        assert_eq!(
            parse_response(plain).unwrap(),
            HttpResponse {
                status: 503,
                body: "no".into()
            }
        );
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap().body, "abcde");
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
        assert!(parse_response(b"garbage\r\n\r\n").is_err());
    }
}
