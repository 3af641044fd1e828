//! Picking one (worker, dp_rank) among the registered candidates.
//!
//! Three policies: the KV-aware cost (default), round-robin and uniform random, the
//! latter two as baselines for A/B comparisons. Selection is O(candidates) with no
//! allocation; the RNG is injected so a seeded scheduler is fully reproducible.
//!
//! # KV cost
//! For a prompt of `request_blocks` blocks, each candidate rank gets
//!
//! ```text
//! cost(rank) = overlap_weight × (request_blocks − overlap_blocks(rank))
//!            + active_decode_blocks(rank)
//! ```
//!
//! The first term is the prefill work the rank would do (uncached prompt blocks, which
//! drive TTFT); the second is the decode load already booked there (which drives ITL).
//! This is the worker cost of NVIDIA Dynamo's KV router (`--kv-overlap-score-weight`,
//! `--router-temperature`; see Dynamo's `docs/architecture/kv_cache_routing.md`),
//! simplified: Dynamo also adds pending prefill tokens to the prefill term, while here
//! only the request's own uncached blocks count.
//!
//! With temperature 0 the lowest cost wins and exact ties are broken uniformly at
//! random. With temperature `T > 0`, costs are min-max normalized to `[0, 1]`
//! (`n = (cost − min) / (max − min)`, all 0 when every cost is equal) and a rank is
//! sampled with probability `softmax(−n / T)`. Normalizing makes `T` independent of
//! prompt length and cluster load: at `T = 1` the worst rank is `e` times less likely
//! than the best; as `T → ∞` the choice approaches uniform.

use crate::config::{KvPolicyConfig, PolicyConfig};
use crate::error::SchedulerError;
use kv_events::WorkerRank;
use rand::Rng;
use rand::rngs::StdRng;

/// One rank as the selector sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The (worker, dp_rank).
    pub rank: WorkerRank,
    /// Leading prompt blocks already cached there, in blocks.
    pub overlap_blocks: u32,
    /// Decode load booked there, in blocks.
    pub active_decode_blocks: u64,
}

/// The outcome of a selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Index of the chosen candidate in the slice passed to [`Selector::select`].
    pub index: usize,
    /// The chosen candidate's KV cost, in blocks; `None` for cost-free policies.
    pub cost: Option<f64>,
}

/// KV cost of one rank, in (weighted) blocks; see the module docs for the formula.
/// An overlap larger than the prompt counts as a full hit (no negative prefill).
pub fn kv_cost(
    overlap_weight: f64,
    request_blocks: u32,
    overlap_blocks: u32,
    active_decode_blocks: u64,
) -> f64 {
    let uncached = request_blocks.saturating_sub(overlap_blocks);
    overlap_weight * f64::from(uncached) + active_decode_blocks as f64
}

/// Stateful selector: owns the RNG and the round-robin cursor.
#[derive(Debug, Clone)]
pub struct Selector {
    rng: StdRng,
    /// The rank round-robin chose last; the next turn goes to the first rank after it.
    last_round_robin: Option<WorkerRank>,
}

impl Selector {
    /// A selector drawing randomness from `rng`.
    pub fn new(rng: StdRng) -> Self {
        Self {
            rng,
            last_round_robin: None,
        }
    }

    /// Chooses one of `candidates` under `policy` for a prompt of `request_blocks`
    /// blocks. `candidates` must be sorted by rank (as
    /// [`crate::workers::WorkerRegistry::ranks`] is) for round-robin order to hold.
    ///
    /// # Errors
    /// [`SchedulerError::NoWorkers`] when `candidates` is empty.
    pub fn select(
        &mut self,
        policy: &PolicyConfig,
        request_blocks: u32,
        candidates: &[Candidate],
    ) -> Result<Choice, SchedulerError> {
        if candidates.is_empty() {
            return Err(SchedulerError::NoWorkers);
        }
        Ok(match policy {
            PolicyConfig::Kv(kv) => self.select_kv(kv, request_blocks, candidates),
            PolicyConfig::RoundRobin => self.select_round_robin(candidates),
            PolicyConfig::Random => Choice {
                index: self.rng.random_range(0..candidates.len()),
                cost: None,
            },
        })
    }

    fn select_kv(
        &mut self,
        kv: &KvPolicyConfig,
        request_blocks: u32,
        candidates: &[Candidate],
    ) -> Choice {
        let cost = |c: &Candidate| {
            kv_cost(
                kv.overlap_weight,
                request_blocks,
                c.overlap_blocks,
                c.active_decode_blocks,
            )
        };
        let (min, max) = candidates
            .iter()
            .map(cost)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
                (lo.min(c), hi.max(c))
            });
        let index = if kv.temperature > 0.0 && max > min {
            self.softmax_sample(candidates.iter().map(cost), min, max, kv.temperature)
        } else {
            self.pick_tied(candidates.iter().map(cost), min)
        };
        Choice {
            index,
            cost: Some(cost(&candidates[index])),
        }
    }

    /// Uniformly picks one of the positions whose cost equals `min` exactly.
    fn pick_tied(&mut self, costs: impl Iterator<Item = f64> + Clone, min: f64) -> usize {
        let tied = costs.clone().filter(|&c| c == min).count();
        let k = if tied > 1 {
            self.rng.random_range(0..tied)
        } else {
            0
        };
        costs
            .enumerate()
            .filter(|&(_, c)| c == min)
            .nth(k)
            .map_or(0, |(i, _)| i)
    }

    /// Samples a position with probability `softmax(−(cost − min) / (max − min) / t)`.
    /// Requires `max > min` and `t > 0`. Exponents lie in `[−1/t, 0]`, so the weights
    /// cannot overflow and the best rank always has weight 1.
    fn softmax_sample(
        &mut self,
        costs: impl Iterator<Item = f64> + Clone,
        min: f64,
        max: f64,
        t: f64,
    ) -> usize {
        let weight = |c: f64| (-((c - min) / (max - min)) / t).exp();
        let total: f64 = costs.clone().map(weight).sum();
        let mut draw = self.rng.random::<f64>() * total;
        let mut best = 0;
        for (i, c) in costs.enumerate() {
            if c == min {
                best = i;
            }
            let w = weight(c);
            if draw < w {
                return i;
            }
            draw -= w;
        }
        // Only reachable through floating-point rounding of `total`.
        best
    }

    fn select_round_robin(&mut self, candidates: &[Candidate]) -> Choice {
        let index = self
            .last_round_robin
            .and_then(|last| candidates.iter().position(|c| c.rank > last))
            .unwrap_or(0);
        self.last_round_robin = Some(candidates[index].rank);
        Choice { index, cost: None }
    }
}

#[cfg(test)]
#[path = "selector_tests.rs"]
mod tests;
