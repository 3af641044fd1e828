//! Hybrid attention: a model whose sliding-window layers keep KV cache groups of their
//! own beside the full-attention group (Gemma 3, gpt-oss), as vLLM's hybrid KV cache
//! manager runs it. Off by default ([`HybridConfig::sliding_window_groups`] 0): a
//! dense model with one full-attention group, exactly the [`crate::KvCache`] model.
//!
//! Why model it: a router that indexes only the full-attention group over-claims on
//! prompts that share a prefix with cached ones, because the engine also needs the
//! sliding window right before the hit point, which vLLM's sparse retention no longer
//! holds. The mock engines and the lab must behave like the engine for the router to
//! be tested and measured against it. The rules reproduce vLLM 0.32 (the source of
//! `HybridKVCacheCoordinator` and `SlidingWindowManager`, and a real capture of a tiny
//! Gemma 3: 3 sliding-window groups of window 128 tokens and one full group, block 32):
//!
//! - **Groups.** `N` sliding-window groups (ids `0 .. N`) of window `W` tokens and one
//!   full-attention group (id `N`), each holding its own physical copy of a block
//!   under the same block hash. A windowed group needs `w = cdiv(W − 1, block_size)`
//!   blocks before a hit point ([`window_blocks`]).
//! - **Hit.** A prefix of `L` blocks is a hit when the full group holds blocks `0..L`
//!   and every windowed group holds `max(0, L − w) .. L`; the hit is the largest such
//!   `L`, capped at `floor((prompt_tokens − 1) / block_size)` blocks (the last prompt
//!   token is always recomputed, so an exactly block-aligned prompt never hits its
//!   last block). The engine reports `L × block_size` as its cached tokens.
//! - **Retention** ([`WindowRetention`]). vLLM's default (`tail`) caches in a
//!   windowed group only the `w` blocks ending at the *replay boundary*
//!   `floor((prompt_tokens − 1) / block_size)` and, when the full group matched further
//!   than the hit (a shared prefix the windowed groups miss), the `w` blocks ending at
//!   that *junction*; `all` caches every block (`--prefix-cache-retention-interval`
//!   ≤ `w × block_size` in vLLM).
//! - **Copies.** Every block a request computes is a new physical block: when the hit
//!   is shorter than the full group's own prefix, the recomputed prefix is stored
//!   again in the full group (a second copy under the same hash, later evicted on its
//!   own), and a repeat of an exactly block-aligned prompt stores its last block again.
//!
//! The cache itself, its capacity model and its events are in [`cache`] (the
//! [`HybridCache`]); the two event forms it produces are the router's protocol
//! (`KvCacheEventData` with groups, one `Stored` per run of consecutive blocks) and
//! [`GroupStore`]s, one per group per request and step, from which the mock engine
//! writes vLLM's `BlockStored` byte for byte. Cost: per admission O(prompt blocks ×
//! groups) hash-map lookups; per cached block one hash-map entry per copy.

mod alloc;
pub mod cache;
mod events;

pub use alloc::HybridAllocation;
pub use cache::{HybridCache, Occupancy};

/// A physical block of the hybrid pool (one copy of a hash in one group): ids are
/// handed out in order and never reused.
type BlockId = u64;

use kv_events::{ExternalBlockHash, KvCacheGroup, StoredBlock};

/// Default `--sliding-window`, in tokens: Gemma 3's 1,024 would not show on short
/// prompts; 128 is the real capture's (and gpt-oss's) window.
pub const DEFAULT_SLIDING_WINDOW: u32 = 128;

/// Most sliding-window groups a model may declare (vLLM groups layers so that every
/// group has as many layers as the smallest kind; real models have at most a few).
pub const MAX_SLIDING_WINDOW_GROUPS: u32 = 64;

/// Which blocks a sliding-window group caches (vLLM's
/// `--prefix-cache-retention-interval`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum WindowRetention {
    /// vLLM 0.32's default (interval 0): only the window before the replay boundary
    /// and before a shared-prefix junction.
    #[default]
    Tail,
    /// Every block, as the full-attention group (a retention interval of at most one
    /// window).
    All,
}

