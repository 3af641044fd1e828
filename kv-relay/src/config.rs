//! `kv-router relay` flags, validated into typed sub-configs: where the engine
//! publishes ([`EngineConfig`]), who the worker is ([`WorkerConfig`]), where to publish
//! and register ([`NatsConfig`] and [`EtcdConfig`], from the very flags of `serve`:
//! see [`kv_cluster::args`]; and the namespace), and the optional Prometheus
//! scrape ([`ScrapeConfig`]).
//!
//! Endpoint layout follows the engines: vLLM and SGLang bind one PUB socket per data
//! parallel rank at the configured port plus the rank, and the same for the replay
//! ROUTER socket. So `--engine-endpoint tcp://h:5557 --dp-size 4` means ranks 0–3 on
//! ports 5557–5560; several `--engine-endpoint`s name the ranks' sockets one by one;
//! `--shared-endpoint` says every rank publishes on the given socket(s) and the rank
//! is read from each batch.

use crate::error::{RelayError, invalid};
use crate::replay::ReplayPolicy;
use clap::{Args, ValueEnum};
use kv_cluster::args::{
    DisaggregationArgs, EtcdArgs, NamespaceArgs, NatsArgs, WorkerPlacement, trimmed,
};
use kv_cluster::etcd::EtcdConfig;
use kv_cluster::nats::NatsConfig;
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, Subjects, WorkerId};
use std::path::PathBuf;
use std::time::Duration;

pub use crate::scrape::target::ScrapeConfig;

/// Bounds of `--reconnect-max-backoff-ms`: the first retry waits 100 ms, and an
/// engine back after an outage is read again within a minute at most.
const MIN_RECONNECT_BACKOFF_MS: u64 = 100;
const MAX_RECONNECT_BACKOFF_MS: u64 = 60_000;

/// Which event encodings the relay accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineFormat {
    /// Detect per event: positional arrays and tagged maps are both accepted.
    Auto,
    /// Only vLLM ≤ 0.23 positional arrays; tagged maps are rejected and counted.
    VllmArray,
    /// Only tagged maps (vLLM ≥ 0.24, SGLang); positional arrays are rejected.
    Tagged,
}

