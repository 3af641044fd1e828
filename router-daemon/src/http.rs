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
//! The client side (`kv-router probe`, tests) is [`kv_cluster::http::get`].

use crate::durability::recovery::status::RankRecoveryView;
use crate::health::{Check, Readiness};
use crate::state::RouterState;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get as get_route;
use indexer::IndexerApi as _;
use kv_cluster::http::ListenAddr;
use kv_events::LoadMetrics;
use scheduler::Liveness;
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

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
    /// What the silence of its load reports says: `never_reported` (judged by its
    /// lease alone), `live`, `quiet` (deprioritized) or `silent` (excluded).
    pub liveness: Liveness,
    /// Time since its last load report, in ms (`None`: never reported).
    pub metrics_age_ms: Option<u64>,
    /// Gap recovery trouble (`{"state": "recovering" | "backing_off" | "degraded",
    /// ...}`); `null` while the rank's events are in order.
    pub recovery: Option<RankRecoveryView>,
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
    let now = tokio::time::Instant::now();
    let clock = std::time::Instant::now();
    let workers = entries
        .into_iter()
        .map(|e| {
            let reg = e.registration;
            let ranks = (0..reg.dp_size)
                .map(|r| {
                    let rank = kv_events::WorkerRank::new(reg.worker_id, kv_events::DpRank(r));
                    let load = scheduler.rank_load(rank);
                    let (liveness, heard) = scheduler.liveness(rank, clock);
                    RankView {
                        dp_rank: r,
                        active_prefill_tokens: load.active_prefill_tokens,
                        active_decode_blocks: load.active_decode_blocks,
                        active_requests: load.active_requests,
                        indexed_blocks: indexed
                            .as_ref()
                            .map(|m| m.get(&rank).copied().unwrap_or(0)),
                        engine: scheduler.load_metrics(rank).copied(),
                        liveness,
                        metrics_age_ms: heard.map(|h| {
                            u64::try_from(clock.saturating_duration_since(h).as_millis())
                                .unwrap_or(u64::MAX)
                        }),
                        recovery: router.recovery.view(rank, now),
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
