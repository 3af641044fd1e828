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

    /// Number of leading prompt blocks `rank` holds each on *some* storage tier (GPU,
    /// CPU or disk), in blocks: at least [`Overlaps::overlap`]; the blocks beyond it
    /// must be loaded from a lower tier instead of prefilled. Defaults to
    /// [`Overlaps::overlap`] (no lower tier).
    fn overlap_any_tier(&self, rank: WorkerRank) -> u32 {
        self.overlap(rank)
    }

    /// Calls `f` with every rank whose overlap (GPU or any tier) may be non-zero —
    /// a superset is fine — and returns `true`; `false` when this source cannot list
    /// them (the default), and a decision then scans every registered rank.
    fn visit_matched(&self, f: &mut dyn FnMut(WorkerRank)) -> bool {
        let _ = f;
        false
    }
}

impl Overlaps for OverlapScores {
    fn overlap(&self, rank: WorkerRank) -> u32 {
        self.get(rank)
    }

    fn overlap_any_tier(&self, rank: WorkerRank) -> u32 {
        self.get_any_tier(rank)
    }

    fn visit_matched(&self, f: &mut dyn FnMut(WorkerRank)) -> bool {
        self.scores
            .keys()
            .chain(self.any_tier.keys())
            .for_each(|&r| f(r));
        true
    }
}

impl Overlaps for HashMap<WorkerRank, u32> {
    fn overlap(&self, rank: WorkerRank) -> u32 {
        self.get(&rank).copied().unwrap_or(0)
    }

    fn visit_matched(&self, f: &mut dyn FnMut(WorkerRank)) -> bool {
        self.keys().for_each(|&r| f(r));
        true
    }
}

impl<T: Overlaps + ?Sized> Overlaps for &T {
    fn overlap(&self, rank: WorkerRank) -> u32 {
        (**self).overlap(rank)
    }

    fn overlap_any_tier(&self, rank: WorkerRank) -> u32 {
        (**self).overlap_any_tier(rank)
    }

    fn visit_matched(&self, f: &mut dyn FnMut(WorkerRank)) -> bool {
        (**self).visit_matched(f)
    }
}

/// No rank caches anything: every overlap is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoOverlap;

impl Overlaps for NoOverlap {
    fn overlap(&self, _rank: WorkerRank) -> u32 {
        0
    }

    fn visit_matched(&self, _f: &mut dyn FnMut(WorkerRank)) -> bool {
        true
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
        assert_eq!(map.overlap_any_tier(a), 5, "default: the GPU overlap");

        // A rank holding 3 blocks on the GPU and 7 on some tier.
        scores.any_tier.insert(b, 7);
        assert_eq!(scores.overlap(b), 3);
        assert_eq!(scores.overlap_any_tier(b), 7);
        fn any_tier<O: Overlaps>(o: O, rank: WorkerRank) -> u32 {
            o.overlap_any_tier(rank)
        }
        assert_eq!(any_tier(&scores, b), 7, "forwarded through &T");
        assert_eq!(scores.overlap_any_tier(a), 0);
    }
}
