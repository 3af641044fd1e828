//! `kv-normalized`: the score of TensorRT-LLM's KV-cache-aware ADP router
//! (`KVCacheAwareADPRouter` in `tensorrt_llm/_torch/pyexecutor/scheduler/adp_router.py`).
//!
//! For a request of `req_tokens` prompt tokens, each eligible rank gets, in tokens:
//!
//! ```text
//! score(rank) = (req_tokens − match_tokens(rank))
//!             + β × rank_active_tokens(rank) / max(total_active_tokens, req_tokens) × req_tokens
//! ```
//!
//! Lower wins. `match_tokens` is the rank's cached prefix in tokens
//! (`overlap_blocks × block_size`, at most `req_tokens`); it is zeroed on every rank
//! when the best match covers at most `match_rate_threshold` of the request, so weak
//! matches do not fight load balance. `rank_active_tokens` is the uncached prompt
//! tokens of every request active on the rank (TensorRT-LLM's "active tokens", net
//! of cache hits); `total_active_tokens` sums it over the eligible ranks. Normalizing
//! by the total keeps both terms on the scale of one request whatever the cluster
//! load. β is `load_balance_weight` (TensorRT-LLM's
//! `kv_cache_routing_load_balance_weight`, default 1.0).
//!
//! **Fair-share cap.** A rank is eligible only while its active requests are below
//! `max(ceil(fair_share_multiplier × fair_share), max active requests)`, with
//! `fair_share = ceil((Σ active requests + requests left in the batch) / ranks)`
//! (`kv_cache_routing_fair_share_multiplier`, default 2.0): a safety net against
//! runaway concentration on one hot cache, loose enough that affinity usually wins.
//! Exact score ties go to the rank with fewer active tokens, then uniformly at random.
//! Batches are grouped by prefix by [`crate::Scheduler::schedule_batch`].
//!
//! `temperature` (our addition, default 0 = TensorRT-LLM's argmin): softmax over the
//! normalized scores of the eligible ranks, as for `kv`.

use super::context::check_non_negative;
use super::context::{Candidate, Choice, SelectContext};
use super::sampling::{pick_by_cost, pick_min};
use crate::error::SchedulerError;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// Knobs of the `kv-normalized` policy (defaults are TensorRT-LLM's).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvNormalizedConfig {
    /// β, weight of the normalized-load term. Finite and ≥ 0. Default 1.0.
    pub load_balance_weight: f64,
    /// Cache affinity only counts when the best match covers more than this fraction
    /// of the request's tokens. In `[0, 1]`. Default 0.1.
    pub match_rate_threshold: f64,
    /// Per-rank cap, in multiples of the fair share of active requests. Finite and
    /// ≥ 1 (below 1 every rank could be capped out). Default 2.0.
    pub fair_share_multiplier: f64,
    /// Softmax temperature over normalized scores; 0 picks the lowest. Default 0.0.
    pub temperature: f64,
}

impl Default for KvNormalizedConfig {
    fn default() -> Self {
        Self {
            load_balance_weight: 1.0,
            match_rate_threshold: 0.1,
            fair_share_multiplier: 2.0,
            temperature: 0.0,
        }
    }
}

impl KvNormalizedConfig {
    /// Checks every knob.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field `policy.kv_normalized.<knob>`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        check_non_negative(
            "policy.kv_normalized.load_balance_weight",
            self.load_balance_weight,
        )?;
        check_non_negative("policy.kv_normalized.temperature", self.temperature)?;
        if !(0.0..=1.0).contains(&self.match_rate_threshold) {
            return Err(SchedulerError::InvalidConfig {
                field: "policy.kv_normalized.match_rate_threshold",
                reason: format!("must be in [0, 1], got {}", self.match_rate_threshold),
            });
        }
        if !(self.fair_share_multiplier.is_finite() && self.fair_share_multiplier >= 1.0) {
            return Err(SchedulerError::InvalidConfig {
                field: "policy.kv_normalized.fair_share_multiplier",
                reason: format!(
                    "must be finite and >= 1, got {}",
                    self.fair_share_multiplier
                ),
            });
        }
        Ok(())
    }
}

/// The per-rank active-request cap for `ranks` ranks whose active requests are
/// `active`, with `batch_remaining` requests still to place (see the module docs).
pub fn fair_share_cap(
    config: &KvNormalizedConfig,
    active: impl Iterator<Item = usize> + Clone,
    batch_remaining: usize,
) -> usize {
    let ranks = active.clone().count().max(1);
    let total: usize = active.clone().sum();
    let fair = (total + batch_remaining).div_ceil(ranks);
    let scaled = (config.fair_share_multiplier * fair as f64).ceil() as usize;
    scaled.max(active.max().unwrap_or(0))
}

/// The score of one rank, in tokens (module docs give the formula).
pub fn score(
    config: &KvNormalizedConfig,
    req_tokens: u64,
    match_tokens: u64,
    rank_active_tokens: u64,
    load_denominator: f64,
) -> f64 {
    let effective = req_tokens.saturating_sub(match_tokens) as f64;
    let load = rank_active_tokens as f64 / load_denominator * req_tokens as f64;
    effective + config.load_balance_weight * load
}

/// Scratch buffers lent by the selector.
pub(super) struct Scratch<'a> {
    pub eligible: &'a mut Vec<usize>,
    pub keys: &'a mut Vec<(f64, f64)>,
    pub costs: &'a mut Vec<f64>,
}

pub(super) fn select(
    config: &KvNormalizedConfig,
    ctx: &SelectContext<'_>,
    scratch: Scratch<'_>,
    rng: &mut StdRng,
) -> Choice {
    let Scratch {
        eligible,
        keys,
        costs,
    } = scratch;
    let cands = ctx.candidates;
    let active = cands.iter().map(|c| c.load.active_requests);
    let cap = fair_share_cap(config, active, ctx.batch_remaining.max(1));
    eligible.clear();
    eligible.extend((0..cands.len()).filter(|&i| cands[i].load.active_requests < cap));
    if eligible.is_empty() {
        // Unreachable with a multiplier ≥ 1; kept so a bad state cannot fail routing.
        eligible.extend(0..cands.len());
    }

    let req_tokens = ctx.request.num_tokens;
    let bs = u64::from(ctx.request.block_size);
    let match_tokens = |c: &Candidate| (u64::from(c.overlap_blocks) * bs).min(req_tokens);
    let best_match = eligible
        .iter()
        .map(|&i| match_tokens(&cands[i]))
        .max()
        .unwrap_or(0);
    let affinity = best_match as f64 / req_tokens.max(1) as f64 > config.match_rate_threshold;
    let total_load: u64 = eligible
        .iter()
        .map(|&i| cands[i].load.active_uncached_tokens)
        .fold(0u64, u64::saturating_add);
    let denominator = (total_load.max(req_tokens) as f64).max(1.0);

    keys.clear();
    keys.extend(eligible.iter().map(|&i| {
        let c = &cands[i];
        let matched = if affinity { match_tokens(c) } else { 0 };
        let s = score(
            config,
            req_tokens,
            matched,
            c.load.active_uncached_tokens,
            denominator,
        );
        (s, c.load.active_uncached_tokens as f64)
    }));
    let pick = if config.temperature > 0.0 {
        costs.clear();
        costs.extend(keys.iter().map(|k| k.0));
        pick_by_cost(rng, costs, config.temperature)
    } else {
        pick_min(rng, keys)
    };
    Choice {
        index: eligible[pick],
        cost: Some(keys[pick].0),
    }
}

#[cfg(test)]
#[path = "kv_normalized_tests.rs"]
mod tests;
