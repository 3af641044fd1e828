//! Applying a `Removed` event in two phases that a query may interrupt: the lookups,
//! then the drop from the tree.
//!
//! Why two phases: a removal's lookups only change the holder's engine-hash map,
//! which queries never read; the tree changes in the drop. A removal stopped in its
//! lookups keeps the blocks looked up so far as pieces to drop later, so a query
//! between two steps sees the holder still holding them (the cache before the
//! event, a state the engine passed through), and no run is split because a step
//! ended. The drop then goes piece by piece, and a piece at the end of a run that
//! the rank alone holds goes from its leaf end `every` blocks at a time: truncating
//! a run frees its tail and moves nothing, so a query waits for a few blocks'
//! truncation, not for a whole chain's. Before this, an eviction sweep's 4,096-block
//! drop (~12 µs at 1M entries) was the longest span a query waited for under a flood
//! (`docs/studies/index-flood.md`, "Fifth attempt"), and a removal stopped every 8
//! blocks split the rest of its run at every stop: ~22× the whole event, ~2.5× since
//! (`cargo bench -p indexer --bench indexer -- steps`).
//!
//! A piece inside a run, or in a run other ranks also hold, is dropped whole:
//! dropping it in parts would split the run at every part and merge the parts back
//! (O(blocks² / part)).
//!
//! Pieces are built while looking up: a block that continues the last piece in its
//! run, forward or backward, extends it, so a chain listed root first or leaf first
//! is one piece with no sort. Blocks listed in any other order are sorted by run and
//! offset and coalesced once, after the last lookup. That sort is the one span here
//! that no query can interrupt, and it is long only for a scattered list, whose
//! pieces are single blocks.

use super::RadixTree;
use super::arena::{BlockId, NodeIdx, Slot};
use super::part::{Dropping, Interrupt, Part, Progress};
use super::ranks::Holder;
use super::rankset::RankIdx;
use super::{ApplyOutcome, is_live};
use kv_events::ExternalBlockHash;

impl RadixTree {
    /// Applies `block_hashes` (the whole event's) to `holder` from
    /// `progress.next_block` on, as `part` says: the lookups, then the drop (module
    /// docs). Marks `progress` done once every block is looked up and dropped.
    pub(super) fn remove(
        &mut self,
        holder: Holder,
        block_hashes: &[ExternalBlockHash],
        progress: &mut Progress,
        part: Part<'_>,
    ) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        let from = progress.next_block.min(block_hashes.len());
        let Some(idx) = self.ranks.lookup(holder) else {
            outcome.unknown_removed = (block_hashes.len() - from) as u64;
            progress.finish(block_hashes.len());
            return outcome;
        };
        // Blocks this call looked up.
        let mut handled = 0;
        if from < block_hashes.len() {
            let rest = &block_hashes[from..];
            handled = self.look_up(idx, rest, &mut progress.dropping, &mut outcome, part);
            progress.next_block = from + handled;
            if handled < rest.len() {
                return outcome;
            }
            self.settle(&mut progress.dropping);
        }
        if self.drop_pieces(idx, &mut progress.dropping, part.interrupt, handled) {
            progress.finish(block_hashes.len());
        }
        outcome
    }

    /// Looks up `hashes` in holder `idx`'s map and takes them out of it (or drops a
    /// copy), adding each block the holder leaves to `dropping`, until `part`'s
    /// interrupt stops it; returns how many hashes were handled.
    fn look_up(
        &mut self,
        idx: RankIdx,
        hashes: &[ExternalBlockHash],
        dropping: &mut Dropping,
        outcome: &mut ApplyOutcome,
        Part { interrupt, warm }: Part<'_>,
    ) -> usize {
        let Some(state) = self.ranks.get_mut(idx) else {
            // Unreachable: `idx` was just looked up.
            return hashes.len();
        };
        let mut check_at = interrupt.every;
        let mut warm_at = 0;
        for (k, hash) in hashes.iter().enumerate() {
            if interrupt.stops_at(k, &mut check_at) {
                return k;
            }
            if let Some(ahead) = warm.due(k, hashes.len(), &mut warm_at) {
                state.warm(hashes[ahead].iter());
            }
            // Empty unless the engine stored a held block again: one length check.
            if !state.copies.is_empty()
                && let Some(held) = state.blocks.get(hash)
                && is_live(&self.arena, state, *held)
                && let Some(extra) = state.copies.get_mut(hash)
            {
                *extra -= 1;
                if *extra == 0 {
                    state.copies.remove(hash);
                }
                outcome.copies_removed += 1;
                continue;
            }
            let Some(held) = state.blocks.remove(hash) else {
                outcome.unknown_removed += 1;
                continue;
            };
            if !is_live(&self.arena, state, held) {
                // Pruned: the tombstone goes, and with it the copies it had.
                state.forgotten -= 1;
                outcome.forgotten += 1;
                if !state.copies.is_empty() {
                    state.copies.remove(hash);
                }
                continue;
            }
            outcome.removed += 1;
            self.entries -= 1;
            match state.aliases.get_mut(&held.id) {
                Some(extra) if *extra > 1 => *extra -= 1,
                Some(_) => {
                    state.aliases.remove(&held.id);
                }
                None => dropping.push(self.arena.slot(held.id), held.id),
            }
        }
        hashes.len()
    }

    /// Sorts and coalesces the pieces of a removal whose blocks were listed out of
    /// order, so that each run's piece is dropped once, not split per block.
    fn settle(&self, dropping: &mut Dropping) {
        if !dropping.scattered {
            return;
        }
        let mut keyed: Vec<(NodeIdx, u32, BlockId, usize)> = (dropping.pieces.iter())
            .map(|&(first, len)| {
                let Slot { node, offset } = self.arena.slot(first);
                (node, offset, first, len)
            })
            .collect();
        keyed.sort_unstable_by_key(|&(node, offset, _, _)| (node, offset));
        dropping.pieces.clear();
        let mut end: Option<(NodeIdx, u32)> = None;
        for (node, offset, first, len) in keyed {
            match dropping.pieces.last_mut() {
                Some(piece) if end == Some((node, offset)) => piece.1 += len,
                _ => dropping.pieces.push((first, len)),
            }
            end = Some((node, offset + len as u32));
        }
        dropping.scattered = false;
    }

    /// Drops holder `rank` from the pieces of `dropping`, from the last, until the
    /// interrupt stops it; this call already looked up `handled` blocks, which count
    /// towards the interrupt's first boundary. True when every piece is dropped.
    fn drop_pieces(
        &mut self,
        rank: RankIdx,
        dropping: &mut Dropping,
        interrupt: Interrupt<'_>,
        mut handled: usize,
    ) -> bool {
        let mut check_at = interrupt.every;
        while let Some(piece) = dropping.pieces.last_mut() {
            if interrupt.stops_at(handled, &mut check_at) {
                return false;
            }
            let (first, len) = *piece;
            let Slot { node, offset } = self.arena.slot(first);
            let (start, end) = (offset as usize, offset as usize + len);
            let from = if self.arena.is_sole_tail(node, end, rank) {
                start.max(end.saturating_sub(interrupt.every))
            } else {
                start
            };
            self.arena.drop_holder(node, from, end, rank);
            handled += end - from;
            if from == start {
                dropping.pieces.pop();
            } else {
                piece.1 = from - start;
            }
        }
        true
    }
}
