//! The memory bound: forgetting the least recently matched leaves.
//!
//! A bounded tree ([`Pruning::LeastRecentlyMatched`]) records on every node the
//! logical time it was last stored into or matched by a query. When a store takes the
//! number of (rank, block) entries above `max_entries`, one pruning pass brings it
//! down to `target_percent` of the bound:
//!
//! 1. collect every leaf with its last use and sort them, oldest first;
//! 2. for each, forget the leaf (all its holders), then walk up: a parent that has
//!    just become a leaf and was not used more recently than that leaf is forgotten
//!    too, and so on. A query that matched a deep block also touched every block
//!    above it, so chains are eaten from the tail, never cut in the middle;
//! 3. stop as soon as the entries are at the target.
//!
//! Forgetting a node does not search the holders' engine-hash maps (that would cost
//! O(rank blocks) per node): the node's slot generation is bumped instead, which
//! turns those map entries into tombstones. A later `Removed` for such a block drops
//! its tombstone, a later `Stored` of it revives it, and a `Stored` below it is
//! refused as [`ApplyError::ForgottenParent`](crate::ApplyError::ForgottenParent)
//! (not as a lost event: the index chose to forget, recovery would not help).
//!
//! Cost of a pass: O(nodes) to find leaves plus O(leaves · log leaves) to sort; with a
//! target of 90 % a pass runs once per 10 % of the bound in new entries, so the
//! amortised cost per stored block is a few node visits. The pass runs inside the
//! shard (or under the write lock) that triggered it: a bound of 10 M entries means a
//! pause of the order of 100 ms every million stores.

use super::RadixTree;
use super::arena::NodeIdx;
use super::rankset::RankIdx;
use crate::config::Pruning;

impl RadixTree {
    /// Prunes when the tree is over its bound; returns the entries forgotten.
    pub(super) fn enforce_bound(&mut self) -> u64 {
        match self.pruning {
            Pruning::LeastRecentlyMatched {
                max_entries,
                target_percent,
            } if self.entries > max_entries => {
                let percent = usize::from(target_percent.min(100));
                let target = max_entries / 100 * percent + max_entries % 100 * percent / 100;
                self.prune_to(target)
            }
            _ => 0,
        }
    }

