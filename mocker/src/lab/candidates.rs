//! Prototype routing costs, evaluated by the lab itself rather than by the
//! `scheduler` crate.
//!
//! A new cost idea is cheapest to try here: the lab gives it the same inputs the
//! scheduler has at decision time — the index's overlap blocks per rank and the load
//! the router booked itself (pending prefill tokens, decode blocks, active requests) —
//! and runs it on the same simulated cluster as the real policies. An idea that wins
//! becomes a scheduler policy; its prototype stays here so the exploration in
//! `docs/benchmarks.md` can be re-run. Each decision is O(ranks); booking is O(1).
//!
//! Every prototype breaks exact ties uniformly at random from a seeded RNG, as the
//! scheduler's `kv` policy does.

use crate::engine::{EngineModelConfig, TimingModel};
use kv_events::RequestId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// A prototype cost. Lower wins.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Candidate {
    /// Predicted time to first token on the rank, in model ms, from the timing model:
    /// with `W` = booked pending prefill tokens + this request's uncached tokens,
    /// `T = prefill_ms_per_token × W + ceil(W / max_num_batched_tokens) × (step_base_ms
    /// + decode_ms_per_seq × active requests + kv_read_ms_per_token × active decode
    /// blocks × block_size)`: the rank prefills everything queued before this request
    /// (FCFS) and every prefill step also carries the running decodes.
    PredictedTtft,
    /// [`Candidate::PredictedTtft`], with each rank's overlap taken as the larger of
    /// the index's and the in-flight prefixes' (prompt blocks of requests booked there
    /// and not yet freed; see [`super::inflight`]).
    PredictedTtftInFlight,
    /// NVIDIA Dynamo's full worker cost (its KV router's `prefill blocks + decode
    /// blocks`, with pending prefill counted): uncached prompt blocks + booked pending
    /// prefill blocks + active decode blocks, in blocks.
    KvPending,
}

impl Candidate {
    /// Every prototype, in documentation order.
    pub const ALL: [Candidate; 3] = [
        Candidate::PredictedTtft,
        Candidate::PredictedTtftInFlight,
        Candidate::KvPending,
    ];

    /// Whether the router should credit in-flight prefixes (see [`super::inflight`]).
    pub fn uses_in_flight(self) -> bool {
        matches!(self, Candidate::PredictedTtftInFlight)
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Candidate::PredictedTtft => "predicted-ttft",
            Candidate::PredictedTtftInFlight => "predicted-ttft-inflight",
            Candidate::KvPending => "kv-pending",
        }
    }
}

