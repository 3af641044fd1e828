//! Daemon configuration: clap flags (with environment variables and the TOML file)
//! parsed once at the edge and validated into typed sub-configs, each handed only to
//! the part that owns it: [`NatsConfig`] to the NATS client, [`EtcdConfig`] to
//! discovery, [`indexer::IndexerConfig`] to the indexer and
//! [`scheduler::SchedulerConfig`] to the scheduler. Every policy's knobs live in its
//! own `PolicyConfig` variant.
//!
//! Why one folder: every setting of `serve` is declared, layered, validated and
//! documented here, and nothing here is imported back by the files it imports
//! (imports go mod → groups → error, and `file` knows clap, not `serve`).
//!
//! # Layout
//! - this file: [`ServeArgs`] (every `serve` flag), [`DaemonConfig`] and its
//!   validation, [`serve_command`].
//! - `error`: [`ConfigError`], the one error of every flag group.
//! - [`mod@file`]: the TOML file under environment and flags; `config print` and
//!   `config reference`.
//! - `scheduling`: the queue and replica flags, with the scheduler's own flags
//!   (`scheduler::args`: policy and knobs, liveness, calibration, sessions, load
//!   accounting) flattened in.
//! - [`index`]: the index backend, memory bound, mode and JetStream flags.
//! - `recovery`: the gap recovery flags (flattened into [`index`]).
//! - The NATS and etcd flags are `kv_cluster::args`, shared with `kv-router relay`
//!   and every other participant; the `Limits` flags are `kv_cluster::limits`,
//!   shared with the gateway; the shutdown budget is `kv_cluster::shutdown`, shared
//!   with `kv-router relay` and the mock engines.

mod error;
pub mod file;
pub mod index;
mod recovery;
mod scheduling;

pub(crate) use crate::http::config::DaemonHttpConfig;
use clap::Args;
pub use error::ConfigError;
pub(crate) use kv_cluster::args::{EtcdArgs, NatsArgs};
pub(crate) use kv_cluster::etcd::EtcdConfig;
pub(crate) use kv_cluster::nats::NatsConfig;
use kv_events::Subjects;
use scheduler::SchedulerConfig;
use std::path::PathBuf;

/// `kv-router serve` flags. Each flag can also be set by the environment variable named
/// in its help text, and by the TOML file of `--config` (see [`mod@file`]):
/// command line over environment over file over built-in default. The help heading of
/// a flag is its TOML table.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// TOML configuration file; environment variables and flags override its values.
    #[arg(long, env = "KV_ROUTER_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// NATS servers, authentication and TLS (shared with `relay`).
    #[command(flatten)]
    pub nats: NatsArgs,
    /// HTTP endpoint: listen addresses (main and `/debug`), header-read timeout,
    /// connection cap.
    #[command(flatten)]
    pub http: crate::http::DaemonHttpArgs,
    /// etcd endpoints and connect timeout (shared with `relay`).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The cluster's namespace (shared with every participant).
    #[command(flatten, next_help_heading = "Cluster")]
    pub namespace: kv_cluster::args::NamespaceArgs,
    /// Tokens per KV block, pinned; a worker registering another size is rejected.
    /// Default: adopted from the first worker registration (see docs/operations.md).
    #[arg(long, help_heading = "Cluster", env = "KV_ROUTER_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Policy, its knobs, load accounting, busy thresholds, wait queue, replica sync.
    #[command(flatten, next_help_heading = "Scheduler")]
    pub scheduling: Box<scheduling::SchedulingArgs>,
    /// Indexer shard tasks (default: the number of cores).
    #[arg(long, help_heading = "Indexer", env = "KV_ROUTER_SHARDS")]
    pub shards: Option<usize>,
    /// Index backend, memory bound, approximate mode, recovery and JetStream.
    #[command(flatten, next_help_heading = "Indexer")]
    pub index: index::IndexArgs,
    /// Seed for the scheduler's tie-break and sampling RNG (default: from the OS).
    #[arg(long, help_heading = "Scheduler", env = "KV_ROUTER_SEED")]
    pub seed: Option<u64>,
    /// Maximum routing queries handled concurrently.
    #[arg(
        long,
        help_heading = "Routing",
        env = "KV_ROUTER_MAX_INFLIGHT_ROUTES",
        default_value_t = 256
    )]
    pub max_inflight_routes: usize,
    /// Most requests in one batch route request (`{ns}.router.route_batch`).
    #[arg(
        long,
        help_heading = "Routing",
        env = "KV_ROUTER_MAX_ROUTE_BATCH",
        default_value_t = 256
    )]
    pub max_route_batch: usize,
    /// Removed KV blocks remembered per worker rank, so a frontend can ask whether
    /// an eviction raced a route (`{ns}.router.removals`); about 90 bytes each on
    /// ranks that evict. 0 keeps none (route replies then carry no `kv_position`).
    #[arg(
        long,
        help_heading = "Routing",
        env = "KV_ROUTER_REMOVALS_PER_RANK",
        default_value_t = crate::removals::DEFAULT_PER_RANK
    )]
    pub removals_per_rank: usize,
    /// Bounds on every message from NATS and every registration from etcd.
    #[command(flatten)]
    pub limits: kv_cluster::limits::LimitArgs,
    /// The budget of the whole shutdown sequence (shared with `relay`).
    #[command(flatten)]
    pub shutdown: kv_cluster::shutdown::ShutdownArgs,
}

