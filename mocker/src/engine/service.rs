//! Wiring of the live mock engines: NATS and etcd connections, one [`Worker`] and its
//! [`Rank`] loops per worker id, the metrics timer, registration, and an orderly
//! shutdown.
//!
//! Start-up order matters for correctness: every worker subscribes (and the
//! subscriptions are flushed to the server) before any worker is registered in etcd,
//! so a router that discovers a worker can route to it immediately. The ready line
//! `kv-mocker engines ready` is logged only after every registration succeeded.
//! Shutdown: stop intake, stop the rank loops (failing requests still in flight with
//! an `error` response), revoke the leases, drain and flush the outbox — within
//! `--shutdown-timeout-ms` ([`kv_cluster::shutdown`]), so engines whose NATS or etcd
//! is gone still exit.

use super::args::EngineArgs;
use super::config::EngineConfigError;
use super::disaggregation::DisaggregationConfig;
use super::http::{self, WorkerHttp};
use super::journal::WorkerJournal;
use super::outbox::Outbox;
use super::rank::{Rank, RankSink};
use super::vllm::{BindError, KvEventsMode, RankEndpoints, VllmPublisher};
use super::worker::Worker;
use crate::protocol::{OP_CLEAR, OP_GENERATE};
use engine_model::EngineCore;
use engine_model::TimingModel;
use kv_cluster::args::WorkerPlacement;
use kv_cluster::lease::WorkerLease;
use kv_events::discovery::WorkerRegistration;
use kv_events::journal::{EventJournal, JournalConfig};
use kv_events::{DpRank, Subjects, WorkerId, WorkerRank};
use kv_tokenizer::{ModelTokenizer, TokenizerError, TokenizerLimits};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The line logged (at info level) once every worker is subscribed and registered.
pub const READY_LINE: &str = "kv-mocker engines ready";

