//! [`IndexerStats`]: sizes of one radix tree, or of every shard summed.
//!
//! Computing them is O(number of worker ranks), never O(nodes): node and heap sizes
//! are kept as running totals by the tree, so the daemon can scrape stats often
//! without stalling a shard.

use std::ops::AddAssign;

/// Sizes of an index. Summed over shards by [`crate::ShardedIndexer::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexerStats {
    /// Live tree nodes (one per distinct block position), the root not counted.
    pub nodes: usize,
    /// (worker rank, block) entries: every engine block hash a rank holds.
    pub entries: usize,
    /// Worker ranks with at least one entry or known to the tree.
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
