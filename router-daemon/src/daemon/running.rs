//! The running daemon: its handle and the orderly shutdown sequence (the order and
//! its deadline are in the parent module's docs), and [`run`], which starts and stops
//! it around a shutdown signal.

use super::Starting;
use crate::config::DaemonConfig;
use crate::health::Phase;
use crate::http::HttpServer;
use crate::route_thread::RouteThread;
use crate::state::RouterState;
use anyhow::Context;
use indexer::IndexerApi as _;
use kv_cluster::shutdown::ShutdownBudget;
use std::future::Future;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

/// A running daemon. Dropping it without [`Daemon::shutdown`] cancels every task
/// abruptly; call `shutdown` for the orderly sequence.
pub struct Daemon {
    pub(super) state: Arc<RouterState>,
    pub(super) shutdown_timeout: std::time::Duration,
    pub(super) nats: async_nats::Client,
    /// The route path's thread and connection.
    pub(super) route_thread: RouteThread,
    pub(super) intake: CancellationToken,
    pub(super) intake_tasks: TaskTracker,
    pub(super) discovery: CancellationToken,
    pub(super) discovery_tasks: TaskTracker,
    pub(super) indexer_shutdown: CancellationToken,
    pub(super) http: Option<HttpServer>,
}

impl Daemon {
    /// Builds, connects, subscribes, loads discovery and recovers; returns once the
    /// daemon is ready to answer routing queries. Serves no HTTP: use [`Starting`] (or
    /// [`run`]) for that.
    ///
    /// # Errors
    /// As [`Starting::new`] and [`Starting::start`].
    pub async fn start(
        config: DaemonConfig,
        registry: &prometheus::Registry,
    ) -> anyhow::Result<Self> {
        Starting::new(config, registry)?.start().await
    }

    /// The shared router state (indexer, scheduler, counters, health).
    pub fn state(&self) -> &Arc<RouterState> {
        &self.state
    }

    /// Runs the shutdown sequence described in the module docs, within the
    /// configured budget (`--shutdown-timeout-ms`).
    ///
    /// # Errors
    /// [`kv_cluster::shutdown::ShutdownIncomplete`] naming the steps abandoned or
    /// skipped when the budget ran out (NATS or etcd unreachable, typically); the
    /// NATS client's error when the final drain cannot be requested.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        info!(
            budget_ms = self.shutdown_timeout.as_millis(),
            "shutting down: stopping intake"
        );
        let mut budget = ShutdownBudget::start(self.shutdown_timeout);
        self.state.health.set_phase(Phase::ShuttingDown);
        self.intake.cancel();
        // Requests waiting for a busy worker are answered now instead of at their
        // maximum wait.
        {
            let queue = &self.state.admission.queue;
            queue.close(&mut queue.lock());
        }
        budget
            .step(
                "draining intake and answering the route queries taken",
                self.intake_tasks.wait(),
            )
            .await;
        // The subscriptions were dropped; make sure the server has processed the
        // unsubscribes, so clients get "no responders" instead of a timeout.
        let barrier = self.route_thread.barrier_with(&self.nats);
        if let Some(Err(e)) = budget
            .step("confirming the unsubscribes with NATS", barrier)
            .await
        {
            tracing::warn!(error = %e, "could not confirm unsubscribes with NATS");
        }
        self.discovery.cancel();
        self.discovery_tasks.close();
        budget
            .step("stopping discovery", self.discovery_tasks.wait())
            .await;
        // Shards serve their event queues before snapshot requests, so once this
        // answers, every batch intake handed to them has been applied.
        let drained = budget.step("draining the indexer shards", self.state.indexer.stats());
        if let Some(Err(e)) = drained.await {
            tracing::warn!(error = %e, "indexer stopped before it could be drained");
        }
        self.indexer_shutdown.cancel();
        budget
            .step("stopping the indexer shards", self.state.indexer.closed())
            .await;
        let drain = async {
            let (main, routes) = tokio::join!(self.nats.drain(), self.route_thread.close());
            main.and(routes)
        };
        let drained = budget
            .step("draining the NATS connections", drain)
            .await
            .transpose()
            .context("draining the NATS connections");
        self.state.health.set_phase(Phase::Stopped);
        if let Some(http) = self.http {
            // Skipped, the server is dropped, which stops it without waiting.
            budget.step("stopping the HTTP endpoint", http.stop()).await;
        }
        budget.finish()?;
        drained?;
        info!("shutdown complete");
        Ok(())
    }
}

/// Runs the daemon until `shutdown` resolves, then shuts it down in order. Serves the
/// HTTP endpoint of `config.http` from the start, so probes can watch start-up. A
/// shutdown during start-up abandons the start.
///
/// # Errors
/// Start-up or shutdown failures (see [`Starting`]).
pub async fn run(
    config: DaemonConfig,
    registry: &prometheus::Registry,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let listen = config.http.listen.0;
    let mut starting = Starting::new(config, registry)?;
    if let Some(addr) = listen {
        starting.serve_http(addr).await?;
    }
    let mut shutdown = std::pin::pin!(shutdown);
    let daemon = tokio::select! {
        daemon = starting.start() => daemon?,
        () = &mut shutdown => {
            info!("shutdown requested during start-up; abandoning start");
            return Ok(());
        }
    };
    shutdown.await;
    daemon.shutdown().await
}