/// Settings of the routing service itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteConfig {
    /// Tokens per KV block, used to hash token prompts and count request blocks, when
    /// pinned by `--block-size`; `None` adopts the registered workers' size
    /// ([`crate::BlockSizeSource`]).
    pub block_size: Option<std::num::NonZeroU32>,
    /// Routing queries handled concurrently (single queries and batches each).
    pub max_inflight: usize,
    /// Most requests in one batch route request.
    pub max_batch: usize,
    /// Removed blocks remembered per rank (`crate::removals`); 0 keeps none.
    pub removals_per_rank: usize,
}

/// The validated daemon configuration.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Subjects and keys of this namespace.
    pub subjects: Subjects,
    /// NATS connection.
    pub nats: NatsConfig,
    /// HTTP endpoint.
    pub http: DaemonHttpConfig,
    /// etcd connection.
    pub etcd: EtcdConfig,
    /// Routing service.
    pub route: RouteConfig,
    /// Indexer backend, shards, queues, memory bound and mode.
    pub indexer: indexer::IndexerConfig,
    /// Gap recovery and the optional JetStream path.
    pub durability: crate::durability::DurabilityConfig,
    /// Policy and its knobs, load accounting and busy thresholds.
    pub scheduler: SchedulerConfig,
    /// Wait queue and replica sync.
    pub admission: crate::admission::AdmissionConfig,
    /// RNG seed of the scheduler, `None` for an OS seed.
    pub rng_seed: Option<u64>,
    /// Bounds on messages and registrations, applied where each is decoded.
    pub limits: kv_events::limits::Limits,
    /// Longest the whole shutdown sequence may take
    /// ([`crate::daemon::Daemon::shutdown`]); past it the remaining steps are skipped.
    pub shutdown_timeout: std::time::Duration,
}

/// The `serve` command: every setting the file, environment and flags can set (for
/// [`mod@file`]'s layering, `config print` and `config reference`).
pub fn serve_command() -> clap::Command {
    ServeArgs::augment_args(clap::Command::new("serve"))
}

