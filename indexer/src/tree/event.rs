//! Applying one KV event to the [`RadixTree`], whole or in parts: the dispatch by
//! kind to stores, removes and clears (`tree/apply.rs`).
//!
//! Parts exist so that the concurrent front can let queries read a shard in the
//! middle of a long event (`crate::ordered` applies a batch in steps): an
//! [`Interrupt`] stops the application at a block boundary when a query waits, and
//! the rest is applied later. A store's blocks form one chain, so its rest from block
//! `k` is a store below block `k - 1`. A removal's blocks are independent: it looks
//! them all up first, then drops them from the tree piece by piece, a piece at the
//! end of a run only its rank holds from the leaf end (`tree/remove.rs`), so no stop
//! splits a run; [`Progress`] carries the pieces between two parts. A stop costs a
//! second call's setup (one parent lookup, the map slots of the rest's next blocks
//! warmed a window at a time rather than all of them again); asking costs one
//! comparison per block and a call every `every` blocks. Stopped at every 8th
//! block, a 4,096-block `Stored` costs ~2× the whole event and a `Removed` ~2.5×
//! (`cargo bench -p indexer --bench indexer -- steps`). The differential test applies
//! every event in parts too and expects the same answers and dump as the whole
//! event.

use super::RadixTree;
use super::part::{Interrupt, Part, Progress};
use super::ranks::{Holder, WarmAhead};
use crate::error::ApplyError;
use crate::tree::ApplyOutcome;
use kv_events::{KvCacheEvent, KvCacheEventData, WorkerId, WorkerRank};

impl RadixTree {
    /// Applies one KV event of `worker_id` (the rank is `event.dp_rank`).
    ///
    /// Each (rank, tier, KV cache group) is its own holder; `group: None` is the
    /// rank's single group of a model without groups.
    ///
    /// - `Stored { parent_hash, blocks, group }`: the chain is added below the
    ///   holder's block `parent_hash` (the root when `None`), creating nodes as
    ///   needed. A parent the holder does not hold is looked up in the rank's other
    ///   groups on the same tier (a windowed group's sparse store hangs below the
    ///   full-attention group's block), then on its other tiers, GPU first. A block
    ///   whose engine hash the holder already holds adds a copy (counted in
    ///   `copies_added`) and the chain continues from the held block. Two engine
    ///   hashes of one holder naming the same node are both kept; the node stays held
    ///   until both are removed. A store with a group and no blocks makes the group
    ///   known (interned, holding nothing). A group's window is fixed by its first
    ///   store.
    /// - `Removed { block_hashes, group }`: each held block of that holder only drops
    ///   one copy, and leaves the holder with its last; unknown ones are counted in
    ///   `unknown_removed`. Dropping an interior block hides the holder's deeper
    ///   blocks from prefix matches (they stay indexed until removed).
    /// - `Cleared`: every block of the rank is dropped, on every tier and group.
    ///
    /// `event_id` is not checked here (see [`crate::OrderedIndex`] for ordering). A
    /// bounded tree prunes before a store that would take it over its bound (keeping
    /// the event's parent), so it never holds more than its bound plus the event's
    /// own blocks, and again after it if it still is over.
    ///
    /// # Errors
    /// [`ApplyError::UnknownParent`] when `parent_hash` is `Some` and no holder of the
    /// rank holds that block; nothing changes then. [`ApplyError::ForgottenParent`]
    /// when this tree pruned the parent block; prefix matches do not change, but the
    /// event's blocks are remembered as forgotten so that their own children are
    /// refused the same way. [`ApplyError::WindowMismatch`] when the event's group is
    /// known with another window; nothing changes.
    pub fn apply_event(
        &mut self,
        worker_id: WorkerId,
        event: &KvCacheEvent,
    ) -> Result<ApplyOutcome, ApplyError> {
        self.apply_event_from(worker_id, event, &mut Progress::default(), Interrupt::NEVER)
    }

    /// Applies the next part of `event`: from where `progress` stands (start each
    /// event at [`Progress::default`]) until it is done or `interrupt` stops it at a
    /// block boundary; returns the outcome of this part, and `progress` says whether
    /// the event is done ([`Progress::is_done`]). A `Cleared` is always whole.
    ///
    /// A `Stored`'s rest from block `k` hangs below its block `k - 1`. A `Removed`
    /// looks its blocks up first and drops them from the tree after the last lookup
    /// (`tree/remove.rs`), so its parts may outnumber its blocks by the pieces it
    /// drops. Applying an event part by part until done leaves the tree answering as
    /// [`RadixTree::apply_event`] would, and a caller may let queries in between; a
    /// query then sees a prefix of a `Stored` chain or part of a `Removed`, states
    /// the engine's cache also passes through. No other event, removal or resync may
    /// reach the tree between two parts of one event (`progress` names the tree's
    /// blocks). Only a bounded tree's pruning may differ: it makes room per call.
    ///
    /// # Errors
    /// As [`RadixTree::apply_event`]'s, for the parent of the part's first block:
    /// after a stop, a store is refused only if that parent (its own previous block)
    /// was pruned or removed in between. `progress` is done after an error.
    pub fn apply_event_from(
        &mut self,
        worker_id: WorkerId,
        event: &KvCacheEvent,
        progress: &mut Progress,
        interrupt: Interrupt<'_>,
    ) -> Result<ApplyOutcome, ApplyError> {
        let rank = WorkerRank::new(worker_id, event.dp_rank);
        let from = progress.next_block;
        // A resumed event may stop again soon: it warms its rest a window at a time.
        let part = Part {
            interrupt,
            warm: if from == 0 {
                WarmAhead::All
            } else {
                WarmAhead::Window
            },
        };
        match &event.data {
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                tier,
                group,
            } => {
                let holder = Holder {
                    rank,
                    tier: *tier,
                    group: group.map(|g| g.id),
                };
                let window = group.and_then(|g| g.window_blocks);
                let from = from.min(blocks.len());
                let parent_hash = match from.checked_sub(1) {
                    None => *parent_hash,
                    Some(before) => Some(blocks[before].block_hash),
                };
                let rest = &blocks[from..];
                let stored = self.check_window(holder, window).and_then(|()| {
                    // Room first, so the bound holds at the peak too, not only after.
                    let room = self.make_room(holder, parent_hash, rest.len());
                    let (mut outcome, done) =
                        self.store(holder, window, parent_hash, rest, true, part)?;
                    outcome.pruned = room + self.enforce_bound();
                    Ok((outcome, done))
                });
                match stored {
                    Ok((outcome, done)) => {
                        progress.next_block = from + done;
                        if progress.next_block == blocks.len() {
                            progress.finish(blocks.len());
                        }
                        Ok(outcome)
                    }
                    Err(error) => {
                        progress.finish(blocks.len());
                        Err(error)
                    }
                }
            }
            KvCacheEventData::Removed {
                block_hashes,
                tier,
                group,
            } => {
                let holder = Holder {
                    rank,
                    tier: *tier,
                    group: *group,
                };
                Ok(self.remove(holder, block_hashes, progress, part))
            }
            KvCacheEventData::Cleared => {
                progress.finish(0);
                Ok(self.clear_rank(rank))
            }
        }
    }
}
