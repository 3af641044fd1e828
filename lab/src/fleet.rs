//! The engines a lab run simulates, when they differ from what the router assumes:
//! another engine preset ([`EnginePreset`]), a mismatched *shape* of the step-time
//! model (prefill cost per token or step base scaled alone, [`ShapeFactors`]), and
//! per-worker speed ([`WorkerSpeeds`]: a heterogeneous fleet).
//!
//! Why: the router's `predicted-ttft` policy predicts with the step-time constants it
//! is configured with (by default the mock engine's `TimingModel::H100_8B`). When the
//! simulated engines use the very same constants, the lab measures the policy at its
//! best. These knobs change only the *engines*; the router keeps its defaults, so the
//! lab shows what a wrong or uncalibrated model costs (`kv-mocker lab robustness`,
//! [`crate::robustness`]).
//!
//! A uniform scale of every constant (all workers at speed 4, say) is only a change of
//! load: every rank's predicted cost scales alike, so decisions are those of the
//! matched engine at a different arrival rate. Shape factors and mixed speeds are what
//! change the *ranking* of ranks.
//!
//! Cost: per rank, one scaled copy of the timing model (four floats); nothing per step.

use crate::error::LabError;
use engine_model::{CpuTierConfig, TimingModel};
use serde::{Deserialize, Serialize};

/// A multiplier that is finite and greater than 0: a worker's speed or a timing
/// constant's factor.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Factor(f64);

impl Factor {
    /// 1: unchanged.
    pub const ONE: Factor = Factor(1.0);

    /// Validates a factor.
    ///
    /// # Errors
    /// [`LabError::Factor`] unless `value` is finite and greater than 0.
    pub fn new(value: f64) -> Result<Self, LabError> {
        if value.is_finite() && value > 0.0 {
            Ok(Self(value))
        } else {
            Err(LabError::Factor(value))
        }
    }

    /// The value.
    pub fn get(self) -> f64 {
        self.0
    }
}

impl Default for Factor {
    fn default() -> Self {
        Self::ONE
    }
}

impl std::str::FromStr for Factor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let value: f64 = s.trim().parse().map_err(|err| format!("{s:?}: {err}"))?;
        Factor::new(value).map_err(|err| err.to_string())
    }
}

impl std::fmt::Display for Factor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Step-time constants of the simulated engines, before shape factors and speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EnginePreset {
    /// `TimingModel::H100_8B`, the mock engine's model and the router's default.
    #[default]
    #[value(name = "h100-8b")]
    #[serde(rename = "h100-8b")]
    H100,
    /// `DYNAMO_POLYNOMIAL`: NVIDIA Dynamo's mocker default timing, linearised.
    DynamoPolynomial,
}

impl EnginePreset {
    /// The preset's timing model.
    pub fn timing(self) -> TimingModel {
        match self {
            EnginePreset::H100 => TimingModel::H100_8B,
            EnginePreset::DynamoPolynomial => DYNAMO_POLYNOMIAL,
        }
    }

    /// Display name (the flag value).
    pub fn name(self) -> &'static str {
        match self {
            EnginePreset::H100 => "h100-8b",
            EnginePreset::DynamoPolynomial => "dynamo-polynomial",
        }
    }
}

