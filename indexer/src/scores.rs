//! [`OverlapScores`]: the answer to one prefix-match query.
//!
//! The radix tree walks the query's block hashes once and reports, per worker rank,
//! how many *leading* blocks that rank holds contiguously from the first block. The
//! scheduler reads these as overlap blocks: the part of the prompt whose prefill the
//! rank can skip. The type is a thin wrapper over an `FxHashMap` so it is cheap to
//! build (one entry per rank with a non-zero score; a query whose prefix is shared by
//! hundreds of ranks inserts hundreds of entries, so the hasher matters) and to merge
//! across shards.

use kv_events::WorkerRank;
use rustc_hash::FxHashMap;

/// Per-[`WorkerRank`] count of leading query blocks held, in blocks.
///
/// A rank scores `k` when it holds blocks `0..k` of the query (as one prefix in the
/// radix tree) on the GPU and not block `k`. A rank with KV cache groups (a
/// hybrid-attention model) scores the engine's own hit instead: the largest `k` such
/// that its full-attention groups hold blocks `0..k` and each windowed group the
/// `window_blocks` blocks before `k`. Ranks that score 0 are normally absent from
/// `scores`; [`OverlapScores::get`] returns 0 for them.
///
/// Engines that offload KV to a lower storage tier (CPU, disk) also get an any-tier
/// score: the leading blocks the rank holds each on *some* tier (a block offloaded
/// to CPU and evicted from the GPU still counts there). It is at least the GPU
/// score, and recorded in `any_tier` only where it is larger, so the map stays empty
/// for GPU-only clusters; [`OverlapScores::get_any_tier`] reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// Leading matched blocks held on the GPU per worker rank (absent means 0).
    pub scores: FxHashMap<WorkerRank, u32>,
    /// Leading matched blocks held on any tier per worker rank, only for ranks where
    /// this exceeds their `scores` entry (absent means: the GPU score).
    pub any_tier: FxHashMap<WorkerRank, u32>,
}

impl OverlapScores {
    /// An empty set of scores (every rank scores 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// The overlap of `rank` in blocks, 0 when the rank matched nothing.
    pub fn get(&self, rank: WorkerRank) -> u32 {
        self.scores.get(&rank).copied().unwrap_or(0)
    }

    /// The overlap of `rank` in blocks held on any storage tier: at least
    /// [`OverlapScores::get`], more when the rank holds the next blocks on CPU or disk.
    pub fn get_any_tier(&self, rank: WorkerRank) -> u32 {
        self.any_tier
            .get(&rank)
            .copied()
            .unwrap_or(0)
            .max(self.get(rank))
    }

    /// Scores from GPU pairs ([`OverlapScores::from_unique`]) and any-tier pairs
    /// ([`crate::RadixTree::collect_any_tier_matches`]); an any-tier pair is kept only
    /// where it exceeds the rank's GPU score.
    pub fn from_tiers(gpu: Vec<(WorkerRank, u32)>, any_tier: Vec<(WorkerRank, u32)>) -> Self {
        let mut out = Self::from_unique(gpu);
        if any_tier.is_empty() {
            return out; // GPU-only trees
        }
        for (rank, blocks) in any_tier {
            if blocks > out.get_any_tier(rank) {
                out.any_tier.insert(rank, blocks);
            }
        }
        out
    }

    /// Sets the score of `rank`; a score of 0 removes the rank.
    pub fn set(&mut self, rank: WorkerRank, blocks: u32) {
        if blocks == 0 {
            self.scores.remove(&rank);
        } else {
            self.scores.insert(rank, blocks);
        }
    }

    /// Scores from (rank, blocks) pairs gathered from the trees of several shards
    /// ([`crate::RadixTree::collect_matches`]): the map is sized once for all of them,
    /// so building it never rehashes. Zero scores are dropped; a repeated rank (not
    /// expected: shards hold disjoint workers) keeps its largest score.
    pub fn from_unique(pairs: Vec<(WorkerRank, u32)>) -> Self {
        let mut scores = FxHashMap::with_capacity_and_hasher(pairs.len(), Default::default());
        for (rank, blocks) in pairs {
            if blocks > 0 {
                scores
                    .entry(rank)
                    .and_modify(|old: &mut u32| *old = (*old).max(blocks))
                    .or_insert(blocks);
            }
        }
        Self {
            scores,
            any_tier: FxHashMap::default(),
        }
    }

