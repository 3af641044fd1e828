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

use super::sampling::pick_min;
use super::{Choice, SelectContext};
use crate::config::check_non_negative;
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
mod tests {
    use super::super::PolicyConfig;
    use super::super::test_support::*;
    use super::*;

    fn policy(cache_threshold: f64, abs: u64, rel: f64) -> PolicyConfig {
        PolicyConfig::CacheAwareThreshold(CacheAwareThresholdConfig {
            cache_threshold,
            balance_abs_threshold: abs,
            balance_rel_threshold: rel,
        })
    }

    #[test]
    fn imbalance_needs_both_thresholds() {
        let c = CacheAwareThresholdConfig::default();
        assert!(!c.imbalanced(0, 64), "64 is not above the absolute 64");
        assert!(c.imbalanced(0, 65));
        assert!(!c.imbalanced(200, 280), "280 is not above 1.5 × 200");
        assert!(c.imbalanced(200, 301));
    }

    #[test]
    fn balanced_load_and_a_good_match_go_to_the_best_match() {
        // 10-block prompt (160 tokens). A matches 4 blocks = 40% > 30%.
        let cands = [
            cand(1, 4, 50, 5, 10),
            cand(2, 1, 0, 0, 10),
            cand(3, 0, 0, 0, 10),
        ];
        let c = ctx(shape(10, 160, 16), &cands);
        let choice = selector(1).select(&policy(0.3, 64, 1.5), &c).unwrap();
        assert_eq!((choice.index, choice.cost), (0, None));
    }

    #[test]
    fn a_weak_match_goes_to_the_least_loaded() {
        // A matches 3 of 10 blocks = 30%, not above 30%: least loaded (C, 0 requests
        // and fewer decode blocks than B).
        let cands = [
            cand(1, 3, 50, 5, 10),
            cand(2, 1, 9, 0, 10),
            cand(3, 0, 2, 0, 10),
        ];
        let c = ctx(shape(10, 160, 16), &cands);
        assert_eq!(histogram(&policy(0.3, 64, 1.5), &c, 50), vec![0, 0, 50]);
    }

    #[test]
    fn imbalanced_load_ignores_even_a_full_match() {
        // Loads 5 and 0 with thresholds 4 (absolute) and 1.5 (relative): imbalanced.
        let cands = [cand(1, 10, 0, 5, 10), cand(2, 0, 0, 0, 10)];
        let c = ctx(shape(10, 160, 16), &cands);
        assert_eq!(
            selector(1).select(&policy(0.3, 4, 1.5), &c).unwrap().index,
            1
        );
        // Same loads under the default thresholds are balanced: the match wins.
        assert_eq!(
            selector(1)
                .select(
                    &PolicyConfig::default_for(kv_events::routing::PolicyKind::CacheAwareThreshold),
                    &c
                )
                .unwrap()
                .index,
            0
        );
    }

    #[test]
    fn best_match_ties_go_to_the_least_loaded_then_at_random() {
        let cands = [
            cand(1, 6, 0, 3, 10),
            cand(2, 6, 0, 1, 10),
            cand(3, 6, 0, 1, 10),
        ];
        let c = ctx(shape(10, 160, 16), &cands);
        let counts = histogram(&policy(0.3, 64, 1.5), &c, 600);
        assert_eq!(counts[0], 0);
        assert!(counts[1] > 220 && counts[2] > 220, "{counts:?}");
    }

    #[test]
    fn validation_names_the_knob() {
        let bad = CacheAwareThresholdConfig {
            cache_threshold: -0.1,
            ..CacheAwareThresholdConfig::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(SchedulerError::InvalidConfig {
                field: "policy.cache_aware_threshold.cache_threshold",
                ..
            })
        ));
    }
}
