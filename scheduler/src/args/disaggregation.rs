//! The flags of conditional disaggregation: when a request that allows
//! disaggregation is prefilled by its decode worker instead of a prefill worker.
//! What the rule does: `scheduler::disaggregation`.

use crate::DisaggregationConfig;
use clap::Args;

/// Conditional disaggregation flags, flattened into [`super::SchedulerArgs`].
#[derive(Debug, Clone, Args)]
pub struct DisaggregationArgs {
    /// A request that allows disaggregation is prefilled by its decode worker when
    /// at most this many of its prompt tokens are not cached there, in tokens (0:
    /// only fully cached prompts).
    #[arg(
        long,
        env = "KV_ROUTER_DISAGG_MAX_LOCAL_PREFILL_TOKENS",
        default_value_t = 1024
    )]
    pub disagg_max_local_prefill_tokens: u64,
    /// A request that allows disaggregation is prefilled by its decode worker when
    /// that worker already holds at least this fraction of the prompt's blocks, in
    /// [0, 1] (0 turns disaggregation off).
    #[arg(
        long,
        env = "KV_ROUTER_DISAGG_MIN_DECODE_OVERLAP",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    pub disagg_min_decode_overlap: f64,
}

impl DisaggregationArgs {
    /// The scheduler's disaggregation settings (validated with the rest of its
    /// config).
    pub fn to_config(&self) -> DisaggregationConfig {
        DisaggregationConfig {
            max_local_prefill_tokens: self.disagg_max_local_prefill_tokens,
            min_decode_overlap: self.disagg_min_decode_overlap,
        }
    }
}
