//! The input and output of one scheduling decision.
//!
//! Kept separate from the facade so the daemon can build a [`ScheduleRequest`] from a
//! decoded `RouteRequest` without touching scheduler state; both are small
//! plain-data records (the request owns its block hashes, 8 bytes per block).

use crate::load::PrefillLoadHint;
use kv_events::disaggregation::DisaggregationReason;
use kv_events::routing::{CostOverrides, MAX_FALLBACKS, PolicyKind, SessionId};
use kv_events::{DpRank, LocalBlockHash, RequestId, WorkerId, WorkerRank};

/// One request to place.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleRequest {
    /// Frontend-chosen id; later lifecycle calls refer to it.
    pub request_id: RequestId,
    /// The prompt's block hashes in prefix order (full blocks; a frontend may also
    /// hash a partial last block). Used to count shared prefix blocks once and to
    /// group a batch by prefix; overlap itself comes from the indexer.
    pub block_hashes: Vec<LocalBlockHash>,
    /// Prompt length in blocks; a partial last block counts as one.
    pub request_blocks: u32,
    /// Prompt length in tokens.
    pub num_tokens: u64,
    /// Tokens per KV block, used to turn blocks into tokens.
    pub block_size: u32,
    /// Per-request policy override. `None` uses the daemon's policy. `Some(kind)` uses
    /// the daemon's knobs when the daemon runs that kind, else
    /// [`crate::PolicyConfig::default_for`] it.
    pub policy: Option<PolicyKind>,
    /// Only ranks with this dp_rank are candidates; if no registered worker has it,
    /// scheduling fails with [`crate::SchedulerError::RankUnavailable`].
    pub dp_rank: Option<DpRank>,
    /// Per-request cost knob overrides, applied on top of the resolved policy.
    pub overrides: CostOverrides,
    /// Workers that are not candidates (a frontend's failover names the workers it
    /// already tried). Sorted and deduplicated by [`ScheduleRequest::exclude`]; if
    /// every registered worker is excluded, scheduling fails with
    /// [`crate::SchedulerError::AllExcluded`].
    pub exclude_workers: Vec<WorkerId>,
    /// The session (conversation) the request belongs to: its last rank is preferred
    /// within a margin ([`crate::sessions`]). `None`: no affinity.
    pub session_id: Option<SessionId>,
    /// The frontend can run the request disaggregated (a prefill worker, then a
    /// decode worker): when a `prefill` worker is registered, the scheduler picks a
    /// decode rank and decides where the prompt is prefilled
    /// ([`Selection::disaggregation`], [`crate::disaggregation`]). Without it, or
    /// with no prefill worker registered, the request is placed on one rank as
    /// always. Either way only ranks of workers that decode (`both`, `decode`) serve
    /// the request itself.
    pub allow_disaggregation: bool,
    /// When non-empty, the only workers that are candidates (an endpoint picker's
    /// subset), on top of every other rule. Sorted and deduplicated by
    /// [`ScheduleRequest::restrict_to`]; if no registered worker is in it (after
    /// exclusions), scheduling fails with [`crate::SchedulerError::AllExcluded`].
    /// Empty: every worker is eligible.
    pub eligible_workers: Vec<WorkerId>,
    /// How many alternates to list in [`Selection::fallbacks`] (at most
    /// [`kv_events::routing::MAX_FALLBACKS`]; more are not listed). 0: none.
    pub fallbacks: u8,
}

impl ScheduleRequest {
    /// A request of `num_tokens` tokens with these block hashes at `block_size`
    /// tokens per block: `request_blocks = max(ceil(num_tokens / block_size),
    /// block_hashes.len())`, saturating at `u32::MAX`. Daemon policy, no pin, no
    /// overrides.
    pub fn new(
        request_id: impl Into<RequestId>,
        block_hashes: Vec<LocalBlockHash>,
        num_tokens: u64,
        block_size: u32,
    ) -> Self {
        let blocks = num_tokens
            .div_ceil(u64::from(block_size.max(1)))
            .max(block_hashes.len() as u64);
        Self {
            request_id: request_id.into(),
            block_hashes,
            request_blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
            num_tokens,
            block_size,
            policy: None,
            dp_rank: None,
            overrides: CostOverrides::default(),
            exclude_workers: Vec::new(),
            session_id: None,
            allow_disaggregation: false,
            eligible_workers: Vec::new(),
            fallbacks: 0,
        }
    }