    /// Folds in the scores of another query answer, for example a second shard's.
    ///
    /// Shards hold disjoint workers, so keys normally do not collide; if they do, the
    /// larger score is kept, which is the right answer when both describe the same
    /// query.
    pub fn merge(&mut self, other: OverlapScores) {
        for (rank, blocks) in other.any_tier {
            let entry = self.any_tier.entry(rank).or_insert(0);
            *entry = (*entry).max(blocks);
        }
        if self.scores.is_empty() {
            self.scores = other.scores;
            return;
        }
        self.scores.reserve(other.scores.len());
        for (rank, blocks) in other.scores {
            let entry = self.scores.entry(rank).or_insert(0);
            *entry = (*entry).max(blocks);
        }
    }

    /// The highest score of any rank, in blocks; 0 when nothing matched.
    pub fn max(&self) -> u32 {
        self.scores.values().copied().max().unwrap_or(0)
    }

    /// The rank with the highest score and that score; ties go to the smallest
    /// [`WorkerRank`] (worker id, then dp_rank) so the answer is deterministic.
    /// `None` when nothing matched.
    pub fn best(&self) -> Option<(WorkerRank, u32)> {
        self.scores
            .iter()
            .map(|(rank, blocks)| (*rank, *blocks))
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
    }

    /// Number of ranks with a non-zero score.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// True when no rank matched any block.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// The (rank, score) pairs sorted by rank, for stable output in logs and tests.
    pub fn sorted(&self) -> Vec<(WorkerRank, u32)> {
        let mut pairs: Vec<_> = self.scores.iter().map(|(r, b)| (*r, *b)).collect();
        pairs.sort_unstable();
        pairs
    }
}

impl FromIterator<(WorkerRank, u32)> for OverlapScores {
    /// Builds scores from pairs; zero scores are dropped, a repeated rank keeps its
    /// largest score.
    fn from_iter<I: IntoIterator<Item = (WorkerRank, u32)>>(iter: I) -> Self {
        let mut out = OverlapScores::new();
        for (rank, blocks) in iter {
            if blocks > out.get(rank) {
                out.set(rank, blocks);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::{DpRank, WorkerId};

    fn wr(w: u64, r: u32) -> WorkerRank {
        WorkerRank::new(WorkerId(w), DpRank(r))
    }

    #[test]
    fn absent_rank_scores_zero_and_zero_is_not_stored() {
        let mut s = OverlapScores::new();
        assert_eq!(s.get(wr(1, 0)), 0);
        s.set(wr(1, 0), 3);
        s.set(wr(2, 0), 0);
        assert_eq!(s.get(wr(1, 0)), 3);
        assert_eq!(s.len(), 1);
        s.set(wr(1, 0), 0);
        assert!(s.is_empty());
    }

    #[test]
    fn merge_keeps_the_larger_score() {
        let mut a: OverlapScores = [(wr(1, 0), 2), (wr(2, 0), 5)].into_iter().collect();
        let b: OverlapScores = [(wr(1, 0), 4), (wr(3, 1), 1)].into_iter().collect();
        a.merge(b);
        assert_eq!(
            a.sorted(),
            vec![(wr(1, 0), 4), (wr(2, 0), 5), (wr(3, 1), 1)]
        );
        let mut empty = OverlapScores::new();
        empty.merge(a.clone());
        assert_eq!(empty, a);
    }

    #[test]
    fn from_unique_drops_zeros_and_keeps_the_larger_of_a_repeat() {
        let s = OverlapScores::from_unique(vec![(wr(1, 0), 2), (wr(2, 0), 0), (wr(1, 0), 5)]);
        assert_eq!(s.sorted(), vec![(wr(1, 0), 5)]);
        assert!(OverlapScores::from_unique(Vec::new()).is_empty());
    }

    #[test]
    fn max_and_best_break_ties_by_smallest_rank() {
        let s: OverlapScores = [(wr(5, 0), 7), (wr(2, 1), 7), (wr(2, 0), 3)]
            .into_iter()
            .collect();
        assert_eq!(s.max(), 7);
        assert_eq!(s.best(), Some((wr(2, 1), 7)));
        assert_eq!(OverlapScores::new().max(), 0);
        assert_eq!(OverlapScores::new().best(), None);
    }
}
