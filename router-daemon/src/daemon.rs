//! Start-up and shutdown of the daemon, in one place.
//!
//! Start-up order, chosen so that nothing published during start-up is lost and so
//! that probes can watch it:
//! 1. ([`Starting::new`]) build the router state — indexer shards, scheduler, metrics,
//!    health — with no network; the HTTP endpoint can be served from here on
//!    ([`Starting::serve_http`]) and reports "starting, not ready";
//! 2. connect to NATS (retried in the background until a server answers);
//! 3. subscribe to KV events (with `--jetstream`: restore the snapshot and create the
//!    stream consumer, which the stream feeds from here on) and load metrics; start the
//!    route path's thread and its NATS connection ([`crate::route_thread`]) and
//!    subscribe, from there, to lifecycle messages and replica sequence sync (NATS
//!    buffers them from here on); start the sync publisher (on that thread too) and
//!    the request expiry task;
//! 4. connect to etcd and load every worker registration, retrying with backoff while
//!    etcd is unavailable; then watch from the next revision;
//! 5. finish the initial recovery of the index: a dump from every registered worker
//!    rank (or, with `--jetstream`, start consuming the stream, now that the
//!    registrations are known, and catch up with it); events arriving meanwhile are
//!    buffered and applied after it (`durability`). Meanwhile, with replica sync on,
//!    ask the other replicas for the requests they booked before step 3 and apply
//!    their answers for at most `--replica-snapshot-timeout-ms`
//!    ([`crate::replica_sync::snapshot`]; after discovery, because a booking needs its
//!    rank registered);
//! 6. answer other replicas' snapshot requests from here on; join the route queue
//!    group last (on the route path's connection), so no query is answered before
//!    workers and peers' bookings are known; confirm the subscriptions of both
//!    connections with a server round trip each; log `kv-router ready` and report
//!    ready.
//!
//! Shutdown order ([`Daemon::shutdown`]): report not ready → stop intake (unsubscribe;
//! route queries already received are still answered, later ones get "no responders")
//! → wait for the intake tasks (those on the route thread too) → confirm the
//! unsubscribes with a NATS round trip on both connections → stop discovery → drain
//! the indexer shards (every event batch intake accepted is applied) and stop them →
//! drain both NATS connections and end the route thread → stop the HTTP endpoint.
//! Every step that waits shares one deadline, `--shutdown-timeout-ms` from the start
//! of the sequence (`kv_cluster::shutdown`): with NATS or etcd gone a drain or a round
//! trip never completes, so past the deadline the step under way is abandoned and the
//! rest skipped, each logged, and [`Daemon::shutdown`] fails naming them.
//!
//! Each step names itself in `/health/readyz` (`step`) and, once a start takes longer
//! than 10 s, in a warning every 10 s ([`crate::startup`]). The NATS round trips
//! (replica sync, step 3; the last one, step 6) re-publish until they arrive and fail
//! the start after 30 s of NATS being up ([`kv_cluster::barrier`]); waits for NATS or etcd
//! to come back are not bounded, and reported.
//!
//! If start-up fails, or its future is dropped (a shutdown signal during start-up),
//! every task it spawned is cancelled.

use crate::admission::Admission;
use crate::block_size::BlockSize;
use crate::config::DaemonConfig;
use crate::health::{Link, Phase};
use crate::http::{HttpServer, HttpState};
use crate::metrics::counters::Counters;
use crate::metrics::{AdmissionMetrics, Registrar};
use crate::route_thread::RouteThread;
use crate::state::RouterState;
use crate::{discovery, intake, lifecycle, replica_sync, route};
use anyhow::Context;
use indexer::Indexer;
use kv_cluster::directory::WorkerDirectory;
use kv_events::Subjects;
use scheduler::Scheduler;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

mod running;
pub use running::{Daemon, run};

/// A daemon whose state exists but which is not connected yet. Serve HTTP from it
/// while it starts, then [`Starting::start`] it.
pub struct Starting {
    config: DaemonConfig,
    registry: prometheus::Registry,
    state: Arc<RouterState>,
    /// Parent of every task token; cancelled if start-up does not complete.
    root: CancellationToken,
    indexer_shutdown: CancellationToken,
    http: Option<HttpServer>,
}

