//! The kv-router daemon: it consumes KV events and load metrics from NATS into the
//! indexer, discovers workers through etcd leases, and answers routing queries
//! on a NATS queue group with the scheduler's choice.
//!
//! The `kv-router` binary (crate `kv-router`) is a thin shell over [`run`] and
//! [`Daemon`]; this library does not depend on the relay or the gateway. Tests run
//! the same code in-process against real nats-server and etcd processes and drive
//! shutdown through a [`tokio_util::sync::CancellationToken`].
//!
//! # Layout
//! - `block_size`: the tokens per block, pinned by `--block-size` or adopted from
//!   the registrations (and why replicas agree on it).
//! - [`config`]: every `serve` setting (flags, environment, TOML file, `config print`),
//!   validated once into typed sub-configs: scheduling, policy and index flag groups.
//! - `daemon`: start-up and the shutdown order (stop intake → drain shards → close).
//! - `startup`: the start-up step under way, and warnings while a start is slow.
//! - `discovery`: applies the etcd worker directory (`kv_cluster::directory`) to
//!   the scheduler, the indexer and `/debug/workers`.
//! - `durability`: gap recovery from publishers, start-up resync, the optional
//!   JetStream snapshot path.
//! - `recovery_status`: each rank's recovery state as `/debug/workers` shows it
//!   (a leaf: written by `durability`, read by the HTTP endpoint).
//! - `intake`: KV event and load-metric subscriptions feeding indexer and scheduler.
//! - `route`: the routing request-reply service.
//! - `removals`: recent `Removed` blocks per rank, and the `{ns}.router.removals`
//!   service telling a frontend whether an eviction raced a route.
//! - `overlap`: the `{ns}.router.overlap` service telling a frontend how much of a
//!   prefix a rank holds now (did the index learn a served prefix late?).
//! - `route_batch`: several routing queries placed together, in one round trip.
//! - `route_thread`: the route path's own thread and NATS connection (routes,
//!   lifecycle, replica sync), so a query and its reply never cross threads.
//! - `lifecycle`: prefill-done / keep-alive / freed messages from frontends.
//! - `admission`: book now or wait in the queue; release waiters; expire requests.
//! - `queue`: the bounded FCFS wait queue for when every worker is busy.
//! - `replicas`: this replica's side of sequence sync (its outbox, its own
//!   bookings), which admission holds; `replica_sync`: applying peers' bookings,
//!   and the start-up snapshot in which a starting replica learns them.
//! - `state`: the parts of the daemon bundled (indexer, admission, counters, health).
//! - `metrics`: every Prometheus metric, and the one way to create them
//!   (`metrics::registrar`); [`counters`] (per-message counters, the root of the
//!   metric groups) is re-exported at the crate root.
//! - `health`: liveness and readiness state.
//! - `http`: `/metrics`, `/health/livez`, `/health/readyz`, `/debug/workers`.
//! - `directory`: registered workers with their etcd leases.
//! - `nats`: NATS connection events and subscription draining (the connection
//!   options are `kv_cluster::nats`).
//! - [`probe`]: `kv-router probe`, a health check client for containers.
//!
//! # Public surface
//! The modules are private: the binary needs [`run`], [`config`] and [`probe`]; the
//! end-to-end tests start a [`Daemon`] and read its state; the fuzz harness drives
//! the message [`handlers`] without a NATS connection. Everything else is
//! `pub(crate)`, so a change inside the daemon breaks no other crate.

// A `pub` item no other crate can reach is `pub(crate)`, so `pub` means public.
#![warn(unreachable_pub)]

mod admission;
mod block_size;
pub mod config;
mod daemon;
mod directory;
mod discovery;
mod durability;
mod expiry;
mod gate;
mod health;
mod http;
mod intake;
mod lifecycle;
mod metrics;
mod nats;
mod overlap;
pub mod probe;
mod publishers;
mod queue;
mod recovery_status;
mod removals;
mod replica_sync;
mod replicas;
mod route;
mod route_batch;
mod route_thread;
mod service;
mod startup;
mod state;
#[cfg(test)]
mod test_state;

pub use admission::Origin;
pub use block_size::BlockSizeSource;
pub use config::{DaemonConfig, ServeArgs};
pub use daemon::{Daemon, Starting, run};
pub use directory::DirectoryEntry;
pub use durability::jetstream::{JetStreamError, JetStreamPath};
pub use health::Phase;
pub use http::workers::workers_view;
pub use metrics::counters;
pub use state::RouterState;

/// The handler of every message the daemon takes from the network, each a step from
/// bytes to state with no NATS connection: public so that the fuzz harness
/// (`kv-fuzz`) and the tests drive them directly.
pub mod handlers {
    pub use crate::admission::{Admission, AdmissionConfig};
    pub use crate::durability::jetstream::StoredSnapshot;
    pub use crate::intake::{decode_events, handle_metrics};
    pub use crate::lifecycle::handle_lifecycle;
    pub use crate::metrics::admission::AdmissionMetrics;
    pub use crate::replica_sync::snapshot::{SnapshotSummary, apply_reply};
    pub use crate::replica_sync::sync::handle_sync;
    pub use crate::replicas::ReplicaConfig;
    pub use crate::route::{handle_route, schedule_request};
    pub use kv_cluster::metrics as registrar;
}
