//! The input and output of one scheduling decision.
//!
//! Kept separate from the facade so the daemon can build a [`ScheduleRequest`] from a
//! decoded `RouteRequest` without touching scheduler state; both types are small
//! plain-data records.

use kv_events::routing::PolicyKind;
use kv_events::{RequestId, WorkerRank};

/// One request to place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleRequest {
    /// Frontend-chosen id; later lifecycle calls refer to it.
    pub request_id: RequestId,
    /// Prompt length in blocks; a partial last block counts as one.
    pub request_blocks: u32,
    /// Prompt length in tokens.
    pub num_tokens: u64,
    /// Tokens per KV block, used to turn overlap blocks into cached tokens.
    pub block_size: u32,
    /// Per-request policy override. `None` uses the daemon's policy. `Some(Kv)` uses the
    /// daemon's KV knobs when the daemon's policy is KV, else
    /// [`crate::KvPolicyConfig::default`].
    pub policy: Option<PolicyKind>,
}

impl ScheduleRequest {
    /// Prompt tokens left to prefill when the first `overlap_blocks` blocks are cached:
    /// `num_tokens − min(num_tokens, overlap_blocks × block_size)`, in tokens.
    pub fn uncached_tokens(&self, overlap_blocks: u32) -> u64 {
        let cached = u64::from(overlap_blocks) * u64::from(self.block_size);
        self.num_tokens - self.num_tokens.min(cached)
    }
}

/// Where a request was placed and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Selection {
    /// The chosen (worker, dp_rank); the request is now booked there.
    pub rank: WorkerRank,
    /// Leading prompt blocks cached on the chosen rank, in blocks (at most
    /// `request_blocks`).
    pub overlap_blocks: u32,
    /// The policy that decided (after any per-request override).
    pub policy: PolicyKind,
    /// The chosen rank's KV cost in weighted blocks; `None` for round-robin and random.
    pub cost: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(num_tokens: u64, block_size: u32) -> ScheduleRequest {
        ScheduleRequest {
            request_id: RequestId::from("r"),
            request_blocks: 0,
            num_tokens,
            block_size,
            policy: None,
        }
    }

    #[test]
    fn uncached_tokens_subtracts_cached_prefix_and_saturates() {
        assert_eq!(req(100, 16).uncached_tokens(0), 100);
        assert_eq!(req(100, 16).uncached_tokens(3), 52);
        // A fully cached prompt whose last block is partial: nothing left to prefill.
        assert_eq!(req(100, 16).uncached_tokens(7), 0);
        assert_eq!(
            req(u64::MAX, u32::MAX).uncached_tokens(u32::MAX),
            u64::MAX - u64::from(u32::MAX) * u64::from(u32::MAX)
        );
    }
}
