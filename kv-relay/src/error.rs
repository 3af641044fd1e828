//! The relay's start-up and configuration errors, and the loss of its worker id. Failures while running (a bad frame,
//! a replay that times out, an engine socket that cannot be opened) are counted and
//! logged by the task that meets them, with their own small error types next to it.

use std::net::SocketAddr;

/// Why the relay's flags are unusable or the relay could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The namespace is not a valid subject token.
    #[error("invalid --namespace: {0}")]
    Namespace(#[from] kv_events::NamespaceError),
    /// A flag is out of range or inconsistent with another.
    #[error("invalid --{field}: {reason}")]
    Invalid {
        /// The flag name, without `--`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A NATS or etcd flag is unusable, or NATS or etcd cannot be reached.
    #[error(transparent)]
    Cluster(#[from] kv_cluster::Error),
    /// The relay's metrics could not be registered.
    #[error("registering relay metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The worker registration could not be prepared.
    #[error("preparing the worker registration: {0}")]
    Registration(kv_cluster::Error),
    /// The worker id could not be claimed (held by another name, no free derived id,
    /// or etcd failed).
    #[error("claiming the worker id: {0}")]
    Claim(kv_cluster::Error),
    /// Another relay took this relay's worker id while it ran (after its claim lease
    /// expired); it stopped publishing.
    #[error("worker id {worker_id} was claimed by another relay; stopped")]
    ClaimLost {
        /// The lost id.
        worker_id: kv_events::WorkerId,
    },
    /// The recovery subscription failed.
    #[error("subscribing to recovery requests: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    /// `--http-listen` could not be bound.
    #[error("listening for http on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// Flushing NATS (the start-up barrier, or the last flush at shutdown) failed.
    #[error("flushing nats: {0}")]
    Flush(#[from] async_nats::client::FlushError),
    /// The shutdown did not finish within `--shutdown-timeout-ms` (NATS or etcd
    /// unreachable, typically); it names the steps skipped.
    #[error(transparent)]
    ShutdownIncomplete(#[from] kv_cluster::shutdown::ShutdownIncomplete),
}

/// A [`RelayError::Invalid`] naming flag `field`.
pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> RelayError {
    RelayError::Invalid {
        field,
        reason: reason.into(),
    }
}
