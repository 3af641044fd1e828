//! `kv-router gateway`: the request path of a kv-router cluster. An OpenAI-compatible
//! HTTP server that tokenizes each prompt the way the engine will, asks the router
//! for a (worker, dp_rank) over the public NATS protocol, forwards the request to that
//! engine's HTTP endpoint (found in the etcd worker directory), streams the answer
//! back and reports the request's lifecycle (`prefill_done`, `keep_alive`, `freed`).
//! When the router splits a request between a prefill and a decode worker, it runs
//! both halves (vLLM's or SGLang's protocol) and answers with the decode worker's.
//!
//! It is stateless and depends only on the protocol (`kv-events`) and the cluster
//! crate (`kv-cluster`), never on the indexer or the scheduler: any number of gateway
//! replicas can front any number of router replicas, and a frontend written in another
//! language could do exactly what this one does. Operator guide: `docs/gateway.md`.
//!
//! # Layout
//! - [`config`]: flags → [`config::GatewayConfig`] (connection, model, forwarding,
//!   limits).
//! - [`http`]: routes, handlers, health and metrics endpoints.
//! - [`flow`]: one request's path: tokenize → route → forward → answer, with failover;
//!   the two halves of a disaggregated request in its `halves` module.
//! - [`limit`]: the bound on one prompt, fixed or the engines' context length.
//! - [`openai`]: the request bodies read, and the engine bodies built from them.
//! - [`tokenize`]: prompt → token ids, in process or by the engine.
//! - [`router`]: route queries (those arriving together grouped into one batch) and
//!   the [`router::Booking`] that frees on every path.
//! - [`forward`]: one engine attempt, up to its first token.
//! - [`answer`]: relaying or assembling the engine's events.
//! - [`Core`]: what the gateway and the endpoint picker (`kv-epp`) share.
//! - [`workers`]: worker id → engine URL, role and KV transfer, from the etcd
//!   directory.
//! - [`parity`]: the router's predicted overlap against the engines' reported cached
//!   tokens, per worker, with a persistent mismatch flagged and its likely cause.
//! - [`metrics`]: the gateway's Prometheus metrics.
//! - [`error`]: [`GatewayError`] and the client-facing [`error::ApiError`].

pub mod answer;
pub mod config;
mod directory;
pub mod error;
pub mod flow;
pub mod forward;
pub mod http;
pub mod limit;
pub mod metrics;
pub mod openai;
pub mod parity;
pub mod router;
pub mod session;
pub mod tokenize;
pub mod workers;

pub use config::{GatewayArgs, GatewayConfig};
pub use error::GatewayError;

use crate::config::TokenizeVia;
use crate::directory::Directory;
use crate::flow::Flow;
use crate::forward::EngineClient;
use crate::http::AppState;
use crate::limit::PromptLimits;
use crate::metrics::GatewayMetrics;
use crate::parity::{ParityMonitor, RouterAsker};
use crate::router::{RouterClient, RouterSettings};
use crate::tokenize::PromptTokenizer;
use crate::tokenize::pool::TokenizerPool;
use crate::tokenize::remote::{Api, Remote, TokenizeTarget};
use crate::workers::WorkerUrls;
use axum::serve::ListenerExt;
use kv_cluster::directory::WorkerDirectory;
use kv_cluster::metrics::Registrar;
use kv_cluster::shutdown::{ShutdownBudget, ShutdownIncomplete};
use kv_tokenizer::{CachedTokenizer, ModelTokenizer};
use prometheus::Registry;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How long shutdown waits for streams in flight before it cuts them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long shutdown then waits for the lifecycle messages to reach NATS; with NATS
/// unreachable the flush never completes, and the gateway exits with an error. With
/// [`SHUTDOWN_GRACE`], 13 s: inside the Helm chart's 15 s termination grace period.
pub const SHUTDOWN_FLUSH_TIMEOUT: Duration = Duration::from_secs(3);

/// A running gateway.
pub struct Gateway {
    local_addr: SocketAddr,
    shutdown: CancellationToken,
    server: JoinHandle<()>,
    nats: async_nats::Client,
    metrics: GatewayMetrics,
    workers: WorkerUrls,
}