impl std::str::FromStr for Candidate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Candidate::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Candidate::ALL.iter().map(|c| c.name()).collect();
                format!("unknown candidate `{s}` (expected one of {})", names.join(", "))
            })
    }
}

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

    /// The cost of placing a prompt of `request_blocks` blocks and `num_tokens` tokens
    /// on a rank with `overlap_blocks` cached and `load` booked.
    pub fn cost(&self, load: RankBooking, overlap_blocks: u32, request_blocks: u32, num_tokens: u64) -> f64 {
        let bs = u64::from(self.engine.block_size);
        let uncached_tokens = num_tokens.saturating_sub(u64::from(overlap_blocks) * bs);
        match self.candidate {
            Candidate::PredictedTtft | Candidate::PredictedTtftInFlight => {
                let t = &self.timing;
                let mut w: f64 = std::env::var("LAB_W").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0);
                if let Some(k) = std::env::var("LAB_K").ok().and_then(|v| v.parse::<f64>().ok()) {
                    let min_pending = self.ranks.iter().map(|r| r.pending_prefill_tokens).min().unwrap_or(0);
                    w += k * min_pending as f64 / self.engine.max_num_batched_tokens as f64;
                }
                let pw: f64 = std::env::var("LAB_PW").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0);
                let dw: f64 = std::env::var("LAB_DW").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0);
                let work = load.pending_prefill_tokens + uncached_tokens;
                let steps = work.div_ceil(self.engine.max_num_batched_tokens).max(1);
                let per_step = t.step_base_ms
                    + t.decode_ms_per_seq * load.requests as f64
                    + t.kv_read_ms_per_token * (load.decode_blocks * bs) as f64;
                if let Some(x) = std::env::var("LAB_X").ok().and_then(|v| v.parse::<f64>().ok()) {
                    let min_pending = self.ranks.iter().map(|r| r.pending_prefill_tokens).min().unwrap_or(0);
                    let b = self.engine.max_num_batched_tokens as f64;
                    let c = w + x / (1.0 + (load.pending_prefill_tokens - min_pending) as f64 / b);
                    let overlap_tokens = num_tokens - uncached_tokens;
                    return t.prefill_ms_per_token * (pw * load.pending_prefill_tokens as f64 + num_tokens as f64 - c * overlap_tokens as f64) + dw * steps as f64 * per_step;
                }
                if std::env::var("LAB_W").is_ok() || std::env::var("LAB_K").is_ok() {
                return t.prefill_ms_per_token * (pw * load.pending_prefill_tokens as f64 + w * uncached_tokens as f64) + dw * steps as f64 * per_step;
                }
                let steps = work.div_ceil(self.engine.max_num_batched_tokens).max(1);
                let per_step = t.step_base_ms
                    + t.decode_ms_per_seq * load.requests as f64
                    + t.kv_read_ms_per_token * (load.decode_blocks * bs) as f64;
                t.prefill_ms_per_token * work as f64 + steps as f64 * per_step
            }
            Candidate::KvPending => {
                let uncached = request_blocks.saturating_sub(overlap_blocks);
                f64::from(uncached)
                    + load.pending_prefill_tokens.div_ceil(bs) as f64
                    + load.decode_blocks as f64
            }
        }
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
        let mut costs = std::mem::take(&mut self.costs);
        costs.clear();
        costs.extend(
            self.ranks
                .iter()
                .zip(overlaps)
                .map(|(load, &o)| self.cost(*load, o.min(request_blocks), request_blocks, num_tokens)),
        );
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let tied = costs.iter().filter(|&&c| c == min).count();
        let pick = if tied > 1 { self.rng.random_range(0..tied) } else { 0 };
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
        let r = router(Candidate::PredictedTtft, 1);
        let load = RankBooking {
            pending_prefill_tokens: 1_500,
            decode_blocks: 10,
            requests: 2,
        };
        // 640 tokens, 4 of 10 blocks cached: 384 uncached; W = 1884 tokens, 2 steps of
        // 10 + 1*2 + 0.001*640 = 12.64 ms, plus 0.1 * 1884 = 188.4 ms.
        let cost = r.cost(load, 4, 10, 640);
        assert!((cost - (188.4 + 2.0 * 12.64)).abs() < 1e-9, "{cost}");
        // An idle rank still costs one step.
        let idle = r.cost(RankBooking::default(), 10, 10, 640);
        assert!((idle - 10.0).abs() < 1e-9, "{idle}");
    }

    #[test]
    fn kv_pending_counts_uncached_pending_and_decode_blocks() {
        let r = router(Candidate::KvPending, 1);
        let load = RankBooking {
            pending_prefill_tokens: 65,
            decode_blocks: 7,
            requests: 1,
        };
        // 10 - 4 uncached + ceil(65 / 64) pending + 7 decode.
        assert_eq!(r.cost(load, 4, 10, 640), 6.0 + 2.0 + 7.0);
    }

    #[test]
    fn booking_follows_the_lifecycle() {
        let mut r = router(Candidate::PredictedTtft, 2);
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
        assert_eq!(router(Candidate::KvPending, 0).route(&a, &[], 1, 1), None);
    }

    #[test]
    fn exact_ties_are_spread() {
        let mut r = router(Candidate::KvPending, 4);
        let mut hit = [false; 4];
        for i in 0..64 {
            let id = RequestId(format!("r{i}"));
            let rank = r.route(&id, &[0, 0, 0, 0], 1, 64).unwrap();
            hit[rank] = true;
            r.free(&id);
        }
        assert_eq!(hit, [true; 4]);
    }

    #[test]
    fn names_round_trip() {
        for c in Candidate::ALL {
            assert_eq!(c.name().parse::<Candidate>(), Ok(c));
        }
        assert!("nope".parse::<Candidate>().unwrap_err().contains("predicted-ttft"));
    }
}