/// `kv-router relay` flags. Each can also be set by the environment variable in its
/// help text. The NATS and etcd flags (and their `KV_ROUTER_*` variables) are
/// `serve`'s, so a relay can share the daemon's environment and secret mounts.
#[derive(Debug, Clone, Args)]
pub struct RelayArgs {
    /// Engine ZMQ PUB endpoint(s), e.g. tcp://127.0.0.1:5557 (repeatable or
    /// comma-separated; one per dp rank, or one base endpoint with --dp-size).
    #[arg(
        long,
        env = "KV_RELAY_ENGINE_ENDPOINT",
        value_delimiter = ',',
        required = true
    )]
    pub engine_endpoint: Vec<String>,
    /// Engine replay ROUTER endpoint(s), laid out like --engine-endpoint. Without it
    /// a gap in the engine's sequence clears the rank instead of being filled.
    #[arg(long, env = "KV_RELAY_REPLAY_ENDPOINT", value_delimiter = ',')]
    pub replay_endpoint: Vec<String>,
    /// ZMQ topic to subscribe to (vLLM's `topic`; empty = everything).
    #[arg(long, env = "KV_RELAY_TOPIC", default_value = "")]
    pub topic: String,
    /// Accepted event encodings: auto, vllm-array or tagged.
    #[arg(long, env = "KV_RELAY_ENGINE_FORMAT", value_enum, default_value_t = EngineFormat::Auto)]
    pub engine_format: EngineFormat,
    /// Worker id and name: which id to claim in etcd.
    #[command(flatten)]
    pub identity: crate::identity::IdentityArgs,
    /// Data-parallel ranks of the engine (default: one per --engine-endpoint).
    #[arg(long, env = "KV_RELAY_DP_SIZE")]
    pub dp_size: Option<u32>,
    /// Every rank publishes on the given endpoint(s); the rank is taken from each
    /// batch (nil means rank 0) instead of from the endpoint.
    #[arg(long, env = "KV_RELAY_SHARED_ENDPOINT")]
    pub shared_endpoint: bool,
    /// Engine Prometheus page (`http://` or `https://`), scraped for load and for the
    /// engine's block size and KV capacity (vLLM `cache_config_info`, SGLang
    /// `page_size`/`num_pages`); default `<engine-url>/metrics`. While it is scraped,
    /// --engine-url's `/v1/models` is read too, for the engine's `max_model_len`.
    #[arg(long, env = "KV_RELAY_METRICS_URL")]
    pub metrics_url: Option<String>,
    /// CA certificate (PEM) trusted for an `https://` --metrics-url or --engine-url,
    /// besides the system's root certificates.
    #[arg(long, env = "KV_RELAY_METRICS_TLS_CA")]
    pub metrics_tls_ca: Option<PathBuf>,
    /// The engine's OpenAI HTTP base URL as the gateway reaches it, e.g.
    /// http://10.0.0.7:8000; registered so `kv-router gateway` can forward requests to
    /// this worker, and where its /metrics page and /v1/models (its `max_model_len`,
    /// registered for the gateway's prompt limit) are read.
    #[arg(long, env = "KV_RELAY_ENGINE_URL")]
    pub engine_url: Option<String>,
    /// The engine's role in a disaggregated fleet (`--role`, `--kv-transfer`,
    /// `--bootstrap-port`), registered with the worker: the flags of every worker.
    #[command(flatten)]
    pub disaggregation: DisaggregationArgs,
    /// The relay's own HTTP endpoint: address, header-read timeout, connection cap.
    #[command(flatten, next_help_heading = "HTTP")]
    pub http: crate::http::RelayHttpArgs,
    /// Scrape period of --metrics-url, in milliseconds.
    #[arg(long, env = "KV_RELAY_METRICS_INTERVAL_MS", default_value_t = 1000)]
    pub metrics_interval_ms: u64,
    /// Deadline of one replay request, from connecting to its last message, in ms;
    /// a reply cut short is asked again from its first missing batch.
    #[arg(long, env = "KV_RELAY_REPLAY_TIMEOUT_MS", default_value_t = 2000)]
    pub replay_timeout_ms: u64,
    /// Requests one read of the engine's replay buffer may make (the first and its
    /// re-asks from the first missing batch) before the relay goes on with what it
    /// has.
    #[arg(long, env = "KV_RELAY_REPLAY_MAX_REQUESTS", default_value_t = 16)]
    pub replay_max_requests: u32,
    /// Longest wait between two attempts to (re)connect an engine socket, in ms
    /// (100 to 60000); attempts start 100 ms apart and double up to it.
    #[arg(
        long,
        env = "KV_RELAY_RECONNECT_MAX_BACKOFF_MS",
        default_value_t = 1000
    )]
    pub reconnect_max_backoff_ms: u64,
    /// Events kept per rank to answer the router's recovery requests.
    #[arg(long, env = "KV_RELAY_JOURNAL_EVENTS", default_value_t = 16_384)]
    pub journal_events: usize,
    /// TTL of the etcd lease bound to the registration, in seconds.
    #[arg(long, env = "KV_RELAY_LEASE_TTL_SECS", default_value_t = 10)]
    pub lease_ttl_secs: u64,
    /// NATS servers, authentication and TLS: the same flags and `KV_ROUTER_NATS_*`
    /// variables as `serve`.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// etcd endpoints and connect timeout: the same flags and `KV_ROUTER_ETCD_*`
    /// variables as `serve`.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The cluster's namespace: the same flag and variable as `serve`.
    #[command(flatten, next_help_heading = "Cluster")]
    pub namespace: NamespaceArgs,
    /// The budget of the whole shutdown sequence: the same flag and variable as
    /// `serve`.
    #[command(flatten)]
    pub shutdown: kv_cluster::shutdown::ShutdownArgs,
}

/// One engine socket and the rank its batches belong to when they name none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEndpoint {
    /// The PUB endpoint to subscribe to.
    pub publish: String,
    /// The replay ROUTER endpoint, if the engine has one.
    pub replay: Option<String>,
    /// Rank of batches whose `dp_rank` is nil.
    pub default_rank: DpRank,
}

