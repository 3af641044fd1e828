//! The memory bound: forgetting the least recently matched leaves.
//!
//! A bounded tree ([`Pruning::LeastRecentlyMatched`]) records on every node the
//! logical time it was last stored into or matched by a query. When a store takes the
//! number of (rank, block) entries above `max_entries`, one pruning pass brings it
//! down to `target_percent` of the bound:
//!
//! 1. collect every leaf with its last use and sort them, oldest first;
//! 2. for each, forget the leaf run's blocks from its tail (for all its holders)
//!    until the target is met or the run is gone, then walk up: a parent that has
//!    just become a leaf and was not used more recently than that leaf is forgotten
//!    too, and so on. A query that matched a deep block also touched every block
//!    above it, so chains are eaten from the tail, never cut in the middle;
//! 3. stop as soon as the entries are at the target.
//!
//! What goes first: leaves are ordered by their [`Tick`](super::arena::Tick), whose
//! top bit says "matched by a query at least once". Every block never matched goes
//! before every block that served a route, each kind least recent first — so a flood
//! of stored blocks nobody asks for (a faulty or hostile publisher) is eaten before a
//! real, recently matched prompt. (Entries of unregistered workers never reach the
//! index: the daemon holds and drops their events, `router-daemon/src/publishers.rs`.)
//!
//! The bound holds at the peak: before a `Stored` event that would take the tree over
//! its bound, [`RadixTree::make_room`] prunes to the target minus the event's blocks,
//! after marking the event's parent as just used so it is not the block pruned. A
//! tree therefore never holds more than `max_entries` plus one event's blocks (which
//! the daemon's `--max-batch-blocks` bounds).
//!
//! Memory is returned, not just reused: nodes freed by pruning go back to the arena's
//! free list (reused by the next stores), and a rank whose engine-hash map is mostly
//! tombstones (more than [`PURGE_MIN_TOMBSTONES`] and more than its live entries) is
//! rebuilt without them and shrunk. A `Stored` below a purged tombstone is then an
//! unknown parent (a dump is requested) instead of a forgotten one.
//!
//! Recency is kept per run (a run's time is its most recent block's), so a query
//! that matched the head of a run protects its tail too; a run is still eaten block
//! by block from its tail.
//!
//! Forgetting a block does not search the holders' engine-hash maps (that would cost
//! O(rank blocks) per node): the block's slot generation is bumped instead, which
//! turns those map entries into tombstones. A pruned block forgets its copies: its
//! copy count is dropped with its tombstone (by the next `Removed` or `Stored` of its
//! hash, or when the map is rebuilt), so a revived block holds one copy. A later `Removed` for such a block drops
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
use super::apply::ParentAt;
use super::arena::NodeIdx;
use super::blockmap::BlockRef;
use super::ranks::Holder;
use super::rankset::RankIdx;
use crate::config::Pruning;
use kv_events::ExternalBlockHash;

/// Tombstones a rank may keep before its map is rebuilt without them.
pub(super) const PURGE_MIN_TOMBSTONES: u64 = 1024;

impl RadixTree {
    /// `(max_entries, target)` of a bounded tree.
    fn bound(&self) -> Option<(usize, usize)> {
        match self.pruning {
            Pruning::LeastRecentlyMatched {
                max_entries,
                target_percent,
            } => {
                let percent = usize::from(target_percent.min(100));
                let target = max_entries / 100 * percent + max_entries % 100 * percent / 100;
                Some((max_entries, target))
            }
            Pruning::Unbounded => None,
        }
    }

    /// Prunes when the tree is over its bound; returns the entries forgotten.
    pub(super) fn enforce_bound(&mut self) -> u64 {
        match self.bound() {
            Some((max_entries, target)) if self.entries > max_entries => self.prune_to(target),
            _ => 0,
        }
    }

