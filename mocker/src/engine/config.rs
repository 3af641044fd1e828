//! Typed configuration of the mock engines, grouped by concern.
//!
//! Each group is a `clap::Args` struct so `kv-mocker engines` keeps flat flags (the
//! groups are flattened into [`super::EngineArgs`]), while library users — the
//! quickstart, integration tests and an offline simulator — build the same structs
//! directly (every group implements `Default` with the CLI defaults). Validation is
//! explicit ([`EngineModelConfig::validate`], [`RuntimeArgs::validate`]) and cheap.

use kv_cluster::args::{EtcdArgs, NatsArgs};
use kv_events::{Namespace, WorkerId};
use std::time::Duration;

/// Default `--block-size`, in tokens.
pub const DEFAULT_BLOCK_SIZE: u32 = 64;
/// Default `--num-gpu-blocks`, in blocks per dp rank.
pub const DEFAULT_NUM_GPU_BLOCKS: u64 = 16_384;
/// Default `--max-num-seqs`, in requests per dp rank.
pub const DEFAULT_MAX_NUM_SEQS: u32 = 256;
/// Default `--max-num-batched-tokens`, in tokens per step.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: u64 = 8_192;
/// Default `--cpu-tier-load-ms-per-token`, in ms per token: copying one token's KV
/// back from pinned host memory over PCIe. Llama-3-8B holds 128 KiB of KV per token
/// (see [`super::TimingModel::H100_8B`]); a PCIe Gen4 x16 link moves ~25 GB/s in
/// practice (half of Gen5's), so one token takes 131,072 B / 25 GB/s ≈ 5.2 µs. This
/// is the scheduler's `tier_load_ms_per_token` default, 12× cheaper than prefilling
/// the token (0.06 ms).
pub const DEFAULT_CPU_TIER_LOAD_MS_PER_TOKEN: f64 = 0.005;

/// Why an engine configuration is unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// `block_size` was 0.
    #[error("block size must be at least 1 token")]
    ZeroBlockSize,
    /// `num_gpu_blocks` was 0.
    #[error("num gpu blocks must be at least 1")]
    ZeroGpuBlocks,
    /// `max_num_seqs` was 0.
    #[error("max num seqs must be at least 1")]
    ZeroMaxNumSeqs,
    /// The step token budget cannot give every running request its decode token.
    #[error(
        "max num batched tokens ({max_num_batched_tokens}) must be at least max num seqs ({max_num_seqs})"
    )]
    BudgetBelowMaxNumSeqs {
        /// The configured per-step token budget, in tokens.
        max_num_batched_tokens: u64,
        /// The configured batch size, in requests.
        max_num_seqs: u32,
    },
    /// `workers` was 0.
    #[error("at least one worker is required")]
    NoWorkers,
    /// `dp_size` was 0.
    #[error("dp size must be at least 1")]
    ZeroDpSize,
    /// Worker ids `first..first + workers` overflow `u64`.
    #[error("worker ids starting at {first} overflow with {workers} workers")]
    WorkerIdOverflow {
        /// The first worker id.
        first: u64,
        /// The number of workers.
        workers: u32,
    },
    /// `time_scale` was not a positive finite number.
    #[error("time scale must be positive and finite, got {0}")]
    BadTimeScale(f64),
    /// `lease_ttl_secs` was below the 2 s needed to renew at a third of it.
    #[error("lease ttl must be at least 2 seconds, got {0}")]
    LeaseTtlTooShort(u64),
    /// `metrics_interval_ms` was 0.
    #[error("metrics interval must be at least 1 ms")]
    ZeroMetricsInterval,
    /// `--zmq-port` or `--zmq-replay-port` + socket offset passes 65535.
    #[error("zmq port {base} + {offset} is past 65535")]
    ZmqPortOverflow {
        /// The base port.
        base: u16,
        /// Worker index × dp size + rank.
        offset: u64,
    },
    /// `--zmq-buffer-steps` was 0.
    #[error("zmq buffer steps must be at least 1")]
    ZeroBufferSteps,
    /// `--cpu-tier-load-ms-per-token` was negative or not finite.
    #[error("cpu tier load time must be finite and >= 0 ms per token, got {0}")]
    BadCpuTierLoad(f64),
    /// `--http-port` + worker index overflows a port number.
    #[error("http port {base} + {workers} workers is past 65535")]
    HttpPortOverflow {
        /// The base port.
        base: u16,
        /// Workers needing a port.
        workers: usize,
    },
}

