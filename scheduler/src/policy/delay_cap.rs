//! `predicted-ttft`'s delay cap: how much the reuse credit may cost the request
//! itself while the fleet has spare capacity.
//!
//! Why: the reuse credit values a cached token above its own prefill (a hit keeps the
//! rank's cache and queue useful to later requests too), so the policy may send a
//! request to a rank whose queue makes *this* request's first token later than an
//! idle rank would. Under load that trade pays: every request behind it waits less.
//! With spare capacity there is little queue to save, and the trade only delays long
//! prompts, which set the p99: on engines 4× faster than the router assumes, at 1×
//! arrivals, the policy was level with `kv` on mean TTFT and 4% worse on p99
//! (`docs/studies/robustness.md`, "The light-load weak spot").
//!
//! What: while the candidates' mean in-flight prefill is below `spare_steps` engine
//! steps (`max_num_batched_tokens` each), a rank is left out when the request's own
//! predicted TTFT there — the policy's prediction with no credit beyond the request's
//! own saving — is more than `max_ratio` times the lowest over the candidates. The
//! rank with that lowest prediction always stays, so the choice is never empty. Under
//! backlog the credit decides alone.
//!
//! Source: the routing-quality lab (`kv-mocker lab robustness` and the light-load cell,
//! issue 17): ratio 2 and 3 steps fixed the light cells without losing the
//! near-saturated prefill ×4 cell, where capping on the least-loaded rank's queue, or
//! with no gate, lost 12–112% of mean TTFT. `docs/studies/robustness.md` has the grid.
//!
//! Cost: per decision with spare capacity, one more prediction per candidate (O(1)
//! each).

use crate::error::SchedulerError;
use serde::{Deserialize, Serialize};

/// The delay cap's knobs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DelayCap {
    /// Apply the cap. Default true.
    pub enabled: bool,
    /// A rank stays a candidate only if the request's own predicted TTFT there is at
    /// most this many times the lowest over the candidates; finite and ≥ 1.
    /// Default 2.
    pub max_ratio: f64,
    /// The cap applies while the candidates' mean in-flight prefill is below this
    /// many steps of `max_num_batched_tokens` tokens; finite and ≥ 0 (0 never
    /// applies it). Default 3.
    pub spare_steps: f64,
}

impl Default for DelayCap {
    fn default() -> Self {
        Self {
            enabled: true,
            max_ratio: 2.0,
            spare_steps: 3.0,
        }
    }
}

impl DelayCap {
    /// Checks the knobs.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field
    /// `policy.predicted_ttft.delay_cap.<knob>`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if !(self.max_ratio.is_finite() && self.max_ratio >= 1.0) {
            return Err(SchedulerError::InvalidConfig {
                field: "policy.predicted_ttft.delay_cap.max_ratio",
                reason: format!("must be finite and >= 1, got {}", self.max_ratio),
            });
        }
        if !(self.spare_steps.is_finite() && self.spare_steps >= 0.0) {
            return Err(SchedulerError::InvalidConfig {
                field: "policy.predicted_ttft.delay_cap.spare_steps",
                reason: format!("must be finite and >= 0, got {}", self.spare_steps),
            });
        }
        Ok(())
    }

    /// Whether the cap applies to a decision whose candidates hold `pending` in-flight
    /// prefill tokens each, at `budget` tokens per step.
    pub fn applies(&self, pending: impl ExactSizeIterator<Item = u64>, budget: u64) -> bool {
        self.applies_with_left_out(pending, (0, 0), budget)
    }

    /// [`Self::applies`] with `left_out.0` more ranks holding `left_out.1` in-flight
    /// prefill tokens in all, which a shortcut decision kept out of its candidates
    /// knowing they cannot be chosen: the idle ranks its stand-in stands for (none)
    /// and the ranks it priced apart and dropped. The sum is exact in `f64` (integers
    /// below 2⁵³), so it does not depend on the order the ranks are added.
    pub(crate) fn applies_with_left_out(
        &self,
        pending: impl ExactSizeIterator<Item = u64>,
        left_out: (usize, u64),
        budget: u64,
    ) -> bool {
        let n = pending.len() + left_out.0;
        if !self.enabled || n == 0 {
            return false;
        }
        let sum = pending.map(|p| p as f64).sum::<f64>() + left_out.1 as f64;
        sum / (n as f64) < self.spare_steps * budget.max(1) as f64
    }

    /// Leaves out (cost `+∞`) every candidate whose own predicted TTFT, `own[i]` in
    /// ms for the candidate at `costs[i]`, is more than `max_ratio` times the lowest.
    /// The caller prices each candidate's own TTFT once, into a buffer it reuses; a
    /// candidate beyond the end of a shorter `own` keeps its cost.
    pub fn apply(&self, costs: &mut [f64], own: &[f64]) {
        let best = own.iter().copied().fold(f64::INFINITY, f64::min);
        for (cost, &own) in costs.iter_mut().zip(own) {
            if own > self.max_ratio * best {
                *cost = f64::INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_applies_only_with_spare_capacity() {
        let cap = DelayCap::default();
        // Mean 2.5 steps of 100 tokens: below 3.
        assert!(cap.applies([0, 500].into_iter(), 100));
        // Mean 3 steps: not below.
        assert!(!cap.applies([100, 500].into_iter(), 100));
        assert!(!cap.applies(std::iter::empty(), 100));
        let off = DelayCap {
            enabled: false,
            ..cap
        };
        assert!(!off.applies([0, 0].into_iter(), 100));
        let never = DelayCap {
            spare_steps: 0.0,
            ..cap
        };
        assert!(!never.applies([0, 0].into_iter(), 100));
    }

    #[test]
    fn ranks_beyond_the_ratio_are_left_out_and_the_best_stays() {
        let cap = DelayCap::default();
        // The credited costs favour rank 2, whose own TTFT is 2.5× the best.
        let mut costs = [100.0, 90.0, 10.0];
        let own = [400.0, 800.0, 1_000.0];
        cap.apply(&mut costs, &own);
        assert_eq!(costs, [100.0, 90.0, f64::INFINITY]);
        // Exactly at the ratio stays.
        let mut at = [5.0, 1.0];
        let own = [100.0, 200.0];
        cap.apply(&mut at, &own);
        assert_eq!(at, [5.0, 1.0]);
    }

    #[test]
    fn validation_names_the_bad_knob() {
        let field = |cap: DelayCap| match cap.validate() {
            Err(SchedulerError::InvalidConfig { field, .. }) => field,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let cap = DelayCap::default();
        assert!(cap.validate().is_ok());
        assert_eq!(
            field(DelayCap {
                max_ratio: 0.5,
                ..cap
            }),
            "policy.predicted_ttft.delay_cap.max_ratio"
        );
        assert_eq!(
            field(DelayCap {
                spare_steps: f64::NAN,
                ..cap
            }),
            "policy.predicted_ttft.delay_cap.spare_steps"
        );
    }
}
