//! `kv`: the KV-cache-aware cost of NVIDIA Dynamo's KV router. (The default policy
//! is `predicted-ttft`, see [`super::predicted_ttft`].)
//!
//! For a prompt of `request_blocks` blocks, each candidate rank gets, in blocks:
//!
//! ```text
//! prefill(rank) = active_prefill_tokens(rank) / block_size
//!               + max(request_blocks − overlap_credit × overlap_blocks(rank)
//!                                    − lower_tier_credit × lower_tier_blocks(rank), 0)
//! decode(rank)  = active_decode_blocks(rank) + new_blocks(rank)
//! cost(rank)    = prefill_load_scale × prefill(rank) + decode(rank)
//! ```
//!
//! The prefill term is the work queued on the rank before this request's first token
//! (its in-flight prefill, the oldest decayed, plus this prompt's uncached blocks):
//! it drives TTFT. The decode term is the KV blocks the rank would hold (ITL).
//! `prefill_load_scale` trades one for the other (0 = pure decode balance);
//! `overlap_credit` scales how much one cached block is worth (1 = a cached block
//! saves a full block of prefill, 0 = ignore the cache).
//!
//! `lower_tier_blocks` are the leading prompt blocks the rank holds beyond its GPU
//! overlap on a lower storage tier only (CPU or disk, for engines that offload KV):
//! the engine loads them instead of prefilling them, which is cheaper than a prefill
//! but not free, so one counts `lower_tier_credit` (in `[0, 1]`, default 0.5) of a
//! cached block. The index reports one combined any-tier prefix per rank, so the
//! weight is the same for CPU and disk. With no lower tier the term is 0 and the
//! cost is the GPU-only one.
//!
//! Source: Dynamo's `DefaultWorkerSelector` logit
//! `overlap_score_weight × potential_prefill_blocks + potential_active_blocks`
//! (`--kv-overlap-score-weight` = `prefill_load_scale`, default 1.0;
//! `--router-temperature` = `temperature`, default 0). `overlap_credit` is our
//! generalization (Dynamo's is fixed at 1). With the rank's in-flight prefill at 0
//! this is the issue's baseline `prefill_load_scale × max(request_blocks −
//! overlap_credit × overlap_blocks, 0) + active decode blocks` (plus the request's own
//! new blocks, which only differ between ranks when KV reuse is assumed).
//!
//! Temperature 0 picks the lowest cost (exact ties uniformly at random); above 0,
//! softmax over normalized costs (see [`super::sampling`]).

use super::context::check_non_negative;
use super::context::{Candidate, Choice, SelectContext};
use super::sampling::pick_by_cost;
use crate::error::SchedulerError;
use crate::request::RequestShape;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// Knobs of the `kv` policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvPolicyConfig {
    /// Weight of prefill blocks against decode blocks. Higher favours cache hits and
    /// so TTFT; lower favours even decode load and so ITL; 0 balances decode only.
    /// Finite and ≥ 0. Default 1.0 (Dynamo's `--kv-overlap-score-weight`).
    #[serde(alias = "overlap_weight")]
    pub prefill_load_scale: f64,
    /// Prefill blocks saved per cached (overlap) block. Finite and ≥ 0. Default 1.0.
    pub overlap_credit: f64,
    /// Prefill blocks saved per block held beyond the GPU overlap on a lower tier
    /// only (CPU or disk; loaded, not prefilled). In `[0, 1]`: a lower-tier block is
    /// worth at most a GPU-cached one. Default 0.5 (half a prefill: a load over
    /// PCIe costs far less than a prefill, but it is not free and the index cannot
    /// tell CPU from disk).
    pub lower_tier_credit: f64,
    /// Softmax temperature over normalized costs; 0 always picks the lowest cost.
    /// Finite and ≥ 0. Default 0.0 (Dynamo's `--router-temperature`).
    pub temperature: f64,
}

impl Default for KvPolicyConfig {
    fn default() -> Self {
        Self {
            prefill_load_scale: 1.0,
            overlap_credit: 1.0,
            lower_tier_credit: 0.5,
            temperature: 0.0,
        }
    }
}

impl KvPolicyConfig {
    /// Checks that every knob is finite and non-negative, and `lower_tier_credit` in
    /// `[0, 1]`.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field `policy.kv.<knob>`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        check_non_negative("policy.kv.prefill_load_scale", self.prefill_load_scale)?;
        check_non_negative("policy.kv.overlap_credit", self.overlap_credit)?;
        if !(0.0..=1.0).contains(&self.lower_tier_credit) {
            return Err(SchedulerError::InvalidConfig {
                field: "policy.kv.lower_tier_credit",
                reason: format!("must be in [0, 1], got {}", self.lower_tier_credit),
            });
        }
        check_non_negative("policy.kv.temperature", self.temperature)
    }
}

/// The cost of one candidate, in weighted blocks (module docs give the formula).
pub fn kv_cost(config: &KvPolicyConfig, request: &RequestShape, c: &Candidate) -> f64 {
    let uncached = (f64::from(request.request_blocks)
        - config.overlap_credit * f64::from(c.overlap_blocks)
        - config.lower_tier_credit * f64::from(c.lower_tier_blocks()))
    .max(0.0);
    let pending = c.load.active_prefill_tokens as f64 / f64::from(request.block_size.max(1));
    let decode = c.load.active_decode_blocks as f64 + f64::from(c.new_blocks);
    config.prefill_load_scale * (pending + uncached) + decode
}

pub(super) fn select(
    config: &KvPolicyConfig,
    ctx: &SelectContext<'_>,
    costs: &mut Vec<f64>,
    rng: &mut StdRng,
) -> Choice {
    costs.clear();
    costs.extend(
        ctx.candidates
            .iter()
            .map(|c| kv_cost(config, &ctx.request, c)),
    );
    let index = pick_by_cost(rng, costs, config.temperature);
    Choice {
        index,
        cost: Some(costs[index]),
    }
}

#[cfg(test)]
#[path = "kv_tests.rs"]
mod tests;
