//! [`RadixTree`]: the single-threaded index of which worker rank holds which prefix.
//!
//! The tree is path-compressed: a node is a *run* of consecutive blocks
//! ([`LocalBlockHash`]es, contiguous in memory) at consecutive positions of a prefix,
//! all held by the same worker ranks; the path from the root spells the prefix. A run
//! records its holders once. Every block position has a stable id, and every rank
//! maps the engine's [`ExternalBlockHash`](kv_events::ExternalBlockHash) of each block it holds to that id, which is
//! how `Stored` events find their parent and `Removed` events find their block — for
//! any engine hashes (chained or not, salted per worker or not), since the tree never
//! relies on engine hashes being shared.
//!
//! How runs change: a `Stored` continuing a chain that only the storing rank holds
//! appends to the run in place (the common case: a conversation's chain appended by
//! one rank); a store by another rank over part of a run, a child branching off the
//! middle of a run, or a removal of a block in the middle of a run splits the run
//! (into at most three); a run whose holders come to equal its parent's again (the
//! parent having no other child) is merged back into it. Splits and merges move only
//! the moved blocks' slots in the arena, never a rank's map (`tree/runs.rs`).
//!
//! Costs: applying a `Stored` event is O(blocks) hash-map operations plus, when it
//! covers part of an existing run, one split or merge (O(run length)); a `Removed` is
//! O(blocks) plus, per contiguous piece of a run it removes, at most two splits
//! (none for a run's tail that only the removing rank holds) and a merge. A prefix
//! match visits each run once: one child lookup, one contiguous comparison of the
//! run's hashes with the prompt's, and one comparison of the run's holders with the
//! ranks still matching (a `memcmp`, or one integer when a single rank is left), so
//! O(runs × holders) in the worst case and O(query blocks) memory reads in sequence.
//! Memory per block position is 24 bytes (hash 8 and id 4 in its run, slot 8 and
//! generation 4 in the block slab), plus an 88-byte run shared by all the run's
//! blocks, plus about 20-25 bytes per (rank, block) entry for the engine-hash map and
//! a 4-byte holder slot per extra holder of a run. Measured on a release build
//! (`docs/benchmarks.md`, "Compressed edges"): 49-69 bytes per entry at 100k-1M
//! entries, where one node per block cost 72-121.
//!
//! A tree may be bounded ([`Pruning::LeastRecentlyMatched`]): past a number of
//! (rank, block) entries it forgets the least recently matched leaves (see
//! `tree/prune.rs` for the algorithm and its cost).
//!
//! Storage tiers: each (rank, tier) is its own holder (`tree/ranks.rs`), so a
//! rank's CPU-offloaded chain is a second holder of the same runs; GPU overlap is
//! answered as before, and the overlap on any tier by a second walk that runs only
//! while some holder is on a lower tier (`tree/any_tier.rs`).
//!
//! KV cache groups (hybrid-attention models): each (rank, tier, group) is its own
//! holder too, and a rank with more than one group or a windowed one is scored by the
//! engine's hybrid rule in a third walk that runs only while such a rank exists
//! (`tree/groups.rs`). A block stored again by a holder that holds it is a copy
//! (`RankState::copies`); it leaves with its last copy.
//!
//! Layout of the submodules: `arena` (run and block slabs, free lists), `runs`
//! (extend, split, merge, free), `children` (child maps), `rankset`
//! (compact holder sets), `ranks` (holder interning and per-holder maps), `dump`
//! (state → rebuild events), `prune` (the memory bound), `groups` (the hybrid hit),
//! `event` (one event, whole or in parts), `apply` (stores), `remove` (removals in
//! two phases).

mod any_tier;
mod apply;
mod arena;
mod blockmap;
mod children;
mod chunks;
#[cfg(test)]
mod differential;
#[cfg(test)]
mod differential_model;
mod dump;
mod event;
mod groups;
mod part;
mod prune;
mod ranks;
mod rankset;
mod remove;
#[cfg(test)]
mod run_tests;
mod runs;
#[cfg(test)]
pub(crate) mod tests;

