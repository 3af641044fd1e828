//! The flags of `kv-mocker engines`, one group per concern, each declared where
//! its concern lives; the service (`service`) takes them whole.

use super::config::{ConnectionArgs, FleetArgs, RuntimeArgs};
use super::disaggregation::EngineDisaggregationArgs;
use super::http::EngineHttpArgs;
use super::vllm::KvEventsArgs;
use engine_model::{CpuTierConfig, EngineModelConfig, HybridConfig};

/// Flags of `kv-mocker engines`: M mock workers with ids `first-worker-id ..
/// first-worker-id + M`, each with `dp-size` ranks of the engine model.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// NATS URL, etcd endpoints and namespace.
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// How many workers, their ids and dp size.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// The engine model of every rank (block size, cache size, batch limits).
    #[command(flatten)]
    pub model: EngineModelConfig,
    /// The CPU tier of every rank (off by default).
    #[command(flatten)]
    pub cpu_tier: CpuTierConfig,
    /// Sliding-window KV cache groups of every rank (a hybrid-attention model; off
    /// by default).
    #[command(flatten)]
    pub hybrid: HybridConfig,
    /// Time scale, lease TTL and metrics interval.
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// The per-worker OpenAI HTTP servers (address, model directory).
    #[command(flatten)]
    pub http: EngineHttpArgs,
    /// Where KV events go: NATS, or vLLM's ZMQ wire for `kv-router relay`.
    #[command(flatten)]
    pub kv_events: KvEventsArgs,
    /// The workers' role in a disaggregated fleet (default: aggregated), the KV
    /// transfer's cost and the SGLang decode's bootstrap wait.
    #[command(flatten)]
    pub disaggregation: EngineDisaggregationArgs,
}
