//! What every policy file shares: the [`Candidate`]s and [`SelectContext`] a policy
//! decides on, the [`Choice`] it returns, and the check of a non-negative knob.
//!
//! These sit in their own file, below `policy/mod.rs` (which dispatches to every
//! policy file) and below `config.rs` (which holds the policy config), so that each
//! policy file depends only downwards and no two files import each other.

use crate::error::SchedulerError;
use crate::load::RankLoad;
use crate::request::RequestShape;
use kv_events::WorkerRank;

/// One eligible rank as a policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The (worker, dp_rank).
    pub rank: WorkerRank,
    /// Leading prompt blocks already cached there (prefix match), in blocks, at most
    /// the request's blocks.
    pub overlap_blocks: u32,
    /// Leading prompt blocks held there on any storage tier (GPU, CPU or disk), in
    /// blocks: at least `overlap_blocks`, at most the request's blocks. The blocks
    /// beyond `overlap_blocks` are on a lower tier only: loaded, not prefilled.
    pub any_tier_blocks: u32,
    /// The rank's load projection now.
    pub load: RankLoad,
    /// Decode blocks this request would add there, in blocks: its blocks minus those
    /// already held by active requests with the same prefix (when KV reuse is assumed).
    pub new_blocks: u32,
}

impl Candidate {
    /// Leading prompt blocks held beyond the GPU overlap on a lower tier only
    /// (`any_tier_blocks − overlap_blocks`), in blocks.
    pub fn lower_tier_blocks(&self) -> u32 {
        self.any_tier_blocks.saturating_sub(self.overlap_blocks)
    }
}

/// Per-rank multipliers of the `predicted-ttft` step-time constants, as online
/// calibration (`crate::calibration`) learned them; [`TimingScale::ONE`] leaves the
/// configured model as it is. Each factor is finite and > 0.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TimingScale {
    /// Multiplier of `prefill_ms_per_token`.
    pub prefill: f64,
    /// Multiplier of `step_base_ms`.
    pub step_base: f64,
    /// Multiplier of both decode terms, `decode_ms_per_seq` and
    /// `kv_read_ms_per_token`.
    pub decode: f64,
}

impl TimingScale {
    /// No change.
    pub const ONE: TimingScale = TimingScale {
        prefill: 1.0,
        step_base: 1.0,
        decode: 1.0,
    };
}

impl Default for TimingScale {
    fn default() -> Self {
        Self::ONE
    }
}

/// What a policy decides on.
#[derive(Debug, Clone, Copy)]
pub struct SelectContext<'a> {
    /// The request's size.
    pub request: RequestShape,
    /// The eligible ranks, sorted by rank.
    pub candidates: &'a [Candidate],
    /// Requests of the current batch still to place, this one included (1 outside a
    /// batch); `kv-normalized` sizes its fair share with it.
    pub batch_remaining: usize,
    /// Calibrated step-time multipliers, parallel to `candidates`, for
    /// `predicted-ttft`; empty when calibration is off (every rank then uses the
    /// configured model).
    pub timing_scales: &'a [TimingScale],
    /// Whether `predicted-ttft`'s delay cap applies, when the caller decided it over
    /// registered ranks left out of `candidates` (the scheduler's shortcuts: idle
    /// ranks one candidate stands for, ranks priced apart, ranks a cost bound
    /// excluded), which still count in its mean backlog; `None`: decide from
    /// `candidates`.
    pub delay_cap_gate: Option<bool>,
}

/// The outcome of a selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Index of the chosen candidate.
    pub index: usize,
    /// The chosen candidate's cost or score; `None` for cost-free policies.
    pub cost: Option<f64>,
}

/// Checks that a knob is finite and non-negative.
pub(crate) fn check_non_negative(field: &'static str, value: f64) -> Result<(), SchedulerError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(SchedulerError::InvalidConfig {
            field,
            reason: format!("must be finite and >= 0, got {value}"),
        })
    }
}