/// The hybrid-attention shape of every rank: sliding-window groups beside the
/// full-attention group. `sliding_window_groups = 0` (the default) is a dense model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct HybridConfig {
    /// Sliding-window KV cache groups beside the full-attention group (vLLM's hybrid
    /// KV cache manager; 0 = a dense model with one group). Groups `0..N` are the
    /// windowed ones, group `N` is full attention. Not combinable with a CPU tier.
    #[arg(long, default_value_t = 0)]
    pub sliding_window_groups: u32,
    /// The sliding window of those groups, in tokens (≥ 2); a hit needs
    /// `cdiv(window − 1, block size)` blocks of each before the hit point.
    #[arg(long, default_value_t = DEFAULT_SLIDING_WINDOW)]
    pub sliding_window: u32,
    /// Which blocks a sliding-window group keeps cached: `tail` (vLLM's default: the
    /// window before the prompt's last full block and before a shared-prefix
    /// junction) or `all` (every block).
    #[arg(long, value_enum, default_value_t = WindowRetention::Tail)]
    pub sliding_window_retention: WindowRetention,
}

impl Default for HybridConfig {
    /// A dense model (no sliding-window group), the flags' defaults otherwise.
    fn default() -> Self {
        Self {
            sliding_window_groups: 0,
            sliding_window: DEFAULT_SLIDING_WINDOW,
            sliding_window_retention: WindowRetention::Tail,
        }
    }
}

impl HybridConfig {
    /// `groups` sliding-window groups of `window` tokens, vLLM's default retention.
    pub fn sliding(groups: u32, window: u32) -> Self {
        Self {
            sliding_window_groups: groups,
            sliding_window: window,
            ..Self::default()
        }
    }

    /// Whether the model has sliding-window groups.
    pub fn is_hybrid(&self) -> bool {
        self.sliding_window_groups > 0
    }

    /// Checks the shape (only when hybrid: a dense model ignores the window).
    ///
    /// # Errors
    /// [`crate::ModelConfigError::SlidingWindowTooShort`] for a window under 2
    /// tokens, [`crate::ModelConfigError::TooManySlidingWindowGroups`] past
    /// [`MAX_SLIDING_WINDOW_GROUPS`].
    pub fn validate(&self) -> Result<(), crate::ModelConfigError> {
        if !self.is_hybrid() {
            return Ok(());
        }
        if self.sliding_window_groups > MAX_SLIDING_WINDOW_GROUPS {
            return Err(crate::ModelConfigError::TooManySlidingWindowGroups(
                self.sliding_window_groups,
            ));
        }
        if self.sliding_window < 2 {
            return Err(crate::ModelConfigError::SlidingWindowTooShort(
                self.sliding_window,
            ));
        }
        Ok(())
    }

    /// The largest request (prompt plus output tokens, in blocks) a rank of `model`
    /// can ever run: its footprint at admission (the cache module's capacity model)
    /// must fit the pool. The whole pool for a dense model; about `1 / (N + 1)` of it
    /// for a hybrid one whose prompts fit one step, as vLLM's start-up check finds
    /// (the real capture: 96 blocks, 4 groups, at most 736 tokens).
    pub fn max_request_blocks(&self, model: &crate::EngineModelConfig) -> u64 {
        let pool = model.num_gpu_blocks;
        if !self.is_hybrid() {
            return pool;
        }
        let layout = self.layout(model.block_size);
        let chunk = chunk_blocks(model.max_num_batched_tokens, model.block_size);
        // The footprint is (N + 1) × total up to one step's working set, then
        // total + N × working set.
        let working = chunk + u64::from(layout.window_blocks);
        let groups = u64::from(layout.windowed);
        let small = pool / (groups + 1);
        if small < working {
            small
        } else {
            pool - groups * working
        }
    }

    /// The group layout on blocks of `block_size` tokens (≥ 1).
    pub(crate) fn layout(&self, block_size: u32) -> Layout {
        Layout {
            windowed: self.sliding_window_groups,
            window_blocks: window_blocks(self.sliding_window, block_size),
            retention: self.sliding_window_retention,
        }
    }
}

/// Blocks a sliding-window group needs right before a hit point:
/// `cdiv(window_tokens − 1, block_size)` (vLLM's `SlidingWindowManager`; window 128
/// and block 32 give 4). `block_size` must be ≥ 1.
pub fn window_blocks(window_tokens: u32, block_size: u32) -> u32 {
    window_tokens.saturating_sub(1).div_ceil(block_size.max(1))
}

/// The groups of a hybrid rank: `windowed` sliding-window groups (ids `0..windowed`),
/// then the full-attention group (id `windowed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Sliding-window groups.
    pub windowed: u32,
    /// Blocks each needs before a hit point.
    pub window_blocks: u32,
    /// Which blocks they cache.
    pub retention: WindowRetention,
}

