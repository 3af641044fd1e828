//! [`RadixTree`]: the single-threaded index of which worker rank holds which prefix.
//!
//! Each node is one block ([`LocalBlockHash`]) at one position of a prefix; the path
//! from the root spells the prefix. A node records the interned worker ranks holding
//! it, and every rank maps the engine's [`ExternalBlockHash`] of each block it holds
//! to that block's node, which is how `Stored` events find their parent and `Removed`
//! events find their block.
//!
//! Costs: applying a `Stored` event is O(blocks) hash-map operations; a `Removed` is
//! O(blocks) plus the pruning of nodes left empty; a prefix match is O(query blocks ×
//! holders) in the worst case and one `memcmp` of the holder sets per block when they
//! do not change along the path (the common case: everyone holding a long prefix).
//! Memory is one 64-byte node per distinct (prefix, block) plus about 20-30 bytes per
//! (rank, block) entry for the engine-hash map and the 4-byte holder slot. Measured
//! on a release build: ~77 bytes per entry when most blocks are held by one rank,
//! ~35 when 256 ranks share every block.
//!
//! Layout of the submodules: `arena` (node slab, children, free list), `rankset`
//! (compact holder sets), `ranks` (rank interning and per-rank maps), `dump`
//! (state → rebuild events).

mod arena;
#[cfg(test)]
mod differential;
mod dump;
mod ranks;
mod rankset;
#[cfg(test)]
mod tests;

use crate::error::ApplyError;
use crate::scores::OverlapScores;
use crate::stats::IndexerStats;
use arena::{Arena, NodeIdx};
use kv_events::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, LocalBlockHash, StoredBlock, WorkerId,
    WorkerRank,
};
use ranks::{RankIdx, RankTable};
use std::ops::AddAssign;

/// What applying one event (or a worker removal) did, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks newly indexed for the rank.
    pub stored: u64,
    /// Blocks of a `Stored` event the rank already held under the same engine hash;
    /// skipped (the chain continues from the held block).
    pub already_present: u64,
    /// Blocks dropped from the rank (by `Removed`, `Cleared` or a worker removal).
    pub removed: u64,
    /// Blocks named by a `Removed` event that the rank did not hold; skipped.
    pub unknown_removed: u64,
}

impl AddAssign for ApplyOutcome {
    fn add_assign(&mut self, rhs: Self) {
        self.stored += rhs.stored;
        self.already_present += rhs.already_present;
        self.removed += rhs.removed;
        self.unknown_removed += rhs.unknown_removed;
    }
}

/// Prefix tree over block hashes recording which worker ranks hold each prefix.
///
/// Not thread-safe by design: one owner applies events and answers queries, which is
/// what a [`crate::ShardedIndexer`] shard does. All operations are infallible except
/// [`RadixTree::apply_event`] on a `Stored` event with an unknown parent, which
/// leaves the tree unchanged.
#[derive(Debug, Default)]
pub struct RadixTree {
    arena: Arena,
    ranks: RankTable,
}