/// NVIDIA Dynamo's mocker default step time (its `PerfModel::Polynomial`), brought to
/// our linear model. Source: `lib/mocker/src/common/perf_model.rs` of
/// <https://github.com/ai-dynamo/dynamo> (the polynomial timing, before it moved into
/// Dynamo's AISimulate engine), which charges
///
/// ```text
/// prefill [ms] = 4.209989e-7 × x² + 1.518344e-2 × x + 16.50142   x = new tokens in the batch
/// decode  [ms] = −25.74 × f² + 54.01 × f + 5.74                   f = active KV tokens / KV capacity
/// ```
///
/// The source does not name the model or GPU it was fitted on. Linearised here:
/// - `step_base_ms = 5.74`: the decode intercept (a step with no prefill and an
///   almost empty cache);
/// - `prefill_ms_per_token = 0.01995`: a full 8,192-token chunk costs what the
///   polynomial charges for it (169.1 ms), base included: (169.1 − 5.74) / 8,192;
/// - `decode_ms_per_seq = 0`: the polynomial has no per-sequence term;
/// - `kv_read_ms_per_token = 2.7e-5`: the decode polynomial's secant over the whole
///   cache (28.27 ms per full cache) divided by the lab's default cache of
///   16,384 blocks × 64 tokens.
///
/// Against `H100_8B` (9, 0.06, 0.04, 4e-5) the step base is 0.64×, prefill per token
/// 0.33×, KV read 0.68×: a faster engine of another *shape* (prefill cheaper relative
/// to the fixed cost), not a uniform scale.
pub const DYNAMO_POLYNOMIAL: TimingModel = TimingModel {
    step_base_ms: 5.74,
    prefill_ms_per_token: 0.01995,
    decode_ms_per_seq: 0.0,
    kv_read_ms_per_token: 2.7e-5,
};

/// Factors applied to single constants of the engine's timing model, relative to the
/// preset (the router keeps its own defaults).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ShapeFactors {
    /// Multiplies `prefill_ms_per_token` alone.
    pub prefill: Factor,
    /// Multiplies `step_base_ms` alone.
    pub step_base: Factor,
}

impl ShapeFactors {
    /// `timing` with the factors applied.
    pub fn apply(self, timing: TimingModel) -> TimingModel {
        TimingModel {
            prefill_ms_per_token: timing.prefill_ms_per_token * self.prefill.get(),
            step_base_ms: timing.step_base_ms * self.step_base.get(),
            ..timing
        }
    }
}

/// `timing` of an engine running at `speed` (2 = twice as fast): every coefficient
/// divided by `speed`, so every step takes `1 / speed` times as long.
pub fn at_speed(timing: TimingModel, speed: Factor) -> TimingModel {
    let s = speed.get();
    TimingModel {
        step_base_ms: timing.step_base_ms / s,
        prefill_ms_per_token: timing.prefill_ms_per_token / s,
        decode_ms_per_seq: timing.decode_ms_per_seq / s,
        kv_read_ms_per_token: timing.kv_read_ms_per_token / s,
    }
}

/// Named fleets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FleetPreset {
    /// Every worker at speed 1.
    Uniform,
    /// The first half of the workers (rounded up) at speed 1, the rest at 0.5: two GPU
    /// generations in one pool.
    HalfSlow,
}

/// Speed of the slow half of [`FleetPreset::HalfSlow`].
pub const HALF_SLOW_SPEED: f64 = 0.5;

/// Per-worker engine speed (1 = the engine's timing model; 0.5 = every step takes
/// twice as long).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkerSpeeds {
    /// Every worker at speed 1.
    #[default]
    Uniform,
    /// [`FleetPreset::HalfSlow`].
    HalfSlow,
    /// One speed for every worker.
    All(Factor),
    /// One speed per worker, in worker order; the count must match the workers.
    PerWorker(Vec<Factor>),
}

impl WorkerSpeeds {
    /// From the `--worker-speed` list (one value: every worker; several: one per
    /// worker) and the `--fleet` preset; neither means uniform.
    pub fn from_flags(list: &[Factor], fleet: Option<FleetPreset>) -> Self {
        match (list, fleet) {
            ([], None | Some(FleetPreset::Uniform)) => WorkerSpeeds::Uniform,
            ([], Some(FleetPreset::HalfSlow)) => WorkerSpeeds::HalfSlow,
            ([one], _) => WorkerSpeeds::All(*one),
            (many, _) => WorkerSpeeds::PerWorker(many.to_vec()),
        }
    }

