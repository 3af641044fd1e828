//! Conditional disaggregation: when a request that may run disaggregated is better
//! prefilled by its decode worker itself, and how that decode worker is chosen.
//!
//! Why conditional: a transfer moves every prompt block the decode worker does not
//! hold from the prefill worker over the network (NIXL, Mooncake), and the request
//! waits for two engines instead of one. When the part the decode worker would have
//! to prefill is short, or it already holds most of the prompt, the transfer costs
//! more than the prefill it saves, and a long prefill on a decode worker is what
//! disaggregation exists to avoid (it stalls every running decode for its steps).
//! Dynamo's conditional disaggregation and vllm-router's skip of cached prompts make
//! the same call. The rule, for the chosen decode rank holding `o` leading prompt
//! blocks (its indexed overlap):
//!
//! ```text
//! uncached = num_tokens − min(num_tokens, o × block_size)
//! uncached ≤ max_local_prefill_tokens              → short_uncached (local)
//! o ≥ min_decode_overlap × request_blocks          → decode_holds_prefix (local)
//! else a prefill worker of the decode worker's protocol → long_uncached
//!      none eligible                                → no_prefill_worker (local)
//! ```
//!
//! The decode rank is chosen first, by [`decode_cost`]: a disaggregated request's
//! decode holds its KV for the whole generation, so the decode side is a question of
//! KV room and decode batch size, not of prefill queues. The prefill rank is then
//! chosen by the request's policy (KV overlap and prefill load, `predicted-ttft` by
//! default) among the prefill workers of the decode worker's transfer protocol.
//!
//! Cost: the rule is O(1); the decode cost is O(1) per candidate.

use crate::error::SchedulerError;
use crate::policy::Candidate;
use crate::request::ScheduleRequest;
use kv_events::disaggregation::DisaggregationReason;
use serde::{Deserialize, Serialize};

/// The thresholds of conditional disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggregationConfig {
    /// A request whose decode rank would have to prefill at most this many tokens
    /// (its uncached part there) is prefilled by the decode worker itself
    /// (`short_uncached`), in tokens. 0: only a fully cached prompt stays local.
    /// Default 1,024: two 512-token chunks, about 60 ms of prefill at the default
    /// step-time model, no longer than a few decode steps' stall, while a transfer
    /// adds a round trip through a second engine to the TTFT.
    pub max_local_prefill_tokens: u64,
    /// A request whose decode rank already holds at least this fraction of the
    /// prompt's blocks is prefilled there (`decode_holds_prefix`), dimensionless in
    /// `[0, 1]`. 0 turns disaggregation off (every decode rank holds at least none);
    /// 1 keeps only fully cached prompts local. Default 0.8: the uncached fifth is
    /// then the transfer's whole saving, seldom worth a second engine.
    pub min_decode_overlap: f64,
}

impl Default for DisaggregationConfig {
    fn default() -> Self {
        Self {
            max_local_prefill_tokens: 1024,
            min_decode_overlap: 0.8,
        }
    }
}

impl DisaggregationConfig {
    /// Checks the fraction.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] for `disaggregation.min_decode_overlap`
    /// outside `[0, 1]` or not finite.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if !(0.0..=1.0).contains(&self.min_decode_overlap) {
            return Err(SchedulerError::InvalidConfig {
                field: "disaggregation.min_decode_overlap",
                reason: format!("must be in [0, 1], got {}", self.min_decode_overlap),
            });
        }
        Ok(())
    }

    /// Why `req` is prefilled on its decode rank, which holds `decode_overlap`
    /// leading prompt blocks; `None` when it should be disaggregated (if a prefill
    /// worker is eligible). Module docs give the rule.
    pub fn local_reason(
        &self,
        req: &ScheduleRequest,
        decode_overlap: u32,
    ) -> Option<DisaggregationReason> {
        if req.uncached_tokens(decode_overlap) <= self.max_local_prefill_tokens {
            return Some(DisaggregationReason::ShortUncached);
        }
        let held = f64::from(decode_overlap.min(req.request_blocks));
        (held >= self.min_decode_overlap * f64::from(req.request_blocks))
            .then_some(DisaggregationReason::DecodeHoldsPrefix)
    }
}

