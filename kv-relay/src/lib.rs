//! `kv-router relay`: a sidecar that lets an unmodified vLLM or SGLang engine feed
//! the router.
//!
//! Engines publish their own msgpack KV events over ZMQ PUB sockets (one per data
//! parallel rank) and keep a replay buffer behind a ROUTER socket. The relay
//! subscribes, decodes every format in use ([`kv_events::engines`]), computes our
//! local block hashes from the events' token ids, and republishes our protocol to
//! NATS with its own event numbering, registered in etcd as the engine's worker.
//!
//! ```text
//!  engine rank 0 PUB ──► Source 0 ─┐ seq check; at connect and  ┌─► {ns}.kv.events.{w}
//!  engine rank 0 ROUTER ◄─ replay ─┘ on a gap, read the replay  │
//!  engine rank 1 PUB ──► Source 1 ──┐                           │  Publisher: translate,
//!        …                          ├─ mpsc (stream order) ──► ─┤  number (EventJournal),
//!                                   │                           │  publish; liveness
//!                                   ┘                           ├─► watch ─► lease task ─► etcd
//!  {ns}.kv.recovery.{w} ──► recovery responder (same journal) ──┘
//!  engine /metrics ──► scraper ──► {ns}.kv.metrics.{w}  (optional)
//!  engine /v1/models ─► scraper ─► max_model_len ─► facts ─► lease task (until read)
//!  relay /metrics (--http-listen, optional): the kv_relay_* counters
//! ```
//!
//! Ordering and consistency rules:
//! - When a socket connects (first time or again), the engine's replay buffer is read
//!   from seq 0 and forwarded before any live batch, so an idle engine's cached
//!   blocks reach the router without waiting for its next batch.
//! - Per socket, batches are forwarded in engine seq order; a gap is filled from the
//!   replay socket before anything later is forwarded, or the socket's ranks are
//!   cleared (`cleared` published) and the stream resynchronises from what follows.
//!   vLLM's replay reply drops messages when the reader falls behind: the read asks
//!   again from the first missing batch ([`replay`]), never applying one twice.
//! - A socket whose engine went away is tried again at most
//!   `--reconnect-max-backoff-ms` apart ([`connect`]), so a restarted engine is read
//!   again within about that.
//! - One publishing task numbers and publishes everything, so our event ids per
//!   (worker, dp_rank) go out strictly increasing and match the journal that answers
//!   recovery requests.
//! - The worker id is claimed in etcd ([`identity`], [`kv_cluster::claim`]) before
//!   anything subscribes or publishes under it, and held for the life of the process
//!   under a lease of its own. If the claim is lost (its lease expired and another
//!   relay took the id), the relay stops in order and [`run`] returns
//!   [`RelayError::ClaimLost`]: two relays never keep publishing under one id.
//! - The etcd registration lease exists exactly while at least one engine socket is
//!   connected; it is revoked when the engine goes away and when the relay stops.
//!
//! Shutdown order: stop the sources → drain the publishing task → revoke the
//! registration lease → stop the recovery responder and scraper → release the worker
//! id claim → flush NATS. The steps share one deadline, `--shutdown-timeout-ms`
//! (`kv_cluster::shutdown`): with NATS or etcd gone a publish or flush never
//! completes, so past it the rest is skipped, each step logged, and the relay exits
//! with [`RelayError::ShutdownIncomplete`] (a skipped revoke or claim release expires with
//! its lease TTL).
//!
//! Cost: one decode and one xxh3 per block of every event, one NATS message per
//! engine batch, the journal's ring (`--journal-events` events per rank), and per
//! held block one entry in the translator and one in the journal (≈ 150 bytes).
//!
//! The relay is its own crate because it is its own process with its own job: it
//! joins the cluster as a worker through `kv-cluster` (the same NATS and etcd flags,
//! the same worker lease) and speaks `kv-events`' protocol, and needs nothing of the
//! router daemon. The `kv-router` binary dispatches its `relay` subcommand here.
//!
//! # Layout
//! - [`config`]: the relay's flags ([`RelayArgs`]) validated into [`RelayConfig`].
//! - [`identity`]: `--worker-id` and `--worker-name`, the worker id claim to make.
//! - [`source`]: one engine ZMQ PUB socket, its sequence check and gap filling.
//! - [`connect`]: (re)connecting that socket, at most `--reconnect-max-backoff-ms`
//!   between tries.
//! - [`frames`]: the engines' ZMQ frame layouts and the sequence tracker (pure).
//! - [`replay`]: reading the engine's replay ROUTER socket, asking again from the
//!   first batch its lossy reply dropped.
//! - [`translate`]: engine events to kv-router events with local block hashes; KV
//!   cache groups of hybrid-attention models pass through with their windows, vLLM's
//!   sparse sliding-window stores are placed through the rank's chain, and copies
//!   are counted (see its docs and `docs/engines.md`, "Hybrid-attention models").
//! - [`publish`]: the one publishing task (numbering, journal) and the recovery
//!   responder.
//! - [`facts`]: the engine's block size, KV capacity and context length, learned
//!   from the engine.
//! - [`models`]: the engine's `max_model_len`, from its `GET /v1/models`.
//! - [`lease`]: the etcd registration, alive exactly while the engine's stream is.
//! - [`scrape`]: the optional scrape of the engine's Prometheus load metrics.
//! - [`counters`]: the `kv_relay_*` metrics; [`http`]: their optional `/metrics`.
//! - [`RelayError`]: start-up and configuration errors.