/// The engine model's knobs (per dp rank), shared by the live engines and offline
/// simulation. Names follow vLLM's engine arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct EngineModelConfig {
    /// Tokens per KV block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: u32,
    /// KV cache capacity of each dp rank, in blocks.
    #[arg(long, default_value_t = DEFAULT_NUM_GPU_BLOCKS)]
    pub num_gpu_blocks: u64,
    /// Maximum requests in one dp rank's running batch.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_SEQS)]
    pub max_num_seqs: u32,
    /// Per-step token budget shared by decodes (1 token each) and prefill chunks, in
    /// tokens; must be at least `max_num_seqs`.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: u64,
}

impl Default for EngineModelConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            num_gpu_blocks: DEFAULT_NUM_GPU_BLOCKS,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
        }
    }
}

impl EngineModelConfig {
    /// Checks that every knob is usable.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad knob.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        if self.num_gpu_blocks == 0 {
            return Err(ConfigError::ZeroGpuBlocks);
        }
        if self.max_num_seqs == 0 {
            return Err(ConfigError::ZeroMaxNumSeqs);
        }
        if self.max_num_batched_tokens < u64::from(self.max_num_seqs) {
            return Err(ConfigError::BudgetBelowMaxNumSeqs {
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_num_seqs: self.max_num_seqs,
            });
        }
        Ok(())
    }
}

/// The CPU tier of each dp rank (vLLM's CPU KV offloading): blocks evicted from the
/// GPU cache are kept in host memory, with their own capacity and LRU, and a request
/// whose prefix continues there copies them back instead of prefilling them.
/// `cpu_tier_blocks = 0` (the default) is no CPU tier: the engine behaves exactly as
/// without this group. See [`super::kv_cache`] for the events.
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct CpuTierConfig {
    /// Blocks the CPU tier of each dp rank holds (0 = no CPU tier).
    #[arg(long, default_value_t = 0)]
    pub cpu_tier_blocks: u64,
    /// Time to copy one token's KV from the CPU tier back to the GPU, in ms per
    /// token; charged to the step that admits the request.
    #[arg(long, default_value_t = DEFAULT_CPU_TIER_LOAD_MS_PER_TOKEN)]
    pub cpu_tier_load_ms_per_token: f64,
}

impl Default for CpuTierConfig {
    /// No CPU tier; the default load time.
    fn default() -> Self {
        Self {
            cpu_tier_blocks: 0,
            cpu_tier_load_ms_per_token: DEFAULT_CPU_TIER_LOAD_MS_PER_TOKEN,
        }
    }
}

impl CpuTierConfig {
    /// Checks the load time.
    ///
    /// # Errors
    /// [`ConfigError::BadCpuTierLoad`] for a negative or non-finite load time.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let load = self.cpu_tier_load_ms_per_token;
        if !(load.is_finite() && load >= 0.0) {
            return Err(ConfigError::BadCpuTierLoad(load));
        }
        Ok(())
    }
}

/// Where the engines find NATS and etcd, and the namespace they serve: the NATS and
/// etcd flags (authentication, TLS) of every kv-router participant.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectionArgs {
    /// NATS servers, authentication and TLS.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// etcd endpoints, authentication and TLS.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Namespace of subjects and etcd keys (1-64 characters of `[A-Za-z0-9_-]`).
    #[arg(long, default_value = "kv-router")]
    pub namespace: Namespace,
}

/// Which workers this process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct FleetArgs {
    /// Number of mock workers M in this process.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Worker id of the first worker; workers get ids `first .. first + M`.
    #[arg(long, default_value_t = 1)]
    pub first_worker_id: u64,
    /// Data-parallel ranks per worker; each rank has its own KV cache and batch.
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
}

impl Default for FleetArgs {
    fn default() -> Self {
        Self {
            workers: 4,
            first_worker_id: 1,
            dp_size: 1,
        }
    }
}

