//! `cache-aware-threshold`: the two-mode rule of SGLang's cache-aware router
//! (sgl-router / sgl-model-gateway `CacheAwarePolicy`).
//!
//! Load is counted in active requests per rank, as SGLang counts in-flight requests
//! per worker. With `max` and `min` the highest and lowest load over the eligible
//! ranks:
//!
//! 1. **Imbalanced** — `max − min > balance_abs_threshold` *and*
//!    `max > min × balance_rel_threshold`: route to the least loaded rank, ignoring
//!    the cache (SGLang's shortest-queue mode).
//! 2. Otherwise, if the best prefix match ratio `match_tokens / prompt_tokens`
//!    (`match_tokens = overlap_blocks × block_size`, at most the prompt) is above
//!    `cache_threshold`: route to the rank with the best match (ties: least loaded,
//!    then at random).
//! 3. Otherwise route to the least loaded rank (SGLang picks the worker with the
//!    smallest approximate tree, i.e. the most free cache; we have exact load, so we
//!    take the least loaded, as the issue specifies).
//!
//! Least-loaded ties are broken by fewer active decode blocks, then uniformly at
//! random. Defaults are SGLang's: `cache_threshold` 0.3, `balance_abs_threshold` 64,
//! `balance_rel_threshold` 1.5.

use super::context::check_non_negative;
use super::context::{Choice, SelectContext};
use super::sampling::pick_min;
use crate::error::SchedulerError;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// Knobs of the `cache-aware-threshold` policy (defaults are SGLang's).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheAwareThresholdConfig {
    /// Route to the best match only when it covers more than this fraction of the
    /// prompt. In `[0, 1]`. Default 0.3.
    pub cache_threshold: f64,
    /// Load is imbalanced when `max − min` active requests exceeds this (and the
    /// relative test holds). Default 64.
    pub balance_abs_threshold: u64,
    /// Load is imbalanced when `max > min × this` (and the absolute test holds).
    /// Finite and ≥ 0. Default 1.5.
    pub balance_rel_threshold: f64,
}

impl Default for CacheAwareThresholdConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
        }
    }
}

impl CacheAwareThresholdConfig {
    /// Checks every knob.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field `policy.cache_aware_threshold.<knob>`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(SchedulerError::InvalidConfig {
                field: "policy.cache_aware_threshold.cache_threshold",
                reason: format!("must be in [0, 1], got {}", self.cache_threshold),
            });
        }
        check_non_negative(
            "policy.cache_aware_threshold.balance_rel_threshold",
            self.balance_rel_threshold,
        )
    }

    /// Whether loads from `min` to `max` active requests are imbalanced.
    pub fn imbalanced(&self, min: usize, max: usize) -> bool {
        (max - min) as u64 > self.balance_abs_threshold
            && max as f64 > min as f64 * self.balance_rel_threshold
    }
}

pub(super) fn select(
    config: &CacheAwareThresholdConfig,
    ctx: &SelectContext<'_>,
    pool: &mut Vec<usize>,
    keys: &mut Vec<(f64, f64)>,
    rng: &mut StdRng,
) -> Choice {
    let cands = ctx.candidates;
    let loads = cands.iter().map(|c| c.load.active_requests);
    let (min, max) = (loads.clone().min().unwrap_or(0), loads.max().unwrap_or(0));
    pool.clear();
    if !config.imbalanced(min, max) {
        let best = cands.iter().map(|c| c.overlap_blocks).max().unwrap_or(0);
        let matched =
            (u64::from(best) * u64::from(ctx.request.block_size)).min(ctx.request.num_tokens);
        let ratio = matched as f64 / ctx.request.num_tokens.max(1) as f64;
        if best > 0 && ratio > config.cache_threshold {
            pool.extend((0..cands.len()).filter(|&i| cands[i].overlap_blocks == best));
        }
    }
    if pool.is_empty() {
        pool.extend(0..cands.len());
    }
    keys.clear();
    keys.extend(pool.iter().map(|&i| {
        let load = &cands[i].load;
        (
            load.active_requests as f64,
            load.active_decode_blocks as f64,
        )
    }));
    Choice {
        index: pool[pick_min(rng, keys)],
        cost: None,
    }
}

#[cfg(test)]
#[path = "cache_aware_tests.rs"]
mod tests;
