//! The flags of online calibration: whether `predicted-ttft` learns each
//! rank's step-time constants from observed TTFTs, and how. What it does:
//! `scheduler::calibration`.

use crate::CalibrationConfig;
use clap::{ArgAction, Args};

/// Calibration flags, flattened into [`super::SchedulerArgs`].
#[derive(Debug, Clone, Args)]
pub struct CalibrationArgs {
    /// Learn each rank's step-time constants (step base, prefill per token, decode)
    /// from its observed routed → prefill_done times and price each rank with its
    /// own (`predicted-ttft` only). On by default; `--calibration false` prices every
    /// rank with the configured constants.
    #[arg(long, env = "KV_ROUTER_CALIBRATION", default_value_t = true, action = ArgAction::Set)]
    pub calibration: bool,
    /// Forgetting factor of the estimator, in (0, 1]; the memory is about
    /// 1 / (1 − factor) samples per rank.
    #[arg(
        long,
        env = "KV_ROUTER_CALIBRATION_FORGETTING",
        default_value_t = 0.995
    )]
    pub calibration_forgetting: f64,
    /// Learned constants stay within this factor of the configured ones (≥ 1).
    #[arg(long, env = "KV_ROUTER_CALIBRATION_MAX_FACTOR", default_value_t = 8.0)]
    pub calibration_max_factor: f64,
    /// An observed TTFT is clipped to within this factor of the prediction before it
    /// updates the estimate (> 1).
    #[arg(
        long,
        env = "KV_ROUTER_CALIBRATION_OUTLIER_RATIO",
        default_value_t = 4.0
    )]
    pub calibration_outlier_ratio: f64,
    /// Observations a rank needs before its own constants are used.
    #[arg(
        long,
        env = "KV_ROUTER_CALIBRATION_WARMUP_SAMPLES",
        default_value_t = 20
    )]
    pub calibration_warmup_samples: u32,
    /// A rank's observed TTFT is learned from only if the request's booking saw at
    /// most this many engine steps of prefill ahead (≥ 1); beyond that the rank is
    /// saturated and its TTFT is queueing the step-time model does not describe.
    #[arg(
        long,
        env = "KV_ROUTER_CALIBRATION_MAX_QUEUE_STEPS",
        default_value_t = 4
    )]
    pub calibration_max_queue_steps: u64,
}

impl CalibrationArgs {
    /// The scheduler's calibration settings (validated with the rest of its config).
    pub fn to_config(&self) -> CalibrationConfig {
        CalibrationConfig {
            enabled: self.calibration,
            forgetting: self.calibration_forgetting,
            max_factor: self.calibration_max_factor,
            outlier_ratio: self.calibration_outlier_ratio,
            warmup_samples: self.calibration_warmup_samples,
            max_queue_steps: self.calibration_max_queue_steps,
        }
    }
}