/// Why the engines could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A flag is out of range.
    #[error("invalid engine configuration: {0}")]
    Config(#[from] EngineConfigError),
    /// The NATS or etcd flags are invalid, or a server could not be reached.
    #[error(transparent)]
    Cluster(#[from] kv_cluster::Error),
    /// `--namespace` is not a subject token.
    #[error("invalid --namespace: {0}")]
    Namespace(#[from] kv_events::NamespaceError),
    /// A subscription could not be created.
    #[error("could not subscribe to {subject}: {source}")]
    Subscribe {
        /// The subject.
        subject: String,
        /// The client's error.
        source: async_nats::SubscribeError,
    },
    /// Subscriptions could not be flushed to the NATS server.
    #[error("nats flush failed: {0}")]
    Flush(#[from] async_nats::client::FlushError),
    /// A worker could not be registered.
    #[error("could not register worker {worker_id} in etcd: {source}")]
    Register {
        /// The worker.
        worker_id: WorkerId,
        /// What failed.
        source: kv_cluster::Error,
    },
    /// `--model-dir` could not be loaded.
    #[error("could not load the tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    /// A worker's HTTP listener could not bind.
    #[error("could not listen on {addr}: {source}")]
    HttpBind {
        /// The address tried.
        addr: String,
        /// The socket error.
        source: std::io::Error,
    },
    /// A rank's ZMQ socket could not bind (vLLM mode).
    #[error(transparent)]
    ZmqBind(#[from] BindError),
    /// The HTTP metrics could not be registered.
    #[error("could not register http metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// An engine task panicked.
    #[error("engine task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The shutdown did not finish within `--shutdown-timeout-ms` (NATS or etcd
    /// unreachable, typically).
    #[error(transparent)]
    ShutdownIncomplete(#[from] kv_cluster::shutdown::ShutdownIncomplete),
}

/// Running engines, returned once they are ready.
#[derive(Debug)]
pub struct EnginesHandle {
    worker_ids: Vec<WorkerId>,
    http_urls: Vec<String>,
    zmq_endpoints: Vec<Vec<RankEndpoints>>,
    shutdown: CancellationToken,
    supervisor: JoinHandle<Result<(), ServiceError>>,
}

impl EnginesHandle {
    /// The ids of the running workers, in order.
    pub fn worker_ids(&self) -> &[WorkerId] {
        &self.worker_ids
    }

    /// Each worker's OpenAI HTTP base URL (`http://host:port`), in worker order — the
    /// URL its registration carries.
    pub fn http_urls(&self) -> &[String] {
        &self.http_urls
    }

    /// Each worker's bound ZMQ endpoints, one per dp rank, in worker order (vLLM
    /// mode; empty lists in NATS mode): what `kv-router relay --engine-endpoint` and
    /// `--replay-endpoint` take.
    pub fn zmq_endpoints(&self) -> &[Vec<RankEndpoints>] {
        &self.zmq_endpoints
    }

    /// Starts the shutdown of these engines (a child of the token given to
    /// [`spawn_engines`], which is left untouched).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the engines have shut down (leases revoked, outbox flushed).
    ///
    /// # Errors
    /// [`ServiceError::Task`] if an engine task panicked.
    pub async fn wait(self) -> Result<(), ServiceError> {
        self.supervisor.await?
    }
}

/// Starts `args.fleet.workers` mock workers and returns once every one of them is
/// subscribed and registered (after logging [`READY_LINE`]); in vLLM mode
/// (`--kv-events vllm`) once every rank's ZMQ sockets are bound, with no NATS or
/// etcd connection at all. They run until `shutdown` is cancelled; then
/// [`EnginesHandle::wait`] returns after an orderly stop.
///
/// # Errors
/// [`ServiceError`] for invalid flags, unreachable NATS or etcd, a failed
/// registration or an unbindable socket; anything already started is stopped and
/// revoked first.
pub async fn spawn_engines(
    args: EngineArgs,
    shutdown: CancellationToken,
) -> Result<EnginesHandle, ServiceError> {
    args.model.validate().map_err(EngineConfigError::from)?;
    args.hybrid.validate().map_err(EngineConfigError::from)?;
    args.runtime.validate()?;
    let disaggregation = args.disaggregation.validate()?;
    let worker_ids = args.fleet.worker_ids()?;
    let shutdown_timeout = args.runtime.shutdown.budget()?;
    let tokenizer = load_tokenizer(&args)?;
    let subjects = Subjects::new(args.connection.namespace.get()?);
    let cluster = match args.kv_events.mode {
        KvEventsMode::Nats => Some(Cluster::connect(&args).await?),
        KvEventsMode::Vllm => None,
    };

    // Tasks stop on `inner`, which also fires if start-up fails half way.
    let inner = shutdown.child_token();
    let mut tasks = JoinSet::new();
    let mut all_ranks = Vec::new();
    let mut http_urls = Vec::new();
    let mut placements = Vec::new();
    let mut zmq_endpoints = Vec::new();
    // Every batch carries this epoch: a restarted engine is told apart by it.
    let epoch = kv_events::journal::unix_epoch_micros();
    for (index, &worker_id) in worker_ids.iter().enumerate() {
        let started = start_worker(
            &args,
            &disaggregation,
            index,
            worker_id,
            epoch,
            cluster.as_ref(),
            &subjects,
            tokenizer.clone(),
            &mut tasks,
            &inner,
        )
        .await;
        match started {
            Ok(started) => {
                all_ranks.extend(started.ranks);
                http_urls.push(started.url);
                placements.push(started.placement);
                zmq_endpoints.push(started.endpoints);
            }
            Err(err) => {
                inner.cancel();
                return Err(err);
            }
        }
    }
    let mut leases: JoinSet<()> = JoinSet::new();
    if let Some(cluster) = &cluster {
        let metrics_period = Duration::from_millis(args.runtime.metrics_interval_ms);
        tasks.spawn(publish_metrics(all_ranks, metrics_period, inner.clone()));
        if let Err(err) = cluster.nats.flush().await {
            inner.cancel();
            return Err(err.into());
        }
        let workers = Workers {
            ids: &worker_ids,
            urls: &http_urls,
            placements: &placements,
        };
        let registrations = register(&args, cluster, &subjects, workers, epoch);
        match registrations.await {
            Ok(registrations) => {
                for reg in registrations {
                    leases.spawn(reg.keep_alive_until(inner.clone()));
                }
            }
            Err(err) => {
                inner.cancel();
                return Err(err);
            }
        }
    }
    info!(
        workers = worker_ids.len(),
        dp_size = args.fleet.dp_size,
        namespace = %subjects.namespace(),
        kv_events = ?args.kv_events.mode,
        role = %disaggregation.role(),
        "{READY_LINE}"
    );

    let handle_token = inner.clone();
    let supervisor = tokio::spawn(stop::supervise(
        inner,
        tasks,
        leases,
        cluster,
        shutdown_timeout,
    ));
    Ok(EnginesHandle {
        worker_ids,
        http_urls,
        zmq_endpoints,
        shutdown: handle_token,
        supervisor,
    })
}

/// The NATS and etcd side of NATS mode.
struct Cluster {
    nats: async_nats::Client,
    etcd: etcd_client::Client,
    outbox: Outbox,
    publisher: JoinHandle<()>,
}

impl Cluster {
    async fn connect(args: &EngineArgs) -> Result<Self, ServiceError> {
        let nats_config = args.connection.nats.to_config()?;
        let etcd_config = args.connection.etcd.to_config()?;
        let nats = nats_config
            .connect_with("kv-mocker-engines", |options| options)
            .await?;
        let etcd = kv_cluster::etcd::connect(&etcd_config).await?;
        let (outbox, publisher) = Outbox::start(nats.clone());
        Ok(Self {
            nats,
            etcd,
            outbox,
            publisher,
        })
    }
}

/// A started worker: its ranks, HTTP URL, registration role and (vLLM mode) each
/// rank's bound ZMQ endpoints.
struct Started {
    ranks: Vec<Arc<Rank>>,
    url: String,
    placement: WorkerPlacement,
    endpoints: Vec<RankEndpoints>,
}

/// Starts worker `index`: its ranks (with their sinks), its HTTP servers and, in NATS
/// mode, its intake.
#[allow(clippy::too_many_arguments)]
async fn start_worker(
    args: &EngineArgs,
    disaggregation: &DisaggregationConfig,
    index: usize,
    worker_id: WorkerId,
    epoch: u64,
    cluster: Option<&Cluster>,
    subjects: &Subjects,
    tokenizer: Option<Arc<ModelTokenizer>>,
    tasks: &mut JoinSet<()>,
    inner: &CancellationToken,
) -> Result<Started, ServiceError> {
    let journal = WorkerJournal::new(EventJournal::new(
        worker_id,
        epoch,
        JournalConfig::default(),
    ));
    let mut ranks = Vec::new();
    let mut endpoints = Vec::new();
    for dp in 0..args.fleet.dp_size {
        let core = EngineCore::new(args.model, TimingModel::default())
            .and_then(|core| core.with_cpu_tier(args.cpu_tier))
            .and_then(|core| core.with_hybrid(args.hybrid))
            .map_err(EngineConfigError::from)?;
        let sink = match cluster {
            Some(cluster) => RankSink::Nats {
                outbox: cluster.outbox.clone(),
                journal: journal.clone(),
                kv_subject: subjects.kv_events(worker_id),
                metrics_subject: subjects.load_metrics(worker_id),
            },
            None => {
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                let config = args.kv_events.rank_config(index, args.fleet.dp_size, dp)?;
                let (publisher, bound, task) =
                    VllmPublisher::start(DpRank(dp), config, inner.clone()).await?;
                tasks.spawn(async move {
                    if let Err(err) = task.await {
                        warn!(%err, "zmq publisher task failed");
                    }
                });
                endpoints.push(bound);
                RankSink::Vllm(publisher)
            }
        };
        let rank = Arc::new(Rank::new(
            WorkerRank::new(worker_id, DpRank(dp)),
            core,
            sink,
        ));
        let (r, token, runtime) = (rank.clone(), inner.clone(), args.runtime);
        tasks.spawn(async move { r.run(runtime, token).await });
        ranks.push(rank);
    }
    let placement = disaggregation.for_worker(index)?;
    let transfer = listen::transfer_side(
        &args.http,
        disaggregation,
        placement,
        args.runtime,
        tasks,
        inner,
    )
    .await?;
    let w = WorkerHttp {
        worker_id,
        ranks: ranks.clone(),
        block_size: args.model.block_size,
        num_gpu_blocks: args.model.num_gpu_blocks,
        max_request_blocks: args.hybrid.max_request_blocks(&args.model),
        tokenizer,
        transfer,
    };
    let url = listen::serve_http(&args.http, index, w, tasks, inner.clone()).await?;
    if let Some(cluster) = cluster {
        let worker = Worker::new(worker_id, ranks.clone(), cluster.outbox.clone(), journal);
        let generate = subscribe(&cluster.nats, subjects.engine(worker_id, OP_GENERATE)).await?;
        let clear = subscribe(&cluster.nats, subjects.engine(worker_id, OP_CLEAR)).await?;
        let recovery = subscribe(&cluster.nats, subjects.kv_recovery(worker_id)).await?;
        let token = inner.clone();
        tasks.spawn(async move { worker.serve(generate, clear, recovery, token).await });
    }
    Ok(Started {
        ranks,
        url,
        placement,
        endpoints,
    })
}

/// The workers to register: ids, URLs and roles, in worker order.
struct Workers<'a> {
    ids: &'a [WorkerId],
    urls: &'a [String],
    placements: &'a [WorkerPlacement],
}

/// Registers every worker under its own lease; on a failure the ones already
/// registered are revoked.
async fn register(
    args: &EngineArgs,
    cluster: &Cluster,
    subjects: &Subjects,
    workers: Workers<'_>,
    epoch: u64,
) -> Result<Vec<WorkerLease>, ServiceError> {
    let mut registrations = Vec::new();
    let all = workers.ids.iter().zip(workers.urls).zip(workers.placements);
    for ((&worker_id, url), placement) in all {
        let record = WorkerRegistration {
            worker_id,
            dp_size: args.fleet.dp_size,
            block_size: (args.http.faults).registered_block_size(args.model.block_size),
            total_kv_blocks: args.model.num_gpu_blocks,
            url: Some(url.clone()),
            epoch,
            // What its `/v1/models` answers, so a gateway bounds prompts by it.
            max_model_len: Some(args.http.max_model_len_or_cache(
                args.model.block_size,
                args.hybrid.max_request_blocks(&args.model),
            )),
            role: placement.role,
            kv_transfer: placement.kv_transfer,
        };
        let key = subjects.etcd_worker_key(worker_id);
        let etcd = cluster.etcd.clone();
        match WorkerLease::register(etcd, key, &record, args.runtime.lease_ttl_secs).await {
            Ok(reg) => registrations.push(reg),
            Err(source) => {
                for mut reg in registrations {
                    reg.revoke().await;
                }
                return Err(ServiceError::Register { worker_id, source });
            }
        }
    }
    Ok(registrations)
}

/// Loads `--model-dir`, bounding prompts by the body limit and the model length.
fn load_tokenizer(args: &EngineArgs) -> Result<Option<Arc<ModelTokenizer>>, ServiceError> {
    let Some(dir) = &args.http.model_dir else {
        return Ok(None);
    };
    let max_len = args.http.max_model_len_or_cache(
        args.model.block_size,
        args.hybrid.max_request_blocks(&args.model),
    );
    let limits = TokenizerLimits {
        max_prompt_bytes: http::MAX_BODY_BYTES,
        max_prompt_tokens: usize::try_from(max_len).unwrap_or(usize::MAX),
    };
    Ok(Some(Arc::new(ModelTokenizer::from_dir(dir, limits)?)))
}

async fn subscribe(
    nats: &async_nats::Client,
    subject: String,
) -> Result<async_nats::Subscriber, ServiceError> {
    nats.subscribe(subject.clone())
        .await
        .map_err(|source| ServiceError::Subscribe { subject, source })
}

/// Publishes every rank's load metrics each `period` (wall clock) until `shutdown`.
async fn publish_metrics(ranks: Vec<Arc<Rank>>, period: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        for rank in &ranks {
            rank.publish_metrics();
        }
    }
}

mod listen;
mod stop;

#[cfg(test)]
mod hybrid_tests;
#[cfg(test)]
mod tests;