impl DaemonConfig {
    /// Validates flags into a configuration.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad field.
    pub fn from_args(args: &ServeArgs) -> Result<Self, ConfigError> {
        let subjects = Subjects::new(args.namespace.get()?);
        let invalid = |field: &'static str, reason: &str| ConfigError::Invalid {
            field,
            reason: reason.to_owned(),
        };
        let block_size = match args.block_size {
            None => None,
            Some(tokens) => Some(
                std::num::NonZeroU32::new(tokens)
                    .ok_or_else(|| invalid("block-size", "must be at least 1 token"))?,
            ),
        };
        let nats = args.nats.to_config()?;
        let etcd = args.etcd.to_config()?;
        let limits = args.limits.to_limits()?;
        let shutdown_timeout = args.shutdown.budget()?;
        if args.max_inflight_routes == 0 {
            return Err(invalid("max-inflight-routes", "must be at least 1"));
        }
        if args.max_route_batch == 0 {
            return Err(invalid("max-route-batch", "must be at least 1"));
        }
        if args.shards == Some(0) {
            return Err(invalid("shards", "must be at least 1"));
        }
        let (scheduler, admission) = args.scheduling.to_configs()?;
        if admission.queue.capacity >= args.max_inflight_routes {
            return Err(invalid(
                "queue-capacity",
                "must be below --max-inflight-routes: each waiting request holds a route slot",
            ));
        }
        let mut indexer = indexer::IndexerConfig::default();
        if let Some(shards) = args.shards {
            indexer.num_shards = shards;
        }
        let durability = args.index.apply(&subjects, &mut indexer)?;
        Ok(Self {
            subjects,
            nats,
            http: args.http.to_config(),
            etcd,
            route: RouteConfig {
                block_size,
                max_inflight: args.max_inflight_routes,
                max_batch: args.max_route_batch,
                removals_per_rank: args.removals_per_rank,
            },
            indexer,
            durability,
            scheduler,
            admission,
            rng_seed: args.seed,
            limits,
            shutdown_timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_cluster::args::parse_flags;
    use kv_cluster::nats::NatsAuth;
    use std::time::Duration;

    fn parse(args: &[&str]) -> ServeArgs {
        parse_flags::<ServeArgs, _, _>(std::iter::once("kv-router").chain(args.iter().copied()))
            .expect("flags parse")
    }

    #[test]
    fn defaults_validate() {
        let config = DaemonConfig::from_args(&parse(&[])).unwrap();
        assert_eq!(config.route.block_size, None);
        assert_eq!(config.subjects.namespace().as_str(), "kv-router");
        assert!(matches!(
            config.scheduler.policy,
            scheduler::PolicyConfig::PredictedTtft(_)
        ));
    }

    #[test]
    fn lists_split_on_commas() {
        let config = DaemonConfig::from_args(&parse(&[
            "--nats-url",
            "nats://a:4222,nats://b:4222",
            "--etcd-endpoints",
            "http://e1:2379, http://e2:2379",
        ]))
        .unwrap();
        assert_eq!(config.nats.servers, vec!["nats://a:4222", "nats://b:4222"]);
        assert_eq!(
            config.etcd.endpoints,
            vec!["http://e1:2379", "http://e2:2379"]
        );
    }

    #[test]
    fn nats_auth_and_tls_flags_reach_the_nats_config() {
        let config = DaemonConfig::from_args(&parse(&[
            "--nats-creds",
            "/s/router.creds",
            "--nats-tls-ca",
            "/s/ca.pem",
            "--nats-tls-required",
            "--etcd-connect-timeout-ms",
            "250",
        ]))
        .unwrap();
        assert_eq!(
            config.nats.auth,
            NatsAuth::CredentialsFile("/s/router.creds".into())
        );
        assert_eq!(config.nats.tls.ca_file, Some("/s/ca.pem".into()));
        assert!(config.nats.tls.required);
        assert_eq!(config.etcd.connect_timeout, Duration::from_millis(250));
    }

    #[test]
    fn bad_values_name_their_field() {
        let err = DaemonConfig::from_args(&parse(&["--block-size", "0"])).unwrap_err();
        assert!(err.to_string().contains("--block-size"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--namespace", "a.b"])).unwrap_err();
        assert!(err.to_string().contains("--namespace"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--shards", "0"])).unwrap_err();
        assert!(err.to_string().contains("--shards"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--nats-tls-cert", "c.pem"])).unwrap_err();
        assert!(err.to_string().contains("--nats-tls-key"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--nats-user", "u"])).unwrap_err();
        assert!(err.to_string().contains("--nats-password"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--policy", "kv", "--overlap-weight", "-1"]))
            .unwrap_err();
        assert!(err.to_string().contains("prefill_load_scale"), "{err}");
        assert!(parse_flags::<ServeArgs, _, _>(["kv-router", "--policy", "best"]).is_err());
    }
}
