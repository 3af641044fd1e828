//! The any-tier prefix match: per worker rank, the leading query blocks it holds on
//! some storage tier (GPU, CPU or disk), each block on any of them.
//!
//! Why a second walk: the GPU walk (`RadixTree::collect_matches`) compares a run's
//! holders with the matching holders as raw integers, which is what keeps it cheap;
//! a rank holding a prefix partly on the GPU and partly on CPU is two holders there,
//! neither of which holds the whole prefix. This walk maps each run's holders to
//! their worker ranks instead. It costs O(runs × holders × log holders) per query,
//! about twice the GPU walk, and runs only while some holder is on a lower tier
//! ([`super::ranks::RankTable::has_lower_tiers`]): GPU-only clusters never pay it.
//!
//! Ranks with KV cache groups (hybrid-attention models) are left out: their holders
//! map to no rank here ([`super::ranks::RankTable::holder_of`]), since a prefix held
//! "each block on some tier" says nothing about the engine's hybrid hit.

use super::RadixTree;
use super::rankset::RankIdx;
use kv_events::{LocalBlockHash, WorkerRank};

impl RadixTree {
    /// Appends to `out` one (rank, blocks) pair per rank holding at least the first
    /// block of `hashes` on some tier: the number of leading blocks it holds, each on
    /// any tier. Each rank once, in no particular order. Appends nothing while every
    /// holder is on the GPU (then the any-tier overlap is the GPU overlap), and
    /// nothing for ranks with KV cache groups.
    #[inline]
    pub fn collect_any_tier_matches(
        &self,
        hashes: &[LocalBlockHash],
        out: &mut Vec<(WorkerRank, u32)>,
    ) {
        // The check alone is inlined into the query fronts: one load and a branch.
        if self.ranks.has_lower_tiers() {
            self.any_tier_walk(hashes, out);
        }
    }

    #[inline(never)]
    fn any_tier_walk(&self, hashes: &[LocalBlockHash], out: &mut Vec<(WorkerRank, u32)>) {
        // Ranks still matching, sorted and distinct; the ranks of the current run.
        let mut active: Vec<WorkerRank> = Vec::new();
        let mut here: Vec<WorkerRank> = Vec::new();
        let depth = self.walk(hashes, |depth, run| {
            here.clear();
            here.extend(
                run.holders
                    .as_raw()
                    .iter()
                    .filter_map(|raw| self.ranks.holder_of(RankIdx(*raw))),
            );
            here.sort_unstable();
            here.dedup();
            if depth == 0 {
                active.clone_from(&here);
            } else {
                // A score never exceeds the query's length, far below 2^32 blocks.
                active.retain(|rank| {
                    let held = here.binary_search(rank).is_ok();
                    if !held {
                        out.push((*rank, depth as u32));
                    }
                    held
                });
            }
            !active.is_empty()
        });
        if depth > 0 {
            out.extend(active.into_iter().map(|rank| (rank, depth as u32)));
        }
    }
}