impl Gateway {
    /// Connects to NATS, loads the tokenizer, starts watching the worker directory
    /// (in the background: until etcd answers, `/health/readyz` says no worker is
    /// known) and serves HTTP on `config.listen`, until `shutdown` is cancelled or
    /// [`Gateway::shutdown`] is called. Metrics go to `registry`.
    ///
    /// # Errors
    /// [`GatewayError`] when the tokenizer cannot be loaded, NATS cannot be reached,
    /// the metrics clash or the address cannot be bound.
    pub async fn start(
        config: GatewayConfig,
        registry: Arc<Registry>,
        shutdown: CancellationToken,
    ) -> Result<Self, GatewayError> {
        let metrics = GatewayMetrics::new(&Registrar::new(&registry))?;
        let Core { flow, nats } =
            Core::connect(&config, "kv-gateway", metrics.clone(), &shutdown).await?;
        let workers = flow.workers.clone();
        let state = AppState { flow, registry };
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| GatewayError::Http {
                addr: config.listen,
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| GatewayError::Http {
            addr: config.listen,
            source,
        })?;
        let (stop, limits) = (shutdown.clone(), config.http);
        let server = tokio::spawn(async move {
            // Each SSE chunk is a small write: without TCP_NODELAY, Nagle's algorithm
            // holds it until the client's delayed ACK (up to 40 ms on Linux).
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    warn!(error = %e, "cannot set TCP_NODELAY");
                }
            });
            kv_cluster::http::serve(listener, http::router(state), limits, stop).await;
        });
        info!(%local_addr, model = %config.model.served_model_name, "kv-router gateway ready");
        Ok(Self {
            local_addr,
            shutdown,
            server,
            nats,
            metrics,
            workers,
        })
    }

    /// The address HTTP is served on (the port chosen when `--listen` gave 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The gateway's metrics.
    pub fn metrics(&self) -> &GatewayMetrics {
        &self.metrics
    }

    /// Worker id → engine URL, as the directory shows them.
    pub fn workers(&self) -> &WorkerUrls {
        &self.workers
    }

    /// Stops accepting requests, lets streams in flight end for up to
    /// [`SHUTDOWN_GRACE`] (then cuts them, which frees their bookings), and flushes
    /// the lifecycle messages to NATS for up to [`SHUTDOWN_FLUSH_TIMEOUT`].
    ///
    /// # Errors
    /// [`ShutdownIncomplete`] when the flush did not finish in time (NATS unreachable):
    /// the lifecycle messages still queued are lost, and the router frees their
    /// bookings at its request TTL.
    pub async fn shutdown(mut self) -> Result<(), ShutdownIncomplete> {
        self.shutdown.cancel();
        if tokio::time::timeout(SHUTDOWN_GRACE, &mut self.server)
            .await
            .is_err()
        {
            warn!("streams still open after the grace period; closing them");
            self.server.abort();
        }
        let mut budget = ShutdownBudget::start(SHUTDOWN_FLUSH_TIMEOUT);
        let flush = self.nats.flush();
        if let Some(Err(e)) = budget
            .step("flushing the lifecycle messages to NATS", flush)
            .await
        {
            warn!(error = %e, "lifecycle messages may not all have reached nats");
        }
        budget.finish()?;
        info!("kv-router gateway stopped");
        Ok(())
    }
}

/// What both frontends of the request path share (the gateway and the endpoint
/// picker, `kv-epp`): the tokenizer, the router client, the worker directory's
/// worker id → engine URL map (watched in the background until `shutdown`), the
/// prompt bound and the metrics, as one [`Flow`]; and the NATS connection.
pub struct Core {
    /// Tokenize → route (→ forward, for the gateway).
    pub flow: Flow,
    /// The NATS connection of the router client (to flush it at shutdown).
    pub nats: async_nats::Client,
}