impl Starting {
    /// Registers the metrics and builds the router state (spawning the indexer
    /// shards). Needs no network.
    ///
    /// # Errors
    /// When the metrics cannot be registered in `registry` (a name is taken), or the
    /// indexer or scheduler refuse their config.
    pub fn new(config: DaemonConfig, registry: &prometheus::Registry) -> anyhow::Result<Self> {
        let counters = Counters::register(registry).context("registering metrics")?;
        let root = CancellationToken::new();
        let indexer_shutdown = root.child_token();
        let indexer = Indexer::spawn(config.indexer.clone(), indexer_shutdown.clone())
            .context("starting the indexer")?;
        let scheduler = Scheduler::new(config.scheduler.clone(), config.rng_seed)
            .context("building the scheduler")?;
        let admission_metrics = AdmissionMetrics::new(&Registrar::new(registry))
            .context("registering admission metrics")?;
        let admission = Admission::new(
            &config.admission,
            scheduler,
            counters.metrics.queue.clone(),
            admission_metrics,
        );
        let state = Arc::new(RouterState::new(
            config.subjects.clone(),
            config
                .route
                .block_size
                .map_or_else(BlockSize::adopted, BlockSize::pinned),
            indexer,
            counters,
            admission,
            config.limits,
            crate::removals::Removals::new(config.route.removals_per_rank),
        ));
        Ok(Self {
            config,
            registry: registry.clone(),
            state,
            root,
            indexer_shutdown,
            http: None,
        })
    }

    /// The shared router state (its `health` reports start-up progress).
    pub fn state(&self) -> &Arc<RouterState> {
        &self.state
    }

    /// Serves the HTTP endpoint on `addr` (port 0 picks one) from now until the end of
    /// [`Daemon::shutdown`], with `/debug/*` and the connection limits of the
    /// configuration's HTTP settings. Returns the bound address (the
    /// separate `/debug` one is [`Starting::http_debug_addr`]).
    ///
    /// # Errors
    /// When an address cannot be bound.
    pub async fn serve_http(&mut self, addr: SocketAddr) -> anyhow::Result<SocketAddr> {
        let server = HttpServer::start(
            addr,
            self.config.http.debug,
            self.config.http.limits,
            HttpState {
                registry: self.registry.clone(),
                router: self.state.clone(),
            },
        )
        .await?;
        let bound = server.local_addr();
        self.http = Some(server);
        Ok(bound)
    }