pub mod config;
pub mod connect;
pub mod counters;
mod error;
pub mod facts;
pub mod frames;
pub mod http;
pub mod identity;
pub mod lease;
pub mod models;
pub mod publish;
pub mod replay;
pub mod scrape;
pub mod source;
pub mod translate;

pub use config::{EngineFormat, RelayArgs, RelayConfig};
pub use counters::RelayCounters;
pub use error::RelayError;

use facts::{EngineFacts, WorkerIdentity};
use kv_cluster::claim::WorkerIdClaim;
use kv_cluster::shutdown::ShutdownBudget;
use kv_events::journal::{EventJournal, JournalConfig, unix_epoch_micros};
use kv_events::{DpRank, WorkerId};
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info};

/// Messages buffered between the engine sockets and the publishing task; when full,
/// the sockets stop reading and ZMQ buffers.
const SOURCE_QUEUE: usize = 1024;

/// A running relay. Call [`Relay::shutdown`] for the orderly stop.
pub struct Relay {
    running: Running,
    claim: HeldClaim,
}

/// Everything of a relay but its claim.
struct Running {
    counters: RelayCounters,
    facts: watch::Receiver<EngineFacts>,
    http_addr: Option<std::net::SocketAddr>,
    nats: async_nats::Client,
    sources: CancellationToken,
    source_tasks: TaskTracker,
    publisher: JoinHandle<()>,
    services: CancellationToken,
    service_tasks: TaskTracker,
    shutdown_timeout: std::time::Duration,
}

/// The worker id claim being kept, and how to stop keeping it.
struct HeldClaim {
    worker_id: WorkerId,
    lost: CancellationToken,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl HeldClaim {
    /// Starts keeping `claim` in a task.
    fn keep(claim: WorkerIdClaim) -> Self {
        let stop = CancellationToken::new();
        Self {
            worker_id: claim.worker_id(),
            lost: claim.lost(),
            stop: stop.clone(),
            task: tokio::spawn(claim.keep_until(stop)),
        }
    }

    /// Stops keeping the claim and releases it (unless it was lost).
    async fn release(self) {
        self.stop.cancel();
        if let Err(e) = self.task.await {
            error!(error = %e, "worker id claim task failed");
        }
    }
}

impl Relay {
    /// Connects to NATS and etcd, claims the worker id (waiting while this name's
    /// previous incarnation still holds it), starts answering recovery requests, and
    /// starts reading the engine's sockets (waiting as long as needed for the engine).
    ///
    /// # Errors
    /// [`RelayError`] when NATS or etcd cannot be reached, the worker id cannot be claimed
    /// ([`RelayError::Claim`]), a subscription fails, the metrics cannot be registered in
    /// `registry`, or `--http-listen` cannot be bound.
    pub async fn start(
        config: RelayConfig,
        registry: &prometheus::Registry,
    ) -> Result<Self, RelayError> {
        let counters = RelayCounters::register(registry)?;
        // The daemon's connections, with the same auth and TLS; unlike the daemon the
        // relay fails fast when NATS is down at start.
        let nats = config
            .nats
            .connect_with("kv-router-relay", |options| options)
            .await?;
        let etcd = kv_cluster::etcd::connect(&config.etcd).await?;
        let claim = WorkerIdClaim::acquire(etcd.clone(), &config.subjects, &config.worker.claim)
            .await
            .map_err(RelayError::Claim)?;
        let claim = HeldClaim::keep(claim);
        match Self::start_claimed(config, registry, counters, nats, etcd, claim.worker_id).await {
            Ok(running) => Ok(Self { running, claim }),
            Err(e) => {
                claim.release().await;
                Err(e)
            }
        }
    }