    /// The most prompt blocks an engine can reuse from its cache: every full block
    /// before the prompt's last token, `min(request_blocks, (num_tokens − 1) /
    /// block_size)`. Engines always compute the last prompt token (its logits give
    /// the first output token): vLLM caps a prefix hit at `num_tokens − 1` tokens
    /// (`KVCacheManager.get_computed_blocks`), SGLang at `len(input_ids) − 1`
    /// (`Req.adjust_max_prefix_ids`), so an exactly block-aligned prompt of `n` blocks
    /// held in full reuses `n − 1` of them.
    pub fn reusable_blocks(&self) -> u32 {
        let before_last = self.num_tokens.saturating_sub(1) / u64::from(self.block_size.max(1));
        u32::try_from(before_last)
            .unwrap_or(u32::MAX)
            .min(self.request_blocks)
    }

    /// Sets the workers this request must not be routed to (sorted and deduplicated,
    /// so a candidate check is a binary search).
    pub fn exclude(&mut self, mut workers: Vec<WorkerId>) {
        workers.sort_unstable();
        workers.dedup();
        self.exclude_workers = workers;
    }

    /// Sets the only workers this request may be routed to (sorted and
    /// deduplicated, so a candidate check is a binary search); empty lifts the
    /// restriction.
    pub fn restrict_to(&mut self, mut workers: Vec<WorkerId>) {
        workers.sort_unstable();
        workers.dedup();
        self.eligible_workers = workers;
    }

    /// Whether `worker_id` is excluded for this request, or outside its eligible set.
    pub fn excludes(&self, worker_id: WorkerId) -> bool {
        self.exclude_workers.binary_search(&worker_id).is_ok()
            || (!self.eligible_workers.is_empty()
                && self.eligible_workers.binary_search(&worker_id).is_err())
    }

    /// Whether the decision must see every candidate: an eligible set or fallbacks
    /// (the shortcuts of `shortcut.rs` neither filter by worker nor price every
    /// alternate).
    pub(crate) fn needs_full_scan(&self) -> bool {
        !self.eligible_workers.is_empty() || self.fallbacks > 0
    }

    /// Prompt tokens left to prefill when the first `overlap_blocks` blocks are cached:
    /// `num_tokens − min(num_tokens, overlap_blocks × block_size)`, in tokens.
    pub fn uncached_tokens(&self, overlap_blocks: u32) -> u64 {
        self.num_tokens - self.num_tokens.min(self.cached_tokens(overlap_blocks))
    }

    /// Prompt tokens covered by `overlap_blocks` cached blocks, at most `num_tokens`.
    pub fn cached_tokens(&self, overlap_blocks: u32) -> u64 {
        (u64::from(overlap_blocks) * u64::from(self.block_size)).min(self.num_tokens)
    }

    /// The size of the request as policies see it.
    pub fn shape(&self) -> RequestShape {
        RequestShape {
            request_blocks: self.request_blocks,
            num_tokens: self.num_tokens,
            block_size: self.block_size.max(1),
        }
    }
}

/// The size of a request, in the units policies compute with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestShape {
    /// Prompt length in blocks (partial last block counted).
    pub request_blocks: u32,
    /// Prompt length in tokens.
    pub num_tokens: u64,
    /// Tokens per block, at least 1.
    pub block_size: u32,
}

/// Where a request was placed and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Selection {
    /// The chosen (worker, dp_rank); the request is now booked there.
    pub rank: WorkerRank,
    /// Leading prompt blocks cached on the chosen rank, in blocks (at most
    /// `request_blocks`).
    pub overlap_blocks: u32,
    /// Leading prompt blocks past `overlap_blocks` (and before the last prompt
    /// token) that requests already booked on the chosen rank hold, in blocks: an
    /// engine that caches blocks as it computes them may serve these too. 0 for a
    /// disaggregated decision.
    pub in_flight_blocks: u32,
    /// The policy that decided (after any per-request override).
    pub policy: PolicyKind,
    /// The chosen rank's cost or score under cost-based policies (`kv`: weighted
    /// blocks; `kv-normalized`: tokens); `None` for the others.
    pub cost: Option<f64>,
    /// The prefill load booked with the request, as computed at routing time.
    pub prefill: PrefillLoadHint,
    /// What session affinity did; `None` for a request without a session id (or with
    /// affinity off).
    pub session: Option<SessionOutcome>,
    /// The disaggregation decision: `Some` for a request that allowed it while a
    /// `prefill` worker was registered, `None` otherwise. Then `rank` is the decode
    /// rank, chosen by [`crate::disaggregation::decode_cost`] (and `cost` is that
    /// cost), and `prefill` above is the decode half's booking: 0 tokens when the
    /// prompt is prefilled remotely (it arrives by transfer).
    pub disaggregation: Option<PairDecision>,
    /// Up to [`ScheduleRequest::fallbacks`] alternates, best first, one per worker
    /// other than the chosen one's (`fallbacks.rs`); none for a disaggregated
    /// decision. Not booked.
    pub fallbacks: Fallbacks,
}