use crate::config::Pruning;

use crate::scores::OverlapScores;
use crate::stats::IndexerStats;
use arena::{Arena, Node, NodeIdx};
use blockmap::BlockRef;
use kv_events::{LocalBlockHash, WorkerId, WorkerRank};
pub use part::{Interrupt, Progress};
use ranks::{RankState, RankTable};
use rankset::RankIdx;
use std::ops::AddAssign;
use std::sync::atomic::{AtomicU32, Ordering};

/// What applying one event (or a worker removal) did, in blocks.
///
/// Entries are (holder, engine hash) pairs, a holder being a worker rank's KV cache
/// group on one storage tier; copies (a hash stored again while held) are not
/// entries: `stored` and `removed` count entries, `copies_added` and
/// `copies_removed` count copies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks newly indexed for the holder.
    pub stored: u64,
    /// Blocks of a `Stored` event the holder already held under the same engine hash:
    /// each adds a copy (a second physical block under that hash), and the chain
    /// continues from the held block. Approximate-mode refreshes add none.
    pub copies_added: u64,
    /// Blocks dropped from the holder (by `Removed`, `Cleared` or a worker removal).
    pub removed: u64,
    /// Copies dropped while their block stays held (a `Removed` of a block held as
    /// several copies), and copies dropped with their block by `Cleared` or a worker
    /// removal.
    pub copies_removed: u64,
    /// Blocks named by a `Removed` event that the holder did not hold; skipped.
    pub unknown_removed: u64,
    /// Blocks named by a `Removed` or `Stored` event that this index had pruned
    /// (forgotten) earlier; their entries are dropped or revived.
    pub forgotten: u64,
    /// (holder, block) entries pruned to stay under the memory bound.
    pub pruned: u64,
}

impl AddAssign for ApplyOutcome {
    fn add_assign(&mut self, rhs: Self) {
        self.stored += rhs.stored;
        self.copies_added += rhs.copies_added;
        self.removed += rhs.removed;
        self.copies_removed += rhs.copies_removed;
        self.unknown_removed += rhs.unknown_removed;
        self.forgotten += rhs.forgotten;
        self.pruned += rhs.pruned;
    }
}

/// True when `r` names a live node: always while the rank has no forgotten entries,
/// else when the slot's generation still matches.
fn is_live(arena: &Arena, state: &RankState, r: BlockRef) -> bool {
    state.forgotten == 0 || arena.generation(r.id) == r.generation
}

/// How many leading hashes `run` and `query` share.
#[inline]
fn common_prefix(run: &[LocalBlockHash], query: &[LocalBlockHash]) -> usize {
    let n = run.len().min(query.len());
    let (run, query) = (&run[..n], &query[..n]);
    // Eight at a time (one slice compare each) while they agree, then one by one.
    let mut i = 0;
    while i + 8 <= n && run[i..i + 8] == query[i..i + 8] {
        i += 8;
    }
    while i < n && run[i] == query[i] {
        i += 1;
    }
    i
}

/// True when a node's holders are exactly the ranks still matching. Inlined for the
/// common single-rank case (the private tail of a prompt), where a `memcmp` call
/// would cost more than the comparison.
#[inline]
fn same_holders(holders: &[u32], active: &[u32]) -> bool {
    match (holders, active) {
        ([a], [b]) => a == b,
        _ => holders == active,
    }
}

/// Prefix tree over block hashes recording which worker ranks hold each prefix.
///
/// Not thread-safe by design: one owner applies events and answers queries, which is
/// what a shard's [`crate::OrderedIndex`] does under its lock. All operations are infallible except
/// [`RadixTree::apply_event`] on a `Stored` event with an unknown parent or a
/// changed group window, which leaves the tree unchanged (or one whose parent this
/// tree pruned).
#[derive(Debug, Default)]
pub struct RadixTree {
    arena: Arena,
    ranks: RankTable,
    /// Live (rank, block) entries, summed over ranks.
    entries: usize,
    pruning: Pruning,
    /// Logical time for [`Pruning::LeastRecentlyMatched`]: bumped by every query and
    /// every store while the tree is bounded; untouched otherwise.
    clock: AtomicU32,
}

