//! The engine model's knobs, per dp rank: the KV cache and batch shape
//! ([`EngineModelConfig`]), the optional CPU tier ([`CpuTierConfig`]) and the KV
//! transfer of a disaggregated decode worker ([`KvTransferConfig`]).
//!
//! Each group is a `clap::Args` struct so `kv-mocker engines` and the lab keep flat
//! flags (the groups are flattened into their arguments), while library users — the
//! quickstart, integration tests and the offline simulator — build the same structs
//! directly (every group implements `Default` with the CLI defaults). Validation is
//! explicit ([`EngineModelConfig::validate`], [`CpuTierConfig::validate`]) and cheap.

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
/// (see [`crate::TimingModel::H100_8B`]); a PCIe Gen4 x16 link moves ~25 GB/s in
/// practice (half of Gen5's), so one token takes 131,072 B / 25 GB/s ≈ 5.2 µs. This
/// is the scheduler's `tier_load_ms_per_token` default, 12× cheaper than prefilling
/// the token (0.06 ms).
pub const DEFAULT_CPU_TIER_LOAD_MS_PER_TOKEN: f64 = 0.005;
/// Default `--transfer-ms-per-token`, in ms per token: pulling one token's KV from a
/// prefill worker over the KV transfer (vLLM's NIXL, SGLang's Mooncake or NIXL
/// backend), GPU to GPU over RDMA. Llama-3-8B holds 128 KiB of KV per token (see
/// [`crate::TimingModel::H100_8B`]); an H100 node has one 400 Gb/s NIC per GPU
/// (50 GB/s line rate), of which a NIXL/UCX read of multi-megabyte blocks achieves
/// about 40 GB/s, so one token takes 131,072 B / 40 GB/s ≈ 3.3 µs: 18× cheaper than
/// prefilling it (0.06 ms), 1.5× cheaper than a PCIe reload from the CPU tier. A
/// transfer moves whole blocks, the prompt's last partial block too: vLLM's decode
/// instance read 688,128 bytes over NIXL for a 649-token prompt of a tiny random
/// model (issue 27's measurement), no whole multiple of 649 tokens.
pub const DEFAULT_TRANSFER_MS_PER_TOKEN: f64 = 0.0033;

/// Why an engine model configuration is unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelConfigError {
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
    /// `--cpu-tier-load-ms-per-token` was negative or not finite.
    #[error("cpu tier load time must be finite and >= 0 ms per token, got {0}")]
    BadCpuTierLoad(f64),
    /// `--transfer-ms-per-token` was negative or not finite.
    #[error("kv transfer time must be finite and >= 0 ms per token, got {0}")]
    BadTransferTime(f64),
    /// `--sliding-window` was below 2 tokens (a hit would need no window block).
    #[error("sliding window must be at least 2 tokens, got {0}")]
    SlidingWindowTooShort(u32),
    /// `--sliding-window-groups` was past [`crate::MAX_SLIDING_WINDOW_GROUPS`].
    #[error("at most {max} sliding-window groups, got {0}", max = crate::MAX_SLIDING_WINDOW_GROUPS)]
    TooManySlidingWindowGroups(u32),
    /// Sliding-window groups and a CPU tier together: the mock offloads only a
    /// dense model's blocks.
    #[error("sliding-window groups cannot be combined with a cpu tier")]
    HybridWithCpuTier,
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
    /// [`ModelConfigError`] naming the first bad knob.
    pub fn validate(&self) -> Result<(), ModelConfigError> {
        if self.block_size == 0 {
            return Err(ModelConfigError::ZeroBlockSize);
        }
        if self.num_gpu_blocks == 0 {
            return Err(ModelConfigError::ZeroGpuBlocks);
        }
        if self.max_num_seqs == 0 {
            return Err(ModelConfigError::ZeroMaxNumSeqs);
        }
        if self.max_num_batched_tokens < u64::from(self.max_num_seqs) {
            return Err(ModelConfigError::BudgetBelowMaxNumSeqs {
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
/// without this group. See the KV cache (`kv_cache`) for the events.
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
    /// [`ModelConfigError::BadCpuTierLoad`] for a negative or non-finite load time.
    pub fn validate(&self) -> Result<(), ModelConfigError> {
        let load = self.cpu_tier_load_ms_per_token;
        if !(load.is_finite() && load >= 0.0) {
            return Err(ModelConfigError::BadCpuTierLoad(load));
        }
        Ok(())
    }
}

/// The KV transfer of a decode worker in a disaggregated fleet: the prompt blocks it
/// does not cache are pulled from the prefill worker instead of prefilled, at this
/// cost (see [`crate::EngineCore::transfer_blocks`]).
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct KvTransferConfig {
    /// Time to pull one token's KV from a prefill worker over the KV transfer, in ms
    /// per token; charged for every whole block a decode worker pulls, before it
    /// admits the request (default: 128 KiB per token at 40 GB/s, a 400 Gb/s RDMA
    /// NIC).
    #[arg(long, default_value_t = DEFAULT_TRANSFER_MS_PER_TOKEN)]
    pub transfer_ms_per_token: f64,
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        Self {
            transfer_ms_per_token: DEFAULT_TRANSFER_MS_PER_TOKEN,
        }
    }
}

impl KvTransferConfig {
    /// Checks the transfer time.
    ///
    /// # Errors
    /// [`ModelConfigError::BadTransferTime`] for a negative or non-finite time.
    pub fn validate(&self) -> Result<(), ModelConfigError> {
        let t = self.transfer_ms_per_token;
        if !(t.is_finite() && t >= 0.0) {
            return Err(ModelConfigError::BadTransferTime(t));
        }
        Ok(())
    }

    /// Time to pull `blocks` whole blocks of `block_size` tokens, in model ms.
    pub fn duration_ms(&self, blocks: u64, block_size: u32) -> f64 {
        self.transfer_ms_per_token * (blocks * u64::from(block_size)) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(EngineModelConfig::default().validate(), Ok(()));
        assert_eq!(CpuTierConfig::default().validate(), Ok(()));
        assert_eq!(KvTransferConfig::default().validate(), Ok(()));
        // 64 blocks of 16 tokens (1,024 tokens) at the default: about 3.4 ms.
        let ms = KvTransferConfig::default().duration_ms(64, 16);
        assert!((ms - 1_024.0 * DEFAULT_TRANSFER_MS_PER_TOKEN).abs() < 1e-9);
    }

    #[test]
    fn bad_knobs_are_named() {
        let m = EngineModelConfig::default();
        assert_eq!(
            EngineModelConfig { block_size: 0, ..m }.validate(),
            Err(ModelConfigError::ZeroBlockSize)
        );
        assert!(matches!(
            EngineModelConfig {
                max_num_batched_tokens: 10,
                ..m
            }
            .validate(),
            Err(ModelConfigError::BudgetBelowMaxNumSeqs { .. })
        ));
        assert_eq!(
            CpuTierConfig {
                cpu_tier_load_ms_per_token: -1.0,
                ..CpuTierConfig::default()
            }
            .validate(),
            Err(ModelConfigError::BadCpuTierLoad(-1.0))
        );
        let nan = KvTransferConfig {
            transfer_ms_per_token: f64::NAN,
        };
        assert!(matches!(
            nan.validate(),
            Err(ModelConfigError::BadTransferTime(_))
        ));
    }
}
