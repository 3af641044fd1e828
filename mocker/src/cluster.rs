//! Real nats-server and etcd processes on free loopback ports, plus a managed child
//! process type for the router daemon and the mock engines.
//!
//! The quickstart and the integration tests need the real infrastructure: an in-memory
//! fake would not catch subject, codec, lease or ordering mistakes. Each server gets
//! fresh loopback ports and a temporary data directory, readiness is detected by
//! reading the server's own log line (no sleeps, no connection polling), and every
//! process is killed and reaped when its handle is dropped, so a failing test does not
//! leak servers. Starting a server costs one process spawn and, typically, 10–300 ms
//! until it reports ready.
//!
//! Every child is put in its own process group, so a Ctrl-C in the terminal reaches
//! only the quickstart, which then stops the children in order.
//!
//! # Layout
//! - [`process`]: [`ManagedProcess`]: spawn, log capture and forwarding, wait for a log
//!   line, graceful stop.
//! - [`servers`]: [`NatsServer`] and [`EtcdServer`].

pub mod process;
pub mod servers;

pub use process::{Echo, ManagedProcess, find_on_path};
pub use servers::{EtcdServer, EtcdServerTls, NatsServer};

use std::time::Duration;

/// Errors from starting, waiting for or stopping cluster processes.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A required executable is not on `PATH`.
    #[error("{binary} not found on PATH; {hint}")]
    BinaryNotFound {
        /// The executable's name.
        binary: String,
        /// How to get it, e.g. "install it with `apt-get install nats-server`".
        hint: String,
    },
    /// The process could not be spawned.
    #[error("cannot start {label}: {source}")]
    Spawn {
        /// The process's label (e.g. `nats`).
        label: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A local resource (temporary directory, port probe, process wait) failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, lowercase.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The process closed its output (exited) before printing the awaited line.
    #[error("{label} exited before logging {marker:?}; last output:\n{tail}")]
    Exited {
        /// The process's label.
        label: String,
        /// The awaited substring.
        marker: String,
        /// The last lines the process printed.
        tail: String,
    },
    /// The awaited line did not appear in time.
    #[error("{label} did not log {marker:?} within {after:?}; last output:\n{tail}")]
    Timeout {
        /// The process's label.
        label: String,
        /// The awaited substring.
        marker: String,
        /// How long we waited.
        after: Duration,
        /// The last lines the process printed.
        tail: String,
    },
    /// A signal could not be sent to the process.
    #[error("cannot signal {label}: {source}")]
    Signal {
        /// The process's label.
        label: String,
        /// The errno.
        source: nix::errno::Errno,
    },
}

impl ClusterError {
    /// Whether the process died because its port was taken (a race with another
    /// process between our port probe and its bind); such starts are retried.
    pub fn is_port_conflict(&self) -> bool {
        match self {
            // Servers log it lowercase; Rust's io::Error says "Address already in use".
            ClusterError::Exited { tail, .. } => {
                tail.to_lowercase().contains("address already in use")
            }
            _ => false,
        }
    }
}
