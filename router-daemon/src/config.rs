//! Daemon configuration: clap flags (with environment variables) parsed once at the
//! edge and validated into typed sub-configs, each handed only to the part that owns
//! it: [`NatsConfig`] to the NATS client, [`EtcdConfig`] to discovery,
//! [`indexer::IndexerConfig`] to the indexer and [`scheduler::SchedulerConfig`] to the
//! scheduler. Every policy's knobs live in its own `PolicyConfig` variant.

use clap::Args;
use kv_events::routing::PolicyKind;
use kv_events::{Namespace, Subjects};
use scheduler::{KvPolicyConfig, PolicyConfig, SchedulerConfig};
use std::time::Duration;

/// `kv-router serve` flags. Each flag can also be set by the environment variable named
/// in its help text.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// NATS server URL(s), comma-separated (a cluster's seed list).
    #[arg(
        long,
        env = "KV_ROUTER_NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        value_delimiter = ','
    )]
    pub nats_url: Vec<String>,
    /// etcd endpoint URL(s), comma-separated.
    #[arg(
        long,
        env = "KV_ROUTER_ETCD_ENDPOINTS",
        default_value = "http://127.0.0.1:2379",
        value_delimiter = ','
    )]
    pub etcd_endpoints: Vec<String>,
    /// Namespace of every subject and etcd key (letters, digits, '_' and '-').
    #[arg(long, env = "KV_ROUTER_NAMESPACE", default_value = "kv-router")]
    pub namespace: String,
    /// Tokens per KV block; every worker in the namespace must register the same size.
    #[arg(long, env = "KV_ROUTER_BLOCK_SIZE", default_value_t = 64)]
    pub block_size: u32,
    /// Default routing policy: kv, round-robin or random (overridable per request).
    #[arg(long, env = "KV_ROUTER_POLICY", default_value = "kv")]
    pub policy: PolicyKind,
    /// kv policy: weight of one uncached prompt block against one active decode block.
    #[arg(long, env = "KV_ROUTER_OVERLAP_WEIGHT", default_value_t = 1.0)]
    pub overlap_weight: f64,
    /// kv policy: softmax temperature over normalized costs; 0 always picks the cheapest.
    #[arg(long, env = "KV_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f64,
    /// Indexer shard tasks (default: the number of cores).
    #[arg(long, env = "KV_ROUTER_SHARDS")]
    pub shards: Option<usize>,
    /// Seed for the scheduler's tie-break and sampling RNG (default: from the OS).
    #[arg(long, env = "KV_ROUTER_SEED")]
    pub seed: Option<u64>,
    /// Maximum routing queries handled concurrently.
    #[arg(long, env = "KV_ROUTER_MAX_INFLIGHT_ROUTES", default_value_t = 256)]
    pub max_inflight_routes: usize,
    /// etcd connect timeout, in milliseconds.
    #[arg(
        long,
        env = "KV_ROUTER_ETCD_CONNECT_TIMEOUT_MS",
        default_value_t = 5000
    )]
    pub etcd_connect_timeout_ms: u64,
}

/// How to reach NATS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsConfig {
    /// Server URLs, tried in order by the client.
    pub servers: Vec<String>,
}

/// How to reach etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Endpoint URLs.
    pub endpoints: Vec<String>,
    /// Timeout of the initial connection.
    pub connect_timeout: Duration,
}

/// Settings of the routing service itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteConfig {
    /// Tokens per KV block, used to hash token prompts and count request blocks.
    pub block_size: u32,
    /// Routing queries handled concurrently.
    pub max_inflight: usize,
}

/// The validated daemon configuration.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Subjects and keys of this namespace.
    pub subjects: Subjects,
    /// NATS connection.
    pub nats: NatsConfig,
    /// etcd connection.
    pub etcd: EtcdConfig,
    /// Routing service.
    pub route: RouteConfig,
    /// Indexer shards and queues.
    pub indexer: indexer::IndexerConfig,
    /// Policy and its knobs.
    pub scheduler: SchedulerConfig,
    /// RNG seed of the scheduler, `None` for an OS seed.
    pub rng_seed: Option<u64>,
}

