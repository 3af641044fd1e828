//! The crate's one error type. Every variant names what failed (a flag, a file, a
//! server list, an etcd call) so a caller can log or return it without adding
//! context of its own; messages are lowercase.

use std::path::PathBuf;
use std::time::Duration;

/// Why a cluster connection, flag, lease, watch or HTTP request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A connection flag is missing, empty or inconsistent with another.
    #[error("invalid --{field}: {reason}")]
    InvalidFlag {
        /// The flag name, without `--`.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An etcd endpoint's scheme does not match the TLS flags.
    #[error("invalid --etcd-endpoints {endpoint}: {reason}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A TLS file named by a flag cannot be read or holds no usable PEM block.
    #[error("cannot use --{flag} {path}: {reason}")]
    TlsFile {
        /// The flag name, without `--`.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it, lowercase.
        reason: String,
    },
    /// The NATS credentials file could not be read or parsed.
    #[error("cannot load nats credentials from {path}: {source}")]
    NatsCredentials {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The NATS client refused the options (bad URL, bad TLS material, ...) or no
    /// server answered.
    #[error("cannot connect to nats at {servers:?}: {source}")]
    NatsConnect {
        /// The seed list.
        servers: Vec<String>,
        /// The cause.
        source: async_nats::ConnectError,
    },
    /// The etcd client could not be built from the endpoints and options.
    #[error("connecting to etcd at {endpoints:?}: {source}")]
    EtcdConnect {
        /// The endpoint URLs.
        endpoints: Vec<String>,
        /// The cause.
        source: etcd_client::Error,
    },
    /// etcd returned an error.
    #[error("etcd request failed: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// An etcd call of the worker directory failed.
    #[error("{what}: {source}")]
    EtcdCall {
        /// The call (`listing worker registrations`, `starting watch`, ...).
        what: &'static str,
        /// The cause.
        source: etcd_client::Error,
    },
    /// etcd did not answer within the call timeout.
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    /// An etcd call of the worker directory got no answer in time.
    #[error("{what}: no answer within {timeout:?}")]
    CallTimeout {
        /// The call.
        what: &'static str,
        /// The bound it exceeded.
        timeout: Duration,
    },
    /// etcd ended or cancelled the watch of the registrations.
    #[error("{0}")]
    WatchEnded(String),
    /// The lease TTL is 0 or does not fit etcd's signed 64-bit seconds.
    #[error("lease ttl {0} s is out of range")]
    TtlOutOfRange(u64),
    /// The registration record could not be serialized.
    #[error("could not encode registration: {0}")]
    Encode(#[from] serde_json::Error),
    /// A worker name (`--worker-name`, `$POD_NAME`, `$HOSTNAME`) is unusable.
    #[error("invalid worker name {name:?}: {reason}")]
    InvalidWorkerName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An explicit worker id is claimed by another name.
    #[error("worker id {worker_id} is claimed by {holder}; give another --worker-id or none")]
    WorkerIdHeld {
        /// The id asked for.
        worker_id: kv_events::WorkerId,
        /// Who holds it: name, host, pid and lease.
        holder: String,
    },
    /// Every derived candidate id of a name is claimed by other names.
    #[error(
        "no free worker id for name {name:?}: all {attempts} derived candidates are claimed by other names"
    )]
    NoFreeWorkerId {
        /// The name.
        name: String,
        /// How many candidates were tried.
        attempts: u32,
    },
    /// An HTTP request failed (connect, write, read, parse or timeout).
    #[error("http request to {target} failed: {reason}")]
    HttpRequest {
        /// The URL asked for.
        target: String,
        /// What went wrong, lowercase.
        reason: String,
    },
}
