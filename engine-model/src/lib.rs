//! The mock engine's model: a vLLM-like engine of one dp rank — the paged KV cache
//! (GPU tier and an optional CPU tier) with prefix reuse and LRU eviction, request
//! validation, continuous batching with chunked prefill, and the step-time model —
//! plus the Mooncake traces that drive it.
//!
//! Why a crate of its own: the model is pure and synchronous (no clock, no I/O, no
//! async runtime), and two very different drivers share it. The engine service in
//! `mocker` runs it in (scaled) real time behind NATS, etcd and HTTP, publishing the
//! KV events each step returns; the offline lab (`kv-lab`) advances a simulated clock
//! by each step's duration. Keeping the model apart means the lab does not link the
//! service's network stack and the service does not link the lab's router and charts,
//! and the model's behaviour is the same in both by construction. Nothing here
//! allocates beyond the cache's own bookkeeping; costs are given per module.
//!
//! The model (cache, batching, timing, event rules) is documented in
//! `docs/engine-model.md`.
//!
//! # Layout
//! - `config`: the model's knobs ([`EngineModelConfig`], [`CpuTierConfig`],
//!   [`KvTransferConfig`]).
//! - `timing`: the step-duration model ([`TimingModel`]).
//! - `kv_cache`: the paged KV cache of one dp rank and its KV events ([`KvCache`]).
//! - [`hybrid`]: hybrid attention, sliding-window KV cache groups beside the
//!   full-attention group ([`HybridConfig`], [`HybridCache`]); `cache`: the rank's
//!   cache of either kind ([`PagedCache`]).
//! - `request`: request validation and per-request progress ([`EngineRequest`]).
//! - `core`: [`EngineCore`], the continuous-batching state machine of one dp rank.
//! - `stats`: [`LatencyStats`] and [`LatencyHistogram`], the latency summary the replay
//!   and the lab report; `table`: [`render_table`], the terminal table both print.
//! - [`trace`]: Mooncake JSONL trace loading and the trace-block → engine-block
//!   mapping shared by the online replay and the lab.

mod cache;
mod config;
mod core;
pub mod hybrid;
mod kv_cache;
mod request;
mod stats;
mod table;
#[cfg(test)]
mod test_support;
mod timing;
pub mod trace;

pub use self::cache::PagedCache;
pub use self::config::{
    CpuTierConfig, DEFAULT_BLOCK_SIZE, DEFAULT_CPU_TIER_LOAD_MS_PER_TOKEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_GPU_BLOCKS,
    DEFAULT_TRANSFER_MS_PER_TOKEN, EngineModelConfig, KvTransferConfig, ModelConfigError,
};
pub use self::core::{ClearError, EngineCore, Finished, FirstToken, StepOutput};
pub use self::hybrid::{
    DEFAULT_SLIDING_WINDOW, GroupStore, HybridCache, HybridConfig, HybridHit,
    MAX_SLIDING_WINDOW_GROUPS, WindowRetention,
};
pub use self::kv_cache::{Allocation, CacheInUse, KvCache, chain_block_hashes, engine_block_hash};
pub use self::request::{EngineRequest, RejectReason};
pub use self::stats::{LatencyHistogram, LatencyStats};
pub use self::table::render_table;
pub use self::timing::{StepWork, TimingModel};
