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
//! - [`config_file`]: the TOML file under environment and flags; `config print`.
//! - [`connection_args`]: the NATS and etcd flags, shared by `serve` and `relay`.
//! - [`daemon`]: start-up and the shutdown order (stop intake → drain shards → close).
//! - [`discovery`]: etcd worker registrations: initial load, then a watch.
//! - [`durability`]: gap recovery from publishers, start-up resync, the optional
//!   JetStream snapshot path, and the index flags (backend, memory bound, mode).
//! - [`intake`]: KV event and load-metric subscriptions feeding indexer and scheduler.
//! - [`route`]: the routing request-reply service.
//! - [`route_batch`]: several routing queries placed together, in one round trip.
//! - [`lifecycle`]: prefill-done / keep-alive / freed messages from frontends.
//! - [`admission`]: book now or wait in the queue; release waiters; expire requests.
//! - [`queue`]: the bounded FCFS wait queue for when every worker is busy.
//! - [`replicas`]: sequence sync of booked load between router replicas, and the
//!   start-up snapshot in which a starting replica learns the bookings its peers hold.
//! - [`scheduling_args`]: the scheduling, queue and replica flags of `serve`.
//! - [`policy_args`]: the default policy and each policy's knob flags.
//! - [`state`]: the parts of the daemon bundled (indexer, admission, counters, health).
//! - [`metrics`]: every Prometheus metric, and the one way to create them
//!   ([`metrics::registrar`]); [`counters`] (per-message counters, the root of the
//!   metric groups) is re-exported at the crate root.
//! - [`health`]: liveness and readiness state.
//! - [`http`]: `/metrics`, `/health/livez`, `/health/readyz`, `/debug/workers`.
//! - [`directory`]: registered workers with their etcd leases.
//! - [`nats`]: NATS connection options (cluster, auth, TLS) and connection events.
//! - [`relay`]: `kv-router relay`, the sidecar that feeds vLLM / SGLang KV events in.
//! - [`worker_lease`]: a worker's etcd registration under a lease (relay, mock engines).
//! - [`process`]: logging set-up and the shutdown signal of both binaries.
//! - [`probe`]: `kv-router probe`, a health check client for containers.

pub mod admission;
pub mod barrier;
pub mod config;
pub mod config_file;
pub mod connection_args;
pub mod daemon;
pub mod directory;
pub mod discovery;
pub mod durability;
pub mod health;
pub mod http;
pub mod intake;
pub mod lifecycle;
pub mod metrics;
pub mod nats;
pub mod policy_args;
pub mod probe;
pub mod process;
pub mod queue;
pub mod relay;
pub mod replicas;
pub mod route;
pub mod route_batch;
pub mod scheduling_args;
pub mod state;
pub mod worker_lease;

pub use config::{DaemonConfig, ServeArgs};
pub use daemon::{Daemon, run};
pub use metrics::counters;