    /// Forgets least recently used leaves until at most `target` entries remain.
    /// Returns the entries forgotten.
    pub(super) fn prune_to(&mut self, target: usize) -> u64 {
        let before = self.entries;
        // One pass normally suffices; another runs when the cascades stopped early
        // (ancestors used more recently than their leaves) and the leaves ran out.
        while self.entries > target {
            let mut leaves = self.arena.leaves();
            if leaves.is_empty() {
                break;
            }
            leaves.sort_unstable();
            'leaves: for (tick, leaf) in leaves {
                let mut node = leaf;
                loop {
                    if self.entries <= target {
                        break 'leaves;
                    }
                    let Some(survivor) = self.forget_leaf(node) else {
                        continue 'leaves;
                    };
                    let parent = self.arena.node(survivor);
                    if survivor == NodeIdx::ROOT
                        || !parent.children.is_empty()
                        || parent.last_used.get() > tick
                    {
                        continue 'leaves;
                    }
                    node = survivor;
                }
            }
        }
        (before - self.entries) as u64
    }

    /// Forgets the leaf `node` for every holder. Returns the nearest ancestor that
    /// survived (still held or still branching; possibly the root), or `None` when
    /// `node` was not a leaf.
    fn forget_leaf(&mut self, node: NodeIdx) -> Option<NodeIdx> {
        let (holders, survivor) = self.arena.prune_leaf(node)?;
        for raw in holders.as_raw() {
            let Some(state) = self.ranks.get_mut(RankIdx(*raw)) else {
                continue;
            };
            let extra = state.aliases.remove(&node).map_or(0, u64::from);
            state.forgotten += 1 + extra;
            self.entries -= 1 + extra as usize;
        }
        Some(survivor)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check_invariants, q, removed, stored, wr};
    use super::*;
    use crate::error::ApplyError;
    use kv_events::{ExternalBlockHash, WorkerId};

    fn bounded(max_entries: usize, target_percent: u8) -> RadixTree {
        RadixTree::with_pruning(Pruning::LeastRecentlyMatched {
            max_entries,
            target_percent,
        })
    }

    /// Worker `w` stores a chain of `len` blocks with local hashes `base..` and engine
    /// hashes `w * 1000 + i`.
    fn store_chain(tree: &mut RadixTree, w: u64, base: u64, len: u64) -> ApplyOutcome {
        let chain: Vec<(u64, u64)> = (0..len).map(|i| (w * 1000 + i, base + i)).collect();
        let out = tree
            .apply_event(WorkerId(w), &stored(0, None, &chain))
            .expect("stores");
        check_invariants(tree);
        out
    }

    use super::super::ApplyOutcome;

    #[test]
    fn least_recently_matched_chains_are_eaten_from_the_tail() {
        let mut tree = bounded(20, 50);
        store_chain(&mut tree, 1, 100, 6);
        store_chain(&mut tree, 2, 200, 6);
        store_chain(&mut tree, 3, 300, 6);
        // Worker 2's chain is matched after everything else was stored.
        let prefix: Vec<u64> = (200..206).collect();
        assert_eq!(tree.find_matches(&q(&prefix)).get(wr(2, 0)), 6);
        let out = store_chain(&mut tree, 4, 400, 6); // 24 entries > 20: prune to 10
        assert_eq!(out.pruned, 14);
        assert_eq!(tree.num_entries(), 10);
        // Worker 3 stored after worker 2 but was never matched: it goes entirely,
        // like worker 1. Worker 2 (matched after worker 3's store) loses only its
        // tail; the newest chain survives.
        let newest: Vec<u64> = (400..406).collect();
        assert_eq!(tree.find_matches(&q(&newest)).get(wr(4, 0)), 6);
        assert_eq!(tree.find_matches(&q(&prefix)).get(wr(2, 0)), 4);
        let third: Vec<u64> = (300..306).collect();
        assert!(tree.find_matches(&q(&third)).is_empty());
        check_invariants(&tree);
    }

    #[test]
    fn pruned_parents_are_refused_as_forgotten_and_stay_consistent() {
        let mut tree = bounded(4, 50);
        store_chain(&mut tree, 1, 10, 3);
        store_chain(&mut tree, 2, 20, 2); // 5 > 4: prune to 2, worker 1 goes first
        check_invariants(&tree);
        assert_eq!(tree.num_entries(), 2);
        assert_eq!(tree.find_matches(&q(&[10])).get(wr(1, 0)), 0);
        // The engine continues below its pruned block 1002: refused as forgotten,
        // and so is the next block below the refused one.
        let err = tree
            .apply_event(WorkerId(1), &stored(0, Some(1002), &[(1003, 13)]))
            .unwrap_err();
        assert_eq!(
            err,
            ApplyError::ForgottenParent {
                rank: wr(1, 0),
                parent_hash: ExternalBlockHash(1002)
            }
        );
        assert!(matches!(
            tree.apply_event(WorkerId(1), &stored(0, Some(1003), &[(1004, 14)])),
            Err(ApplyError::ForgottenParent { .. })
        ));
        check_invariants(&tree);
        // Removing forgotten blocks drops their tombstones.
        let out = tree
            .apply_event(WorkerId(1), &removed(0, &[1000, 1003, 9999]))
            .expect("removes never fail");
        assert_eq!((out.forgotten, out.unknown_removed, out.removed), (2, 1, 0));
        check_invariants(&tree);
        // Storing blocks again from the root: 1000 lost its tombstone above, 1001's
        // tombstone is revived.
        let out = tree
            .apply_event(WorkerId(1), &stored(0, None, &[(1000, 10), (1001, 11)]))
            .expect("stores");
        assert_eq!((out.stored, out.forgotten), (2, 1));
        check_invariants(&tree);
        assert!(tree.num_entries() <= 4);
        assert_eq!(tree.find_matches(&q(&[10, 11])).get(wr(1, 0)), 2);
        // Clearing the rank drops tombstones along with live entries.
        let out = tree.clear_rank(wr(1, 0));
        assert_eq!(out.removed, 2);
        check_invariants(&tree);
    }
}
