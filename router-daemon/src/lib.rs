//! The kv-router daemon: it consumes KV events and load metrics from NATS into the
//! sharded indexer, discovers workers through etcd leases, and answers routing queries
//! on a NATS queue group with the scheduler's choice.
//!
//! The binary (`kv-router`) is a thin shell over [`Daemon`]; tests run the same code
//! in-process against real nats-server and etcd processes and drive shutdown through a
//! [`tokio_util::sync::CancellationToken`].
//!
//! # Layout
//! - [`barrier`]: a NATS round trip proving our subscriptions are registered.
//! - [`config`]: command-line flags parsed once into typed, validated sub-configs.
//! - [`daemon`]: start-up and the shutdown order (stop intake → drain shards → close).
//! - [`discovery`]: etcd worker registrations: initial load, then a watch.
//! - [`intake`]: KV event and load-metric subscriptions feeding indexer and scheduler.
//! - [`route`]: the routing request-reply service.
//! - [`lifecycle`]: prefill-done / freed messages from frontends.
//! - [`state`]: the shared router state (indexer handle, scheduler lock, counters).
//! - [`counters`]: Prometheus counters for messages the daemon handled or rejected.

pub mod barrier;
pub mod config;
pub mod counters;
pub mod daemon;
pub mod discovery;
pub mod intake;
pub mod lifecycle;
pub mod route;
pub mod state;

pub use config::{DaemonConfig, ServeArgs};
pub use daemon::{Daemon, run};
