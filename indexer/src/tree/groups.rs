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
//! it covers for each GPU holder of a grouped rank, one record per holder for
//! consecutive runs it holds (the fast walk skips those holders:
//! [`RankTable::rank_of`](super::ranks::RankTable::rank_of) does not name them). It
//! stops at the first block no run matches, or at the first run that no
//! full-attention group of a grouped rank holds (every such rank's hit ends there),
//! unless a grouped rank has no full-attention group. Then, per rank, the largest `L`
//! is found as the engine does, by a fixed point: start from the deepest position any
//! of its groups reached; each group lowers `L` to the largest value at most `L` it
//! accepts; repeat until no group lowers it.
//!
//! Cost: O(runs on the path × holders per run), a counting sort of the records by
//! rank, and a small sort of each rank's few records; nothing at all while no rank is
//! grouped ([`RankTable::has_grouped`](super::ranks::RankTable::has_grouped)). About
//! 7–9 times the fast walk's time when 256 hybrid ranks (4 groups each) share the
//! query's prefix (`docs/benchmarks.md`). Grouped ranks get no any-tier score (the
//! any-tier walk skips them).

use super::RadixTree;
use super::common_prefix;
use super::ranks::GroupedName;
use super::rankset::RankIdx;
use kv_events::{LocalBlockHash, WorkerRank};
use std::num::NonZeroU32;

/// Query positions `start..end` held by one GPU holder of a grouped rank. 24 bytes:
/// hundreds are written per query on a fleet sharing a prefix.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    /// The rank's dense number ([`GroupedName::slot`]).
    slot: u32,
    holder: u32,
    start: u32,
    end: u32,
    /// The holder's window ([`GroupedName::window`]).
    window: Option<NonZeroU32>,
    /// The rank's GPU groups ([`GroupedName::gpu_groups`]).
    gpu_groups: u32,
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
        let mut held: Vec<Held> = Vec::with_capacity(64);
        // Per holder, its latest record plus one (0: none), so that a holder of
        // consecutive runs gets one record for all of them.
        let mut latest = vec![0u32; self.ranks.slots_len()];
        self.walk(hashes, |depth, run| {
            // The walk compares the run again after this: twice per run, but only
            // while a grouped rank exists.
            let matched = common_prefix(&run.hashes, &hashes[depth..]);
            let mut full = false;
            for raw in run.holders.as_raw() {
                if let Some(GroupedName {
                    window,
                    slot,
                    gpu_groups,
                    ..
                }) = self.ranks.grouped_name(RankIdx(*raw))
                {
                    full |= window.is_none();
                    // Positions are below the query's length, far below 2^32 blocks.
                    let end = (depth + matched) as u32;
                    let last = &mut latest[*raw as usize];
                    if let Some(prev) = last.checked_sub(1).map(|i| &mut held[i as usize])
                        && prev.end == depth as u32
                    {
                        prev.end = end;
                        continue;
                    }
                    // Records are far fewer than 2^32.
                    *last = held.len() as u32 + 1;
                    held.push(Held {
                        slot,
                        holder: *raw,
                        start: depth as u32,
                        end,
                        window,
                        gpu_groups,
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
        // Per rank (a counting sort by its dense number: shared runs give one record
        // per rank, hundreds of them), then per holder in path order (a rank has a
        // few records).
        let mut starts = vec![0u32; self.ranks.grouped_slots() as usize + 1];
        for h in &held {
            starts[h.slot as usize + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut by_rank = vec![Held::default(); held.len()];
        let mut next = starts.clone();
        for h in held {
            by_rank[next[h.slot as usize] as usize] = h;
            next[h.slot as usize] += 1;
        }
        for bounds in starts.windows(2) {
            let records = &mut by_rank[bounds[0] as usize..bounds[1] as usize];
            if records.is_empty() {
                continue;
            }
            records.sort_unstable_by_key(|h| (h.holder, h.start));
            let hit = hybrid_hit(records);
            if hit > 0
                && let Some(name) = self.ranks.grouped_name(RankIdx(records[0].holder))
            {
                out.push((name.rank, hit));
            }
        }
    }
}

/// The largest `L` every GPU group of the rank of `records` (its holdings along the
/// query, sorted by holder then position) accepts. No allocation: a rank has a
/// handful of groups, each a handful of intervals.
fn hybrid_hit(records: &[Held]) -> u32 {
    let groups = || records.chunk_by(|a, b| a.holder == b.holder);
    // A group holding nothing on the path accepts no hit at all.
    if groups().count() < records[0].gpu_groups as usize {
        return 0;
    }
    let mut hit = records.iter().map(|r| r.end).max().unwrap_or(0);
    loop {
        let before = hit;
        for group in groups() {
            hit = accepted(group, group[0].window, hit);
            if hit == 0 {
                return 0;
            }
        }
        if hit == before {
            return hit;
        }
    }
}

/// The largest `L ≤ limit` a group with `window` accepts, given the positions it
/// holds along the query (`records`, in path order; adjacent ones form one interval):
/// for full attention, its prefix from position 0; for a window `w`, the end of a
/// held interval `a..b` with `L ≤ b` and `max(0, L − w) ≥ a`.
fn accepted(records: &[Held], window: Option<NonZeroU32>, limit: u32) -> u32 {
    let Some(w) = window else {
        let mut end = 0;
        for r in records {
            if r.start != end {
                break;
            }
            end = r.end;
        }
        return end.min(limit);
    };
    // Maximal intervals from the last one back.
    let mut i = records.len();
    while i > 0 {
        i -= 1;
        let b = records[i].end;
        let mut a = records[i].start;
        while i > 0 && records[i - 1].end == a {
            i -= 1;
            a = records[i].start;
        }
        // The smallest `L` whose window starts inside `a..b`.
        let lowest = if a == 0 { 1 } else { a + w.get() };
        let l = b.min(limit);
        if l >= lowest {
            return l;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(intervals: &[(u32, u32)]) -> Vec<Held> {
        intervals
            .iter()
            .map(|&(start, end)| Held {
                start,
                end,
                ..Held::default()
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