/// Where and how to read the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// One entry per engine socket.
    pub endpoints: Vec<RankEndpoint>,
    /// ZMQ subscription prefix.
    pub topic: String,
    /// Accepted encodings.
    pub format: EngineFormat,
    /// How the replay socket is read ([`crate::replay`]).
    pub replay: ReplayPolicy,
    /// Longest wait between two connection attempts to an engine socket.
    pub reconnect_max_backoff: Duration,
    /// Every socket carries every rank (`--shared-endpoint`).
    pub shared: bool,
}

/// The worker the relay stands for. Its block size and KV capacity are not
/// configured: they are learned from the engine ([`crate::facts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Which worker id to claim, under which name ([`crate::identity`]).
    pub claim: kv_cluster::claim::ClaimRequest,
    /// Data-parallel ranks of the engine.
    pub dp_size: u32,
    /// The engine's OpenAI HTTP base URL, registered for the gateway.
    pub url: Option<String>,
    /// Its role in a disaggregated fleet and its transfer protocol, registered.
    pub placement: WorkerPlacement,
    /// Lease TTL, in seconds.
    pub lease_ttl_secs: u64,
    /// Events kept per rank for recovery.
    pub journal_events: usize,
}

/// The validated relay configuration.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Subjects and keys of the namespace.
    pub subjects: Subjects,
    /// NATS servers, authentication and TLS.
    pub nats: NatsConfig,
    /// etcd connection.
    pub etcd: EtcdConfig,
    /// The engine's sockets.
    pub engine: EngineConfig,
    /// The worker identity and registration.
    pub worker: WorkerConfig,
    /// Load and facts scrape, if `--metrics-url` or `--engine-url` was given.
    pub scrape: Option<ScrapeConfig>,
    /// Where and how to serve the relay's `/metrics`, if anywhere.
    pub http: Option<crate::http::RelayHttpConfig>,
    /// Longest the whole shutdown sequence may take (`Relay::shutdown`).
    pub shutdown_timeout: Duration,
}

/// A `tcp://host:port` endpoint and its port.
fn tcp_endpoint(endpoint: &str, field: &'static str) -> Result<(url::Url, u16), RelayError> {
    let url =
        url::Url::parse(endpoint).map_err(|e| invalid(field, format!("{endpoint:?}: {e}")))?;
    if url.scheme() != "tcp" || url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(
            field,
            format!("{endpoint:?} is not a tcp:// endpoint"),
        ));
    }
    let port = url
        .port()
        .ok_or_else(|| invalid(field, format!("{endpoint:?} has no port")))?;
    Ok((url, port))
}

/// `tcp://host:port` with the port increased by `offset`.
fn offset_port(endpoint: &str, offset: u32, field: &'static str) -> Result<String, RelayError> {
    let (mut url, port) = tcp_endpoint(endpoint, field)?;
    let shifted = u16::try_from(u32::from(port) + offset).map_err(|_| {
        invalid(
            field,
            format!("{endpoint:?} + rank {offset} passes port 65535"),
        )
    })?;
    url.set_port(Some(shifted))
        .map_err(|()| invalid(field, format!("{endpoint:?} takes no port")))?;
    Ok(url.to_string())
}

/// Expands `given` to `n` endpoints: as is when there are `n`, or by port offset
/// from one base endpoint.
fn expand(given: &[String], n: u32, field: &'static str) -> Result<Vec<String>, RelayError> {
    for e in given {
        tcp_endpoint(e, field)?;
    }
    match given.len() {
        len if len == n as usize => Ok(given.to_vec()),
        1 => (0..n).map(|r| offset_port(&given[0], r, field)).collect(),
        len => Err(invalid(
            field,
            format!("{len} endpoints for {n} ranks (give one base endpoint or one per rank)"),
        )),
    }
}

