//! What a part of an event is: when it stops ([`Interrupt`]), how far ahead it warms
//! ([`Part`]), and where the event stands between two parts ([`Progress`], with a
//! removal's pieces still to drop). `tree/event.rs` applies the parts,
//! `tree/remove.rs` a removal's two phases.

use super::arena::{BlockId, NodeIdx, Slot};
use super::ranks::WarmAhead;

/// Where one event stands while it is applied in parts
/// ([`crate::RadixTree::apply_event_from`]): its next block, and a removal's blocks looked
/// up and not yet dropped from the tree. Start each event at the default and pass
/// the same value to every part. It names blocks of the tree it was used with, so
/// it is valid only for that tree, and only while no other write reaches it.
#[derive(Debug, Default)]
pub struct Progress {
    /// The next block of the event to apply: a store's next block, a removal's
    /// next lookup.
    pub(super) next_block: usize,
    /// A removal's blocks looked up and still to drop.
    pub(super) dropping: Dropping,
    done: bool,
}

impl Progress {
    /// True once the whole event is applied (or was refused).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Marks the event of `len` blocks done.
    pub(super) fn finish(&mut self, len: usize) {
        self.next_block = len;
        self.done = true;
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

    /// Whether to stop after `k` blocks, asked as `k` grows (by one block or by
    /// several): `check_at` (start it at `self.every`) is the next boundary to ask
    /// at.
    #[inline]
    pub(super) fn stops_at(&self, k: usize, check_at: &mut usize) -> bool {
        if k < *check_at {
            return false;
        }
        *check_at = k.saturating_add(self.every.max(1));
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

/// A removal's blocks looked up and not yet dropped from the tree.
#[derive(Debug, Default)]
pub(super) struct Dropping {
    /// Pieces as (first block, length), each contiguous in one run and disjoint;
    /// dropped from the last. Dropping one piece splits runs only at its own ends
    /// and frees or merges whole runs, so every other piece stays contiguous in one
    /// run: it is found again from its first block.
    pub(super) pieces: Vec<(BlockId, usize)>,
    /// The last piece's run and offsets `lo..hi` while looking up, to extend it.
    last: Option<(NodeIdx, u32, u32)>,
    /// True once some block did not extend the last piece: the pieces are sorted
    /// and coalesced before the drop.
    pub(super) scattered: bool,
}

impl Dropping {
    /// Adds block `id`, at `slot`, to the pieces: it extends the last piece when it
    /// continues it in its run, at either end.
    pub(super) fn push(&mut self, slot: Slot, id: BlockId) {
        let Slot { node, offset } = slot;
        if let Some((run, lo, hi)) = &mut self.last
            && *run == node
            && let Some(piece) = self.pieces.last_mut()
        {
            if offset == *hi {
                *hi += 1;
                piece.1 += 1;
                return;
            }
            if offset + 1 == *lo {
                *lo = offset;
                *piece = (id, piece.1 + 1);
                return;
            }
        }
        self.scattered |= !self.pieces.is_empty();
        self.pieces.push((id, 1));
        self.last = Some((node, offset, offset + 1));
    }
}