impl Core {
    /// Loads the tokenizer, connects to NATS as `client_name` and starts watching the
    /// worker directory in the background (until etcd answers, no worker is known).
    ///
    /// # Errors
    /// [`GatewayError`] when the tokenizer cannot be loaded, its threads cannot start,
    /// or NATS cannot be reached.
    pub async fn connect(
        config: &GatewayConfig,
        client_name: &str,
        metrics: GatewayMetrics,
        shutdown: &CancellationToken,
    ) -> Result<Self, GatewayError> {
        let client = kv_cluster::http::client_builder()
            .connect_timeout(config.limits.engine_connect_timeout)
            // Below the engines' own keep-alive: a pooled connection is never one the
            // engine is closing (reqwest's default, 90 s, showed as retries).
            .pool_idle_timeout(config.limits.engine_idle_timeout)
            .tcp_nodelay(true)
            .build()?;
        let workers = WorkerUrls::default();
        // The tokenizer is built with the largest bound there can be; each request is
        // checked against the bound of its moment (`Flow::prompt`).
        let limits = config.limits.prompt.ceiling();
        // An engine's tokenization is bounded like its first token.
        let remote_timeout = config.limits.first_token_timeout;
        let remote = |api| {
            let target = match &config.model.render_url {
                Some(url) if api == Api::Render => TokenizeTarget::Server(url.clone()),
                _ => TokenizeTarget::Engines(workers.clone()),
            };
            let remote = Remote::new(client.clone(), api, target, remote_timeout);
            PromptTokenizer::remote(remote, metrics.clone())
        };
        let tokenizer = match config.model.tokenize_via {
            TokenizeVia::Engine => remote(Api::Tokenize),
            TokenizeVia::Render => remote(Api::Render),
            TokenizeVia::Local => {
                let dir = config.model.model_dir.clone().ok_or_else(|| {
                    GatewayError::Config("--tokenize-via local needs --model-dir".into())
                })?;
                let tokenizer = Arc::new(ModelTokenizer::from_dir(dir, limits)?);
                let tokenizer = CachedTokenizer::new(tokenizer, config.model.tokenizer.cache_bytes);
                if let Some(reason) = tokenizer.off_reason() {
                    tracing::info!(reason, "no tokenizer cache");
                }
                let pool = TokenizerPool::start(
                    config.model.tokenizer.threads,
                    config.model.tokenizer.queue,
                )
                .map_err(GatewayError::Threads)?;
                // A prompt waits for a thread no longer than the request may take.
                let deadline = config.limits.request_timeout;
                PromptTokenizer::local(
                    Arc::new(tokenizer),
                    Arc::new(pool),
                    deadline,
                    metrics.clone(),
                )
            }
        };
        // The lifecycle publisher re-sends `freed` after a reconnect: it hears of the
        // connection's ups and downs through this channel.
        let (events, connection) = tokio::sync::mpsc::unbounded_channel();
        let nats = config
            .nats
            .connect_with(client_name, |options| {
                options.event_callback(move |event| {
                    // The receiver lives as long as the lifecycle publisher.
                    let _ = events.send(event);
                    async {}
                })
            })
            .await?;
        let router = RouterClient::new(
            nats.clone(),
            config.subjects.clone(),
            RouterSettings {
                timeout: config.limits.route_timeout,
                keep_alive: config.limits.keep_alive,
                lifecycle_batch: config.limits.lifecycle_batch,
                grouping: config.limits.route_grouping,
                max_message_bytes: config.wire_limits.max_message_bytes,
                affinity: config.limits.route_affinity,
            },
            metrics.router(),
            connection,
        );

        let asker = RouterAsker::new(nats.clone(), &config.subjects);
        let parity = ParityMonitor::asking(metrics.clone(), workers.clone(), Some(asker));
        let directory_shutdown = shutdown.child_token();
        let (etcd, subjects, limits) = (
            config.etcd.clone(),
            config.subjects.clone(),
            config.wire_limits,
        );
        let mut urls = Directory {
            urls: workers.clone(),
            parity: parity.clone(),
        };
        tokio::spawn(async move {
            let loaded = WorkerDirectory::connect_and_load(
                etcd,
                subjects,
                limits,
                &mut urls,
                &directory_shutdown,
            )
            .await;
            if let Some(directory) = loaded {
                directory.watch(urls, directory_shutdown).await;
            }
        });

        Ok(Self {
            flow: Flow {
                model: config.model.clone(),
                limits: config.limits,
                prompt: PromptLimits::new(config.limits.prompt, workers.clone()),
                tokenizer,
                router,
                workers: workers.clone(),
                engine: EngineClient::new(client, config.model.engine_api),
                metrics: metrics.clone(),
                parity,
            },
            nats,
        })
    }
}

/// `kv-router gateway`: runs until SIGINT or SIGTERM.
///
/// # Errors
/// [`GatewayError`] from the configuration or start-up, or
/// [`GatewayError::ShutdownIncomplete`] when the shutdown ran out of time.
pub async fn run(args: GatewayArgs) -> Result<(), GatewayError> {
    let config = args.to_config()?;
    let registry = Arc::new(kv_cluster::metrics::process_registry());
    let shutdown = CancellationToken::new();
    let gateway = Gateway::start(config, registry, shutdown).await?;
    kv_cluster::process::shutdown_signal().await;
    gateway.shutdown().await?;
    Ok(())
}
