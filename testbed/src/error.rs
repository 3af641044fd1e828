//! The one error type of the test bed: what can go wrong starting, waiting for or
//! stopping a local process. It sits in its own module so `process` and `servers`
//! both import it without reaching back up into the crate root.

use std::time::Duration;

/// Errors from starting, waiting for or stopping local processes.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
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

impl ProcessError {
    /// Whether the process died because its port was taken (a race with another
    /// process between our port probe and its bind); such starts are retried.
    pub fn is_port_conflict(&self) -> bool {
        match self {
            // Servers log it lowercase; Rust's io::Error says "Address already in use".
            ProcessError::Exited { tail, .. } => {
                tail.to_lowercase().contains("address already in use")
            }
            _ => false,
        }
    }
}
