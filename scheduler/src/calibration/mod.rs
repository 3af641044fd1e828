//! Online calibration of `predicted-ttft`'s step-time model, per (worker, dp_rank).
//!
//! Why: `predicted-ttft` prices a rank with one configured [`StepTimeModel`], the mock
//! engine's constants by default. A real fleet runs other models and GPUs, often
//! mixed in one pool, and a policy that predicts the wrong TTFT can route worse than
//! a plain block cost. The router sees every request's TTFT anyway (routed →
//! `prefill_done`), so it can learn each rank's constants from them.
//!
//! How:
//! - At booking (local, or a peer replica's through [`crate::Scheduler::apply`]) the
//!   request's [`TtftFeatures`] on its rank are recorded with the booking time: the
//!   prefill tokens ahead of and in it (`P + N − O`), its steps, the rank's active
//!   requests `R`, context tokens `D × block_size` and whether it was mid-step — what
//!   the policy priced.
//! - At `prefill_done` (local or peer) the interval since booking is one observation
//!   `y` (ms) of the seed model's parts `z = [prefill, per step]` weighted by unknown
//!   multipliers `θ`, `y ≈ zᵀθ` (the per-step part includes the wait for a running
//!   step, see [`TtftFeatures::parts`]); [`rls`] updates `θ` by recursive least
//!   squares with forgetting, winsorised, trace-capped and projected onto
//!   `[1/max_factor, max_factor]` (formula, sources, and why two multipliers and not
//!   one per constant, there).
//! - A rank with at least `warmup_samples` observations is priced with its own
//!   model, the seed scaled by `θ` ([`TimingScale`]); the others with the seed.
//!
//! The seed is the daemon's `predicted-ttft` model (or its default under another
//! policy). A constant configured as 0 stays 0: its multiplier has nothing to scale.
//! The per-step multiplier scales `step_base_ms`, `decode_ms_per_seq` and
//! `kv_read_ms_per_token` together (reported as equal `step_base` and `decode`
//! factors of [`TimingScale`]); `max_num_batched_tokens` is the engine's setting, not
//! learned.
//!
//! Costs: one map entry per booked, not yet prefilled request (its features, 40
//! bytes), dropped at `prefill_done`, `free`, expiry or when its worker leaves; one
//! estimator per rank that ever got a sample (dropped with the rank); O(1) per
//! booking, per `prefill_done` and per candidate of a decision. Off by default.

mod rls;

use crate::error::SchedulerError;
use crate::policy::predicted_ttft::{StepTimeModel, TtftFeatures};
use crate::policy::{PolicyConfig, TimingScale};
use kv_events::{RequestId, WorkerRank};
use rls::{Bounds, Rls};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Instant;

/// Whether and how the router learns each rank's step-time constants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CalibrationConfig {
    /// Learn and use per-rank constants. Default false (until the lab's robustness
    /// table shows it pays everywhere).
    pub enabled: bool,
    /// Forgetting factor `λ` of the estimator, in (0, 1]: a sample `k` observations
    /// old weighs `λ^k`, so the memory is about `1 / (1 − λ)` samples. Default 0.995
    /// (~200 samples per rank: a few seconds to a minute of traffic).
    pub forgetting: f64,
    /// Each learned constant stays within `[seed / max_factor, seed × max_factor]`;
    /// finite and ≥ 1. Default 8 (covers engines 4× faster or slower with margin).
    pub max_factor: f64,
    /// An observed TTFT is clipped to `[ŷ / outlier_ratio, outlier_ratio × ŷ]` around
    /// the current prediction `ŷ` before it updates the estimate; finite and > 1.
    /// Default 4.
    pub outlier_ratio: f64,
    /// Observations a rank needs before its own model is used. Default 20.
    pub warmup_samples: u32,
}

impl Default for CalibrationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            forgetting: 0.995,
            max_factor: 8.0,
            outlier_ratio: 4.0,
            warmup_samples: 20,
        }
    }
}

impl CalibrationConfig {
    /// Checks the knobs (also when disabled, so turning it on cannot fail later).
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field `calibration.<knob>`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let invalid = |field, reason: String| Err(SchedulerError::InvalidConfig { field, reason });
        if !(self.forgetting > 0.0 && self.forgetting <= 1.0) {
            return invalid(
                "calibration.forgetting",
                format!("must be in (0, 1], got {}", self.forgetting),
            );
        }
        if !(self.max_factor.is_finite() && self.max_factor >= 1.0) {
            return invalid(
                "calibration.max_factor",
                format!("must be finite and >= 1, got {}", self.max_factor),
            );
        }
        if !(self.outlier_ratio.is_finite() && self.outlier_ratio > 1.0) {
            return invalid(
                "calibration.outlier_ratio",
                format!("must be finite and > 1, got {}", self.outlier_ratio),
            );
        }
        Ok(())
    }

    fn bounds(&self) -> Bounds {
        Bounds {
            forgetting: self.forgetting,
            max_factor: self.max_factor,
            outlier_ratio: self.outlier_ratio,
        }
    }
}

