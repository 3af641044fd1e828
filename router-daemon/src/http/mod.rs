//! The operator's HTTP endpoint (axum, HTTP/1.1, plain text and JSON):
//!
//! | path | answer |
//! |---|---|
//! | `GET /metrics` | Prometheus text format of the injected registry |
//! | `GET /health/livez` | `200` while the process serves HTTP at all |
//! | `GET /health/readyz` | `200` when ready, `503` otherwise; JSON [`Readiness`] body |
//! | `GET /debug/workers` | JSON [`WorkersView`]: workers, leases, ranks, load; where [`DebugListen`] says |
//!
//! The server runs from the start of the daemon (so probes see "starting, not ready"
//! while etcd is retried) until the very end of shutdown. A scrape costs one sampling
//! pass ([`crate::metrics::Metrics::refresh`]: one round trip to every indexer shard, one
//! scheduler lock) plus encoding the registry; `/debug/workers` costs one scheduler
//! lock and one copy of the worker directory.
//!
//! Every listener is served by [`kv_cluster::http::serve`]: a header-read timeout that
//! also bounds idle keep-alive connections, and a connection cap
//! ([`DaemonHttpConfig::limits`]). The client side (`kv-router probe`, tests) is
//! [`kv_cluster::http::get_text`].
//!
//! # Layout
//! - this file: the main routes and the running [`HttpServer`].
//! - [`config`]: the `[http]` flags ([`DaemonHttpArgs`]) and [`DaemonHttpConfig`].
//! - [`workers`]: the `/debug/workers` view and its routes.

pub(crate) mod config;
pub(crate) mod workers;

pub(crate) use config::{DaemonHttpArgs, DebugListen};
pub(crate) use workers::debug_app;

use crate::health::Readiness;
use crate::state::RouterState;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get as get_route;
use kv_cluster::http::ServerLimits;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

/// What the handlers read.
#[derive(Clone)]
pub(crate) struct HttpState {
    /// The registry `/metrics` encodes.
    pub registry: prometheus::Registry,
    /// The router state (indexer, scheduler, counters, worker directory, health).
    pub router: Arc<RouterState>,
}

/// Errors of the HTTP endpoint.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// The listen address could not be bound.
    #[error("cannot listen for http on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// The main routes (`/metrics`, `/health/*`), for embedding or testing; `/debug/*` is
/// [`debug_app`].
pub(crate) fn app(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get_route(metrics))
        .route("/health/livez", get_route(livez))
        .route("/health/readyz", get_route(readyz))
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

/// A running HTTP endpoint: the main listener and, with [`DebugListen::Separate`], the
/// `/debug` one. Dropping it stops both without waiting; [`HttpServer::stop`] also
/// waits for open requests to finish.
pub(crate) struct HttpServer {
    local_addr: SocketAddr,
    debug_addr: Option<SocketAddr>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), HttpError> {
    let bind_error = |source| HttpError::Bind { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let local = listener.local_addr().map_err(bind_error)?;
    Ok((listener, local))
}

impl HttpServer {
    /// Binds `addr` (port 0 picks a free port) and serves [`app`] there until
    /// [`HttpServer::stop`], with `/debug/*` where `debug_listen` says and every connection
    /// bounded by `limits`.
    ///
    /// # Errors
    /// [`HttpError::Bind`] when an address cannot be bound.
    pub(crate) async fn start(
        addr: SocketAddr,
        debug_listen: DebugListen,
        limits: ServerLimits,
        state: HttpState,
    ) -> Result<Self, HttpError> {
        let (listener, local_addr) = bind(addr).await?;
        let debug_listener = match debug_listen {
            DebugListen::Separate(debug_addr) => Some(bind(debug_addr).await?),
            DebugListen::Main | DebugListen::Off => None,
        };
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        let main = match debug_listen {
            DebugListen::Main => app(state.clone()).merge(debug_app(state.clone())),
            DebugListen::Separate(_) | DebugListen::Off => app(state.clone()),
        };
        tasks.spawn(kv_cluster::http::serve(
            listener,
            main,
            limits,
            shutdown.clone(),
        ));
        info!(%local_addr, %debug_listen, "http endpoint listening (/metrics, /health/livez, /health/readyz)");
        let debug_addr = debug_listener.map(|(listener, debug_addr)| {
            tasks.spawn(kv_cluster::http::serve(
                listener,
                debug_app(state),
                limits,
                shutdown.clone(),
            ));
            info!(%debug_addr, "http debug endpoint listening (/debug/workers)");
            debug_addr
        });
        tasks.close();
        Ok(Self {
            local_addr,
            debug_addr,
            shutdown,
            tasks,
        })
    }
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The bound address of the separate `/debug` listener, if there is one.
    pub(crate) fn debug_addr(&self) -> Option<SocketAddr> {
        self.debug_addr
    }

    /// Stops accepting, lets open requests finish, and waits for the servers.
    pub(crate) async fn stop(self) {
        self.shutdown.cancel();
        self.tasks.wait().await;
    }
}
