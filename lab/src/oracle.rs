//! The oracle bound: the prefix-cache hit rate of one infinite cache that every
//! request can use, with every earlier request's prompt already in it.
//!
//! No policy can beat it. A rank admits its requests in arrival order (FCFS), so any
//! block cached on the rank that admits request `i` was computed for a request that
//! arrived before `i`; the oracle holds every such block, and more (blocks of requests
//! still queued, and of every other rank). It is computed in the engine's units — full
//! engine blocks of the leading run, times the block size, over prompt tokens — exactly
//! as the engines report `cached_tokens`, so the two are comparable.
//!
//! Cost: one pass over the prepared trace, one chained hash per full block and one
//! hash-set entry per distinct block.

use crate::sim::PreparedTrace;
use engine_model::chain_block_hashes;
use kv_events::ExternalBlockHash;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// The oracle's result.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OracleBound {
    /// Σ cached tokens / Σ prompt tokens; 0 for an empty trace.
    pub hit_rate: f64,
    /// Prompt tokens the infinite cache serves, in tokens.
    pub cached_tokens: u64,
    /// Prompt tokens of the whole trace, in tokens.
    pub prompt_tokens: u64,
}

/// Computes the oracle bound of `trace` (see the module docs). Only full engine blocks
/// count, as in the engine: a prompt of `p` tokens has `floor(p / block_size)`
/// cacheable blocks.
pub fn oracle_bound(trace: &PreparedTrace) -> OracleBound {
    let bs = u64::from(trace.block_size());
    let mut seen: HashSet<ExternalBlockHash> = HashSet::new();
    let (mut cached, mut prompt) = (0u64, 0u64);
    for (tokens, hashes) in trace.prompts() {
        let full = (tokens / bs).min(hashes.len() as u64) as usize;
        // Chained like the engine's cache keys, so a block only matches behind the
        // same prefix.
        let cacheable = chain_block_hashes(&hashes[..full]);
        let hit = cacheable
            .iter()
            .take_while(|b| seen.contains(&b.block_hash))
            .count() as u64;
        cached += hit * bs;
        prompt += tokens;
        seen.extend(cacheable.iter().map(|b| b.block_hash));
    }
    OracleBound {
        hit_rate: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        cached_tokens: cached,
        prompt_tokens: prompt,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_model::trace::{BlockMapping, TraceRequest};

    fn request(t: u64, input_length: u64, hash_ids: Vec<u64>) -> TraceRequest {
        TraceRequest {
            timestamp_ms: t,
            input_length,
            output_length: 1,
            hash_ids,
        }
    }

    #[test]
    fn counts_the_leading_run_of_blocks_seen_before() {
        let trace = [
            // 2 trace blocks, 1,000 tokens: 15 full engine blocks of 64 (the last partial).
            request(0, 1_000, vec![1, 2]),
            // Shares trace block 1 (8 engine blocks), then diverges.
            request(1, 1_024, vec![1, 3]),
            // Same two blocks as the first, whole: its 15 full engine blocks were
            // seen (the 16th was partial in the first request and never cached).
            request(2, 1_024, vec![1, 2]),
            // Block 2 behind no block 1: a different prefix, no leading run.
            request(3, 512, vec![2]),
        ];
        let prepared = PreparedTrace::new(&trace, BlockMapping::new(64).unwrap());
        let bound = oracle_bound(&prepared);
        assert_eq!(bound.prompt_tokens, 1_000 + 1_024 + 1_024 + 512);
        assert_eq!(bound.cached_tokens, (8 + 15) * 64);
        let expected = (23.0 * 64.0) / 3_560.0;
        assert!((bound.hit_rate - expected).abs() < 1e-12);
    }

    #[test]
    fn empty_trace_has_a_zero_bound() {
        let prepared = PreparedTrace::new(&[], BlockMapping::new(64).unwrap());
        assert_eq!(oracle_bound(&prepared).hit_rate, 0.0);
    }
}
