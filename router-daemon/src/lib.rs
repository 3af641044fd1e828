//! The kv-router daemon: it consumes KV events and load metrics from NATS into the
//! sharded indexer, discovers workers through etcd leases, and answers routing queries
//! on a NATS queue group with the scheduler's choice.
//!
//! The `kv-router` binary (crate `kv-router`) is a thin shell over [`run`] and
//! [`Daemon`]; this library does not depend on the relay or the gateway. Tests run
//! the same code in-process against real nats-server and etcd processes and drive
//! shutdown through a [`tokio_util::sync::CancellationToken`].
//!
//! # Layout
//! - [`barrier`]: a NATS round trip proving our subscriptions are registered,
//!   re-published until it arrives (NATS clusters), with a deadline.
//! - [`block_size`]: the tokens per block, pinned by `--block-size` or adopted from
//!   the registrations (and why replicas agree on it).
//! - [`config`]: every `serve` setting (flags, environment, TOML file, `config print`),
//!   validated once into typed sub-configs: scheduling, policy and index flag groups.
//! - [`daemon`]: start-up and the shutdown order (stop intake → drain shards → close).
//! - [`startup`]: the start-up step under way, and warnings while a start is slow.
//! - [`discovery`]: applies the etcd worker directory (`kv_cluster::directory`) to
//!   the scheduler, the indexer and `/debug/workers`.
//! - [`durability`]: gap recovery from publishers, start-up resync, the optional
//!   JetStream snapshot path.
//! - [`intake`]: KV event and load-metric subscriptions feeding indexer and scheduler.
//! - [`route`]: the routing request-reply service.
//! - [`route_batch`]: several routing queries placed together, in one round trip.
//! - [`lifecycle`]: prefill-done / keep-alive / freed messages from frontends.
//! - [`admission`]: book now or wait in the queue; release waiters; expire requests.
//! - [`queue`]: the bounded FCFS wait queue for when every worker is busy.
//! - [`replicas`]: sequence sync of booked load between router replicas, and the
//!   start-up snapshot in which a starting replica learns the bookings its peers hold.
//! - [`state`]: the parts of the daemon bundled (indexer, admission, counters, health).
//! - [`metrics`]: every Prometheus metric, and the one way to create them
//!   ([`metrics::registrar`]); [`counters`] (per-message counters, the root of the
//!   metric groups) is re-exported at the crate root.
//! - [`health`]: liveness and readiness state.
//! - [`http`]: `/metrics`, `/health/livez`, `/health/readyz`, `/debug/workers`.
//! - [`directory`]: registered workers with their etcd leases.
//! - [`nats`]: NATS connection events and subscription draining (the connection
//!   options are `kv_cluster::nats`).
//! - [`probe`]: `kv-router probe`, a health check client for containers.

pub mod admission;
pub mod barrier;
pub mod block_size;
pub mod config;
pub mod daemon;
pub mod directory;
pub mod discovery;
pub mod durability;
pub mod expiry;
pub mod gate;
pub mod health;
pub mod http;
pub mod intake;
pub mod lifecycle;
pub mod metrics;
pub mod nats;
pub mod probe;
pub mod publishers;
pub mod queue;
pub mod replicas;
pub mod route;
pub mod route_batch;
pub mod startup;
pub mod state;

pub use config::{DaemonConfig, ServeArgs};
pub use daemon::{Daemon, run};
pub use metrics::counters;
