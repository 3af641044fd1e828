//! Baselines for A/B comparisons: `round-robin`, `random` and `least-loaded`. None of
//! them looks at the cache.
//!
//! - `round-robin`: the first eligible rank after the one it chose last, in
//!   (worker id, dp_rank) order, wrapping around.
//! - `random`: an eligible rank uniformly at random.
//! - `least-loaded`: the lowest booked load in blocks,
//!   `active_decode_blocks + active_prefill_tokens / block_size` (the rank's KV
//!   footprint plus its queued prefill); ties go to fewer active requests, then
//!   uniformly at random.

use super::context::{Candidate, Choice, SelectContext};
use super::sampling::pick_min;
use kv_events::WorkerRank;
use rand::Rng;
use rand::rngs::StdRng;

pub(super) fn round_robin(candidates: &[Candidate], last: &mut Option<WorkerRank>) -> Choice {
    let index = last
        .and_then(|prev| candidates.iter().position(|c| c.rank > prev))
        .unwrap_or(0);
    *last = Some(candidates[index].rank);
    Choice { index, cost: None }
}

pub(super) fn random(candidates: &[Candidate], rng: &mut StdRng) -> Choice {
    Choice {
        index: rng.random_range(0..candidates.len()),
        cost: None,
    }
}

/// The booked load of a candidate in blocks, as `least-loaded` ranks it.
pub fn load_blocks(c: &Candidate, block_size: u32) -> f64 {
    c.load.active_decode_blocks as f64
        + c.load.active_prefill_tokens as f64 / f64::from(block_size.max(1))
}

pub(super) fn least_loaded(
    ctx: &SelectContext<'_>,
    keys: &mut Vec<(f64, f64)>,
    rng: &mut StdRng,
) -> Choice {
    keys.clear();
    keys.extend(ctx.candidates.iter().map(|c| {
        (
            load_blocks(c, ctx.request.block_size),
            c.load.active_requests as f64,
        )
    }));
    Choice {
        index: pick_min(rng, keys),
        cost: None,
    }
}

#[cfg(test)]
#[path = "baseline_tests.rs"]
mod tests;