    /// The rest of [`Self::start`], publishing as the claimed `worker_id`.
    async fn start_claimed(
        config: RelayConfig,
        registry: &prometheus::Registry,
        counters: RelayCounters,
        nats: async_nats::Client,
        etcd: etcd_client::Client,
        worker_id: WorkerId,
    ) -> Result<Running, RelayError> {
        // The epoch of this relay's event stream, registered with the worker so the
        // router follows it (and nothing else can move the worker to a new epoch).
        let epoch = unix_epoch_micros();
        let who = WorkerIdentity {
            worker_id,
            dp_size: config.worker.dp_size,
            url: config.worker.url.clone(),
            epoch,
            placement: config.worker.placement,
        };
        // Without a page to read, registration waits only for the block size.
        let (facts, facts_rx) = watch::channel(EngineFacts {
            scraped: config.scrape.is_none(),
            ..EngineFacts::default()
        });
        let subjects = &config.subjects;
        let journal = Arc::new(Mutex::new(EventJournal::new(
            worker_id,
            epoch,
            JournalConfig {
                ring_capacity: config.worker.journal_events,
                ..JournalConfig::default()
            },
        )));

        let services = CancellationToken::new();
        let service_tasks = TaskTracker::new();
        let recovery = nats.subscribe(subjects.kv_recovery(worker_id)).await?;
        service_tasks.spawn(publish::serve_recovery(
            recovery,
            nats.clone(),
            journal.clone(),
            counters.clone(),
            services.clone(),
        ));
        let (alive_tx, alive_rx) = watch::channel(false);
        service_tasks.spawn(lease::run(
            lease::Registration {
                etcd,
                key: subjects.etcd_worker_key(worker_id),
                ttl_secs: config.worker.lease_ttl_secs,
                who: who.clone(),
            },
            alive_rx,
            facts.clone(),
            services.clone(),
        ));
        if let Some(scrape) = config.scrape.clone() {
            service_tasks.spawn(
                scrape::Scraper {
                    config: scrape,
                    nats: nats.clone(),
                    subject: subjects.load_metrics(worker_id),
                    worker_id,
                    dp_size: who.dp_size,
                    facts: facts.clone(),
                    counters: counters.clone(),
                }
                .run(services.clone()),
            );
        }
        let http_addr = match config.http {
            Some(http) => {
                let (bound, task) = http::serve_metrics(http, registry.clone(), services.clone())
                    .await
                    .map_err(|source| RelayError::Listen {
                        addr: http.listen,
                        source,
                    })?;
                service_tasks.spawn(async move {
                    // The server logs its own failure; a join error is a panic there.
                    let _ = task.await;
                });
                Some(bound)
            }
            None => None,
        };
        service_tasks.close();

        let (tx, rx) = mpsc::channel(SOURCE_QUEUE);
        let publisher = tokio::spawn(
            publish::Publisher {
                translator: translate::Translator::new(config.engine.format),
                journal,
                nats: nats.clone(),
                subject: subjects.kv_events(worker_id),
                socket_ranks: config
                    .engine
                    .endpoints
                    .iter()
                    .map(|e| e.default_rank)
                    .collect::<Vec<DpRank>>(),
                shared: config.engine.shared,
                dp_size: who.dp_size,
                counters: counters.clone(),
                alive: alive_tx,
                facts,
            }
            .run(rx),
        );
        let sources = CancellationToken::new();
        let source_tasks = TaskTracker::new();
        for (socket, endpoint) in config.engine.endpoints.iter().cloned().enumerate() {
            let source = source::Source {
                socket,
                endpoint,
                topic: config.engine.topic.clone(),
                replay: config.engine.replay,
                reconnect_max_backoff: config.engine.reconnect_max_backoff,
                tx: tx.clone(),
                counters: counters.clone(),
            };
            let token = sources.clone();
            source_tasks.spawn(async move {
                if let Err(e) = source.run(token).await {
                    error!(error = %e, "engine socket stopped");
                }
            });
        }
        source_tasks.close();
        // Barrier: the recovery subscription is registered with the server.
        nats.flush().await?;
        info!(worker_id = %worker_id, sockets = config.engine.endpoints.len(), "kv-router relay started");
        Ok(Running {
            counters,
            facts: facts_rx,
            http_addr,
            nats,
            sources,
            source_tasks,
            publisher,
            services,
            service_tasks,
            shutdown_timeout: config.shutdown_timeout,
        })
    }