/// An alternate rank for a request, not booked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fallback {
    /// The (worker, dp_rank).
    pub rank: WorkerRank,
    /// Leading prompt blocks cached there, in blocks.
    pub overlap_blocks: u32,
}

/// The alternates of a [`Selection`], best first: at most
/// [`kv_events::routing::MAX_FALLBACKS`], held inline so a selection stays `Copy`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Fallbacks {
    items: [Option<Fallback>; MAX_FALLBACKS as usize],
}

impl Fallbacks {
    /// Appends `fallback`; `false` (and nothing kept) when full.
    pub fn push(&mut self, fallback: Fallback) -> bool {
        match self.items.iter_mut().find(|f| f.is_none()) {
            Some(slot) => {
                *slot = Some(fallback);
                true
            }
            None => false,
        }
    }

    /// The alternates, best first.
    pub fn iter(&self) -> impl Iterator<Item = &Fallback> {
        self.items.iter().map_while(Option::as_ref)
    }

    /// How many alternates are listed.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether none is listed.
    pub fn is_empty(&self) -> bool {
        self.items[0].is_none()
    }
}

/// Where a request that allowed disaggregation is prefilled, and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairDecision {
    /// Why: `long_uncached` when `prefill` is set, else why the decode rank
    /// prefills the prompt itself.
    pub reason: DisaggregationReason,
    /// The prefill rank, booked under the request's prefill booking id
    /// (`kv_events::disaggregation::prefill_booking_id`); `None` when the decode
    /// rank prefills.
    pub prefill: Option<PrefillChoice>,
}

/// The prefill half of a disaggregated request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillChoice {
    /// The prefill (worker, dp_rank).
    pub rank: WorkerRank,
    /// Leading prompt blocks cached there, in blocks (at most `request_blocks`).
    pub overlap_blocks: u32,
    /// The prefill load booked there: the prompt's tokens not cached there.
    pub prefill: PrefillLoadHint,
    /// Its cost or score under the request's policy, as [`Selection::cost`].
    pub cost: Option<f64>,
}

/// What session affinity ([`crate::sessions`]) did for one request that carried a
/// session id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionOutcome {
    /// Served by the session's last rank (the policy's pick, or kept within the
    /// margin).
    Hit,
    /// The session's last rank was a priced candidate, but another was cheaper by
    /// more than the margin.
    Override,
    /// No last rank to prefer: a new, expired, evicted or departed session, or a
    /// last rank that is not a candidate now (busy, silent, excluded, pinned away)
    /// or not priced by the policy.
    Miss,
}

impl SessionOutcome {
    /// A metric label: `hit`, `override` or `miss`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hit => "hit",
            Self::Override => "override",
            Self::Miss => "miss",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_stops_before_the_last_prompt_token() {
        use crate::tests::{scheduler, with_policy};
        use crate::{KvPolicyConfig, PolicyConfig};
        use std::collections::HashMap;
        use std::time::Instant;
        const BLOCK: u32 = 16;
        let prompt = |id: &str, num_tokens: u64| {
            let hashes = (0..num_tokens / u64::from(BLOCK))
                .map(|i| LocalBlockHash(1000 + i))
                .collect();
            ScheduleRequest::new(id, hashes, num_tokens, BLOCK)
        };
        let mut s = scheduler(
            with_policy(PolicyConfig::Kv(KvPolicyConfig::default())),
            &[(1, 1)],
        );
        let t = Instant::now();
        let held = HashMap::from([(WorkerRank::new(WorkerId(1), DpRank(0)), 4)]);
        // An exactly block-aligned prompt of 4 blocks held in full: the engine computes
        // its last token again, so it reuses 3 blocks (vLLM reports 3 × BLOCK cached
        // tokens).
        let aligned = prompt("aligned", 4 * u64::from(BLOCK));
        assert_eq!(aligned.reusable_blocks(), 3);
        assert_eq!(s.schedule(&aligned, &held, t).unwrap().overlap_blocks, 3);
        // One token more: all 4 full blocks are before the last token.
        let longer = prompt("longer", 4 * u64::from(BLOCK) + 1);
        assert_eq!(longer.reusable_blocks(), 4);
        assert_eq!(s.schedule(&longer, &held, t).unwrap().overlap_blocks, 4);
        // A one-token prompt reuses nothing.
        assert_eq!(prompt("one", 1).reusable_blocks(), 0);
    }