    /// The separate `/debug` listener's address, when [`Starting::serve_http`] started
    /// one.
    pub fn http_debug_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().and_then(HttpServer::debug_addr)
    }

    /// Connects, subscribes, loads discovery (retrying etcd with backoff) and recovers;
    /// returns once the daemon is ready to answer routing queries.
    ///
    /// # Errors
    /// When the NATS options are unusable or a subscription fails. etcd being
    /// unavailable is not an error: it is retried until it answers.
    pub async fn start(self) -> anyhow::Result<Daemon> {
        let Starting {
            config,
            registry: _,
            state,
            root,
            indexer_shutdown,
            http,
        } = self;
        // Cancels every task below if this future fails or is dropped before the end.
        let abandon = root.clone().drop_guard();
        let _slow = crate::startup::report_slow_start(state.health.clone());
        let step = |name| state.health.set_step(name);
        let subjects = config.subjects.clone();
        step("connecting to NATS");
        let nats = crate::nats::connect(&config.nats, state.health.clone(), Link::Main)
            .await
            .context("configuring the NATS connection")?;

        let intake = root.child_token();
        let intake_tasks = TaskTracker::new();
        // KV events first: a core subscription, or the JetStream stream after its
        // snapshot is restored (see `durability`); then the recovery service.
        step(match config.durability.jetstream {
            Some(_) => "opening the jetstream stream and restoring the index snapshot",
            None => "subscribing to kv events",
        });
        let event_intake = crate::durability::start_event_intake(
            &config.durability,
            &state,
            &nats,
            &intake_tasks,
            &intake,
        )
        .await?;
        let recovery = crate::durability::recovery::spawn(
            state.clone(),
            nats.clone(),
            config.durability.recovery,
            &intake_tasks,
            intake.child_token(),
        );
        step("subscribing to load metrics and lifecycle messages");
        let metrics = nats
            .subscribe(subjects.load_metrics_all())
            .await
            .context("subscribing to load metrics")?;
        // The route path's own thread and connection (`route_thread`): the lifecycle
        // intake contends with the route service for the scheduler lock.
        let route_thread = RouteThread::start(&config.nats, state.health.clone()).await?;
        let lifecycle = route_thread
            .client()
            .subscribe(subjects.lifecycle())
            .await
            .context("subscribing to lifecycle")?;
        let (admission, counters, limits) = (
            state.admission.clone(),
            state.counters.clone(),
            state.limits,
        );
        intake_tasks.spawn(intake::serve_with(
            metrics,
            intake.child_token(),
            move |subject, payload| {
                intake::handle_metrics(&admission, &counters, &limits, subject, payload);
            },
        ));
        let (admission, counters) = (state.admission.clone(), state.counters.clone());
        route_thread.spawn(
            &intake_tasks,
            intake::serve_batches_with(lifecycle, intake.child_token(), move |batch| {
                let payloads = batch.iter().map(|m| (m.subject.as_str(), &m.payload[..]));
                lifecycle::handle_lifecycle_batch(&admission, &counters, &limits, payloads);
            }),
        );
        step("starting replica sync: a NATS round trip between its two connections");
        replica_sync::sync::start(
            &state.admission,
            &state.counters,
            state.limits,
            &subjects,
            replica_sync::sync::SyncNats {
                config: &config.nats,
                main: &nats,
                thread: &route_thread,
            },
            &intake_tasks,
            &intake,
        )
        .await?;
        intake_tasks.spawn(
            state
                .admission
                .clone()
                .expire_requests(intake.child_token()),
        );

        step("loading worker registrations from etcd");
        let discovery_token = root.child_token();
        let mut discovery = discovery::Discovery::new(state.clone());
        let Some(directory) = WorkerDirectory::connect_and_load(
            config.etcd.clone(),
            subjects.clone(),
            config.limits,
            &mut discovery,
            &discovery_token,
        )
        .await
        else {
            anyhow::bail!("start-up cancelled while waiting for etcd");
        };
        state.health.set_discovery_loaded();
        let discovery_tasks = TaskTracker::new();
        info!(
            workers = discovery.known().len(),
            revision = directory.revision(),
            "loaded worker registrations"
        );
        // Workers joining from now on are asked for a dump; the loaded ones are
        // resynced by the initial recovery below.
        discovery.resync_joins();
        discovery_tasks.spawn(directory.watch(discovery, discovery_token.clone()));

        // Initial recovery: JetStream catch-up and/or a dump from every registered
        // worker; live events arriving meanwhile are buffered, not lost or doubled.
        // The peers' bookings are gathered at the same time.
        step("initial recovery of the index, and the peers' bookings");
        let (recovered, _snapshot) = tokio::join!(
            crate::durability::initial_recovery(
                &state,
                &recovery,
                event_intake,
                &intake_tasks,
                &intake,
            ),
            replica_sync::snapshot::gather(
                &state.admission,
                &state.counters,
                &state.limits,
                &subjects,
                &nats,
            ),
        );
        let recovered = recovered?;
        info!(summary = %recovered, "initial recovery done");
        state.health.set_recovery_done(recovered);
        step("joining the route queue groups");
        replica_sync::snapshot::serve(
            &state.admission,
            &state.counters,
            &subjects,
            &nats,
            &intake_tasks,
            &intake,
        )
        .await?;

        let route_nats = route_thread.client();
        // Each service listens on the queue group's subject and on this replica's
        // own, where a frontend pinned to it sends (`Subjects::route_at`); every
        // reply names the replica.
        let router_id = state.admission.replicas.router_id();
        let mut answered_by = async_nats::HeaderMap::new();
        answered_by.insert(kv_events::ROUTER_ID_HEADER, router_id.to_string().as_str());
        let routes = shared_and_own(
            route_nats,
            &subjects,
            subjects.route(),
            subjects.route_at(router_id),
        )
        .await
        .context("subscribing to the route subjects")?;
        route_thread.spawn(
            &intake_tasks,
            route::serve(
                state.clone(),
                route_nats.clone(),
                routes,
                config.route.max_inflight,
                intake.child_token(),
                answered_by.clone(),
            ),
        );
        let batches = shared_and_own(
            route_nats,
            &subjects,
            subjects.route_batch(),
            subjects.route_batch_at(router_id),
        )
        .await
        .context("subscribing to the batch route subjects")?;
        route_thread.spawn(
            &intake_tasks,
            crate::route_batch::serve(
                state.clone(),
                route_nats.clone(),
                batches,
                config.route.max_inflight,
                config.route.max_batch,
                intake.child_token(),
                answered_by.clone(),
            ),
        );
        // Roll calls: every replica answers each, naming itself (a frontend's way to
        // learn which replicas are up); on the main connection, off the route path.
        let roll_call = nats
            .subscribe(subjects.router_roll_call())
            .await
            .context("subscribing to the roll call")?;
        intake_tasks.spawn(crate::service::serve_requests(
            state.clone(),
            vec![roll_call],
            crate::service::Service {
                client: nats.clone(),
                max_inflight: config.route.max_inflight,
                intake: intake.child_token(),
                kind: crate::metrics::counters::MessageKind::RollCall,
                headers: Some(answered_by),
            },
            move |state: Arc<RouterState>, _payload: bytes::Bytes| {
                state.counters.message(
                    crate::metrics::counters::MessageKind::RollCall,
                    crate::metrics::counters::Outcome::Ok,
                );
                std::future::ready(kv_events::replicas::RollCallReply {
                    router_id: state.admission.replicas.router_id(),
                })
            },
        ));
        // Removals queries stay on the main connection: not on the per-route path.
        let removals = nats
            .queue_subscribe(subjects.router_removals(), subjects.route_queue_group())
            .await
            .context("joining the removals queue group")?;
        intake_tasks.spawn(crate::service::serve_requests(
            state.clone(),
            vec![removals],
            crate::service::Service {
                client: nats.clone(),
                max_inflight: config.route.max_inflight,
                intake: intake.child_token(),
                kind: crate::metrics::counters::MessageKind::Removals,
                headers: None,
            },
            {
                let subject = subjects.router_removals();
                move |state: Arc<RouterState>, payload: bytes::Bytes| {
                    let reply =
                        (state.removals).handle(&state.counters, &state.limits, &subject, &payload);
                    std::future::ready(reply)
                }
            },
        ));
        // Overlap queries too: a few per thousand answers, off the route thread.
        let overlap = nats
            .queue_subscribe(subjects.router_overlap(), subjects.route_queue_group())
            .await
            .context("joining the overlap queue group")?;
        intake_tasks.spawn(crate::service::serve_requests(
            state.clone(),
            vec![overlap],
            crate::service::Service {
                client: nats.clone(),
                max_inflight: config.route.max_inflight,
                intake: intake.child_token(),
                kind: crate::metrics::counters::MessageKind::Overlap,
                headers: None,
            },
            {
                let subject = Arc::<str>::from(subjects.router_overlap());
                move |state: Arc<RouterState>, payload: bytes::Bytes| {
                    let subject = subject.clone();
                    async move { crate::overlap::handle(&state, &subject, &payload).await }
                }
            },
        ));
        intake_tasks.close();
        step("confirming the subscriptions with NATS");
        route_thread
            .barrier_with(&nats)
            .await
            .context("syncing subscriptions with NATS")?;
        abandon.disarm();
        state.health.set_phase(Phase::Running);
        info!(namespace = %subjects.namespace(), route = %subjects.route(), "kv-router ready");
        Ok(Daemon {
            state,
            shutdown_timeout: config.shutdown_timeout,
            nats,
            route_thread,
            intake,
            intake_tasks,
            discovery: discovery_token,
            discovery_tasks,
            indexer_shutdown,
            http,
        })
    }
}

/// The route queue group's subscription to `shared` and this replica's own to `own`.
async fn shared_and_own(
    nats: &async_nats::Client,
    subjects: &Subjects,
    shared: String,
    own: String,
) -> anyhow::Result<Vec<async_nats::Subscriber>> {
    Ok(vec![
        nats.queue_subscribe(shared, subjects.route_queue_group())
            .await?,
        nats.subscribe(own).await?,
    ])
}
