//! The one thing the scheduler needs from the indexer: how many leading prompt blocks
//! each (worker, dp_rank) already caches.
//!
//! A trait rather than the concrete `indexer::OverlapScores` keeps the scheduler
//! testable with a plain map and lets callers that skip the index (round-robin,
//! random, prompts shorter than one block) pass [`NoOverlap`] at zero cost. A lookup
//! is one hash-map probe per candidate rank.

use indexer::OverlapScores;
use kv_events::WorkerRank;
use std::collections::HashMap;

/// Per-rank prefix match length, in blocks.
pub trait Overlaps {
    /// Number of leading prompt blocks cached on `rank` (overlap blocks); 0 when the
    /// rank matched nothing or is unknown to the index.
    fn overlap(&self, rank: WorkerRank) -> u32;
}

impl Overlaps for OverlapScores {
    fn overlap(&self, rank: WorkerRank) -> u32 {
        self.get(rank)
    }
}

impl Overlaps for HashMap<WorkerRank, u32> {
    fn overlap(&self, rank: WorkerRank) -> u32 {
        self.get(&rank).copied().unwrap_or(0)
    }
}

impl<T: Overlaps + ?Sized> Overlaps for &T {
    fn overlap(&self, rank: WorkerRank) -> u32 {
        (**self).overlap(rank)
    }
}

/// No rank caches anything: every overlap is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoOverlap;

impl Overlaps for NoOverlap {
    fn overlap(&self, _rank: WorkerRank) -> u32 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::{DpRank, WorkerId};

    #[test]
    fn absent_ranks_overlap_zero() {
        let a = WorkerRank::new(WorkerId(1), DpRank(0));
        let b = WorkerRank::new(WorkerId(1), DpRank(1));
        let map = HashMap::from([(a, 5)]);
        assert_eq!(map.overlap(a), 5);
        assert_eq!(map.overlap(b), 0);
        assert_eq!(NoOverlap.overlap(a), 0);

        let mut scores = OverlapScores::default();
        scores.scores.insert(b, 3);
        assert_eq!(scores.overlap(b), 3);
        assert_eq!(scores.overlap(a), 0);
    }
}
