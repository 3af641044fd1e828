//! The mock inference engine's service: the NATS/etcd/HTTP process that runs M workers
//! of the `engine_model` crate's vLLM-like engine model.
//!
//! The router needs engines that behave like the real thing where it matters for
//! routing — a finite paged KV cache with prefix reuse and LRU eviction, continuous
//! batching with chunked prefill, and step times that grow with prefill and decode
//! work — and that speak the real wire protocol: KV events, load metrics, etcd leases.
//! The model core (`engine_model`) is pure and synchronous (no clock, no I/O), so the
//! offline lab drives it on a virtual clock; this service drives it in real time, optionally
//! faster than real time (`--time-scale`). One process with M workers costs one NATS
//! connection, one etcd connection, and a few tokio tasks per worker.
//!
//! The model (cache, batching, timing, event rules) is documented in
//! `docs/engine-model.md`.
//!
//! # Layout
//! - `args`: [`EngineArgs`], the flags of `kv-mocker engines`, made of the groups
//!   below.
//! - [`config`]: the service's typed flag groups (connection, fleet, runtime); the
//!   model's own ([`engine_model::EngineModelConfig`], [`engine_model::CpuTierConfig`]) are `engine_model`'s.
//! - [`disaggregation`]: the workers' role (prefill, decode or both), transfer
//!   protocol and transfer cost.
//! - `outbox`: the single ordered publication path to NATS.
//! - `journal`: each worker's KV event journal (event ids, epoch, recovery replies).
//! - `rank`: one live dp rank — the core, its reply inboxes, its real-time loop.
//! - `worker`: one worker's generate / clear intake.
//! - etcd lease registration with keep-alive: `kv_cluster::lease`, shared
//!   with the relay.
//! - `progress`: where a rank sends results — a NATS inbox or an HTTP stream's watch
//!   channel.
//! - [`http`]: the per-worker OpenAI HTTP server (`/v1/completions`, `/tokenize`,
//!   `/v1/models`, `/metrics`).
//! - [`vllm`]: `--kv-events vllm`, the engines as vLLM stand-ins (ZMQ KV events).
//! - `service`: [`spawn_engines`], which wires all of the above.

mod args;
pub mod config;
pub mod disaggregation;
pub mod http;
mod journal;
mod outbox;
mod progress;
mod rank;
mod service;
pub mod vllm;
mod worker;

pub use self::args::EngineArgs;
pub use self::config::{ConnectionArgs, EngineConfigError, FleetArgs, RuntimeArgs};
pub use self::disaggregation::{DisaggregationConfig, EngineDisaggregationArgs};
pub use self::http::EngineHttpArgs;
pub use self::service::{EnginesHandle, READY_LINE, ServiceError, spawn_engines};
pub use self::vllm::{KvEventsArgs, KvEventsMode, RankEndpoints};

use tokio_util::sync::CancellationToken;

/// Runs the engines until `shutdown` is cancelled, then stops them in order (leases
/// revoked, in-flight requests answered with an error, outbox flushed).
///
/// # Errors
/// Start-up failures ([`ServiceError`]: bad flags, NATS or etcd unreachable,
/// registration refused) and panicked engine tasks.
pub async fn run_engines(args: EngineArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    let handle = spawn_engines(args, shutdown).await?;
    handle.wait().await?;
    Ok(())
}
