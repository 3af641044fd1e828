//! Trace replay: the frontend's role, once per routing policy.
//!
//! For each policy, in order: clear every registered engine's KV cache (a cold start,
//! so policies are compared on equal terms), then replay the trace's arrivals on their
//! timestamps divided by the time scale, each request in its own task (route,
//! generate, lifecycle; see `request`), await them all, and aggregate a
//! [`PolicyReport`]. Arrivals are driven by one dispatcher sleeping until each
//! request's due instant (a timer, no polling), so a pass over a trace spanning `T` ms
//! takes about `T / time_scale` wall ms plus the tail of the last requests.
//!
//! Latencies are reported in model ms (wall ms × time scale): the engines run their
//! timing model the same factor faster, so model ms are comparable to the trace's.
//!
//! # Layout
//! - [`cold`]: list workers in etcd and clear their caches.
//! - [`http`]: one request through an OpenAI-compatible gateway.
//! - [`progress`]: a bar on a terminal, plain lines elsewhere.
//! - `request`: one request's route → generate → lifecycle flow.
//! - [`report`]: per-policy aggregation, percentiles and the JSON report.
//! - `table`: [`ReplayReport::render_table`], the terminal rendering.

pub mod cold;
pub mod http;
pub mod progress;
pub mod report;
mod request;
mod table;

pub use report::{PolicyReport, ReplayReport, RequestOutcome, RouteFailure};

