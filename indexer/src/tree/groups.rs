//! The hybrid hit of grouped ranks: per worker rank whose KV cache has several groups
//! (a hybrid-attention model: sliding-window or Mamba layers next to full attention),
//! the longest prefix the engine itself would reuse.
//!
//! The rule is the engine's (vLLM `HybridKVCacheCoordinator`): a prefix of `L` blocks
//! is a hit when every full-attention group holds blocks `0..L` and every windowed
//! group (window `w` blocks) holds blocks `max(0, L − w)..L`; the overlap is the
//! largest such `L`. A windowed group may hold a sparse set of blocks (vLLM keeps
//! only the windows a later hit can use), so a group's holdings along the query are
//! not a prefix but a set of intervals.
//!
//! Why a separate walk: the GPU fast walk (`RadixTree::collect_matches`) follows the
//! holders still matching from the first block and drops a holder at its first
//! missing block, which is exactly wrong for a windowed group. This walk follows the
//! query along the tree and, for every run, records the interval of query positions
//! it covers for each GPU holder of a grouped rank (the fast walk skips those
//! holders: [`RankTable::rank_of`](super::ranks::RankTable::rank_of) does not name
//! them). It stops at the first block no run matches, or at the first run that no
//! full-attention group of a grouped rank holds (every such rank's hit ends there),
//! unless a grouped rank has no full-attention group. Then, per rank, the largest `L`
//! is found as the engine does, by a fixed point: start from the deepest position any
//! of its groups reached; each group lowers `L` to the largest value at most `L` it
//! accepts; repeat until no group lowers it.
//!
//! Cost: O(runs on the path × holders per run) plus O(records × log records) to sort
//! them by rank, and nothing at all while no rank is grouped
//! ([`RankTable::has_grouped`](super::ranks::RankTable::has_grouped)). Grouped ranks
//! get no any-tier score (the any-tier walk skips them).

use super::RadixTree;
use super::common_prefix;
use super::ranks::GroupedName;
use super::rankset::RankIdx;
use kv_events::{LocalBlockHash, WorkerRank};
use std::num::NonZeroU32;

/// Query positions `start..end` held by one GPU holder of a grouped rank.
#[derive(Debug, Clone, Copy)]
struct Held {
    rank: WorkerRank,
    holder: u32,
    start: u32,
    end: u32,
}

impl RadixTree {
    /// Appends one (rank, blocks) pair per grouped rank whose hybrid hit on `hashes`
    /// is at least one block. `tick` marks the runs visited as matched (bounded trees).
    #[inline(never)]
    pub(super) fn grouped_walk(
        &self,
        hashes: &[LocalBlockHash],
        tick: u32,
        out: &mut Vec<(WorkerRank, u32)>,
    ) {
        let bounded = self.bounded();
        let unbounded_ranks = self.ranks.has_grouped_without_full();
        let mut held: Vec<Held> = Vec::new();
        self.walk(hashes, |depth, run| {
            // The walk compares the run again after this: twice per run, but only
            // while a grouped rank exists.
            let matched = common_prefix(&run.hashes, &hashes[depth..]);
            let mut full = false;
            for raw in run.holders.as_raw() {
                if let Some(GroupedName { rank, window }) = self.ranks.grouped_name(RankIdx(*raw)) {
                    full |= window.is_none();
                    // Positions are below the query's length, far below 2^32 blocks.
                    held.push(Held {
                        rank,
                        holder: *raw,
                        start: depth as u32,
                        end: (depth + matched) as u32,
                    });
                }
            }
            if !full && !unbounded_ranks {
                // No full-attention group of a grouped rank holds block `depth`: every
                // grouped rank's hit ends at or before it, so nothing deeper counts.
                return false;
            }
            if bounded {
                run.last_used.matched(tick);
            }
            true
        });
        // Per rank, per holder, in path order (the sort is stable).
        held.sort_by_key(|h| (h.rank, h.holder));
        for records in held.chunk_by(|a, b| a.rank == b.rank) {
            let hit = self.hybrid_hit(records);
            if hit > 0 {
                out.push((records[0].rank, hit));
            }
        }
    }

