//! What one running request holds on a hybrid rank: its hit, the full group's blocks
//! and reservation, and each windowed group's working set (the capacity model is in
//! the `cache` module's docs), plus the retention rule that decides which of its
//! blocks a windowed group caches.

use super::BlockId;
use super::{HybridHit, Layout, WindowRetention};

/// A windowed group's share of a running request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Window {
    /// Cached blocks the request references, with their prompt positions, in order.
    pub held: Vec<(usize, BlockId)>,
    /// Anonymous blocks of the working set, in blocks.
    pub reserved: u64,
}

/// The KV space one running request holds on a hybrid rank. Obtained from
/// [`super::HybridCache::try_allocate`]; must be handed back to
/// [`super::HybridCache::release`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HybridAllocation {
    pub(super) hit: HybridHit,
    /// The full group's blocks of prompt positions `0..full.len()`.
    pub(super) full: Vec<BlockId>,
    /// The rest of the full group's footprint, in blocks.
    pub(super) full_reserved: u64,
    /// Each windowed group's working set.
    pub(super) windows: Vec<Window>,
    /// Replay boundary, in blocks: `floor((prompt_tokens − 1) / block_size)`.
    pub(super) replay_end: usize,
    /// The request's whole footprint in the full group, in blocks.
    pub(super) total_blocks: u64,
    /// The prefill is done and the working sets are down to `w + 1`.
    pub(super) decoding: bool,
}

impl HybridAllocation {
    /// The engine's hit at admission, in blocks.
    pub fn hit_blocks(&self) -> usize {
        self.hit.blocks
    }

    /// Leading prompt blocks the full group holds for the request (hit and computed),
    /// in blocks: the next block to commit.
    pub fn committed_blocks(&self) -> usize {
        self.full.len()
    }

    /// Blocks the request occupies in every group (held and reserved), in blocks.
    pub fn total_blocks(&self) -> u64 {
        let windows: u64 = self
            .windows
            .iter()
            .map(|w| w.held.len() as u64 + w.reserved)
            .sum();
        self.full.len() as u64 + self.full_reserved + windows
    }

    /// Whether a windowed group caches block `pos` of this request.
    pub(super) fn keeps(&self, pos: usize, layout: &Layout) -> bool {
        let w = layout.window_blocks as usize;
        let in_tail = |end: usize| pos < end && pos + w >= end;
        match layout.retention {
            WindowRetention::All => true,
            WindowRetention::Tail => {
                in_tail(self.replay_end)
                    || (self.hit.full_blocks > self.hit.blocks && in_tail(self.hit.full_blocks))
            }
        }
    }
}