    /// The worker id this relay claimed and publishes as.
    pub fn worker_id(&self) -> WorkerId {
        self.claim.worker_id
    }

    /// Fires when the worker id claim is lost to another relay: stop this one
    /// ([`run`] does, returning [`RelayError::ClaimLost`]).
    pub fn claim_lost(&self) -> CancellationToken {
        self.claim.lost.clone()
    }

    /// The relay's metrics.
    pub fn counters(&self) -> &RelayCounters {
        &self.running.counters
    }

    /// The engine's KV cache facts learned so far (block size, capacity).
    pub fn facts(&self) -> EngineFacts {
        self.running.facts.borrow().clone()
    }

    /// Where `/metrics` is served (`--http-listen`), once bound.
    pub fn http_addr(&self) -> Option<std::net::SocketAddr> {
        self.running.http_addr
    }

    /// Stops in the order given in the module docs, within `--shutdown-timeout-ms`.
    ///
    /// # Errors
    /// [`RelayError::ShutdownIncomplete`] naming the steps skipped when the budget ran out
    /// (NATS or etcd unreachable, typically); [`RelayError::Flush`] when the final NATS
    /// flush fails.
    pub async fn shutdown(self) -> Result<(), RelayError> {
        let Self { mut running, claim } = self;
        let timeout = running.shutdown_timeout;
        info!(budget_ms = timeout.as_millis(), "relay shutting down");
        let mut budget = ShutdownBudget::start(timeout);
        running.sources.cancel();
        let sockets = running.source_tasks.wait();
        budget.step("closing the engine sockets", sockets).await;
        // Every sender is gone: the publisher drains and ends, marking the engine gone.
        let published = budget.step(
            "publishing the batches taken from the engine",
            &mut running.publisher,
        );
        match published.await {
            Some(Ok(())) => {}
            Some(Err(e)) => error!(error = %e, "relay publishing task failed"),
            // Its sender of the engine's liveness drops with it: the registration
            // task sees the engine gone.
            None => running.publisher.abort(),
        }
        running.services.cancel();
        let services = running.service_tasks.wait();
        let step = "revoking the registration and stopping the services";
        budget.step(step, services).await;
        // Skipped, the claim is kept until the process ends, then expires after its
        // lease TTL: the id is never free while this relay may still publish.
        budget
            .step("releasing the worker id claim", claim.release())
            .await;
        let flushed = budget.step("flushing NATS", running.nats.flush()).await;
        budget.finish()?;
        flushed.transpose()?;
        info!("relay stopped");
        Ok(())
    }
}

/// Runs a relay until `shutdown` resolves (also while it is still waiting for its
/// worker id), then stops it in order.
///
/// # Errors
/// Start-up or shutdown failures (see [`Relay::start`]); [`RelayError::ClaimLost`] after
/// an orderly stop when another relay took the worker id.
pub async fn run(
    config: RelayConfig,
    registry: &prometheus::Registry,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RelayError> {
    let mut shutdown = std::pin::pin!(shutdown);
    let relay = tokio::select! {
        started = Relay::start(config, registry) => started?,
        () = &mut shutdown => return Ok(()),
    };
    let lost = relay.claim_lost();
    let worker_id = relay.worker_id();
    tokio::select! {
        () = &mut shutdown => relay.shutdown().await,
        () = lost.cancelled() => {
            relay.shutdown().await?;
            Err(RelayError::ClaimLost { worker_id })
        }
    }
}
