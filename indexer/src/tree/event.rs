//! Applying one KV event to the [`RadixTree`], whole or in parts: the dispatch by
//! kind to stores, removes and clears (`tree/apply.rs`).
//!
//! Parts exist so that the concurrent front can let queries read a shard in the
//! middle of a long event (`crate::ordered` applies a batch in steps): an
//! [`Interrupt`] stops the application at a block boundary when a query waits, and
//! the rest is applied later. A store's blocks form one chain, so its rest from block
//! `k` is a store below block `k - 1`; a removal's blocks are independent. A stop
//! costs a second call's setup (one parent lookup, the map slots of the rest's next
//! blocks warmed a window at a time rather than all of them again) and, for a
//! removal that stopped inside a run, one split of it; asking costs one comparison
//! per block and a call every `every` blocks. Stopped at every 8th block, a
//! 4,096-block `Stored` costs ~2× the whole event and a `Removed` ~21×, most of it
//! the splits (`cargo bench -p indexer --bench indexer -- steps`). The differential test
//! applies every event in parts too and expects the same answers and dump as the
//! whole event.

use super::RadixTree;
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
        self.apply_event_from(worker_id, event, 0, Interrupt::NEVER)
            .map(|(outcome, _)| outcome)
    }

    /// Applies `event` from block `from` on (an index into its `blocks` or
    /// `block_hashes`; a `Cleared` is always whole) until it is done or `interrupt`
    /// stops it at a block boundary; returns the outcome and the index of the next
    /// block to apply (the event's length once done). Blocks `from..` of a `Stored`
    /// hang below block `from - 1` of the event; blocks of a `Removed` are
    /// independent. So applying an event from 0, then from where it stopped, and so
    /// on, leaves the tree answering as [`RadixTree::apply_event`] would, and a
    /// caller may let queries in between; a query then sees a prefix of a `Stored`
    /// chain or part of a `Removed`, states the engine's cache also passes through.
    /// Only a bounded tree's pruning may differ: it makes room per call.
    ///
    /// # Errors
    /// As [`RadixTree::apply_event`]'s, for the parent of block `from`: after a stop,
    /// a store is refused only if that parent (its own previous block) was pruned or
    /// removed in between.
    pub fn apply_event_from(
        &mut self,
        worker_id: WorkerId,
        event: &KvCacheEvent,
        from: usize,
        interrupt: Interrupt<'_>,
    ) -> Result<(ApplyOutcome, usize), ApplyError> {
        let rank = WorkerRank::new(worker_id, event.dp_rank);
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
                self.check_window(holder, window)?;
                // Room first, so the bound holds at the peak too, not only after.
                let room = self.make_room(holder, parent_hash, rest.len());
                let (mut outcome, done) =
                    self.store(holder, window, parent_hash, rest, true, part)?;
                outcome.pruned = room + self.enforce_bound();
                Ok((outcome, from + done))
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
                let from = from.min(block_hashes.len());
                let (outcome, done) = self.remove(holder, &block_hashes[from..], part);
                Ok((outcome, from + done))
            }
            KvCacheEventData::Cleared => Ok((self.clear_rank(rank), 0)),
        }
    }
}

/// When a long event's application may stop early: `stop` is asked at every
/// `every`-th block boundary, and true stops it there.
#[derive(Clone, Copy)]
pub struct Interrupt<'a> {
    /// Blocks between two questions; at least 1 ([`usize::MAX`]: never asked).
    pub every: usize,
    /// Asked at the boundaries; true to stop.
    pub stop: &'a dyn Fn() -> bool,
}

impl Interrupt<'_> {
    /// Never stops: the event is applied whole.
    pub const NEVER: Interrupt<'static> = Interrupt {
        every: usize::MAX,
        stop: &|| false,
    };

    /// Whether to stop before block `k`, asked once per block: `check_at` (start it
    /// at `self.every`) is the next boundary to ask at.
    #[inline]
    pub(super) fn stops_at(&self, k: usize, check_at: &mut usize) -> bool {
        if k != *check_at {
            return false;
        }
        *check_at = check_at.saturating_add(self.every.max(1));
        (self.stop)()
    }
}

/// How one call applies its part of an event: when it may stop, and how far ahead
/// of its loop it warms the map slots of the blocks.
#[derive(Debug, Clone, Copy)]
pub(super) struct Part<'a> {
    pub(super) interrupt: Interrupt<'a>,
    pub(super) warm: WarmAhead,
}

impl Part<'_> {
    /// An event applied whole, from its first block.
    pub(super) const WHOLE: Part<'static> = Part {
        interrupt: Interrupt::NEVER,
        warm: WarmAhead::All,
    };
}

impl std::fmt::Debug for Interrupt<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interrupt")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}
