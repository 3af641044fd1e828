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
//!   step, see [`TtftFeatures::parts`]); `rls.rs` updates `θ` by recursive least
//!   squares with forgetting, winsorised, trace-capped and projected onto
//!   `[1/max_factor, max_factor]` (formula, sources, and why two multipliers and not
//!   one per constant, there).
//! - **Step fill.** An engine with chunked prefill fills the step that computes a
//!   request's last prompt token up to its token budget `B` with the prefill of
//!   requests queued *behind* it, so that step, and the request's TTFT, grows by up
//!   to `prefill_ms_per_token × (B − its last chunk)` (≈ 490 ms at the defaults),
//!   which the booking-time features cannot know. Measured in the lab (8 workers,
//!   1×, engines = router): the residual of the seed's prediction had median +1 ms
//!   but 90th percentile +276 ms, almost all of it this; the per-step multiplier, a few
//!   percent of these TTFTs, absorbed it and settled at 2.4–5.8 instead of 1. So at
//!   `prefill_done` the prefill part also counts the *fill* `f`: the prefill tokens
//!   booked on the rank after the request, at most the room its own model leaves in
//!   its last step (`steps × B − (P + N − O)`), and before a last step carrying
//!   them can have started (the largest `f` booked by `now − θ_prefill ×
//!   prefill_ms_per_token × (B − room + f)`, see `fill_tokens`). The bound leaves
//!   out the step's base and decodes, so a booking made in their first few ms of
//!   that step counts although it missed it (capped by the room).
//! - **Saturation.** A sample whose booking saw more than `max_queue_steps` steps of
//!   prefill ahead is not learned from: on a saturated rank the TTFT is queueing the
//!   features do not describe (in the mock engine at 4× the trace's arrivals, a
//!   rank held on average 163 requests waiting for KV space next to 96 running, and
//!   the router's `R` counts the waiting ones as decoding), and the prefill and per-step parts both grow with the queue, so
//!   their multipliers cannot be told apart (they ran to opposite clamps, 8 and
//!   1/8). The rank keeps what it learned below saturation.
//! - A rank with at least `warmup_samples` observations is priced with its own
//!   model, the seed scaled by `θ` ([`TimingScale`]); the others with the fleet's:
//!   the seed scaled by the geometric mean of the warmed-up ranks' `θ` (the seed
//!   itself while no rank is warm). Why not the seed: a rank still warming up then
//!   looks cheaper than its warmed-up peers by their whole learned factor, gets
//!   their traffic, saturates, and (saturated samples being skipped) may never warm
//!   up. Measured in the lab (prefill ×4 engines, 1×): two of eight ranks stuck at
//!   15–17 samples, priced 3.4× cheaper than the rest, and p99 TTFT 62 s against
//!   33 s uncalibrated.
//!
//! The seed is the daemon's `predicted-ttft` model (or its default under another
//! policy). A constant configured as 0 stays 0: its multiplier has nothing to scale.
//! The per-step multiplier scales `step_base_ms`, `decode_ms_per_seq` and
//! `kv_read_ms_per_token` together (reported as equal `step_base` and `decode`
//! factors of [`TimingScale`]); `max_num_batched_tokens` is the engine's setting, not
//! learned.
//!
//! Costs: one map entry per booked, not yet prefilled request (its features, about
//! 90 bytes), dropped at `prefill_done`, `free`, expiry or when its worker leaves;
//! per rank that ever got a booking, one estimator and the last [`HISTORY`]
//! bookings' times and token counts (≈ 6 KiB, dropped with the rank); O(1) per
//! booking and per candidate of a decision, O(log [`HISTORY`] + bookings made while
//! it was pending) per `prefill_done`.
//! On by default (see [`CalibrationConfig::enabled`] for the measurement).

mod hooks;
mod rls;

use crate::cost_bound::Changed;
use crate::error::SchedulerError;
use crate::policy::predicted_ttft::{StepTimeModel, TtftFeatures};
use crate::policy::{PolicyConfig, TimingScale};
use kv_events::{RequestId, WorkerRank};
use rls::{Bounds, Rls};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Bookings per rank remembered for the step-fill correction (see the module docs):
/// older ones no longer count as fill. A request whose last step begins more than
/// this many bookings after its own gets no correction.
pub const HISTORY: usize = 256;

