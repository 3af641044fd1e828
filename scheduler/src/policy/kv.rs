//! `kv` (default): the KV-cache-aware cost of NVIDIA Dynamo's KV router.
//!
//! For a prompt of `request_blocks` blocks, each candidate rank gets, in blocks:
//!
//! ```text
//! prefill(rank) = active_prefill_tokens(rank) / block_size
//!               + max(request_blocks − overlap_credit × overlap_blocks(rank), 0)
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

use super::sampling::pick_by_cost;
use super::{Candidate, Choice, SelectContext};
use crate::config::check_non_negative;
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
    /// Softmax temperature over normalized costs; 0 always picks the lowest cost.
    /// Finite and ≥ 0. Default 0.0 (Dynamo's `--router-temperature`).
    pub temperature: f64,
}

impl Default for KvPolicyConfig {
    fn default() -> Self {
        Self {
            prefill_load_scale: 1.0,
            overlap_credit: 1.0,
            temperature: 0.0,
        }
    }
}

impl KvPolicyConfig {
    /// Checks that every knob is finite and non-negative.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field `policy.kv.<knob>`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        check_non_negative("policy.kv.prefill_load_scale", self.prefill_load_scale)?;
        check_non_negative("policy.kv.overlap_credit", self.overlap_credit)?;
        check_non_negative("policy.kv.temperature", self.temperature)
    }
}

/// The cost of one candidate, in weighted blocks (module docs give the formula).
pub fn kv_cost(config: &KvPolicyConfig, request: &RequestShape, c: &Candidate) -> f64 {
    let uncached = (f64::from(request.request_blocks)
        - config.overlap_credit * f64::from(c.overlap_blocks))
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
mod tests {
    use super::super::PolicyConfig;
    use super::super::test_support::*;
    use super::*;
    use crate::sequences::RankLoad;

    fn kv(scale: f64, credit: f64, temperature: f64) -> PolicyConfig {
        PolicyConfig::Kv(KvPolicyConfig {
            prefill_load_scale: scale,
            overlap_credit: credit,
            temperature,
        })
    }

    fn cfg(scale: f64, credit: f64) -> KvPolicyConfig {
        KvPolicyConfig {
            prefill_load_scale: scale,
            overlap_credit: credit,
            temperature: 0.0,
        }
    }

    #[test]
    fn cost_matches_hand_computation() {
        let req = shape(10, 160, 16);
        // No pending prefill, every request block new.
        assert_eq!(
            kv_cost(&cfg(1.0, 1.0), &req, &cand(1, 8, 10, 0, 10)),
            2.0 + 20.0
        );
        assert_eq!(
            kv_cost(&cfg(2.0, 1.0), &req, &cand(1, 0, 3, 0, 10)),
            20.0 + 13.0
        );
        assert_eq!(
            kv_cost(&cfg(0.5, 1.0), &req, &cand(1, 4, 1, 0, 10)),
            3.0 + 11.0
        );
        // Half credit per cached block: 10 − 0.5 × 8 = 6 uncached blocks.
        assert_eq!(
            kv_cost(&cfg(1.0, 0.5), &req, &cand(1, 8, 0, 0, 10)),
            6.0 + 10.0
        );
        // Credit beyond the prompt never goes negative.
        assert_eq!(kv_cost(&cfg(1.0, 3.0), &req, &cand(1, 8, 5, 0, 10)), 15.0);
        // Pending prefill: 96 tokens at 16 tokens per block = 6 blocks, weighted.
        let mut c = cand(1, 10, 2, 1, 4);
        c.load = RankLoad {
            active_prefill_tokens: 96,
            ..c.load
        };
        assert_eq!(kv_cost(&cfg(2.0, 1.0), &req, &c), 2.0 * 6.0 + 2.0 + 4.0);
    }

    #[test]
    fn picks_lowest_cost_and_reports_it() {
        // Costs at scale 1: A 2+10+10=22, B 8+0+10=18, C 10+3+10=23.
        let cands = [
            cand(1, 8, 10, 0, 10),
            cand(2, 2, 0, 0, 10),
            cand(3, 0, 3, 0, 10),
        ];
        let c = ctx(shape(10, 160, 16), &cands);
        let choice = selector(1).select(&kv(1.0, 1.0, 0.0), &c).unwrap();
        assert_eq!((choice.index, choice.cost), (1, Some(18.0)));
        // At scale 2: A 4+20=24, B 16+10=26, C 20+13=33, so the cache wins.
        let choice = selector(1).select(&kv(2.0, 1.0, 0.0), &c).unwrap();
        assert_eq!((choice.index, choice.cost), (0, Some(24.0)));
    }

    #[test]
    fn best_cache_rank_loses_when_its_decode_load_is_high() {
        // A caches the whole 10-block prompt; B caches nothing and is idle (cost 20).
        let busy = [cand(1, 10, 11, 0, 10), cand(2, 0, 0, 0, 10)];
        let c = ctx(shape(10, 160, 16), &busy);
        assert_eq!(selector(1).select(&kv(1.0, 1.0, 0.0), &c).unwrap().index, 1);
        let lighter = [cand(1, 10, 9, 0, 10), cand(2, 0, 0, 0, 10)];
        let c = ctx(shape(10, 160, 16), &lighter);
        assert_eq!(selector(1).select(&kv(1.0, 1.0, 0.0), &c).unwrap().index, 0);
    }

    #[test]
    fn shared_active_prefix_makes_a_rank_cheaper_under_kv_reuse() {
        // Same cache and load, but rank 2 already runs 6 of this prompt's 8 blocks.
        let cands = [cand(1, 4, 12, 1, 8), cand(2, 4, 12, 1, 2)];
        let c = ctx(shape(8, 128, 16), &cands);
        let choice = selector(1).select(&kv(1.0, 1.0, 0.0), &c).unwrap();
        assert_eq!((choice.index, choice.cost), (1, Some(4.0 + 14.0)));
    }

    #[test]
    fn ties_are_random_and_temperature_spreads() {
        // Costs: 0+5+5=10, 5+0+5=10, 5+1+5=11.
        let cands = [
            cand(1, 5, 5, 0, 5),
            cand(2, 0, 0, 0, 5),
            cand(3, 0, 1, 0, 5),
        ];
        let c = ctx(shape(5, 80, 16), &cands);
        let counts = histogram(&kv(1.0, 1.0, 0.0), &c, 2000);
        assert_eq!(counts[2], 0);
        assert!(counts[0] > 800 && counts[1] > 800, "{counts:?}");
        let counts = histogram(&kv(1.0, 1.0, 1.0), &c, 3000);
        assert!(
            counts[2] > 300,
            "temperature 1 sometimes picks the worse: {counts:?}"
        );
    }

    #[test]
    fn validation_names_the_knob() {
        let bad = KvPolicyConfig {
            overlap_credit: -1.0,
            ..KvPolicyConfig::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(SchedulerError::InvalidConfig {
                field: "policy.kv.overlap_credit",
                ..
            })
        ));
        let bad = KvPolicyConfig {
            temperature: f64::INFINITY,
            ..KvPolicyConfig::default()
        };
        assert!(bad.validate().is_err());
        let old: KvPolicyConfig = serde_json::from_str(r#"{"overlap_weight": 2.5}"#).unwrap();
        assert_eq!(old.prefill_load_scale, 2.5, "the old knob name still reads");
    }
}