    /// Before `holder` stores `incoming` blocks below `parent`: if they would take the
    /// tree over its bound, marks the parent as just used and prunes to the target
    /// minus `incoming`. Returns the entries forgotten.
    pub(super) fn make_room(
        &mut self,
        holder: Holder,
        parent: Option<ExternalBlockHash>,
        incoming: usize,
    ) -> u64 {
        let Some((max_entries, target)) = self.bound() else {
            return 0;
        };
        if self.entries.saturating_add(incoming) <= max_entries {
            return 0;
        }
        if let Some(parent) = parent {
            let held = match self.find_parent(holder, parent) {
                ParentAt::Own(_, held) => Some(held.id),
                ParentAt::Other(id) => Some(id),
                _ => None,
            };
            if let Some(id) = held {
                let tick = self.tick();
                let run = self.arena.run_of(id);
                self.arena.node(run).last_used.stored(tick);
            }
        }
        self.prune_to(target.saturating_sub(incoming))
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
                    let Some(survivor) = self.forget_leaf(node, target) else {
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
        self.purge_tombstones();
        (before - self.entries) as u64
    }

    /// Rebuilds the engine-hash map of every rank that holds more tombstones than
    /// [`PURGE_MIN_TOMBSTONES`] and than live entries, without them, and shrinks it.
    fn purge_tombstones(&mut self) {
        let crowded: Vec<RankIdx> = self
            .ranks
            .iter()
            .filter(|(_, s)| {
                let live = (s.blocks.len() as u64).saturating_sub(s.forgotten);
                s.forgotten > PURGE_MIN_TOMBSTONES && s.forgotten > live
            })
            .map(|(idx, _)| idx)
            .collect();
        for idx in crowded {
            let arena = &self.arena;
            if let Some(state) = self.ranks.get_mut(idx) {
                let stale = |r: &BlockRef| arena.generation(r.id) != r.generation;
                state.blocks.retain(|_, r| !stale(r));
                state.blocks.shrink_to_fit();
                let blocks = &state.blocks;
                state.copies.retain(|hash, _| blocks.contains_key(hash));
                state.forgotten = 0;
            }
        }
    }

    /// Forgets the blocks of the leaf run `node` for every holder, from its tail,
    /// until at most `target` entries remain or the run is gone. Returns the nearest
    /// ancestor that survived (still held or still branching; possibly the root) when
    /// the run went, `node` itself when the target was reached first, or `None` when
    /// `node` was not a leaf.
    fn forget_leaf(&mut self, node: NodeIdx, target: usize) -> Option<NodeIdx> {
        let holders: Vec<u32> = self.arena.node(node).holders.as_raw().to_vec();
        loop {
            let (id, survivor) = self.arena.pop_leaf_block(node)?;
            for raw in &holders {
                let Some(state) = self.ranks.get_mut(RankIdx(*raw)) else {
                    continue;
                };
                let extra = state.aliases.remove(&id).map_or(0, u64::from);
                state.forgotten += 1 + extra;
                self.entries -= 1 + extra as usize;
            }
            if let Some(survivor) = survivor {
                return Some(survivor);
            }
            if self.entries <= target {
                return Some(node);
            }
        }
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
        // 18 + 6 > 20: room is made first, down to 10 - 6 = 4, then the chain is
        // stored (10 entries).
        let out = store_chain(&mut tree, 4, 400, 6);
        assert_eq!(out.pruned, 14);
        assert_eq!(tree.num_entries(), 10);
        // Never-matched chains go first, oldest first: worker 1's, worker 3's, then
        // the tail of worker 2's — the only one a query matched — is left with 4.
        let third: Vec<u64> = (300..306).collect();
        assert!(tree.find_matches(&q(&third)).is_empty());
        assert_eq!(tree.find_matches(&q(&prefix)).get(wr(2, 0)), 4);
        let newest: Vec<u64> = (400..406).collect();
        assert_eq!(tree.find_matches(&q(&newest)).get(wr(4, 0)), 6);
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

    /// Issue 14, finding 6: a flood of junk blocks stored after a real prompt used to
    /// push the real, recently matched prompt out (it was older) while the junk
    /// stayed. Blocks never matched now go first, whoever stored them last.
    #[test]
    fn a_flood_of_never_matched_blocks_goes_before_a_matched_prompt() {
        let mut tree = bounded(1000, 90);
        store_chain(&mut tree, 1, 100, 20);
        let real: Vec<u64> = (100..120).collect();
        assert_eq!(tree.find_matches(&q(&real)).get(wr(1, 0)), 20);
        // Worker 2 floods 4,500 blocks in 45 chains, never asked for.
        for c in 0..45 {
            let chain: Vec<(u64, u64)> = (0..100)
                .map(|i| (2_000_000 + c * 100 + i, 1_000_000 + c * 1000 + i))
                .collect();
            tree.apply_event(WorkerId(2), &stored(0, None, &chain))
                .expect("stores");
            assert!(tree.num_entries() <= 1000, "over the bound");
        }
        check_invariants(&tree);
        assert_eq!(
            tree.find_matches(&q(&real)).get(wr(1, 0)),
            20,
            "the real prompt stays"
        );
    }

    /// The bound holds at the peak: a store that would go over it prunes first, so
    /// the arena never grows past the bound plus one event.
    #[test]
    fn the_bound_holds_at_the_peak_not_only_after_the_store() {
        let mut tree = bounded(100, 90);
        for w in 1..=10 {
            store_chain(&mut tree, w, w * 1000, 60);
            assert!(tree.num_entries() <= 100);
        }
        // Ten chains of 60 went through a tree bounded at 100: the arena's slots
        // never held more than the bound (the root and 100 nodes), where pruning
        // after the store needed 160.
        assert!(tree.arena.slots() <= 101, "{} slots", tree.arena.slots());
        // The event's parent survives the room made for it.
        let chain: Vec<(u64, u64)> = (0..60).map(|i| (11_000 + i, 11_000 + i)).collect();
        tree.apply_event(WorkerId(11), &stored(0, None, &chain[..1]))
            .expect("stores");
        let out = tree
            .apply_event(WorkerId(11), &stored(0, Some(11_000), &chain[1..]))
            .expect("the parent was kept");
        assert_eq!(out.stored, 59);
        check_invariants(&tree);
    }

    /// Issue 28: a pruned block forgets all its copies: storing it again revives one
    /// copy, which one removal drops; removals of a pruned block drop its tombstone,
    /// then name nothing.
    #[test]
    fn a_pruned_block_forgets_its_copies() {
        let mut tree = bounded(4, 50);
        let chain = [(1000, 10), (1001, 11)];
        for _ in 0..2 {
            tree.apply_event(WorkerId(1), &stored(0, None, &chain))
                .expect("stores");
        }
        check_invariants(&tree);
        // Two copies each: one removal keeps block 1001.
        let out = tree
            .apply_event(WorkerId(1), &removed(0, &[1001]))
            .expect("removes never fail");
        assert_eq!((out.removed, out.copies_removed), (0, 1));
        assert_eq!(tree.find_matches(&q(&[10, 11])).get(wr(1, 0)), 2);
        // Three copies of 1000, two of 1001, then worker 2's chain prunes both.
        tree.apply_event(WorkerId(1), &stored(0, None, &chain))
            .expect("stores");
        tree.apply_event(WorkerId(1), &stored(0, None, &chain[..1]))
            .expect("stores");
        let out = store_chain(&mut tree, 2, 20, 3);
        assert_eq!(out.pruned, 2);
        assert_eq!(tree.find_matches(&q(&[10])).get(wr(1, 0)), 0);
        // Stored again, block 1000 holds one copy.
        let out = tree
            .apply_event(WorkerId(1), &stored(0, None, &chain[..1]))
            .expect("stores");
        assert_eq!((out.stored, out.forgotten, out.copies_added), (1, 1, 0));
        check_invariants(&tree);
        let out = tree
            .apply_event(WorkerId(1), &removed(0, &[1000]))
            .expect("removes never fail");
        assert_eq!((out.removed, out.copies_removed), (1, 0));
        assert_eq!(tree.find_matches(&q(&[10])).get(wr(1, 0)), 0);
        // Block 1001's tombstone goes with its copy count; a second removal is unknown.
        let out = tree
            .apply_event(WorkerId(1), &removed(0, &[1001, 1001]))
            .expect("removes never fail");
        assert_eq!(
            (out.forgotten, out.unknown_removed, out.copies_removed),
            (1, 1, 0)
        );
        check_invariants(&tree);
        assert_eq!(super::super::tests::num_copies(&tree), 0);
    }

    /// Pruned blocks leave tombstones in their rank's engine-hash map; a rank whose
    /// map is mostly tombstones is rebuilt without them, so the map does not grow with
    /// every block ever pruned.
    #[test]
    fn tombstones_are_purged_when_they_outnumber_live_entries() {
        let mut tree = bounded(500, 50);
        for c in 0..100u64 {
            let chain: Vec<(u64, u64)> = (0..100)
                .map(|i| (c * 100 + i, 500_000 + c * 1000 + i))
                .collect();
            tree.apply_event(WorkerId(3), &stored(0, None, &chain))
                .expect("stores");
        }
        check_invariants(&tree);
        let idx = tree
            .ranks
            .lookup(Holder {
                rank: wr(3, 0),
                tier: kv_events::StorageTier::Gpu,
                group: None,
            })
            .expect("rank known");
        let state = tree.ranks.get(idx).expect("state");
        assert!(
            state.blocks.len() as u64 <= 500 + 2 * PURGE_MIN_TOMBSTONES,
            "{} map entries for {} live blocks",
            state.blocks.len(),
            tree.num_entries()
        );
    }
}
