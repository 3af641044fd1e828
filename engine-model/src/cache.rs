//! The KV cache of one dp rank as the engine core drives it: the dense model's
//! [`KvCache`] (one full-attention group, optional CPU tier) or a hybrid model's
//! [`HybridCache`] (sliding-window groups beside the full-attention group).
//!
//! Why an enum and not a trait: the core needs both caches' whole surface (admission,
//! commits, release, events), the set of kinds is closed, and matching keeps the
//! dense path exactly as it was. Cost: one match per call.

use crate::hybrid::{GroupStore, HybridAllocation, HybridCache};
use crate::kv_cache::{Allocation, CacheInUse, KvCache, hit_candidates, prompt_block_tokens};
use kv_events::{ExternalBlockHash, KvCacheEventData, StoredBlock};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// One dp rank's KV cache: dense or hybrid (see the module docs).
#[derive(Debug, Clone)]
pub enum PagedCache {
    /// One full-attention group ([`KvCache`]).
    Dense(KvCache),
    /// Sliding-window groups beside the full-attention group ([`HybridCache`]).
    Hybrid(HybridCache),
}

/// The KV space one running request holds, in the cache's own kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CacheAllocation {
    Dense(Allocation),
    Hybrid(HybridAllocation),
}

impl CacheAllocation {
    /// Leading prompt blocks cached at admission (the engine's prefix hit), in blocks.
    pub fn hit_blocks(&self) -> usize {
        match self {
            Self::Dense(a) => a.hit_blocks(),
            Self::Hybrid(a) => a.hit_blocks(),
        }
    }

    /// Prompt blocks loaded back from the CPU tier at admission, in blocks.
    pub fn loaded_blocks(&self) -> usize {
        match self {
            Self::Dense(a) => a.loaded_blocks(),
            Self::Hybrid(_) => 0,
        }
    }

    /// Leading prompt blocks the request holds cached: the next block to commit.
    pub fn committed_blocks(&self) -> usize {
        match self {
            Self::Dense(a) => a.held().len(),
            Self::Hybrid(a) => a.committed_blocks(),
        }
    }

    /// Blocks the request occupies (held and reserved, every group), in blocks.
    pub fn total_blocks(&self) -> u64 {
        match self {
            Self::Dense(a) => a.total_blocks(),
            Self::Hybrid(a) => a.total_blocks(),
        }
    }
}

impl PagedCache {
    /// Capacity, in blocks (a hybrid rank's pool is shared by its groups).
    pub fn capacity(&self) -> u64 {
        match self {
            Self::Dense(c) => c.capacity(),
            Self::Hybrid(c) => c.occupancy().capacity,
        }
    }

    /// Blocks in use: cached (referenced or not) plus reserved, in blocks.
    pub fn used_blocks(&self) -> u64 {
        match self {
            Self::Dense(c) => c.used_blocks(),
            Self::Hybrid(c) => c.occupancy().used(),
        }
    }

    /// Blocks neither cached nor reserved, in blocks.
    pub fn free_blocks(&self) -> u64 {
        match self {
            Self::Dense(c) => c.free_blocks(),
            Self::Hybrid(c) => c.occupancy().free(),
        }
    }

    /// Cached blocks (every group's copies on a hybrid rank), in blocks.
    pub fn cached_blocks(&self) -> u64 {
        match self {
            Self::Dense(c) => c.cached_blocks(),
            Self::Hybrid(c) => c.occupancy().cached,
        }
    }

    /// Unreferenced cached blocks, which eviction may reclaim, in blocks.
    pub fn evictable_blocks(&self) -> u64 {
        match self {
            Self::Dense(c) => c.evictable_blocks(),
            Self::Hybrid(c) => c.occupancy().evictable,
        }
    }