/// Whether and how the router learns each rank's step-time constants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CalibrationConfig {
    /// Learn and use per-rank constants. Default true: in the lab's robustness study
    /// (`docs/studies/robustness.md`, "Robustness with online calibration", seeds 42, 1, 2
    /// and 3) it keeps 96–108% of the mean-TTFT gain the engines' true constants give,
    /// is within noise of the configured constants where those are right, and cuts
    /// mean TTFT by 15% on a half-slow fleet.
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
    /// A sample is learned from only if its booking saw at most this many steps of
    /// prefill (`ceil((P + N − O) / B)`, the request's own included); beyond it the
    /// rank is saturated and its TTFT is queueing the features do not describe (see
    /// the module docs). At least 1. Default 4.
    pub max_queue_steps: u64,
}

impl Default for CalibrationConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            forgetting: 0.995,
            max_factor: 8.0,
            outlier_ratio: 4.0,
            warmup_samples: 20,
            max_queue_steps: 4,
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
        if self.max_queue_steps == 0 {
            return invalid(
                "calibration.max_queue_steps",
                "must be at least 1, got 0".into(),
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
    /// The rank's [`RankState::booked_tokens`] once this booking was added.
    booked_through: u64,
}

/// One rank's estimator and recent bookings.
#[derive(Debug, Clone, Default)]
struct RankState {
    rls: Rls,
    /// Σ own prefill tokens (`N − O`) of every booking on the rank so far, in tokens.
    booked_tokens: u64,
    /// `(booking time, booked_tokens after it)` of the last [`HISTORY`] bookings,
    /// oldest first.
    history: VecDeque<(Instant, u64)>,
}

impl RankState {
    /// Records a booking of `tokens` own prefill tokens at `now`; returns the new
    /// running total.
    fn book(&mut self, tokens: u64, now: Instant) -> u64 {
        self.booked_tokens = self.booked_tokens.saturating_add(tokens);
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back((now, self.booked_tokens));
        self.booked_tokens
    }

    /// The largest fill `f` ≤ `room` such that `f` prefill tokens were booked after
    /// `p` no later than `started(f)`, the latest start of a last step carrying them
    /// (see [`fill_tokens`]), in tokens; 0 when the history no longer reaches back.
    /// A later booking makes both `f` and its time larger and `started(f)` earlier,
    /// so the scan stops at the first one that fails. O(bookings after `p`).
    fn fill(&self, p: &Pending, room: u64, started: impl Fn(u64) -> Option<Instant>) -> u64 {
        let first = self
            .history
            .partition_point(|&(_, total)| total <= p.booked_through);
        let mut fill = 0;
        for &(at, total) in self.history.range(first..) {
            let f = total.saturating_sub(p.booked_through).min(room);
            if started(f).is_none_or(|start| at > start) {
                break;
            }
            fill = f;
            if f == room {
                break;
            }
        }
        fill
    }
}

/// Per-rank estimators and the bookings they wait on.
#[derive(Debug, Clone)]
pub struct Calibration {
    config: CalibrationConfig,
    seed: StepTimeModel,
    ranks: HashMap<WorkerRank, RankState, foldhash::fast::RandomState>,
    pending: HashMap<RequestId, Pending>,
    fleet: FleetPrior,
    /// The ranks priced with their own estimate (warmed up), in no order.
    warmed: Vec<WorkerRank>,
    /// Ranks whose own multipliers changed (the decision bound's updates).
    changed: Changed,
}

/// Σ ln θ over the warmed-up ranks, kept as samples update them: the prior of the
/// ranks still warming up (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
struct FleetPrior {
    log_sum: [f64; rls::DIM],
    ranks: usize,
}

impl FleetPrior {
    /// A warmed-up rank's `θ` went from `old` (`None`: it was not warm) to `new`.
    fn replace(&mut self, old: Option<[f64; rls::DIM]>, new: [f64; rls::DIM]) {
        match old {
            Some(old) => (0..rls::DIM).for_each(|i| self.log_sum[i] -= old[i].ln()),
            None => self.ranks += 1,
        }
        (0..rls::DIM).for_each(|i| self.log_sum[i] += new[i].ln());
    }

    /// The geometric mean of the warmed-up ranks' `θ`; the seed's when none is.
    fn scale(&self) -> TimingScale {
        if self.ranks == 0 {
            return TimingScale::ONE;
        }
        to_scale(self.log_sum.map(|v| (v / self.ranks as f64).exp()))
    }
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
            fleet: FleetPrior::default(),
            warmed: Vec::new(),
            changed: Changed::default(),
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
            let booked_through = self
                .ranks
                .entry(rank)
                .or_default()
                .book(features.uncached_tokens, now);
            self.pending.insert(
                id.clone(),
                Pending {
                    rank,
                    features,
                    booked_at: now,
                    booked_through,
                },
            );
        }
    }

    /// `id` produced its first token at `now`: the interval since its booking updates
    /// its rank's estimate, its prefill part counting the step fill (see the module
    /// docs). Returns whether an observation was taken (false for an unknown id, a
    /// repeated `prefill_done`, a booking on a saturated rank, or a skipped
    /// degenerate sample).
    pub fn prefill_done(&mut self, id: &RequestId, now: Instant) -> bool {
        let Some(p) = self.pending.remove(id) else {
            return false;
        };
        let Some(state) = self.ranks.get_mut(&p.rank) else {
            return false; // its rank left; `remove_ranks` dropped it too
        };
        let ttft_ms = now.saturating_duration_since(p.booked_at).as_secs_f64() * 1e3;
        if p.features.steps > self.config.max_queue_steps {
            tracing::debug!(request_id = %id, rank = %p.rank, ttft_ms, steps = p.features.steps, "calibration sample skipped: rank saturated");
            return false;
        }
        let mut z = p.features.parts(&self.seed);
        let fill = fill_tokens(&self.seed, state, &p, now);
        z[0] += self.seed.prefill_ms_per_token * fill as f64;
        let warmup = u64::from(self.config.warmup_samples);
        let before = (state.rls.samples() >= warmup).then(|| state.rls.theta());
        let used = state.rls.update(z, ttft_ms, &self.config.bounds());
        if used && state.rls.samples() >= warmup {
            self.changed.push(p.rank);
            if before.is_none() {
                self.warmed.push(p.rank);
            }
            self.fleet.replace(before, state.rls.theta());
        }
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
        let warmup = u64::from(self.config.warmup_samples);
        self.fleet = FleetPrior::default();
        self.changed.all = true;
        self.warmed.clear();
        for (&rank, r) in self.ranks.iter().filter(|(_, r)| r.rls.samples() >= warmup) {
            self.fleet.replace(None, r.rls.theta());
            self.warmed.push(rank);
        }
    }

    /// The ranks whose multipliers changed since the last call, emptied.
    pub(crate) fn take_changed(&mut self) -> Changed {
        std::mem::take(&mut self.changed)
    }

    /// Calls `f` with every rank [`Self::scale`] may price apart from the fleet
    /// prior (the others are priced alike): the warmed-up ranks, O(those); every
    /// rank with state when `warmup_samples` is 0; none when calibration is off.
    pub(crate) fn visit_own_scales(&self, mut f: impl FnMut(WorkerRank)) {
        if !self.config.enabled {
            return;
        }
        if self.config.warmup_samples == 0 {
            self.ranks.keys().for_each(|&r| f(r));
        } else {
            self.warmed.iter().for_each(|&r| f(r));
        }
    }

    /// The multipliers routing uses for `rank`: the learned ones once warmed up,
    /// before that the geometric mean of the warmed-up ranks' ([`TimingScale::ONE`]
    /// while there is none, and when calibration is off).
    pub fn scale(&self, rank: WorkerRank) -> TimingScale {
        self.own_scale(rank).unwrap_or_else(|| self.prior_scale())
    }

    /// What calibration knows about `rank`; `None` when calibration is off. A rank
    /// without samples reports the seed.
    pub fn report(&self, rank: WorkerRank) -> Option<RankCalibration> {
        if !self.config.enabled {
            return None;
        }
        let (samples, scale) = self.ranks.get(&rank).map_or((0, TimingScale::ONE), |r| {
            (r.rls.samples(), to_scale(r.rls.theta()))
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

/// The step-fill tokens of `p`, completed at `now` (see the module docs), in tokens:
/// the most prefill tokens `f`, up to the room its last step had, booked on its rank
/// after it and before that step can have started. A last step carrying its own
/// share `B − room` and `f` fill tokens lasted at least their prefill,
/// `θ_prefill × prefill_ms_per_token × (B − room + f)` (its step base and decodes
/// are left out: that bound holds whatever the per-step multiplier, which is what
/// the fill must not depend on), so it started no later than `now` minus that.
fn fill_tokens(seed: &StepTimeModel, state: &RankState, p: &Pending, now: Instant) -> u64 {
    let budget = seed.max_num_batched_tokens.max(1);
    let room = p
        .features
        .steps
        .saturating_mul(budget)
        .saturating_sub(p.features.prefill_tokens);
    if room == 0 {
        return 0;
    }
    let ms_per_token = state.rls.theta()[0] * seed.prefill_ms_per_token;
    state.fill(p, room, |f| {
        let tokens = (budget - room).saturating_add(f);
        Duration::try_from_secs_f64(ms_per_token * tokens as f64 / 1e3)
            .ok()
            .and_then(|d| now.checked_sub(d))
    })
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

#[cfg(test)]
mod gating_tests;