impl FleetArgs {
    /// The worker ids, in order.
    ///
    /// # Errors
    /// [`ConfigError`] for zero workers, zero dp ranks or an id overflow.
    pub fn worker_ids(&self) -> Result<Vec<WorkerId>, ConfigError> {
        if self.workers == 0 {
            return Err(ConfigError::NoWorkers);
        }
        if self.dp_size == 0 {
            return Err(ConfigError::ZeroDpSize);
        }
        let overflow = ConfigError::WorkerIdOverflow {
            first: self.first_worker_id,
            workers: self.workers,
        };
        self.first_worker_id
            .checked_add(u64::from(self.workers) - 1)
            .ok_or(overflow)?;
        Ok((0..u64::from(self.workers))
            .map(|i| WorkerId(self.first_worker_id + i))
            .collect())
    }
}

/// How the service paces itself against the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct RuntimeArgs {
    /// Model time runs this many times faster than wall-clock time: a step of `t` model
    /// ms takes `t / time_scale` wall ms.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// TTL of each worker's etcd lease, in seconds (renewed every TTL/3).
    #[arg(long, default_value_t = 10)]
    pub lease_ttl_secs: u64,
    /// Period of load-metrics publication, in wall-clock ms (not scaled by
    /// `time_scale`: it is about router freshness, which is wall-clock).
    #[arg(long, default_value_t = 100)]
    pub metrics_interval_ms: u64,
    /// Budget of the whole shutdown (`--shutdown-timeout-ms`, as `kv-router serve`).
    #[command(flatten)]
    pub shutdown: kv_cluster::shutdown::ShutdownArgs,
}

impl Default for RuntimeArgs {
    fn default() -> Self {
        Self {
            time_scale: 1.0,
            lease_ttl_secs: 10,
            metrics_interval_ms: 100,
            shutdown: Default::default(),
        }
    }
}

impl RuntimeArgs {
    /// Checks the pacing knobs.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad knob.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(ConfigError::BadTimeScale(self.time_scale));
        }
        if self.lease_ttl_secs < 2 {
            return Err(ConfigError::LeaseTtlTooShort(self.lease_ttl_secs));
        }
        if self.metrics_interval_ms == 0 {
            return Err(ConfigError::ZeroMetricsInterval);
        }
        Ok(())
    }

    /// Wall-clock duration of `model_ms` model milliseconds.
    pub fn wall_duration(&self, model_ms: f64) -> Duration {
        Duration::from_secs_f64((model_ms / self.time_scale / 1_000.0).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(EngineModelConfig::default().validate(), Ok(()));
        assert_eq!(RuntimeArgs::default().validate(), Ok(()));
        assert_eq!(CpuTierConfig::default().validate(), Ok(()));
        assert_eq!(
            FleetArgs::default().worker_ids(),
            Ok(vec![WorkerId(1), WorkerId(2), WorkerId(3), WorkerId(4)])
        );
    }

    #[test]
    fn bad_knobs_are_named() {
        let m = EngineModelConfig::default();
        assert_eq!(
            EngineModelConfig { block_size: 0, ..m }.validate(),
            Err(ConfigError::ZeroBlockSize)
        );
        assert!(matches!(
            EngineModelConfig {
                max_num_batched_tokens: 10,
                ..m
            }
            .validate(),
            Err(ConfigError::BudgetBelowMaxNumSeqs { .. })
        ));
        assert_eq!(
            CpuTierConfig {
                cpu_tier_load_ms_per_token: -1.0,
                ..CpuTierConfig::default()
            }
            .validate(),
            Err(ConfigError::BadCpuTierLoad(-1.0))
        );
        let r = RuntimeArgs::default();
        assert!(
            RuntimeArgs {
                time_scale: 0.0,
                ..r
            }
            .validate()
            .is_err()
        );
        assert!(
            RuntimeArgs {
                time_scale: f64::NAN,
                ..r
            }
            .validate()
            .is_err()
        );
        let f = FleetArgs {
            workers: 2,
            first_worker_id: u64::MAX,
            dp_size: 1,
        };
        assert!(matches!(
            f.worker_ids(),
            Err(ConfigError::WorkerIdOverflow { .. })
        ));
    }

    #[test]
    fn time_scale_shrinks_wall_time() {
        let r = RuntimeArgs {
            time_scale: 4.0,
            ..RuntimeArgs::default()
        };
        assert_eq!(r.wall_duration(100.0), Duration::from_millis(25));
    }
}
