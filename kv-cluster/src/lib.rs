//! Everything a participant needs to join a kv-router cluster: the router daemon,
//! the relay sidecar, the mock engines and the gateway all connect,
//! register and discover through this crate, so they agree on flags, environment
//! variables, credentials, lease timing and reconnect behaviour without depending on
//! each other.
//!
//! It depends only on `kv-events` (subjects, ids, the registration record) and on
//! the NATS, etcd, clap, tracing and HTTP (axum, hyper, reqwest) crates; it holds no router
//! state.
//!
//! # Layout
//! - [`args`]: the NATS and etcd flags (with `KV_ROUTER_NATS_*` / `KV_ROUTER_ETCD_*`
//!   variables) and their validation; [`args::parse_flags`] for embedding and tests;
//!   a worker's role in a disaggregated fleet ([`args::DisaggregationArgs`]).
//! - [`barrier`]: a NATS round trip proving a connection's subscriptions are
//!   registered, re-published until it arrives (NATS clusters), with a deadline.
//! - [`nats`]: NATS seed list, authentication (creds, token, user/password) and TLS,
//!   turned into connect options.
//! - [`etcd`]: etcd connection settings (TLS, user and password), the client, and the
//!   retry schedule ([`etcd::retry_delays`]).
//! - [`limits`]: the `Limits` flags, the bounds on messages and registrations.
//! - [`lease`]: a worker's registration under an etcd lease (register, keep alive,
//!   revoke).
//! - [`claim`]: a worker id claimed in etcd (derived from a stable name or given),
//!   unique in the namespace, held under a lease for the life of the process.
//! - [`directory`]: the worker directory: load the registrations, then watch them,
//!   reconnecting and reconciling after an outage.
//! - [`metrics`]: the one way every binary creates its Prometheus metrics, in an
//!   injected registry or none ([`metrics::Registrar`]).
//! - [`process`]: tracing set-up and the shutdown signal of every binary.
//! - [`shutdown`]: the shutdown budget (`--shutdown-timeout-ms`): one deadline for a
//!   whole shutdown sequence, so no step can hang it when NATS or etcd are gone.
//! - [`http`]: the listen-address flag value, the bounded HTTP server every
//!   participant serves with, the bounded reqwest client side, and the Prometheus
//!   text reader.
//! - [`security`]: the NATS permissions of each role (router, worker, frontend,
//!   operator), rendered as nats-server configuration.
//! - [`Error`]: the crate's one error type.

pub mod args;
pub mod barrier;
pub mod claim;
pub mod directory;
mod error;
pub mod etcd;
pub mod http;
pub mod lease;
pub mod limits;
pub mod metrics;
pub mod nats;
pub mod process;
pub mod security;
pub mod shutdown;

pub use error::Error;