impl RadixTree {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one KV event of `worker_id` (the rank is `event.dp_rank`).
    ///
    /// - `Stored { parent_hash, blocks }`: the chain is added below the rank's block
    ///   `parent_hash` (the root when `None`), creating nodes as needed. A block whose
    ///   engine hash the rank already holds is counted in `already_present` and the
    ///   chain continues from the held block. Two engine hashes of one rank naming the
    ///   same node are both kept; the node stays held until both are removed.
    /// - `Removed { block_hashes }`: each held block is dropped from the rank; unknown
    ///   ones are counted in `unknown_removed`. Dropping an interior block hides the
    ///   rank's deeper blocks from prefix matches (they stay indexed until removed).
    /// - `Cleared`: every block of the rank is dropped.
    ///
    /// `event_id` is not checked here.
    ///
    /// # Errors
    /// [`ApplyError::UnknownParent`] when `parent_hash` is `Some` and the rank does not
    /// hold that block; nothing changes then.
    pub fn apply_event(
        &mut self,
        worker_id: WorkerId,
        event: &KvCacheEvent,
    ) -> Result<ApplyOutcome, ApplyError> {
        let rank = WorkerRank::new(worker_id, event.dp_rank);
        match &event.data {
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
            } => self.store(rank, *parent_hash, blocks),
            KvCacheEventData::Removed { block_hashes } => Ok(self.remove(rank, block_hashes)),
            KvCacheEventData::Cleared => Ok(self.clear_rank(rank)),
        }
    }

    fn store(
        &mut self,
        rank: WorkerRank,
        parent_hash: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<ApplyOutcome, ApplyError> {
        if blocks.is_empty() && parent_hash.is_none() {
            return Ok(ApplyOutcome::default()); // do not intern a rank that holds nothing
        }
        let (idx, mut cur) = match parent_hash {
            None => (self.ranks.intern(rank), NodeIdx::ROOT),
            Some(parent) => {
                let found = self.ranks.lookup(rank).and_then(|idx| {
                    let node = self.ranks.get(idx)?.blocks.get(&parent)?;
                    Some((idx, *node))
                });
                found.ok_or(ApplyError::UnknownParent {
                    rank,
                    parent_hash: parent,
                })?
            }
        };
        let mut outcome = ApplyOutcome::default();
        let Some(state) = self.ranks.get_mut(idx) else {
            return Ok(outcome); // unreachable: `idx` was just interned or looked up
        };
        for block in blocks {
            if let Some(&held) = state.blocks.get(&block.block_hash) {
                outcome.already_present += 1;
                cur = held;
                continue;
            }
            let child = self.arena.child_or_insert(cur, block.tokens_hash);
            if !self.arena.add_holder(child, idx) {
                *state.aliases.entry(child).or_insert(0) += 1;
            }
            state.blocks.insert(block.block_hash, child);
            outcome.stored += 1;
            cur = child;
        }
        Ok(outcome)
    }

    fn remove(&mut self, rank: WorkerRank, block_hashes: &[ExternalBlockHash]) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        let state = self
            .ranks
            .lookup(rank)
            .and_then(|idx| Some((idx, self.ranks.get_mut(idx)?)));
        let Some((idx, state)) = state else {
            outcome.unknown_removed = block_hashes.len() as u64;
            return outcome;
        };
        for hash in block_hashes {
            let Some(node) = state.blocks.remove(hash) else {
                outcome.unknown_removed += 1;
                continue;
            };
            outcome.removed += 1;
            match state.aliases.get_mut(&node) {
                Some(extra) if *extra > 1 => *extra -= 1,
                Some(_) => {
                    state.aliases.remove(&node);
                }
                None => {
                    self.arena.drop_holder(node, idx);
                }
            }
        }
        outcome
    }

    /// Drops every block of `rank` and forgets the rank. Unknown ranks are a no-op.
    /// Returns the number of blocks dropped in `removed`.
    pub fn clear_rank(&mut self, rank: WorkerRank) -> ApplyOutcome {
        match self.ranks.lookup(rank) {
            Some(idx) => self.release_rank(idx),
            None => ApplyOutcome::default(),
        }
    }

    /// Drops every rank of `worker_id` (a worker left or its lease expired).
    /// O(live ranks + blocks of the worker).
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        for idx in self.ranks.of_worker(worker_id) {
            outcome += self.release_rank(idx);
        }
        outcome
    }

    fn release_rank(&mut self, idx: RankIdx) -> ApplyOutcome {
        let Some(state) = self.ranks.release(idx) else {
            return ApplyOutcome::default();
        };
        for node in state.blocks.values() {
            // Aliased nodes appear more than once; the second drop is a no-op.
            self.arena.drop_holder(*node, idx);
        }
        ApplyOutcome {
            removed: state.blocks.len() as u64,
            ..ApplyOutcome::default()
        }
    }

    /// Scores every rank by the number of leading blocks of `hashes` it holds.
    ///
    /// Walks from the root along `hashes` and stops at the first block no node
    /// matches or when no rank is left. A rank missing block `i` scores `i` even if it
    /// holds later blocks. Ranks scoring 0 are absent from the result.
    pub fn find_matches(&self, hashes: &[LocalBlockHash]) -> OverlapScores {
        let mut scores = OverlapScores::new();
        // Raw rank indices (see `RankSet`), so the per-block comparison is a memcmp.
        let mut active: Vec<u32> = Vec::new();
        let mut kept: Vec<u32> = Vec::new();
        let mut cur = NodeIdx::ROOT;
        let mut depth = 0u32;
        for (i, hash) in hashes.iter().enumerate() {
            let Some(child) = self.arena.node(cur).children.get(*hash) else {
                break;
            };
            let holders = self.arena.node(child).holders.as_raw();
            if i == 0 {
                active.extend_from_slice(holders);
            } else if holders != active.as_slice() {
                // Both sides are sorted: one merge pass splits `active` into the ranks
                // that continue and those whose match ends at `depth` blocks.
                kept.clear();
                let mut h = holders.iter().peekable();
                for &rank in &active {
                    while h.next_if(|other| **other < rank).is_some() {}
                    if h.next_if_eq(&&rank).is_some() {
                        kept.push(rank);
                    } else {
                        self.score(&mut scores, RankIdx(rank), depth);
                    }
                }
                std::mem::swap(&mut active, &mut kept);
            }
            if active.is_empty() {
                break;
            }
            depth += 1;
            cur = child;
        }
        scores.scores.reserve(active.len());
        for rank in active {
            self.score(&mut scores, RankIdx(rank), depth);
        }
        scores
    }

    fn score(&self, scores: &mut OverlapScores, idx: RankIdx, depth: u32) {
        if let Some(rank) = self.ranks.rank_of(idx) {
            scores.set(rank, depth);
        }
    }

    /// Live tree nodes (distinct (prefix, block) positions), the root not counted.
    pub fn num_nodes(&self) -> usize {
        self.arena.live_nodes()
    }

    /// Total (rank, block) entries: engine block hashes held, summed over ranks.
    /// O(live ranks).
    pub fn num_entries(&self) -> usize {
        self.ranks.iter().map(|(_, s)| s.blocks.len()).sum()
    }

    /// Worker ranks the tree knows (those stored into and not cleared since).
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Blocks held per worker rank, sorted by rank.
    pub fn blocks_per_rank(&self) -> Vec<(WorkerRank, usize)> {
        let mut out: Vec<_> = self
            .ranks
            .iter()
            .map(|(_, s)| (s.rank, s.blocks.len()))
            .collect();
        out.sort_unstable();
        out
    }

    /// Approximate heap footprint in bytes (see [`IndexerStats::memory_bytes`]).
    /// O(live ranks).
    pub fn memory_bytes(&self) -> usize {
        self.arena.memory_bytes() + self.ranks.memory_bytes()
    }

    /// Nodes, entries, ranks and memory in one struct. O(live ranks).
    pub fn stats(&self) -> IndexerStats {
        IndexerStats {
            nodes: self.num_nodes(),
            entries: self.num_entries(),
            ranks: self.num_ranks(),
            memory_bytes: self.memory_bytes(),
        }
    }
}
