//! The lab's router for prototype costs ([`Candidate`]): evaluates a cost per rank
//! and keeps the load it booked itself (pending prefill tokens, decode blocks, active
//! requests) through each request's lifecycle, as the scheduler's active sequences do.
//! Each decision is O(ranks); booking is O(1).
//!
//! Every prototype breaks exact ties uniformly at random from a seeded RNG, as the
//! scheduler's `kv` policy does.

use super::candidates::{BaseShape, Candidate};
use crate::engine::{EngineModelConfig, TimingModel};
use kv_events::RequestId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Load the router booked on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankBooking {
    /// Uncached prompt tokens of requests without a first token yet, in tokens.
    pub pending_prefill_tokens: u64,
    /// Prompt blocks of active requests, in blocks.
    pub decode_blocks: u64,
    /// Active (booked, not freed) requests.
    pub requests: u64,
}

#[derive(Debug, Clone, Copy)]
struct Booking {
    rank: usize,
    prefill_tokens: u64,
    blocks: u64,
    prefill_done: bool,
}

/// One prototype with its booked-load write model.
#[derive(Debug)]
pub struct CandidateRouter {
    candidate: Candidate,
    engine: EngineModelConfig,
    timing: TimingModel,
    ranks: Vec<RankBooking>,
    requests: HashMap<RequestId, Booking>,
    rng: StdRng,
    costs: Vec<f64>,
}

impl CandidateRouter {
    /// A router over `ranks` ranks of the given engine model, seeded with `seed`.
    pub fn new(
        candidate: Candidate,
        ranks: usize,
        engine: EngineModelConfig,
        timing: TimingModel,
        seed: u64,
    ) -> Self {
        Self {
            candidate,
            engine,
            timing,
            ranks: vec![RankBooking::default(); ranks],
            requests: HashMap::new(),
            rng: StdRng::seed_from_u64(seed),
            costs: Vec::with_capacity(ranks),
        }
    }

    /// The booked load of rank `index`.
    pub fn booking(&self, index: usize) -> Option<RankBooking> {
        self.ranks.get(index).copied()
    }

    /// The cost of placing a prompt of `num_tokens` tokens on a rank with
    /// `overlap_blocks` cached and `load` booked, when the least-loaded rank has
    /// `min_pending` pending prefill tokens (formula in [`Candidate`]).
    pub fn cost(
        &self,
        load: RankBooking,
        overlap_blocks: u32,
        num_tokens: u64,
        min_pending: u64,
    ) -> f64 {
        let Candidate::PredictedTtft(k) = self.candidate;
        let t = &self.timing;
        let bs = u64::from(self.engine.block_size);
        let budget = self.engine.max_num_batched_tokens.max(1);
        let cached = (u64::from(overlap_blocks) * bs).min(num_tokens);
        let pending = load.pending_prefill_tokens;
        let excess = pending.saturating_sub(min_pending) as f64 / budget as f64;
        let credit = if (cached as f64) < k.min_match_ratio * num_tokens as f64 {
            1.0
        } else {
            // Only these shapes read the whole fleet; the others stay O(1) per rank.
            let (mean_pending, busy_share) = match k.base_shape {
                BaseShape::MixMean { .. } | BaseShape::MixBusy { .. } if !self.ranks.is_empty() => {
                    let n = self.ranks.len() as f64;
                    let pending = self.ranks.iter().map(|r| r.pending_prefill_tokens);
                    let busy = pending.clone().filter(|&p| p >= budget).count();
                    (pending.sum::<u64>() as f64 / n, busy as f64 / n)
                }
                _ => (0.0, 0.0),
            };
            let f = k.base_shape.factor(
                excess,
                min_pending as f64 / budget as f64,
                mean_pending / budget as f64,
                busy_share,
            );
            1.0 + (k.base_credit - 1.0) * f
                + k.balanced_credit / (1.0 + excess)
                + k.backlog_credit * min_pending as f64 / budget as f64
        };
        let steps = (pending + num_tokens - cached).div_ceil(budget).max(1);
        let per_step = t.step_base_ms
            + t.decode_ms_per_seq * load.requests as f64
            + t.kv_read_ms_per_token * (load.decode_blocks * bs) as f64;
        t.prefill_ms_per_token * (pending as f64 + num_tokens as f64 - credit * cached as f64)
            + steps as f64 * per_step
    }