/// Blocks one step can complete per request, plus one: `cdiv(budget, block_size) + 1`.
fn chunk_blocks(max_num_batched_tokens: u64, block_size: u32) -> u64 {
    max_num_batched_tokens.div_ceil(u64::from(block_size.max(1))) + 1
}

impl Layout {
    /// A windowed group's working set while a request of `total_blocks` blocks
    /// prefills in steps of `chunk_blocks`: its window plus one step's blocks, at
    /// most its total.
    pub fn prefill_working(&self, total_blocks: u64, chunk_blocks: u64) -> u64 {
        total_blocks.min(chunk_blocks + u64::from(self.window_blocks))
    }

    /// What the pool must hold for a request of `total_blocks` blocks at admission
    /// with no hit: its full-group blocks and every window's working set.
    pub fn footprint(&self, total_blocks: u64, chunk_blocks: u64) -> u64 {
        total_blocks + u64::from(self.windowed) * self.prefill_working(total_blocks, chunk_blocks)
    }

    /// Index of the full-attention group.
    pub fn full(&self) -> usize {
        self.windowed as usize
    }

    /// Group `index` as the router's protocol names it.
    pub fn group(&self, index: usize) -> KvCacheGroup {
        // Group indexes are below MAX_SLIDING_WINDOW_GROUPS + 1, so they fit in u32.
        let id = u32::try_from(index).unwrap_or(u32::MAX);
        if index < self.full() {
            // window_blocks ≥ 1 for a window ≥ 2 tokens (validated).
            KvCacheGroup::windowed(id, self.window_blocks).unwrap_or(KvCacheGroup::full(id))
        } else {
            KvCacheGroup::full(id)
        }
    }
}

/// One KV cache group's part of one request's prompt blocks completed in one step, as
/// vLLM publishes it: one `BlockStored` per group per request and step, the windowed
/// groups' possibly sparse or empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupStore {
    /// The group (id and window).
    pub group: KvCacheGroup,
    /// The engine hash of the block before `range`; `None` when `range` starts at
    /// block 0 (vLLM's `parent_block_hash`, whichever group holds it).
    pub parent_hash: Option<ExternalBlockHash>,
    /// Every full prompt block the request completed in the step, in prefix order
    /// (vLLM's `token_ids` are these blocks' tokens).
    pub range: Vec<StoredBlock>,
    /// The blocks of `range` this group cached, in prefix order: all of them for the
    /// full-attention group (vLLM's `block_hashes`).
    pub stored: Vec<StoredBlock>,
}

/// The hit of a prompt on a hybrid rank, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HybridHit {
    /// The engine's hit (the rule in the module docs).
    pub blocks: usize,
    /// The leading blocks the full-attention group alone holds (same cap); more than
    /// `blocks` at a shared prefix the windowed groups miss (the junction).
    pub full_blocks: usize,
}

#[cfg(test)]
mod prop_tests;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod rule_tests {
    use super::*;

    #[test]
    fn window_blocks_is_vllms_cdiv() {
        assert_eq!(window_blocks(128, 32), 4);
        assert_eq!(window_blocks(129, 32), 4);
        assert_eq!(window_blocks(130, 32), 5);
        assert_eq!(window_blocks(2, 64), 1);
        assert_eq!(window_blocks(1024, 64), 16);
    }

    #[test]
    fn groups_are_windowed_first_then_full() {
        let layout = HybridConfig::sliding(3, 128).layout(32);
        assert_eq!(layout.group(0), KvCacheGroup::windowed(0, 4).unwrap());
        assert_eq!(layout.group(2), KvCacheGroup::windowed(2, 4).unwrap());
        assert_eq!(layout.group(3), KvCacheGroup::full(3));
        assert_eq!(layout.full(), 3);
    }

    #[test]
    fn bad_shapes_are_named() {
        assert!(HybridConfig::default().validate().is_ok());
        // A dense model ignores the window.
        assert!(HybridConfig::sliding(0, 0).validate().is_ok());
        assert_eq!(
            HybridConfig::sliding(1, 1).validate(),
            Err(crate::ModelConfigError::SlidingWindowTooShort(1))
        );
        assert_eq!(
            HybridConfig::sliding(65, 128).validate(),
            Err(crate::ModelConfigError::TooManySlidingWindowGroups(65))
        );
    }
}