use crate::engine::ConnectionArgs;
use crate::replay::http::GatewayTarget;
use crate::replay::progress::PassProgress;
use engine_model::trace::{self, BlockMapping, TraceBlockSizeMismatch, TraceError, TraceRequest};
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::PolicyKind;
use kv_events::{RequestId, Subjects, WorkerId};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Errors that stop a replay (individual request failures are counted, not raised).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace could not be loaded.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// `--namespace` is not a subject token.
    #[error("invalid --namespace: {0}")]
    Namespace(#[from] kv_events::NamespaceError),
    /// etcd could not be reached or read.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// A cluster flag is unusable, NATS or etcd cannot be reached, or the HTTP
    /// client cannot be built.
    #[error(transparent)]
    Cluster(#[from] kv_cluster::Error),
    /// [`Frontend::Gateways`] names no gateway.
    #[error("no gateway to replay through")]
    NoGateways,
    /// No worker is registered, so there is nothing to replay against.
    #[error("no workers registered under etcd prefix {prefix}")]
    NoWorkers {
        /// The etcd prefix searched.
        prefix: String,
    },
    /// A worker's cache could not be cleared before a pass.
    #[error("cannot clear worker {worker}: {reason}")]
    Clear {
        /// The worker.
        worker: WorkerId,
        /// Why, lowercase.
        reason: String,
    },
    /// The workers' block size cannot be mapped onto the trace's 512-token blocks.
    #[error(transparent)]
    BlockSize(#[from] TraceBlockSizeMismatch),
    /// Registered workers disagree on the block size, so one prompt hashing cannot
    /// serve them all.
    #[error("workers disagree on the block size: {first} and {other} tokens")]
    MixedBlockSizes {
        /// The first worker's block size, in tokens.
        first: u32,
        /// Another worker's, in tokens.
        other: u32,
    },
    /// The time scale is not a finite number greater than 0.
    #[error("time scale must be a finite number greater than 0, got {0}")]
    TimeScale(f64),
    /// The JSON report could not be written.
    #[error("cannot write report {path}: {source}")]
    Report {
        /// The report path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// How many times faster than wall clock trace time runs: a finite number > 0.
/// `1.0` replays in real time; `10.0` replays 10 trace minutes in one wall minute.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct TimeScale(f64);

impl TimeScale {
    /// Validates a time scale.
    ///
    /// # Errors
    /// [`ReplayError::TimeScale`] unless `factor` is finite and greater than 0.
    pub fn new(factor: f64) -> Result<Self, ReplayError> {
        if factor.is_finite() && factor > 0.0 {
            Ok(Self(factor))
        } else {
            Err(ReplayError::TimeScale(factor))
        }
    }

    /// The factor.
    pub fn get(self) -> f64 {
        self.0
    }

    /// Wall-clock duration of `model_ms` trace milliseconds.
    pub fn to_wall(self, model_ms: u64) -> Duration {
        Duration::from_secs_f64(model_ms as f64 / 1000.0 / self.0)
    }

    /// Model milliseconds elapsed during the wall-clock duration `wall`.
    pub fn to_model_ms(self, wall: Duration) -> f64 {
        wall.as_secs_f64() * 1000.0 * self.0
    }
}

impl std::str::FromStr for TimeScale {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let factor: f64 = s.parse().map_err(|err| format!("{s:?}: {err}"))?;
        TimeScale::new(factor).map_err(|err| err.to_string())
    }
}

impl std::fmt::Display for TimeScale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

/// `kv-mocker replay`: replay a Mooncake trace through a running router and engines.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// NATS and etcd (authentication, TLS) and the namespace: the cluster's own
    /// flags, as every participant declares them.
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// Mooncake JSONL trace; default: the bundled conversation excerpt.
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// Routing policy to replay under; repeat for several passes, run in order.
    #[arg(long = "policy", value_name = "POLICY", default_values = ["kv", "round-robin"])]
    pub policies: Vec<PolicyKind>,
    /// Trace time runs this many times faster than wall clock (must match the
    /// engines' --time-scale).
    #[arg(long, default_value = "1.0")]
    pub time_scale: TimeScale,
    /// Replay only the first N requests of the trace.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Wall-clock limit for one request from routing to its last token, in seconds.
    #[arg(long, default_value_t = 600)]
    pub request_timeout_s: u64,
    /// Write the JSON report (an array of per-policy objects) here.
    #[arg(long, value_name = "PATH")]
    pub report: Option<PathBuf>,
}

/// The replay's knobs that are not connections or the trace.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Trace time runs this many times faster than wall clock.
    pub time_scale: TimeScale,
    /// Wall-clock limit for one request from routing to its last token; a request
    /// still running then counts as failed.
    pub request_timeout: Duration,
    /// Show progress per pass on stderr: a bar on a terminal, a plain line every few
    /// seconds elsewhere (see [`progress`]).
    pub progress: bool,
    /// How requests reach the engines.
    pub frontend: Frontend,
}

/// How the replay plays the frontend.
#[derive(Debug, Clone)]
pub enum Frontend {
    /// Over NATS, itself: route with a `blocks` prompt naming each pass's policy,
    /// generate on the mock engine's NATS subject, publish the lifecycle (`request`).
    Nats,
    /// Through OpenAI-compatible gateways over HTTP, as an application would
    /// ([`http`]), each request to the next gateway in turn (a round-robin load
    /// balancer; at least one); the router's own policy decides, so a pass's policy is
    /// the daemon's.
    Gateways(Vec<GatewayTarget>),
}

/// Connections to the cluster under test, in one namespace.
#[derive(Clone)]
pub struct ReplayTarget {
    /// NATS client for routing, engine requests and lifecycle messages.
    pub nats: async_nats::Client,
    /// etcd client for listing workers.
    pub etcd: etcd_client::Client,
    /// Subjects and keys of the namespace.
    pub subjects: Subjects,
}

impl ReplayTarget {
    /// Connects to NATS and etcd with the cluster's flags, as every participant does
    /// (connect timeouts, authentication, TLS).
    ///
    /// # Errors
    /// [`ReplayError::Cluster`] if a flag is unusable or a server cannot be reached.
    pub async fn connect(connection: &ConnectionArgs) -> Result<Self, ReplayError> {
        let namespace = connection.namespace.get()?;
        let nats = (connection.nats.to_config()?)
            .connect_with("kv-mocker-replay", |options| options)
            .await?;
        let etcd = kv_cluster::etcd::connect(&connection.etcd.to_config()?).await?;
        Ok(Self {
            nats,
            etcd,
            subjects: Subjects::new(namespace),
        })
    }
}

/// Runs `kv-mocker replay`: loads the trace, connects, replays every policy, writes the
/// JSON report if asked.
///
/// # Errors
/// Trace, connection, cold-start and report errors (see [`ReplayError`]).
pub async fn run_replay(args: ReplayArgs) -> anyhow::Result<ReplayReport> {
    let mut trace = match &args.trace {
        Some(path) => trace::load_trace(path)?,
        None => trace::bundled_excerpt()?,
    };
    if let Some(max) = args.max_requests {
        trace.truncate(max);
    }
    let target = ReplayTarget::connect(&args.connection).await?;
    let config = ReplayConfig {
        time_scale: args.time_scale,
        request_timeout: Duration::from_secs(args.request_timeout_s),
        progress: true,
        frontend: Frontend::Nats,
    };
    let report = run_replay_with(&target, &trace, &args.policies, &config).await?;
    if let Some(path) = &args.report {
        report.write_json(path)?;
        eprintln!("report written to {}", path.display());
    }
    Ok(report)
}

/// Replays `trace` once per policy, in order, each pass from a cold cluster.
///
/// # Errors
/// [`ReplayError::NoWorkers`], [`ReplayError::Etcd`] or [`ReplayError::Clear`] from a
/// cold start.
pub async fn run_replay_with(
    target: &ReplayTarget,
    trace: &[TraceRequest],
    policies: &[PolicyKind],
    config: &ReplayConfig,
) -> Result<ReplayReport, ReplayError> {
    let mut report = ReplayReport::default();
    for &policy in policies {
        report
            .policies
            .push(replay_policy(target, trace, policy, config).await?);
    }
    Ok(report)
}

/// One pass: clear all workers, replay `trace` under `policy`, await every request.
///
/// # Errors
/// [`ReplayError::NoGateways`] for an empty gateway list; [`ReplayError::NoWorkers`],
/// [`ReplayError::Etcd`] or [`ReplayError::Clear`] from the cold start. Request
/// failures are counted in the report.
pub async fn replay_policy(
    target: &ReplayTarget,
    trace: &[TraceRequest],
    policy: PolicyKind,
    config: &ReplayConfig,
) -> Result<PolicyReport, ReplayError> {
    if matches!(&config.frontend, Frontend::Gateways(g) if g.is_empty()) {
        return Err(ReplayError::NoGateways);
    }
    let workers = cold::clear_all(target).await?;
    let mapping = block_mapping(target, &workers)?;
    tracing::info!(%policy, workers = workers.len(), requests = trace.len(), block_size = mapping.engine_block_size(), "starting pass from a cold cache");
    let bar = PassProgress::start(&policy.to_string(), trace.len(), config.progress);
    let shared = Arc::new(target.clone());
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    let mut outcomes = Vec::with_capacity(trace.len());
    for (index, request) in trace.iter().enumerate() {
        let due = start + config.time_scale.to_wall(request.timestamp_ms);
        // Collect finished requests while waiting for the next arrival.
        loop {
            tokio::select! {
                biased;
                Some(done) = tasks.join_next() => record(done, &mut outcomes, &bar),
                () = tokio::time::sleep_until(due) => break,
            }
        }
        let target = Arc::clone(&shared);
        let request = request.clone();
        let request_id = RequestId(format!("{policy}-{index}"));
        let (time_scale, timeout) = (config.time_scale, config.request_timeout);
        // Not empty: checked above.
        if let Frontend::Gateways(gateways) = &config.frontend
            && let Some(gateway) = gateways.get(index % gateways.len().max(1))
        {
            let gateway = gateway.clone();
            tasks.spawn(async move {
                http::replay_request(&gateway, &request, time_scale, timeout).await
            });
            continue;
        }
        tasks.spawn(async move {
            let block_hashes = mapping.block_hashes(&request);
            let pass = request::Pass {
                policy,
                time_scale,
                timeout,
            };
            request::replay_request(&target, request_id, &request, block_hashes, pass).await
        });
    }
    while let Some(done) = tasks.join_next().await {
        record(done, &mut outcomes, &bar);
    }
    bar.finish();
    if let Err(err) = shared.nats.flush().await {
        tracing::warn!(%err, "cannot flush lifecycle messages");
    }
    let report = PolicyReport::from_outcomes(policy, &outcomes, start.elapsed().as_secs_f64());
    if report.failed > 0 || report.route_error_count() > 0 {
        tracing::warn!(%policy, failed = report.failed, route_errors = report.route_error_count(), "some requests did not complete");
    }
    Ok(report)
}

/// The prompt hashing for the registered workers' block size (see
/// [`engine_model::trace::BlockMapping`]).
///
/// # Errors
/// [`ReplayError::MixedBlockSizes`] if workers disagree, [`ReplayError::BlockSize`] if
/// the size does not divide 512, [`ReplayError::NoWorkers`] for an empty list.
fn block_mapping(
    target: &ReplayTarget,
    workers: &[WorkerRegistration],
) -> Result<BlockMapping, ReplayError> {
    let Some(first) = workers.first() else {
        return Err(ReplayError::NoWorkers {
            prefix: target.subjects.etcd_worker_prefix(),
        });
    };
    if let Some(other) = workers.iter().find(|w| w.block_size != first.block_size) {
        return Err(ReplayError::MixedBlockSizes {
            first: first.block_size,
            other: other.block_size,
        });
    }
    Ok(BlockMapping::new(first.block_size)?)
}

fn record(
    done: Result<RequestOutcome, tokio::task::JoinError>,
    outcomes: &mut Vec<RequestOutcome>,
    bar: &PassProgress,
) {
    match done {
        Ok(outcome) => outcomes.push(outcome),
        // A request task can only end this way if it panicked, which is a bug; count
        // it as not routed rather than losing it.
        Err(err) => {
            tracing::error!(%err, "replay task failed");
            outcomes.push(RequestOutcome::RouteFailed(RouteFailure::Internal));
        }
    }
    bar.inc();
}

impl ReplayReport {
    /// Writes the report as pretty JSON to `path`, creating parent directories.
    ///
    /// # Errors
    /// [`ReplayError::Report`] if the file cannot be written.
    pub fn write_json(&self, path: &Path) -> Result<(), ReplayError> {
        let io_error = |source| ReplayError::Report {
            path: path.to_owned(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io_error)?;
        }
        let json = serde_json::to_string_pretty(self)
            .map_err(|err| io_error(std::io::Error::other(err)))?;
        std::fs::write(path, json + "\n").map_err(io_error)
    }
}

#[cfg(test)]
mod tests;