    /// Chooses a rank given each rank's overlap blocks (`overlaps[i]` for rank `i`)
    /// and books the request there. Returns `None` when there are no ranks.
    pub fn route(
        &mut self,
        id: &RequestId,
        overlaps: &[u32],
        request_blocks: u32,
        num_tokens: u64,
    ) -> Option<usize> {
        let min_pending = self
            .ranks
            .iter()
            .map(|r| r.pending_prefill_tokens)
            .min()
            .unwrap_or(0);
        let mut costs = std::mem::take(&mut self.costs);
        costs.clear();
        costs.extend(
            self.ranks
                .iter()
                .zip(overlaps)
                .map(|(load, &o)| self.cost(*load, o.min(request_blocks), num_tokens, min_pending)),
        );
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let tied = costs.iter().filter(|&&c| c == min).count();
        let pick = if tied > 1 {
            self.rng.random_range(0..tied)
        } else {
            0
        };
        let chosen = costs
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c == min)
            .nth(pick)
            .map(|(i, _)| i);
        self.costs = costs;
        let rank = chosen?;
        let bs = u64::from(self.engine.block_size);
        let overlap = overlaps.get(rank).copied().unwrap_or(0).min(request_blocks);
        let booking = Booking {
            rank,
            prefill_tokens: num_tokens.saturating_sub(u64::from(overlap) * bs),
            blocks: u64::from(request_blocks),
            prefill_done: false,
        };
        let load = &mut self.ranks[rank];
        load.pending_prefill_tokens += booking.prefill_tokens;
        load.decode_blocks += booking.blocks;
        load.requests += 1;
        self.requests.insert(id.clone(), booking);
        Some(rank)
    }

    /// The request produced its first token: its prefill leaves the pending load.
    pub fn prefill_done(&mut self, id: &RequestId) {
        if let Some(b) = self.requests.get_mut(id)
            && !b.prefill_done
        {
            b.prefill_done = true;
            let load = &mut self.ranks[b.rank];
            load.pending_prefill_tokens -= b.prefill_tokens;
        }
    }

    /// The request ended: everything it booked is released.
    pub fn free(&mut self, id: &RequestId) {
        let Some(b) = self.requests.remove(id) else {
            return;
        };
        let load = &mut self.ranks[b.rank];
        if !b.prefill_done {
            load.pending_prefill_tokens -= b.prefill_tokens;
        }
        load.decode_blocks -= b.blocks;
        load.requests -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::candidates::{BaseShape, PredictedTtftKnobs};

    fn router(candidate: Candidate, ranks: usize) -> CandidateRouter {
        let engine = EngineModelConfig {
            block_size: 64,
            num_gpu_blocks: 1_000,
            max_num_seqs: 16,
            max_num_batched_tokens: 1_000,
        };
        let timing = TimingModel {
            step_base_ms: 10.0,
            prefill_ms_per_token: 0.1,
            decode_ms_per_seq: 1.0,
            kv_read_ms_per_token: 0.001,
        };
        CandidateRouter::new(candidate, ranks, engine, timing, 7)
    }

    #[test]
    fn predicted_ttft_matches_a_hand_computation() {
        let r = router(Candidate::TTFT, 1);
        let load = RankBooking {
            pending_prefill_tokens: 1_500,
            decode_blocks: 10,
            requests: 2,
        };
        // 640 tokens, 4 blocks (256 tokens) cached: 1500 + 384 = 1884 tokens to
        // prefill, 2 steps of 10 + 1*2 + 0.001*640 = 12.64 ms, plus 0.1 * 1884 ms.
        let cost = r.cost(load, 4, 640, 0);
        assert!((cost - (188.4 + 2.0 * 12.64)).abs() < 1e-9, "{cost}");
        // An idle rank holding the whole prompt still costs one step.
        let idle = r.cost(RankBooking::default(), 10, 640, 0);
        assert!((idle - 10.0).abs() < 1e-9, "{idle}");
    }

    #[test]
    fn credits_decay_with_excess_pending_and_grow_with_backlog() {
        let knobs = PredictedTtftKnobs {
            in_flight: false,
            base_credit: 2.0,
            base_shape: BaseShape::Flat,
            balanced_credit: 4.0,
            backlog_credit: 1.0,
            min_match_ratio: 0.0,
        };
        let r = router(Candidate::PredictedTtft(knobs), 1);
        // The credit per cached token: one more cached block (64 tokens) lowers the
        // cost by 0.1 ms × credit × 64 (same step count here).
        let credit = |pending: u64, min_pending: u64| {
            let load = RankBooking {
                pending_prefill_tokens: pending,
                ..RankBooking::default()
            };
            (r.cost(load, 0, 640, min_pending) - r.cost(load, 1, 640, min_pending)) / 6.4
        };
        // At the minimum: 2 + 4 / 1 + 0.
        assert!((credit(0, 0) - 6.0).abs() < 1e-9);
        // One budget (1,000 tokens) above the minimum: 2 + 4 / 2.
        assert!((credit(1_000, 0) - 4.0).abs() < 1e-9);
        // A backlog of two budgets everywhere: 2 + 4 + 1 × 2.
        assert!((credit(2_000, 2_000) - 8.0).abs() < 1e-9);
    }

    #[test]
    fn mix_mean_keeps_the_base_credit_while_the_fleet_mostly_queues() {
        let credit = |shape: BaseShape| {
            let mut r = router(
                Candidate::PredictedTtft(PredictedTtftKnobs {
                    in_flight: false,
                    base_credit: 3.0,
                    base_shape: shape,
                    balanced_credit: 0.0,
                    backlog_credit: 0.0,
                    min_match_ratio: 0.0,
                }),
                2,
            );
            // One idle rank, one with three budgets queued: the mean is 1.5 budgets.
            r.ranks[1].pending_prefill_tokens = 3_000;
            let load = r.ranks[1];
            (r.cost(load, 0, 640, 0) - r.cost(load, 1, 640, 0)) / 6.4
        };
        // `mix:1` decays to 1 + 2 / (1 + 3); `mix-mean:1` keeps the full 3.
        assert!((credit(BaseShape::Mix { steps: 1.0 }) - 1.5).abs() < 1e-9);
        assert!((credit(BaseShape::MixMean { steps: 1.0 }) - 3.0).abs() < 1e-9);
    }

    #[test]
    fn credits_apply_only_above_the_match_ratio() {
        let knobs = PredictedTtftKnobs {
            in_flight: false,
            base_credit: 5.0,
            base_shape: BaseShape::Flat,
            balanced_credit: 0.0,
            backlog_credit: 0.0,
            min_match_ratio: 0.5,
        };
        let r = router(Candidate::PredictedTtft(knobs), 1);
        let idle = RankBooking::default();
        // 640 tokens: 4 blocks (40%) cached earn credit 1, 5 blocks (50%) credit 5.
        let below = r.cost(idle, 0, 640, 0) - r.cost(idle, 4, 640, 0);
        assert!((below - 0.1 * 256.0).abs() < 1e-9, "{below}");
        let above = r.cost(idle, 0, 640, 0) - r.cost(idle, 5, 640, 0);
        assert!((above - 0.1 * 5.0 * 320.0).abs() < 1e-9, "{above}");
    }

    #[test]
    fn booking_follows_the_lifecycle() {
        let mut r = router(Candidate::TTFT, 2);
        let a = RequestId::from("a");
        // Rank 1 holds the whole prompt: it wins.
        assert_eq!(r.route(&a, &[0, 10], 10, 640), Some(1));
        assert_eq!(
            r.booking(1),
            Some(RankBooking {
                pending_prefill_tokens: 0,
                decode_blocks: 10,
                requests: 1
            })
        );
        let b = RequestId::from("b");
        // Nothing cached anywhere: the idle rank 0 wins.
        assert_eq!(r.route(&b, &[0, 0], 10, 640), Some(0));
        assert_eq!(r.booking(0).unwrap().pending_prefill_tokens, 640);
        r.prefill_done(&b);
        r.prefill_done(&b);
        assert_eq!(r.booking(0).unwrap().pending_prefill_tokens, 0);
        r.free(&b);
        r.free(&a);
        r.free(&a);
        assert_eq!(r.booking(0), Some(RankBooking::default()));
        assert_eq!(r.booking(1), Some(RankBooking::default()));
        assert_eq!(router(Candidate::TTFT, 0).route(&a, &[], 1, 1), None);
    }

    #[test]
    fn exact_ties_are_spread() {
        let mut r = router(Candidate::TTFT, 4);
        let mut hit = [false; 4];
        for i in 0..64 {
            let id = RequestId(format!("r{i}"));
            let rank = r.route(&id, &[0, 0, 0, 0], 1, 64).unwrap();
            hit[rank] = true;
            r.free(&id);
        }
        assert_eq!(hit, [true; 4]);
    }
}
