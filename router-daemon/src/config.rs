//! Daemon configuration: clap flags (with environment variables) parsed once at the
//! edge and validated into typed sub-configs, each handed only to the part that owns
//! it: [`NatsConfig`] to the NATS client, [`EtcdConfig`] to discovery,
//! [`indexer::IndexerConfig`] to the indexer and [`scheduler::SchedulerConfig`] to the
//! scheduler. Every policy's knobs live in its own `PolicyConfig` variant.

pub use crate::http::{HttpConfig, ListenAddr};
pub use crate::nats::{ClientCertificate, NatsAuth, NatsConfig, NatsTls};
use clap::Args;
use kv_events::{Namespace, Subjects};
use scheduler::SchedulerConfig;
use std::path::PathBuf;
use std::time::Duration;

/// `kv-router serve` flags. Each flag can also be set by the environment variable named
/// in its help text, and by the TOML file of `--config` (see [`crate::config_file`]):
/// command line over environment over file over built-in default. The help heading of
/// a flag is its TOML table.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// TOML configuration file; environment variables and flags override its values.
    #[arg(long, env = "KV_ROUTER_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated (a cluster's seed list).
    #[arg(
        long,
        help_heading = "NATS",
        env = "KV_ROUTER_NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        value_delimiter = ','
    )]
    pub nats_url: Vec<String>,
    /// NATS credentials file (user JWT + nkey seed, `.creds`).
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// NATS authentication token.
    #[arg(
        long,
        help_heading = "NATS",
        env = "KV_ROUTER_NATS_TOKEN",
        hide_env_values = true
    )]
    pub nats_token: Option<String>,
    /// NATS user name (with --nats-password).
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password (with --nats-user).
    #[arg(
        long,
        help_heading = "NATS",
        env = "KV_ROUTER_NATS_PASSWORD",
        hide_env_values = true
    )]
    pub nats_password: Option<String>,
    /// Root CA (PEM) to verify the NATS servers with, in addition to the system roots.
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS with NATS (with --nats-tls-key).
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_TLS_CERT")]
    pub nats_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert.
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_TLS_KEY")]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse to talk to NATS without TLS.
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_TLS_REQUIRED")]
    pub nats_tls_required: bool,
    /// Address of the HTTP endpoint (/metrics, /health/livez, /health/readyz,
    /// /debug/workers), or `off`.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_ROUTER_HTTP_LISTEN",
        default_value = "0.0.0.0:9090"
    )]
    pub http_listen: ListenAddr,
    /// etcd endpoint URL(s), comma-separated.
    #[arg(
        long,
        help_heading = "etcd",
        env = "KV_ROUTER_ETCD_ENDPOINTS",
        default_value = "http://127.0.0.1:2379",
        value_delimiter = ','
    )]
    pub etcd_endpoints: Vec<String>,
    /// Namespace of every subject and etcd key (letters, digits, '_' and '-').
    #[arg(
        long,
        help_heading = "Cluster",
        env = "KV_ROUTER_NAMESPACE",
        default_value = "kv-router"
    )]
    pub namespace: String,
    /// Tokens per KV block; every worker in the namespace must register the same size.
    #[arg(
        long,
        help_heading = "Cluster",
        env = "KV_ROUTER_BLOCK_SIZE",
        default_value_t = 64
    )]
    pub block_size: u32,
    /// Policy, its knobs, load accounting, busy thresholds, wait queue, replica sync.
    #[command(flatten, next_help_heading = "Scheduler")]
    pub scheduling: Box<crate::scheduling_args::SchedulingArgs>,
    /// Indexer shard tasks (default: the number of cores).
    #[arg(long, help_heading = "Indexer", env = "KV_ROUTER_SHARDS")]
    pub shards: Option<usize>,
    /// Index backend, memory bound, approximate mode, recovery and JetStream.
    #[command(flatten, next_help_heading = "Indexer")]
    pub index: crate::durability::IndexArgs,
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
    /// etcd connect timeout, in milliseconds.
    #[arg(
        long,
        help_heading = "etcd",
        env = "KV_ROUTER_ETCD_CONNECT_TIMEOUT_MS",
        default_value_t = 5000
    )]
    pub etcd_connect_timeout_ms: u64,
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
    /// HTTP endpoint.
    pub http: HttpConfig,
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
            nats: nats_config(args)?,
            http: HttpConfig {
                listen: args.http_listen,
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
            durability,
            scheduler,
            admission,
            rng_seed: args.seed,
        })
    }
}

/// NATS servers, authentication (at most one method) and TLS from the flags.
fn nats_config(args: &ServeArgs) -> Result<NatsConfig, ConfigError> {
    let invalid = |field: &'static str, reason: &str| ConfigError::Invalid {
        field,
        reason: reason.to_owned(),
    };
    let auth = match (
        &args.nats_creds,
        &args.nats_token,
        &args.nats_user,
        &args.nats_password,
    ) {
        (None, None, None, None) => NatsAuth::None,
        (Some(path), None, None, None) => NatsAuth::CredentialsFile(path.clone()),
        (None, Some(token), None, None) => NatsAuth::Token(token.clone()),
        (None, None, Some(user), Some(password)) => NatsAuth::UserPassword {
            user: user.clone(),
            password: password.clone(),
        },
        (None, None, Some(_), None) => {
            return Err(invalid("nats-password", "required with --nats-user"));
        }
        (None, None, None, Some(_)) => {
            return Err(invalid("nats-user", "required with --nats-password"));
        }
        _ => {
            return Err(invalid(
                "nats-creds",
                "choose one of --nats-creds, --nats-token or --nats-user/--nats-password",
            ));
        }
    };
    let client_cert = match (&args.nats_tls_cert, &args.nats_tls_key) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some(ClientCertificate {
            cert: cert.clone(),
            key: key.clone(),
        }),
        (Some(_), None) => return Err(invalid("nats-tls-key", "required with --nats-tls-cert")),
        (None, Some(_)) => return Err(invalid("nats-tls-cert", "required with --nats-tls-key")),
    };
    Ok(NatsConfig {
        servers: trimmed(&args.nats_url),
        auth,
        tls: NatsTls {
            ca_file: args.nats_tls_ca.clone(),
            client_cert,
            required: args.nats_tls_required,
        },
    })
}

/// Trims each value and drops empty ones (comma-separated flag lists).
pub(crate) fn trimmed(values: &[String]) -> Vec<String> {
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
        assert!(matches!(
            config.scheduler.policy,
            scheduler::PolicyConfig::Kv(_)
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
    fn bad_values_name_their_field() {
        let err = DaemonConfig::from_args(&parse(&["--block-size", "0"])).unwrap_err();
        assert!(err.to_string().contains("--block-size"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--namespace", "a.b"])).unwrap_err();
        assert!(err.to_string().contains("--namespace"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--shards", "0"])).unwrap_err();
        assert!(err.to_string().contains("--shards"), "{err}");
        let err = DaemonConfig::from_args(&parse(&["--overlap-weight", "-1"])).unwrap_err();
        assert!(err.to_string().contains("prefill_load_scale"), "{err}");
        assert!(Cli::try_parse_from(["kv-router", "--policy", "best"]).is_err());
    }
}