    /// The speed of each of `workers` workers.
    ///
    /// # Errors
    /// [`LabError::WorkerSpeedCount`] when a per-worker list has another length.
    pub fn for_workers(&self, workers: u32) -> Result<Vec<Factor>, LabError> {
        let n = workers as usize;
        match self {
            WorkerSpeeds::Uniform => Ok(vec![Factor::ONE; n]),
            WorkerSpeeds::All(speed) => Ok(vec![*speed; n]),
            WorkerSpeeds::HalfSlow => {
                let fast = n.div_ceil(2);
                Ok((0..n)
                    .map(|i| {
                        if i < fast {
                            Factor::ONE
                        } else {
                            Factor(HALF_SLOW_SPEED)
                        }
                    })
                    .collect())
            }
            WorkerSpeeds::PerWorker(list) if list.len() == n => Ok(list.clone()),
            WorkerSpeeds::PerWorker(list) => Err(LabError::WorkerSpeedCount {
                given: list.len(),
                workers,
            }),
        }
    }

    /// Short description for tables: `uniform`, `half-slow`, `all 4`, `1,1,0.5,0.5`.
    pub fn describe(&self) -> String {
        match self {
            WorkerSpeeds::Uniform => "uniform".into(),
            WorkerSpeeds::HalfSlow => "half-slow".into(),
            WorkerSpeeds::All(speed) => format!("all {speed}"),
            WorkerSpeeds::PerWorker(list) => list
                .iter()
                .map(Factor::to_string)
                .collect::<Vec<_>>()
                .join(","),
        }
    }
}

/// `kv-mocker lab` flags for the simulated engines (the router keeps its defaults).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SimulatedFleetArgs {
    /// Step-time constants of the simulated engines.
    #[arg(long, value_enum, default_value_t = EnginePreset::H100)]
    pub engine_preset: EnginePreset,
    /// Multiply the engines' prefill cost per token alone by this factor (> 0).
    #[arg(long, default_value_t = Factor::ONE, value_name = "FACTOR")]
    pub engine_prefill_factor: Factor,
    /// Multiply the engines' step base alone by this factor (> 0).
    #[arg(long, default_value_t = Factor::ONE, value_name = "FACTOR")]
    pub engine_step_base_factor: Factor,
    /// Per-worker engine speed, comma-separated (> 0; 0.5 = every step takes twice
    /// as long): one value for every worker, or exactly one per worker.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "SPEEDS",
        conflicts_with = "fleet"
    )]
    pub worker_speed: Vec<Factor>,
    /// A named fleet: `half-slow` runs the first half of the workers at speed 1 and
    /// the rest at 0.5.
    #[arg(long, value_enum)]
    pub fleet: Option<FleetPreset>,
    /// Every engine's CPU tier (`--cpu-tier-blocks`, default 0 = none, and its load
    /// time per token).
    #[command(flatten)]
    pub cpu_tier: CpuTierConfig,
    /// Whether the router prices blocks held only on a lower tier (see
    /// [`TierPricing`]).
    #[arg(long, value_enum, default_value_t = TierPricing::On)]
    pub tier_pricing: TierPricing,
}

/// How the simulated router prices prefix blocks a rank holds only on a lower tier
/// (CPU): with the scheduler's defaults, or as if they were not cached (to measure
/// what the pricing buys).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TierPricing {
    /// The policies' defaults: `predicted-ttft` charges `tier_load_ms_per_token`
    /// (0.005 ms) per such token instead of prefill, `kv` gives such a block
    /// `lower_tier_credit` (0.5) of a GPU block's credit.
    #[default]
    On,
    /// No value for lower-tier blocks: `predicted-ttft` charges them the prefill
    /// cost per token, `kv` a credit of 0.
    Off,
}

impl SimulatedFleetArgs {
    /// The engines' timing model before per-worker speed: the preset with the shape
    /// factors applied.
    pub fn timing(&self) -> TimingModel {
        ShapeFactors {
            prefill: self.engine_prefill_factor,
            step_base: self.engine_step_base_factor,
        }
        .apply(self.engine_preset.timing())
    }

    /// The per-worker speeds.
    pub fn speeds(&self) -> WorkerSpeeds {
        WorkerSpeeds::from_flags(&self.worker_speed, self.fleet)
    }
}

#[cfg(test)]
#[path = "fleet_tests.rs"]
mod tests;