    #[test]
    fn in_flight_blocks_name_the_prefix_booked_requests_share_past_the_overlap() {
        use crate::tests::{scheduler, with_policy};
        use crate::{KvPolicyConfig, PolicyConfig};
        use std::collections::HashMap;
        use std::time::Instant;
        const BLOCK: u32 = 16;
        let prompt = |id: &str, hashes: &[u64], num_tokens: u64| {
            let hashes = hashes.iter().copied().map(LocalBlockHash).collect();
            ScheduleRequest::new(id, hashes, num_tokens, BLOCK)
        };
        let mut s = scheduler(
            with_policy(PolicyConfig::Kv(KvPolicyConfig::default())),
            &[(1, 1)],
        );
        let t = Instant::now();
        let none = HashMap::new();
        let first = prompt("first", &[1, 2, 3, 4], 4 * u64::from(BLOCK) + 1);
        let sel = s.schedule(&first, &none, t).unwrap();
        assert_eq!((sel.overlap_blocks, sel.in_flight_blocks), (0, 0));
        // Shares 3 blocks with the booked request, none indexed yet.
        let second = prompt("second", &[1, 2, 3, 9, 10], 5 * u64::from(BLOCK) + 1);
        let sel = s.schedule(&second, &none, t).unwrap();
        assert_eq!((sel.overlap_blocks, sel.in_flight_blocks), (0, 3));
        // One block indexed: the in-flight share starts past it.
        let rank = WorkerRank::new(WorkerId(1), DpRank(0));
        let third = prompt("third", &[1, 2, 3, 4, 5], 5 * u64::from(BLOCK) + 1);
        let sel = s.schedule(&third, &HashMap::from([(rank, 1)]), t).unwrap();
        assert_eq!((sel.overlap_blocks, sel.in_flight_blocks), (1, 3));
        // Capped at the full blocks before the last token, like the overlap.
        let aligned = prompt("aligned", &[1, 2, 3, 4], 4 * u64::from(BLOCK));
        let sel = s.schedule(&aligned, &none, t).unwrap();
        assert_eq!((sel.overlap_blocks, sel.in_flight_blocks), (0, 3));
        // Freed requests share nothing.
        for id in ["first", "second", "third", "aligned"] {
            s.free(&RequestId::from(id), t).unwrap();
        }
        let sel = s.schedule(&prompt("alone", &[1, 2], 40), &none, t).unwrap();
        assert_eq!(sel.in_flight_blocks, 0);
    }

    fn req(num_tokens: u64, block_size: u32) -> ScheduleRequest {
        ScheduleRequest::new("r", Vec::new(), num_tokens, block_size)
    }

    #[test]
    fn uncached_tokens_subtracts_cached_prefix_and_saturates() {
        assert_eq!(req(100, 16).uncached_tokens(0), 100);
        assert_eq!(req(100, 16).uncached_tokens(3), 52);
        // A fully cached prompt whose last block is partial: nothing left to prefill.
        assert_eq!(req(100, 16).uncached_tokens(7), 0);
        assert_eq!(req(100, 16).cached_tokens(7), 100);
        assert_eq!(
            req(u64::MAX, u32::MAX).uncached_tokens(u32::MAX),
            u64::MAX - u64::from(u32::MAX) * u64::from(u32::MAX)
        );
    }

    #[test]
    fn request_blocks_count_the_partial_block_and_every_hash() {
        assert_eq!(req(100, 16).request_blocks, 7);
        assert_eq!(req(96, 16).request_blocks, 6);
        let hashes = vec![LocalBlockHash(1), LocalBlockHash(2), LocalBlockHash(3)];
        assert_eq!(
            ScheduleRequest::new("r", hashes, 10, 16).request_blocks,
            3,
            "more hashes than tokens need: every hash is a block"
        );
        assert_eq!(req(u64::MAX, 1).request_blocks, u32::MAX);
        assert_eq!(req(5, 0).shape().block_size, 1);
    }
}
