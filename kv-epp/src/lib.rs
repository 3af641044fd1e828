//! `kv-router epp`: kv-router as the endpoint picker (EPP) of a Kubernetes Gateway API
//! Inference Extension `InferencePool`. The Gateway's proxy (Envoy, or any
//! implementation of the protocol) streams each inference request to the picker over
//! Envoy's ext_proc v3 gRPC API; the picker reads the OpenAI body, tokenizes it exactly
//! as `kv-router gateway` does (the same code, [`kv_gateway::Core`]), asks the router
//! over the public NATS protocol for a worker, and names that worker's pod
//! (`ip:port`) to the proxy, which forwards the request itself. The picker then
//! watches the response pass by to report the request's lifecycle (`prefill_done` at
//! the first body chunk, `freed` when the stream ends on any path).
//!
//! Why a separate frontend rather than the gateway behind the Gateway: an operator who
//! runs a Gateway API implementation keeps one HTTP front door; the picker adds one
//! gRPC round trip per request (the body is buffered here until it is whole, as the
//! protocol requires to pick on its content) and no forwarding, so no extra copy of
//! the answer. Operator guide: `docs/epp.md`.
//!
//! # Layout
//! - [`config`]: flags → [`EppConfig`] (the gateway's flag groups plus the gRPC
//!   listen address).
//! - [`stream`]: one ext_proc stream, request headers to end of response.
//! - [`pick`]: tokenize, route inside the subset, name the primary and its
//!   fallbacks.
//! - [`rebook`]: the booking of a picked request, moved when the proxy served an
//!   alternate.
//! - `body_mode`: the proxy's body modes (`FULL_DUPLEX_STREAMED`, `STREAMED`) and
//!   how each one's body messages are answered.
//! - [`wire`]: reading Envoy's messages and building its answers.
//! - [`pods`]: pod `ip:port` ↔ worker id, from the registrations' engine URLs.
//! - [`health`]: the gRPC health service.
//! - [`metrics`]: the picker's Prometheus metrics (`kv_epp_*`).

mod body_mode;
pub mod config;
pub mod health;
pub mod metrics;
pub mod pick;
pub mod pods;
pub mod rebook;
pub mod stream;
pub mod wire;

pub use config::{EppArgs, EppConfig};

use crate::health::Health;
use crate::metrics::EppMetrics;
use crate::stream::Picker;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use kv_cluster::metrics::Registrar;
use kv_gateway::metrics::GatewayMetrics;
use kv_gateway::workers::WorkerUrls;
use kv_gateway::{Core, GatewayError};
use prometheus::{Registry, TextEncoder};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Errors of the picker's start-up and shutdown.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    /// Configuration, tokenizer, NATS or metrics (as the gateway reports them).
    #[error(transparent)]
    Gateway(#[from] GatewayError),
    /// A listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The metrics clash.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A running endpoint picker.
pub struct Epp {
    grpc_addr: SocketAddr,
    metrics_addr: SocketAddr,
    shutdown: CancellationToken,
    servers: Vec<JoinHandle<()>>,
    nats: async_nats::Client,
    metrics: EppMetrics,
    workers: WorkerUrls,
}

impl Epp {
    /// Loads the tokenizer, connects to NATS, starts watching the worker directory,
    /// and serves ext_proc and gRPC health on `config.grpc_listen` and Prometheus
    /// metrics (`GET /metrics`) on the gateway's `--listen`, until `shutdown`.
    ///
    /// # Errors
    /// [`EppError`] when the tokenizer cannot be loaded, NATS cannot be reached, the
    /// metrics clash or an address cannot be bound.
    pub async fn start(
        config: EppConfig,
        registry: Arc<Registry>,
        shutdown: CancellationToken,
    ) -> Result<Self, EppError> {
        let registrar = Registrar::new(&registry);
        let gateway_metrics = GatewayMetrics::new(&registrar).map_err(GatewayError::from)?;
        let metrics = EppMetrics::new(&registrar)?;
        let gateway = &config.gateway;
        let Core { flow, nats } =
            Core::connect(gateway, "kv-epp", gateway_metrics, &shutdown).await?;
        let workers = flow.workers.clone();
        let health = Health::new(flow.router.clone(), workers.clone());
        let picker = Picker::new(flow, config.limits, config.fallbacks, metrics.clone());

        let bind = |addr| async move {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| EppError::Listen { addr, source })?;
            let local = listener
                .local_addr()
                .map_err(|source| EppError::Listen { addr, source })?;
            Ok::<_, EppError>((listener, local))
        };
        let (grpc, grpc_addr) = bind(config.grpc_listen).await?;
        let (http, metrics_addr) = bind(gateway.listen).await?;

        let stop = shutdown.clone();
        let grpc_server = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(ExternalProcessorServer::new(picker))
                .add_service(health.service())
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
                    stop.cancelled_owned(),
                )
                .await;
            if let Err(e) = served {
                warn!(error = %e, "ext_proc server failed");
            }
        });
        let app = axum::Router::new()
            .route("/metrics", axum::routing::get(export))
            .with_state(registry);
        let (stop, limits) = (shutdown.clone(), gateway.http);
        let http_server = tokio::spawn(async move {
            kv_cluster::http::serve(http, app, limits, stop).await;
        });
        info!(%grpc_addr, %metrics_addr, "kv-router epp ready");
        Ok(Self {
            grpc_addr,
            metrics_addr,
            shutdown,
            servers: vec![grpc_server, http_server],
            nats,
            metrics,
            workers,
        })
    }

    /// The address ext_proc and gRPC health are served on.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The address `/metrics` is served on.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// Worker id → engine URL (and so pod address), as the directory shows them.
    pub fn workers(&self) -> &WorkerUrls {
        &self.workers
    }

    /// The picker's metrics.
    pub fn metrics(&self) -> &EppMetrics {
        &self.metrics
    }

    /// Stops serving (streams in flight end, which frees their bookings) and flushes
    /// the lifecycle messages to NATS, each for up to the gateway's shutdown bounds
    /// ([`kv_gateway::SHUTDOWN_GRACE`], [`kv_gateway::SHUTDOWN_FLUSH_TIMEOUT`]).
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        for mut server in self.servers {
            if tokio::time::timeout(kv_gateway::SHUTDOWN_GRACE, &mut server)
                .await
                .is_err()
            {
                warn!("streams still open after the grace period; closing them");
                server.abort();
            }
        }
        let flush = tokio::time::timeout(kv_gateway::SHUTDOWN_FLUSH_TIMEOUT, self.nats.flush());
        if !matches!(flush.await, Ok(Ok(()))) {
            warn!("lifecycle messages may not all have reached nats");
        }
        info!("kv-router epp stopped");
    }
}

async fn export(
    axum::extract::State(registry): axum::extract::State<Arc<Registry>>,
) -> Result<String, (axum::http::StatusCode, String)> {
    TextEncoder::new()
        .encode_to_string(&registry.gather())
        .map_err(|e| (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// `kv-router epp`: runs until SIGINT or SIGTERM.
///
/// # Errors
/// [`EppError`] from the configuration or start-up.
pub async fn run(args: EppArgs) -> Result<(), EppError> {
    let config = args.to_config()?;
    let epp = Epp::start(
        config,
        Arc::new(kv_cluster::metrics::process_registry()),
        CancellationToken::new(),
    )
    .await?;
    kv_cluster::process::shutdown_signal().await;
    epp.shutdown().await;
    Ok(())
}