impl RelayConfig {
    /// Validates flags into a configuration.
    ///
    /// # Errors
    /// [`RelayError`] naming the first bad flag.
    pub fn from_args(args: &RelayArgs) -> Result<Self, RelayError> {
        let subjects = Subjects::new(args.namespace.get()?);
        let engines = trimmed(&args.engine_endpoint);
        let replays = trimmed(&args.replay_endpoint);
        if engines.is_empty() {
            return Err(invalid(
                "engine-endpoint",
                "at least one endpoint is required",
            ));
        }
        let default_size = if args.shared_endpoint {
            1
        } else {
            engines.len()
        };
        let dp_size = args
            .dp_size
            .unwrap_or(u32::try_from(default_size).unwrap_or(u32::MAX));
        if dp_size == 0 {
            return Err(invalid("dp-size", "must be at least 1"));
        }
        let sockets = if args.shared_endpoint {
            u32::try_from(engines.len()).unwrap_or(u32::MAX)
        } else {
            dp_size
        };
        let publish = expand(&engines, sockets, "engine-endpoint")?;
        let replay = if replays.is_empty() {
            vec![None; publish.len()]
        } else {
            expand(&replays, sockets, "replay-endpoint")?
                .into_iter()
                .map(Some)
                .collect()
        };
        let endpoints = publish
            .into_iter()
            .zip(replay)
            .enumerate()
            .map(|(i, (publish, replay))| RankEndpoint {
                publish,
                replay,
                default_rank: if args.shared_endpoint {
                    DpRank(0)
                } else {
                    DpRank(u32::try_from(i).unwrap_or(u32::MAX))
                },
            })
            .collect();
        if args.replay_timeout_ms == 0 {
            return Err(invalid("replay-timeout-ms", "must be at least 1"));
        }
        if args.replay_max_requests == 0 {
            return Err(invalid("replay-max-requests", "must be at least 1"));
        }
        if !(MIN_RECONNECT_BACKOFF_MS..=MAX_RECONNECT_BACKOFF_MS)
            .contains(&args.reconnect_max_backoff_ms)
        {
            return Err(invalid(
                "reconnect-max-backoff-ms",
                format!("must be {MIN_RECONNECT_BACKOFF_MS} to {MAX_RECONNECT_BACKOFF_MS}"),
            ));
        }
        if args.journal_events == 0 {
            return Err(invalid("journal-events", "must be at least 1"));
        }
        if args.lease_ttl_secs < 3 || i64::try_from(args.lease_ttl_secs).is_err() {
            return Err(invalid("lease-ttl-secs", "must be at least 3 seconds"));
        }
        let nats = args.nats.to_config()?;
        let etcd = args.etcd.to_config()?;
        let shutdown_timeout = args.shutdown.budget()?;
        let engine_url = args
            .engine_url
            .as_deref()
            .map(|u| u.trim().trim_end_matches('/').to_owned());
        let scrape = crate::scrape::target::from_flags(
            args.metrics_url.as_deref(),
            engine_url.as_deref(),
            args.metrics_interval_ms,
            args.metrics_tls_ca.as_deref(),
        )?;
        let claim = args.identity.to_request(args.lease_ttl_secs)?;
        let worker_id = claim.worker_id.unwrap_or(WorkerId(0));
        let placement = args.disaggregation.placement()?;
        if placement.kv_transfer.is_some() && engine_url.is_none() {
            // A frontend sends each half to the registered url (and an SGLang
            // decode worker reaches the prefill worker's bootstrap server on its host).
            return Err(invalid(
                "engine-url",
                "required with --role prefill or decode: frontends send each half of a \
                 disaggregated request to the registered url",
            ));
        }
        let check = WorkerRegistration {
            worker_id,
            dp_size: 1,
            block_size: 1,
            total_kv_blocks: 0,
            url: engine_url.clone(),
            epoch: 0,
            max_model_len: None,
            role: placement.role,
            kv_transfer: placement.kv_transfer,
        };
        if let Err(e) = check.validate() {
            return Err(invalid("engine-url", e.to_string()));
        }
        Ok(Self {
            subjects,
            nats,
            etcd,
            engine: EngineConfig {
                endpoints,
                topic: args.topic.clone(),
                format: args.engine_format,
                replay: ReplayPolicy {
                    request_timeout: Duration::from_millis(args.replay_timeout_ms),
                    max_requests: args.replay_max_requests,
                },
                reconnect_max_backoff: Duration::from_millis(args.reconnect_max_backoff_ms),
                shared: args.shared_endpoint,
            },
            worker: WorkerConfig {
                claim,
                dp_size,
                url: engine_url,
                placement,
                lease_ttl_secs: args.lease_ttl_secs,
                journal_events: args.journal_events,
            },
            scrape,
            http: args.http.to_config(),
            shutdown_timeout,
        })
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