    /// The largest `L` every GPU group of the rank of `records` (its holdings along
    /// the query, sorted by holder then position) accepts.
    fn hybrid_hit(&self, records: &[Held]) -> u32 {
        let rank = records[0].rank;
        let groups: Vec<(u32, Option<NonZeroU32>)> = self
            .ranks
            .holders_of(rank)
            .iter()
            .filter_map(|idx| Some((idx.0, self.ranks.grouped_name(*idx)?.window)))
            .collect();
        let mut hit = records.iter().map(|r| r.end).max().unwrap_or(0);
        loop {
            let before = hit;
            for (holder, window) in &groups {
                let start = records.partition_point(|r| r.holder < *holder);
                let end = records.partition_point(|r| r.holder <= *holder);
                hit = accepted(&records[start..end], *window, hit);
            }
            if hit == before || hit == 0 {
                return hit;
            }
        }
    }
}

/// The largest `L ≤ limit` a group with `window` accepts, given the positions it
/// holds along the query (`records`, in path order): for full attention, its prefix
/// from position 0; for a window `w`, the end of a held interval `a..b` with `L ≤ b`
/// and `max(0, L − w) ≥ a`.
fn accepted(records: &[Held], window: Option<NonZeroU32>, limit: u32) -> u32 {
    // Merge adjacent runs into maximal intervals (runs along a path are contiguous).
    let mut intervals: Vec<(u32, u32)> = Vec::with_capacity(records.len());
    for r in records {
        match intervals.last_mut() {
            Some(last) if last.1 == r.start => last.1 = r.end,
            _ => intervals.push((r.start, r.end)),
        }
    }
    match window {
        None => match intervals.first() {
            Some(&(0, end)) => end.min(limit),
            _ => 0,
        },
        Some(w) => intervals
            .iter()
            .rev()
            .find_map(|&(a, b)| {
                // The smallest `L` whose window starts inside `a..b`.
                let lowest = if a == 0 { 1 } else { a + w.get() };
                let l = b.min(limit);
                (l >= lowest).then_some(l)
            })
            .unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(intervals: &[(u32, u32)]) -> Vec<Held> {
        let rank = WorkerRank::default();
        intervals
            .iter()
            .map(|&(start, end)| Held {
                rank,
                holder: 0,
                start,
                end,
            })
            .collect()
    }

    #[test]
    fn a_group_accepts_the_largest_hit_its_blocks_allow() {
        let w = |n| NonZeroU32::new(n);
        // Full attention: the prefix from 0, adjacent runs merged.
        assert_eq!(accepted(&held(&[(0, 3), (3, 5), (6, 9)]), None, 9), 5);
        assert_eq!(accepted(&held(&[(0, 3), (3, 5)]), None, 4), 4);
        assert_eq!(accepted(&held(&[(1, 5)]), None, 5), 0);
        // Window 4 holding 7..11 (the capture's sparse store of an 11-block prompt).
        let sparse = held(&[(7, 11)]);
        assert_eq!(accepted(&sparse, w(4), 11), 11);
        assert_eq!(accepted(&sparse, w(4), 10), 0, "10 needs 6..10");
        assert_eq!(accepted(&sparse, w(3), 10), 10, "window 3 needs 7..10");
        // Held from 0: any prefix of the interval is a hit, however short.
        assert_eq!(accepted(&held(&[(0, 2), (5, 9)]), w(4), 4), 2);
        assert_eq!(accepted(&held(&[(0, 2), (5, 9)]), w(4), 9), 9);
        assert_eq!(accepted(&held(&[(0, 2), (5, 9)]), w(4), 8), 2);
        assert_eq!(accepted(&[], w(1), 8), 0);
    }
}
