//! [`IndexerStats`]: sizes of one radix tree, or of every shard summed, and
//! [`IndexerReport`]: those plus blocks per worker rank and recovery state, the plain
//! data the daemon exports as metrics.
//!
//! Computing them is O(number of worker ranks), never O(nodes): node and heap sizes
//! are kept as running totals by the tree, so the daemon can scrape stats often
//! without stalling a shard.

use kv_events::{WorkerId, WorkerRank};
use std::ops::AddAssign;

/// Sizes of an index. Summed over shards by [`crate::IndexerApi::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexerStats {
    /// Live tree nodes (one per distinct block position), the root not counted.
    pub nodes: usize,
    /// (holder, block) entries: every engine block hash a holder holds, a holder
    /// being a worker rank on one storage tier in one KV cache group (copies of a
    /// block are not counted).
    pub entries: usize,
    /// Holders (worker rank, tier, KV cache group) with at least one entry or known
    /// to the tree: one per rank for a dense model on the GPU.
    pub ranks: usize,
    /// Approximate heap footprint in bytes: arena slots, holder sets, child maps and
    /// per-rank block maps by capacity. Allocator overhead is not counted.
    pub memory_bytes: usize,
}

impl AddAssign for IndexerStats {
    fn add_assign(&mut self, rhs: Self) {
        self.nodes += rhs.nodes;
        self.entries += rhs.entries;
        self.ranks += rhs.ranks;
        self.memory_bytes += rhs.memory_bytes;
    }
}

impl IndexerStats {
    /// Approximate heap bytes per (worker rank, block) entry; 0 for an empty index.
    pub fn bytes_per_entry(&self) -> f64 {
        if self.entries == 0 {
            0.0
        } else {
            self.memory_bytes as f64 / self.entries as f64
        }
    }
}

/// Everything an operator wants to know about the index's size and recovery state.
/// Computing it is O(live ranks) per shard.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IndexerReport {
    /// Totals over shards.
    pub stats: IndexerStats,
    /// Blocks held by each worker rank, sorted by rank.
    pub blocks_per_rank: Vec<(WorkerRank, usize)>,
    /// Ranks with a recovery pending.
    pub recovering_ranks: usize,
    /// Events waiting in recovery buffers.
    pub buffered_events: usize,
    /// Approximate-mode blocks whose TTL is tracked.
    pub approximate_blocks: usize,
}

impl IndexerReport {
    /// Folds in another shard's report.
    pub fn merge(&mut self, other: IndexerReport) {
        self.stats += other.stats;
        self.blocks_per_rank.extend(other.blocks_per_rank);
        self.blocks_per_rank.sort_unstable();
        self.recovering_ranks += other.recovering_ranks;
        self.buffered_events += other.buffered_events;
        self.approximate_blocks += other.approximate_blocks;
    }

    /// Blocks held per worker (its ranks summed), sorted by worker.
    pub fn blocks_per_worker(&self) -> Vec<(WorkerId, usize)> {
        let mut out: Vec<(WorkerId, usize)> = Vec::new();
        for (rank, blocks) in &self.blocks_per_rank {
            match out.last_mut() {
                Some((w, n)) if *w == rank.worker_id => *n += blocks,
                _ => out.push((rank.worker_id, *blocks)),
            }
        }
        out
    }
}