/// What calibration knows about one rank, for `/debug/workers` and gauges.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RankCalibration {
    /// Observations taken.
    pub samples: u64,
    /// Whether routing uses the learned model (warm-up done).
    pub in_use: bool,
    /// The learned multipliers of the seed's constants.
    pub scale: TimingScale,
    /// The learned model: the seed scaled by `scale`, in ms.
    pub model: StepTimeModel,
}

/// A booking whose `prefill_done` is awaited.
#[derive(Debug, Clone, Copy)]
struct Pending {
    rank: WorkerRank,
    features: TtftFeatures,
    booked_at: Instant,
}

/// Per-rank estimators and the bookings they wait on.
#[derive(Debug, Clone)]
pub struct Calibration {
    config: CalibrationConfig,
    seed: StepTimeModel,
    ranks: HashMap<WorkerRank, Rls, foldhash::fast::RandomState>,
    pending: HashMap<RequestId, Pending>,
}

impl Calibration {
    /// Calibration under `config`, seeded with the `predicted-ttft` model of `policy`
    /// (the default model under any other policy).
    pub fn new(config: CalibrationConfig, policy: &PolicyConfig) -> Self {
        let seed = match policy {
            PolicyConfig::PredictedTtft(c) => c.timing,
            _ => StepTimeModel::default(),
        };
        Self {
            config,
            seed,
            ranks: HashMap::default(),
            pending: HashMap::new(),
        }
    }

    /// Whether calibration is on.
    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    /// The model calibration starts from (and falls back to), in ms.
    pub fn seed(&self) -> &StepTimeModel {
        &self.seed
    }

    /// Records a booking of `id` on `rank` at `now` with its features; nothing when
    /// calibration is off.
    pub fn book(&mut self, id: &RequestId, rank: WorkerRank, features: TtftFeatures, now: Instant) {
        if self.config.enabled {
            self.pending.insert(
                id.clone(),
                Pending {
                    rank,
                    features,
                    booked_at: now,
                },
            );
        }
    }

    /// `id` produced its first token at `now`: the interval since its booking updates
    /// its rank's estimate. Returns whether an observation was taken (false for an
    /// unknown id, a repeated `prefill_done`, or a skipped degenerate sample).
    pub fn prefill_done(&mut self, id: &RequestId, now: Instant) -> bool {
        let Some(p) = self.pending.remove(id) else {
            return false;
        };
        let ttft_ms = now.saturating_duration_since(p.booked_at).as_secs_f64() * 1e3;
        let bounds = self.config.bounds();
        let used = self.ranks.entry(p.rank).or_default().update(
            p.features.parts(&self.seed),
            ttft_ms,
            &bounds,
        );
        if !used {
            tracing::debug!(request_id = %id, rank = %p.rank, ttft_ms, "calibration sample skipped");
        }
        used
    }

    /// Forgets the booking of `id` (freed or expired before its first token).
    pub fn forget(&mut self, id: &RequestId) {
        self.pending.remove(id);
    }

    /// Drops the estimators and bookings of every rank for which `gone` holds.
    pub fn remove_ranks(&mut self, gone: impl Fn(WorkerRank) -> bool) {
        self.ranks.retain(|&rank, _| !gone(rank));
        self.pending.retain(|_, p| !gone(p.rank));
    }

    /// The multipliers routing uses for `rank`: the learned ones once warmed up,
    /// [`TimingScale::ONE`] otherwise (and when calibration is off).
    pub fn scale(&self, rank: WorkerRank) -> TimingScale {
        self.ranks
            .get(&rank)
            .filter(|r| self.config.enabled && r.samples() >= u64::from(self.config.warmup_samples))
            .map_or(TimingScale::ONE, |r| to_scale(r.theta()))
    }

    /// What calibration knows about `rank`; `None` when calibration is off. A rank
    /// without samples reports the seed.
    pub fn report(&self, rank: WorkerRank) -> Option<RankCalibration> {
        if !self.config.enabled {
            return None;
        }
        let (samples, scale) = self.ranks.get(&rank).map_or((0, TimingScale::ONE), |r| {
            (r.samples(), to_scale(r.theta()))
        });
        Some(RankCalibration {
            samples,
            in_use: samples >= u64::from(self.config.warmup_samples),
            scale,
            model: self.seed.scaled(scale),
        })
    }

    /// Bookings awaiting their `prefill_done`.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

fn to_scale(theta: [f64; rls::DIM]) -> TimingScale {
    TimingScale {
        prefill: theta[0],
        step_base: theta[1],
        decode: theta[1],
    }
}

#[cfg(test)]
mod tests;