impl RadixTree {
    /// An empty, unbounded tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty tree with the given memory bound.
    pub fn with_pruning(pruning: Pruning) -> Self {
        Self {
            pruning,
            ..Self::default()
        }
    }

    /// The memory bound.
    pub fn pruning(&self) -> Pruning {
        self.pruning
    }

    fn bounded(&self) -> bool {
        !matches!(self.pruning, Pruning::Unbounded)
    }

    /// The next logical time, 31 bits (0 when unbounded: no recency is tracked).
    fn tick(&self) -> u32 {
        if self.bounded() {
            self.clock.fetch_add(1, Ordering::Relaxed).wrapping_add(1) & !arena::MATCHED
        } else {
            0
        }
    }

    /// Drops every block of `rank`, on every tier and in every group, and forgets
    /// the rank. Unknown ranks are a no-op. Returns the number of blocks dropped in
    /// `removed`.
    pub fn clear_rank(&mut self, rank: WorkerRank) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        let holders: Vec<RankIdx> = self.ranks.holders_of(rank).to_vec();
        for idx in holders {
            outcome += self.release_rank(idx);
        }
        outcome
    }

    /// Drops every rank of `worker_id` (a worker left or its lease expired), every
    /// holder of each. O(live ranks + blocks of the worker).
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        for idx in self.ranks.of_worker(worker_id) {
            outcome += self.release_rank(idx);
        }
        outcome
    }

    /// Scores every rank by the number of leading blocks of `hashes` it holds on the
    /// GPU, and (only while some rank holds blocks on a lower tier) by the number it
    /// holds on any tier.
    ///
    /// Walks from the root along `hashes` and stops at the first block no node
    /// matches or when no rank is left. A rank missing block `i` scores `i` even if it
    /// holds later blocks. Ranks scoring 0 are absent from the result; the any-tier
    /// scores ([`OverlapScores::any_tier`]) name only ranks whose any-tier overlap
    /// exceeds their GPU overlap.
    ///
    /// A grouped rank (KV cache groups of a hybrid-attention model: more than one
    /// group, or a windowed one) scores the engine's own hybrid hit: the largest `L`
    /// such that every full-attention GPU group holds blocks `0..L` and every windowed
    /// GPU group (window `w`) holds blocks `max(0, L − w)..L`. It gets no any-tier
    /// score. Its score comes from a second walk (`tree/groups.rs`) that runs only
    /// while some rank is grouped.
    pub fn find_matches(&self, hashes: &[LocalBlockHash]) -> OverlapScores {
        let mut pairs = Vec::new();
        self.collect_matches(hashes, &mut pairs);
        let mut any_tier = Vec::new();
        self.collect_any_tier_matches(hashes, &mut any_tier);
        OverlapScores::from_tiers(pairs, any_tier)
    }

    /// [`RadixTree::find_matches`] as (rank, score in blocks) pairs appended to `out`:
    /// one pair per rank scoring at least 1 block, each rank once, in no particular
    /// order. No hashing: a front that asks several trees builds one
    /// [`OverlapScores`] from all their pairs, sized once
    /// ([`OverlapScores::from_unique`]). Grouped ranks' hybrid hits are included.
    pub fn collect_matches(&self, hashes: &[LocalBlockHash], out: &mut Vec<(WorkerRank, u32)>) {
        let tick = self.tick();
        let bounded = self.bounded();
        // Raw rank indices (see `RankSet`), so the per-run comparison is a memcmp.
        let mut active: Vec<u32> = Vec::new();
        let mut kept: Vec<u32> = Vec::new();
        let depth = self.walk(hashes, |depth, run| {
            if bounded {
                run.last_used.matched(tick);
            }
            let holders = run.holders.as_raw();
            if depth == 0 {
                // Every rank that scores holds the first block: size the output once.
                active.extend_from_slice(holders);
                out.reserve(holders.len());
            } else if !same_holders(holders, &active) {
                // Both sides are sorted: one merge pass splits `active` into the ranks
                // that continue and those whose match ends at `depth` blocks.
                kept.clear();
                let mut h = holders.iter().peekable();
                for &rank in &active {
                    while h.next_if(|other| **other < rank).is_some() {}
                    if h.next_if_eq(&&rank).is_some() {
                        kept.push(rank);
                    } else {
                        self.score(out, rank, depth);
                    }
                }
                std::mem::swap(&mut active, &mut kept);
            }
            !active.is_empty()
        });
        if depth > 0 {
            for rank in active {
                self.score(out, rank, depth);
            }
        }
        // The check alone is inlined: one load and a branch for fleets without groups.
        if self.ranks.has_grouped() {
            self.grouped_walk(hashes, tick, out);
        }
    }

    /// Walks the runs along `query` from the root, calling `visit(depth, run)` on
    /// each run whose first block matches (`depth`: the blocks matched before it).
    /// Stops when `visit` returns false, at the first block no run matches, or inside
    /// a run that matches only in part. Returns the blocks matched.
    #[inline]
    fn walk(&self, query: &[LocalBlockHash], mut visit: impl FnMut(usize, &Node) -> bool) -> usize {
        let mut cur = NodeIdx::ROOT;
        let mut depth = 0usize;
        while let Some(&first) = query.get(depth) {
            let Some(child) = self.arena.node(cur).children.get(first) else {
                break;
            };
            let run = self.arena.node(child);
            if !visit(depth, run) {
                break;
            }
            // The run's first block matched (it is the child's key); the rest is one
            // contiguous comparison.
            let matched = common_prefix(&run.hashes, &query[depth..]);
            depth += matched;
            if matched < run.hashes.len() {
                break;
            }
            cur = child;
        }
        depth
    }

    fn score(&self, out: &mut Vec<(WorkerRank, u32)>, raw: u32, depth: usize) {
        // A score never exceeds the query's length, which is far below 2^32 blocks.
        if let Some(rank) = self.ranks.rank_of(RankIdx(raw)) {
            out.push((rank, depth as u32));
        }
    }

    /// Live block positions (distinct (prefix, block) pairs), the root not counted.
    /// Unchanged by path compression: a run of 16 blocks counts 16 (see
    /// [`RadixTree::num_runs`] for the runs).
    pub fn num_nodes(&self) -> usize {
        self.arena.live_blocks()
    }

    /// Live runs (compressed nodes: consecutive blocks with one holder set), the root
    /// not counted. At most [`RadixTree::num_nodes`].
    pub fn num_runs(&self) -> usize {
        self.arena.live_runs()
    }

    /// Total (holder, block) entries: engine block hashes held, summed over holders
    /// (ranks, tiers and KV cache groups); a block's extra copies are not entries.
    /// O(1).
    pub fn num_entries(&self) -> usize {
        self.entries
    }

    /// Holders the tree knows: (worker rank, storage tier, KV cache group) triples
    /// stored into and not cleared since, so a rank holding blocks on the GPU and on
    /// CPU counts twice, and a hybrid model's rank once per group.
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Blocks held on the GPU per worker rank, sorted by rank. A grouped rank (a
    /// hybrid-attention model's KV cache groups) counts its largest full-attention GPU
    /// group, or its largest GPU group when none is full attention: the blocks its
    /// longest usable prefixes occupy, not the sum over groups (the engine holds every
    /// group's copy of a block in its own KV cache pages).
    pub fn blocks_per_rank(&self) -> Vec<(WorkerRank, usize)> {
        let live = |s: &RankState| s.blocks.len() - s.forgotten as usize;
        let mut out: Vec<_> = self
            .ranks
            .ranks()
            .filter_map(|(rank, holders)| {
                let gpu = holders
                    .iter()
                    .filter_map(|i| self.ranks.get(*i))
                    .filter(|s| s.tier.is_gpu());
                let full = gpu.clone().filter(|s| s.window.is_none()).map(live).max();
                full.or_else(|| gpu.map(live).max())
                    .map(|blocks| (rank, blocks))
            })
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
