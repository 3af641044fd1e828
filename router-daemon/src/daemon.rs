//! Start-up and shutdown of the daemon, in one place.
//!
//! Start-up order, chosen so that nothing published during start-up is lost:
//! 1. connect to NATS and etcd, spawn the indexer shards;
//! 2. subscribe to KV events, load metrics and lifecycle messages (NATS buffers them
//!    from here on);
//! 3. load every worker registration from etcd, then watch from the next revision;
//! 4. join the route queue group last, so no query is answered before workers are
//!    known; log `kv-router ready`.
//!
//! Shutdown order: stop intake (unsubscribe; in-flight route queries are still
//! answered) → wait for the intake tasks → stop discovery → drain and stop the indexer
//! shards → drain the NATS connection.

use crate::config::DaemonConfig;
use crate::counters::Counters;
use crate::state::RouterState;
use crate::{discovery, intake, route};
use anyhow::Context;
use indexer::ShardedIndexer;
use scheduler::Scheduler;
use std::future::Future;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

/// A running daemon. Dropping it without [`Daemon::shutdown`] cancels every task
/// abruptly; call `shutdown` for the orderly sequence.
pub struct Daemon {
    state: Arc<RouterState>,
    nats: async_nats::Client,
    intake: CancellationToken,
    intake_tasks: TaskTracker,
    discovery: CancellationToken,
    discovery_tasks: TaskTracker,
    indexer_shutdown: CancellationToken,
}

impl Daemon {
    /// Connects, subscribes and loads discovery; returns once the daemon is ready to
    /// answer routing queries.
    ///
    /// # Errors
    /// When NATS or etcd cannot be reached, a subscription fails, or the metrics
    /// cannot be registered in `registry`.
    pub async fn start(
        config: DaemonConfig,
        registry: &prometheus::Registry,
    ) -> anyhow::Result<Self> {
        let counters = Counters::register(registry).context("registering metrics")?;
        let nats = async_nats::ConnectOptions::new()
            .name("kv-router")
            .connect(config.nats.servers.clone())
            .await
            .with_context(|| format!("connecting to NATS at {:?}", config.nats.servers))?;
        let mut etcd = discovery::connect(&config.etcd).await?;

        let indexer_shutdown = CancellationToken::new();
        let indexer = ShardedIndexer::spawn(config.indexer.clone(), indexer_shutdown.clone())
            .context("starting the indexer")?;
        let scheduler = Scheduler::new(config.scheduler.clone(), config.rng_seed)
            .context("building the scheduler")?;
        let subjects = config.subjects.clone();
        let state = Arc::new(RouterState::new(
            subjects.clone(),
            config.route.block_size,
            indexer,
            scheduler,
            counters,
        ));

        let intake = CancellationToken::new();
        let intake_tasks = TaskTracker::new();
        let events = nats
            .subscribe(subjects.kv_events_all())
            .await
            .context("subscribing to kv events")?;
        let metrics = nats
            .subscribe(subjects.load_metrics_all())
            .await
            .context("subscribing to load metrics")?;
        let lifecycle = nats
            .subscribe(subjects.lifecycle())
            .await
            .context("subscribing to lifecycle")?;
        intake_tasks.spawn(intake::serve_events(
            state.clone(),
            events,
            intake.child_token(),
        ));
        intake_tasks.spawn(intake::serve_with(
            state.clone(),
            metrics,
            intake.child_token(),
            intake::handle_metrics,
        ));
        intake_tasks.spawn(intake::serve_with(
            state.clone(),
            lifecycle,
            intake.child_token(),
            crate::lifecycle::handle_lifecycle,
        ));

        let mut known = discovery::KnownWorkers::new();
        let revision = discovery::resync(&mut etcd, &state, &mut known).await?;
        let discovery_token = CancellationToken::new();
        let discovery_tasks = TaskTracker::new();
        info!(
            workers = known.len(),
            revision, "loaded worker registrations"
        );
        discovery_tasks.spawn(discovery::watch(
            etcd,
            state.clone(),
            known,
            revision,
            discovery_token.clone(),
        ));

        let routes = nats
            .queue_subscribe(subjects.route(), subjects.route_queue_group())
            .await
            .context("joining the route queue group")?;
        intake_tasks.spawn(route::serve(
            state.clone(),
            nats.clone(),
            routes,
            config.route.max_inflight,
            intake.child_token(),
        ));
        intake_tasks.close();
        crate::barrier::server_barrier(&nats)
            .await
            .context("syncing subscriptions with NATS")?;
        info!(namespace = %subjects.namespace(), route = %subjects.route(), "kv-router ready");
        Ok(Self {
            state,
            nats,
            intake,
            intake_tasks,
            discovery: discovery_token,
            discovery_tasks,
            indexer_shutdown,
        })
    }

    /// The shared router state (indexer, scheduler, counters).
    pub fn state(&self) -> &Arc<RouterState> {
        &self.state
    }

    /// Runs the shutdown sequence described in the module docs.
    ///
    /// # Errors
    /// When the final NATS drain fails.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        info!("shutting down: stopping intake");
        self.intake.cancel();
        self.intake_tasks.wait().await;
        // The subscriptions were dropped; make sure the server has processed the
        // unsubscribes, so clients get "no responders" instead of a timeout.
        if let Err(e) = crate::barrier::server_barrier(&self.nats).await {
            tracing::warn!(error = %e, "could not confirm unsubscribes with NATS");
        }
        self.discovery.cancel();
        self.discovery_tasks.close();
        self.discovery_tasks.wait().await;
        info!("draining indexer shards");
        self.indexer_shutdown.cancel();
        self.state.indexer.closed().await;
        self.nats
            .drain()
            .await
            .context("draining the NATS connection")?;
        info!("shutdown complete");
        Ok(())
    }
}

/// Runs the daemon until `shutdown` resolves, then shuts it down in order.
///
/// # Errors
/// Start-up or shutdown failures (see [`Daemon::start`]).
pub async fn run(
    config: DaemonConfig,
    registry: &prometheus::Registry,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let daemon = Daemon::start(config, registry).await?;
    shutdown.await;
    daemon.shutdown().await
}
