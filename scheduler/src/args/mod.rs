//! The scheduler's command-line flags, declared once (feature `clap`) and flattened
//! wherever a scheduler runs: into `kv-router serve` (whose config file and
//! environment layering reads them through clap like any other flag) and into the
//! routing-quality lab, so a knob has one name, one default and one help text.
//!
//! Each group turns into its part of [`SchedulerConfig`]; [`SchedulerArgs::to_config`]
//! assembles and validates the whole. A knob given for a policy that does not have it
//! is an error naming the flag ([`SchedulerError::InvalidFlag`]).
//!
//! # Layout
//! - `policy`: the policy and every policy's knobs.
//! - `liveness`, `calibration`, `sessions`, `disaggregation`: one group
//!   each, beside their scheduler module.

mod calibration;
mod disaggregation;
mod liveness;
mod policy;
mod sessions;

pub use calibration::CalibrationArgs;
pub use disaggregation::DisaggregationArgs;
pub use liveness::LivenessArgs;
pub use policy::{
    CacheAwareArgs, DelayCapArgs, KvArgs, KvNormalizedArgs, PolicyArgs, PredictedTtftArgs,
    ReuseCreditArgs,
};
pub use sessions::{SessionArgs, SessionTuningArgs};

use crate::{
    BusyThresholds, PrefillDurationModel, SchedulerConfig, SchedulerError, SequencesConfig,
    Threshold,
};
use clap::{ArgAction, Args};
use std::time::Duration;

/// Every scheduler flag: the policy and its knobs, liveness, calibration, sessions,
/// disaggregation, booked-load accounting and busy thresholds.
#[derive(Debug, Clone, Args)]
pub struct SchedulerArgs {
    /// The default policy and its knobs.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Liveness from silence in the engines' load metrics.
    #[command(flatten)]
    pub liveness: LivenessArgs,
    /// Online calibration of `predicted-ttft`'s step-time constants.
    #[command(flatten)]
    pub calibration: CalibrationArgs,
    /// Session affinity for requests with a session id.
    #[command(flatten)]
    pub sessions: SessionArgs,
    /// Conditional disaggregation's thresholds.
    #[command(flatten)]
    pub disaggregation: DisaggregationArgs,
    /// Count prefix blocks shared by concurrent requests on one rank once (engines
    /// with prefix sharing during decode); false counts every request's blocks.
    #[arg(long, env = "KV_ROUTER_ASSUME_KV_REUSE", default_value_t = true, action = ArgAction::Set)]
    pub assume_kv_reuse: bool,
    /// Drop a booked request after this many milliseconds without a lifecycle
    /// message (prefill_done, keep_alive, freed).
    #[arg(long, env = "KV_ROUTER_REQUEST_TTL_MS", default_value_t = 600_000)]
    pub request_ttl_ms: u64,
    /// Prefill speed of one rank, tokens per second; when set, the oldest in-flight
    /// prefill of a rank decays linearly over its expected duration.
    #[arg(
        long,
        env = "KV_ROUTER_PREFILL_TOKENS_PER_SECOND",
        allow_negative_numbers = true
    )]
    pub prefill_tokens_per_second: Option<f64>,
    /// A rank is busy at this many active decode blocks (`1500`) or this share of its
    /// KV blocks (`90%`).
    #[arg(long, env = "KV_ROUTER_BUSY_DECODE_BLOCKS")]
    pub busy_decode_blocks: Option<Threshold>,
    /// A rank is busy at this many in-flight prefill tokens (`8192`) or this share of
    /// its KV capacity in tokens (`10%`).
    #[arg(long, env = "KV_ROUTER_BUSY_PREFILL_TOKENS")]
    pub busy_prefill_tokens: Option<Threshold>,
}

impl SchedulerArgs {
    /// The validated scheduler configuration these flags describe.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidFlag`] naming a flag given for a policy that lacks
    /// it, or `--request-ttl-ms` 0; [`SchedulerError::InvalidConfig`] naming the
    /// first field out of range.
    pub fn to_config(&self) -> Result<SchedulerConfig, SchedulerError> {
        if self.request_ttl_ms == 0 {
            return Err(SchedulerError::InvalidFlag {
                flag: "request-ttl-ms",
                reason: "must be at least 1 ms".into(),
            });
        }
        let config = SchedulerConfig {
            policy: self.policy.policy_config()?,
            sequences: SequencesConfig {
                assume_kv_reuse: self.assume_kv_reuse,
                request_ttl: Duration::from_millis(self.request_ttl_ms),
            },
            busy: BusyThresholds {
                decode_blocks: self.busy_decode_blocks,
                prefill_tokens: self.busy_prefill_tokens,
            },
            prefill_duration: match self.prefill_tokens_per_second {
                None => PrefillDurationModel::Unknown,
                Some(tokens_per_second) => PrefillDurationModel::Throughput { tokens_per_second },
            },
            liveness: self.liveness.to_config(),
            calibration: self.calibration.to_config(),
            sessions: self.sessions.to_config(),
            disaggregation: self.disaggregation.to_config(),
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