    /// The cached blocks' hashes, in no order: the dense cache's, or those the hybrid
    /// rank's full-attention group holds (once each).
    pub fn cached_hashes(&self) -> impl Iterator<Item = ExternalBlockHash> + '_ {
        let hashes: Vec<ExternalBlockHash> = match self {
            Self::Dense(c) => c.cached_hashes().collect(),
            Self::Hybrid(c) => c
                .group_blocks(c.group_count() - 1)
                .map(|(h, _)| h)
                .collect(),
        };
        hashes.into_iter()
    }

    /// Blocks the CPU tier holds (0 without one, always on a hybrid rank).
    pub fn cpu_blocks(&self) -> u64 {
        match self {
            Self::Dense(c) => c.cpu_blocks(),
            Self::Hybrid(_) => 0,
        }
    }

    /// The dense cache, if this is one.
    pub fn dense(&self) -> Option<&KvCache> {
        match self {
            Self::Dense(c) => Some(c),
            Self::Hybrid(_) => None,
        }
    }

    /// The hybrid cache, if this is one.
    pub fn hybrid(&self) -> Option<&HybridCache> {
        match self {
            Self::Dense(_) => None,
            Self::Hybrid(c) => Some(c),
        }
    }

    /// The engine's prefix hit of `prompt` (chained full prompt blocks) of a
    /// `prompt_tokens`-token prompt, in blocks: the dense cache's leading cached run
    /// (GPU) within `(prompt_tokens − 1) / block_size` blocks (the last prompt token is
    /// never a hit, as in vLLM), or the hybrid rule ([`HybridCache::hit`]).
    pub fn hit_blocks(&self, prompt: &[StoredBlock], prompt_tokens: u64) -> usize {
        match self {
            Self::Dense(c) => c.prefix_hits(hit_candidates(prompt, prompt_tokens, c.block_size())),
            Self::Hybrid(c) => c.hit(prompt, prompt_tokens).blocks,
        }
    }

    /// Blocks the pool must hold for a request of `total_blocks` blocks to run.
    pub(crate) fn footprint(&self, total_blocks: u64) -> u64 {
        match self {
            Self::Dense(_) => total_blocks,
            Self::Hybrid(c) => c.footprint(total_blocks),
        }
    }

    pub(crate) fn try_allocate(
        &mut self,
        prompt: &[StoredBlock],
        prompt_tokens: u64,
        total_blocks: u64,
    ) -> Option<CacheAllocation> {
        match self {
            // The blocks past the cap are reserved and computed, then found cached
            // when committed ([`KvCache::commit`]).
            Self::Dense(c) => c
                .try_allocate(
                    hit_candidates(prompt, prompt_tokens, c.block_size()),
                    total_blocks,
                )
                .map(CacheAllocation::Dense),
            Self::Hybrid(c) => c
                .try_allocate(prompt, prompt_tokens, total_blocks)
                .map(CacheAllocation::Hybrid),
        }
    }

    /// At the start of a step, brings a running request's hybrid working sets up to
    /// date (a no-op on a dense rank).
    pub(crate) fn settle(
        &mut self,
        alloc: &mut CacheAllocation,
        computed_blocks: usize,
        prefill_done: bool,
    ) {
        if let (Self::Hybrid(c), CacheAllocation::Hybrid(a)) = (self, alloc) {
            c.settle(a, computed_blocks, prefill_done);
        }
    }

    /// Caches the request's prompt blocks `range` (of `prompt`, computed this step)
    /// and records in `block_tokens` the tokens of every block a `Stored` names, when
    /// the request has `token_ids`.
    pub(crate) fn commit(
        &mut self,
        alloc: &mut CacheAllocation,
        prompt: &[StoredBlock],
        range: Range<usize>,
        token_ids: Option<&[u32]>,
        block_tokens: &mut HashMap<ExternalBlockHash, Vec<u32>>,
    ) {
        match (self, alloc) {
            (Self::Dense(c), CacheAllocation::Dense(a)) => {
                let bs = c.block_size();
                for i in range {
                    let block = prompt[i];
                    let tokens = prompt_block_tokens(token_ids, i, bs);
                    if c.commit(a, block, tokens)
                        && let Some(tokens) = tokens
                    {
                        block_tokens.insert(block.block_hash, tokens.to_vec());
                    }
                }
            }
            (Self::Hybrid(c), CacheAllocation::Hybrid(a)) => {
                // The full-attention group stores every block of the range.
                for i in range.clone() {
                    if let Some(tokens) = prompt_block_tokens(token_ids, i, c.block_size()) {
                        block_tokens.insert(prompt[i].block_hash, tokens.to_vec());
                    }
                }
                c.commit(a, prompt, range.end);
            }
            _ => debug_assert!(false, "allocation of another cache kind"),
        }
    }

    pub(crate) fn release(&mut self, alloc: CacheAllocation) {
        match (self, alloc) {
            (Self::Dense(c), CacheAllocation::Dense(a)) => c.release(a),
            (Self::Hybrid(c), CacheAllocation::Hybrid(a)) => c.release(a),
            _ => debug_assert!(false, "allocation of another cache kind"),
        }
    }

    pub(crate) fn clear(&mut self) -> Result<(), CacheInUse> {
        match self {
            Self::Dense(c) => c.clear(),
            Self::Hybrid(c) => c.clear(),
        }
    }

    pub(crate) fn take_events(&mut self) -> Vec<KvCacheEventData> {
        match self {
            Self::Dense(c) => c.take_events(),
            Self::Hybrid(c) => c.take_events(),
        }
    }

    pub(crate) fn take_event_tokens(&mut self) -> HashMap<ExternalBlockHash, Arc<[u32]>> {
        match self {
            Self::Dense(c) => c.take_event_tokens(),
            Self::Hybrid(_) => HashMap::new(),
        }
    }

    pub(crate) fn take_group_stores(&mut self) -> Vec<GroupStore> {
        match self {
            Self::Dense(_) => Vec::new(),
            Self::Hybrid(c) => c.take_group_stores(),
        }
    }
}