/// The decode cost of candidate `c` for a request of `request_blocks` blocks, on a
/// rank of `total_kv_blocks` KV blocks: the share of its KV cache booked requests
/// would hold with this one, dimensionless (lower is better):
///
/// ```text
/// added = min(new_blocks, request_blocks − overlap_blocks)
/// cost  = (active_decode_blocks + added) / total_kv_blocks
/// ```
///
/// `added` is what the request adds to the rank's KV: its blocks minus those the
/// rank already holds, whether for an active request (`new_blocks` leaves those
/// out under KV reuse) or in its prefix cache (`overlap_blocks`); a block held both
/// ways is credited once. Dividing by the capacity makes the cost the fill level a
/// heterogeneous fleet balances on: a rank with twice the KV takes twice the
/// blocks before it costs the same. A `total_kv_blocks` of 0 counts as 1.
pub fn decode_cost(c: &Candidate, request_blocks: u32, total_kv_blocks: u64) -> f64 {
    let added = c
        .new_blocks
        .min(request_blocks.saturating_sub(c.overlap_blocks));
    (c.load.active_decode_blocks as f64 + f64::from(added)) / total_kv_blocks.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::RankLoad;
    use kv_events::{DpRank, WorkerId, WorkerRank};

    fn req(num_tokens: u64) -> ScheduleRequest {
        ScheduleRequest::new("r", Vec::new(), num_tokens, 16)
    }

    #[test]
    fn short_then_held_then_remote() {
        let c = DisaggregationConfig::default();
        // 100 blocks of 16 tokens.
        let r = req(1600);
        assert_eq!(c.local_reason(&r, 0), None, "1600 uncached, nothing held");
        assert_eq!(
            c.local_reason(&r, 36),
            Some(DisaggregationReason::ShortUncached),
            "1024 uncached: at the limit"
        );
        assert_eq!(c.local_reason(&r, 35), None, "1040 uncached, 35% held");
        let long = req(16_000);
        assert_eq!(
            c.local_reason(&long, 800),
            Some(DisaggregationReason::DecodeHoldsPrefix),
            "3200 uncached but 80% held"
        );
        assert_eq!(c.local_reason(&long, 799), None);
        let off = DisaggregationConfig {
            min_decode_overlap: 0.0,
            ..c
        };
        assert_eq!(
            off.local_reason(&long, 0),
            Some(DisaggregationReason::DecodeHoldsPrefix),
            "0 keeps every request local"
        );
        let strict = DisaggregationConfig {
            max_local_prefill_tokens: 0,
            min_decode_overlap: 1.0,
        };
        assert_eq!(strict.local_reason(&long, 999), None);
        assert_eq!(
            strict.local_reason(&long, 1000),
            Some(DisaggregationReason::ShortUncached)
        );
    }

    #[test]
    fn validation_names_the_fraction() {
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let c = DisaggregationConfig {
                min_decode_overlap: bad,
                ..DisaggregationConfig::default()
            };
            assert!(
                matches!(c.validate(), Err(SchedulerError::InvalidConfig { field, .. })
                    if field == "disaggregation.min_decode_overlap"),
                "{bad}"
            );
        }
        assert!(DisaggregationConfig::default().validate().is_ok());
    }

    #[test]
    fn decode_cost_is_the_fill_level_with_held_blocks_credited_once() {
        let cand = |decode: u64, overlap: u32, new: u32| Candidate {
            rank: WorkerRank::new(WorkerId(1), DpRank(0)),
            overlap_blocks: overlap,
            any_tier_blocks: overlap,
            load: RankLoad {
                active_decode_blocks: decode,
                ..RankLoad::default()
            },
            new_blocks: new,
        };
        assert_eq!(decode_cost(&cand(30, 0, 10), 10, 100), 0.4);
        assert_eq!(decode_cost(&cand(30, 6, 10), 10, 100), 0.34, "prefix held");
        // 6 blocks in the prefix cache, the same 6 held by an active request: once.
        assert_eq!(decode_cost(&cand(30, 6, 4), 10, 100), 0.34);
        assert_eq!(decode_cost(&cand(30, 0, 10), 10, 200), 0.2, "twice the KV");
        assert_eq!(decode_cost(&cand(3, 0, 1), 1, 0), 4.0, "no capacity: 1");
    }
}