/// A configuration value that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The namespace is not a valid subject token.
    #[error("invalid --namespace: {0}")]
    Namespace(#[from] kv_events::NamespaceError),
    /// A field is out of range.
    #[error("invalid --{field}: {reason}")]
    Invalid {
        /// The flag name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The scheduler rejected its sub-config.
    #[error("invalid scheduler config: {0}")]
    Scheduler(#[from] scheduler::SchedulerError),
}

impl DaemonConfig {
    /// Validates flags into a configuration.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad field.
    pub fn from_args(args: &ServeArgs) -> Result<Self, ConfigError> {
        let subjects = Subjects::new(Namespace::new(args.namespace.clone())?);
        let invalid = |field: &'static str, reason: &str| ConfigError::Invalid {
            field,
            reason: reason.to_owned(),
        };
        if args.block_size == 0 {
            return Err(invalid("block-size", "must be at least 1 token"));
        }
        if args.nats_url.iter().all(|u| u.trim().is_empty()) {
            return Err(invalid("nats-url", "at least one url is required"));
        }
        if args.etcd_endpoints.iter().all(|u| u.trim().is_empty()) {
            return Err(invalid(
                "etcd-endpoints",
                "at least one endpoint is required",
            ));
        }
        if args.max_inflight_routes == 0 {
            return Err(invalid("max-inflight-routes", "must be at least 1"));
        }
        if args.shards == Some(0) {
            return Err(invalid("shards", "must be at least 1"));
        }
        let policy = match args.policy {
            PolicyKind::Kv => PolicyConfig::Kv(KvPolicyConfig {
                overlap_weight: args.overlap_weight,
                temperature: args.temperature,
            }),
            PolicyKind::RoundRobin => PolicyConfig::RoundRobin,
            PolicyKind::Random => PolicyConfig::Random,
        };
        let scheduler = SchedulerConfig { policy };
        scheduler.validate()?;
        let mut indexer = indexer::IndexerConfig::default();
        if let Some(shards) = args.shards {
            indexer.num_shards = shards;
        }
        Ok(Self {
            subjects,
            nats: NatsConfig {
                servers: trimmed(&args.nats_url),
            },
            etcd: EtcdConfig {
                endpoints: trimmed(&args.etcd_endpoints),
                connect_timeout: Duration::from_millis(args.etcd_connect_timeout_ms),
            },
            route: RouteConfig {
                block_size: args.block_size,
                max_inflight: args.max_inflight_routes,
            },
            indexer,
            scheduler,
            rng_seed: args.seed,
        })
    }
}

fn trimmed(values: &[String]) -> Vec<String> {
    values
        .iter()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> ServeArgs {
        Cli::try_parse_from(std::iter::once("kv-router").chain(args.iter().copied()))
            .expect("flags parse")
            .serve
    }

    #[test]
    fn defaults_validate() {
        let config = DaemonConfig::from_args(&parse(&[])).unwrap();
        assert_eq!(config.route.block_size, 64);
        assert_eq!(config.subjects.namespace().as_str(), "kv-router");
        assert!(matches!(config.scheduler.policy, PolicyConfig::Kv(_)));
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
    fn bad_values_name_their_field() {
        let err = DaemonConfig::from_args(&parse(&["--block-size", "0"])).unwrap_err();
        assert!(err.to_string().contains("--block-size"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--namespace", "a.b"])).unwrap_err();
        assert!(err.to_string().contains("--namespace"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--shards", "0"])).unwrap_err();
        assert!(err.to_string().contains("--shards"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--overlap-weight", "-1"])).unwrap_err();
        assert!(err.to_string().contains("overlap_weight"), "{err}");
        assert!(Cli::try_parse_from(["kv-router", "--policy", "best"]).is_err());
    }
}
