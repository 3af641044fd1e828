//! [`RankTable`]: interning of holders (worker rank, storage tier, KV cache group) and
//! each holder's engine-hash map.
//!
//! Tree nodes name their holders by a 4-byte [`RankIdx`] instead of the 12-byte
//! [`WorkerRank`], which keeps holder sets small and makes them sortable by a plain
//! integer. Each (rank, [`StorageTier`], group) is its own holder: a rank's GPU blocks
//! and its CPU-offloaded blocks are two holders, and so are the KV cache groups of a
//! hybrid-attention model (an engine caches and evicts each group's copy of a block
//! on its own, under the same engine hash). A GPU-only cluster of dense models interns
//! one holder per rank and pays nothing for tiers or groups. The table maps both ways
//! and owns, per holder, the map from the engine's [`ExternalBlockHash`] to the block
//! it names (needed to find a `Stored` event's parent and a `Removed` event's block).
//! Released indices are reused, so the table stays as large as the number of live
//! holders ever seen at once.
//!
//! A rank is *grouped* when its holders name more than one group or a windowed one
//! (sliding window, Mamba). The prefix-match walk over GPU holders reads only
//! [`RankTable::rank_of`], which names the GPU holders of ranks that are not grouped:
//! lower-tier holders and grouped ranks' holders are carried along in runs but never
//! scored there. Grouped ranks are scored by their own walk (`tree/groups.rs`) through
//! [`RankTable::grouped_name`]; the status of a rank changes only when a holder of it
//! is interned or released, O(its holders).

use super::arena::BlockId;
use super::blockmap::BlockMap;
use super::rankset::RankIdx;
use kv_events::{ExternalBlockHash, GroupId, StorageTier, WorkerId, WorkerRank};
use rustc_hash::FxHashMap;
use std::num::NonZeroU32;
use std::ops::Range;

/// Who holds blocks: a worker rank's KV cache group on one storage tier. `group` is
/// `None` for the single group of a model (or publisher) without groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Holder {
    pub(crate) rank: WorkerRank,
    pub(crate) tier: StorageTier,
    pub(crate) group: Option<GroupId>,
}

/// Everything the tree knows about one holder.
#[derive(Debug)]
pub(crate) struct RankState {
    /// The rank this state belongs to.
    pub(crate) rank: WorkerRank,
    /// The tier of the rank's KV cache these blocks are on.
    pub(crate) tier: StorageTier,
    /// The KV cache group; `None` for a model without groups.
    pub(crate) group: Option<GroupId>,
    /// The group's window in blocks, fixed by its first store; `None` for full
    /// attention (and for `group: None`).
    pub(crate) window: Option<NonZeroU32>,
    /// True while the rank is grouped (see the module docs): its holders are left out
    /// of the GPU fast walk and of the any-tier walk.
    pub(crate) grouped: bool,
    /// Engine block hash → block, one entry per block the rank holds, plus
    /// `forgotten` stale entries (pruned blocks), dropped when next looked up.
    pub(crate) blocks: BlockMap,
    /// Entries of `blocks` that may be stale. While 0, every entry is live and no
    /// generation needs checking.
    pub(crate) forgotten: u64,
    /// Blocks that more than one engine hash of this rank map to, with the number of
    /// extra hashes. Only engines that cache identical content twice create these;
    /// the map is empty (and unallocated) otherwise. A node stays held until its last
    /// engine hash is removed.
    pub(crate) aliases: FxHashMap<BlockId, u32>,
    /// Engine hashes stored again while held (a second physical block under the same
    /// hash), with the number of extra copies; a `Removed` drops one copy and the hash
    /// leaves with its last. Empty (and unallocated) for engines that never duplicate
    /// a block. An entry whose hash is stale (pruned) is dropped when the hash is next
    /// removed or stored: a pruned block forgets its copies.
    pub(crate) copies: FxHashMap<ExternalBlockHash, u32>,
}

impl RankState {
    fn new(holder: Holder, window: Option<NonZeroU32>) -> Self {
        Self {
            rank: holder.rank,
            tier: holder.tier,
            group: holder.group,
            window,
            grouped: false,
            blocks: BlockMap::default(),
            forgotten: 0,
            aliases: FxHashMap::default(),
            copies: FxHashMap::default(),
        }
    }

    /// The holder this state belongs to.
    pub(crate) fn holder(&self) -> Holder {
        Holder {
            rank: self.rank,
            tier: self.tier,
            group: self.group,
        }
    }

    /// Loads the engine-hash map's slot for every hash of an event before the event
    /// changes the map ([`BlockMap::touch`]). At millions of entries each is a cache
    /// miss on the line that the event's own probe then reads and, for a new block,
    /// writes; these loads are independent and branch on nothing, so the CPU overlaps
    /// their misses, where the event's own probes (each followed by tree changes that
    /// depend on it) would take them one after another. Measured: +11 % bare-tree
    /// apply at 64 workers × 10M entries as full probes (`docs/benchmarks.md`, "Round
    /// three"); branch-free loads beat full probes again (`docs/studies/bare-apply.md`,
    /// round three). A no-op for one hash.
    pub(crate) fn warm<'a>(&self, hashes: impl ExactSizeIterator<Item = &'a ExternalBlockHash>) {
        if hashes.len() < 2 {
            return;
        }
        let mut sum = 0u64;
        for hash in hashes {
            sum = sum.wrapping_add(self.blocks.touch(*hash));
        }
        // Keeps the loads from being optimised away; the sum itself is unused.
        std::hint::black_box(sum);
    }

    /// Heap bytes of the maps, by capacity (key + value + one control byte).
    fn heap_bytes(&self) -> usize {
        let alias_entry = size_of::<(BlockId, u32)>() + 1;
        let copy_entry = size_of::<(ExternalBlockHash, u32)>() + 1;
        self.blocks.heap_bytes()
            + self.aliases.capacity() * alias_entry
            + self.copies.capacity() * copy_entry
    }
}

/// How far ahead of its loop an event's application loads the map slots of its
/// blocks ([`RankState::warm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WarmAhead {
    /// Every block at the start: the most misses overlapped, for an event applied
    /// from its first block.
    All,
    /// [`WARM_WINDOW`] blocks at a time, one window ahead: for the rest of an event
    /// resumed after a stop, which may stop again soon. Warming the whole rest at
    /// every resume made a 4,096-block `Stored` stopped every 8 blocks cost ~16× the
    /// whole event, ~2× since (`cargo bench -p indexer --bench indexer -- steps`).
    Window,
}

/// Blocks per window of [`WarmAhead::Window`].
const WARM_WINDOW: usize = 64;

impl WarmAhead {
    /// The blocks to warm before applying block `k` of `len`, asked once per block:
    /// `warm_at` (start it at 0) is the next block at which a window is due.
    #[inline]
    pub(super) fn due(self, k: usize, len: usize, warm_at: &mut usize) -> Option<Range<usize>> {
        if k != *warm_at {
            return None;
        }
        let (ahead, next) = match self {
            WarmAhead::All => (0..len, usize::MAX),
            WarmAhead::Window if k == 0 => (0..(2 * WARM_WINDOW).min(len), WARM_WINDOW),
            WarmAhead::Window => (
                (k + WARM_WINDOW).min(len)..(k + 2 * WARM_WINDOW).min(len),
                k + WARM_WINDOW,
            ),
        };
        *warm_at = next;
        Some(ahead)
    }
}

/// A GPU holder of a grouped rank, as the grouped walk sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupedName {
    pub(crate) rank: WorkerRank,
    /// The group's window in blocks; `None` for full attention.
    pub(crate) window: Option<NonZeroU32>,
    /// The rank's GPU holders (groups), this one included: a rank whose groups do not
    /// all hold blocks on the query's path scores 0.
    pub(crate) gpu_groups: u32,
    /// A dense number of the grouped rank, below [`RankTable::grouped_slots`], so a
    /// query buckets its grouped ranks' holdings without hashing or sorting.
    pub(crate) slot: u32,
}

/// The holders of one worker rank and whether the rank is grouped.
#[derive(Debug, Default)]
struct RankHolders {
    /// Sorted by (tier, full attention first, group): the order in which a `Stored`
    /// event's parent is looked up in the rank's other holders, and dumped.
    holders: Vec<RankIdx>,
    grouped: bool,
    /// Some GPU holder is a full-attention group.
    full_gpu: bool,
    /// The rank's dense number while it is grouped (see [`GroupedName::slot`]).
    slot: Option<u32>,
}

/// Two-way interning of holders (worker rank, tier, group) plus their state.
#[derive(Debug, Default)]
pub(crate) struct RankTable {
    index: FxHashMap<Holder, RankIdx>,
    slots: Vec<Option<RankState>>,
    /// The rank of each GPU holder's slot of a rank that is not grouped, dense (16
    /// bytes a slot), so that a query naming hundreds of scoring ranks reads a few
    /// contiguous cache lines instead of one `RankState` each. `None` for free slots,
    /// lower-tier holders and grouped ranks' holders.
    names: Vec<Option<WorkerRank>>,
    /// The rank and window of each GPU holder of a grouped rank; `None` elsewhere.
    grouped_names: Vec<Option<GroupedName>>,
    free: Vec<RankIdx>,
    /// Live holders on a tier other than the GPU; while 0, queries skip the any-tier
    /// walk.
    lower_tier: usize,
    by_rank: FxHashMap<WorkerRank, RankHolders>,
    /// Grouped ranks; while 0, queries skip the grouped walk.
    grouped: usize,
    /// Grouped ranks without a full-attention GPU group (their hit is not bounded by
    /// a full group's prefix).
    grouped_without_full: usize,
    /// Dense numbers of grouped ranks: the high-water mark and the freed ones.
    grouped_slots: u32,
    free_grouped_slots: Vec<u32>,
}

impl RankTable {
    /// The index of `holder`, if it is known.
    pub(crate) fn lookup(&self, holder: Holder) -> Option<RankIdx> {
        self.index.get(&holder).copied()
    }

    /// The index of `holder`, interning it (with no blocks and the group's `window`)
    /// when it is new.
    pub(crate) fn intern(&mut self, holder: Holder, window: Option<NonZeroU32>) -> RankIdx {
        if let Some(idx) = self.lookup(holder) {
            return idx;
        }
        let name = holder.tier.is_gpu().then_some(holder.rank);
        let state = RankState::new(holder, window);
        let idx = match self.free.pop() {
            Some(idx) => {
                self.slots[idx.0 as usize] = Some(state);
                self.names[idx.0 as usize] = name;
                idx
            }
            None => {
                // Cannot overflow in practice: 2^32 live ranks would need far more
                // memory than any host has just for their states.
                let idx = RankIdx(u32::try_from(self.slots.len()).expect("fewer than 2^32 ranks"));
                self.slots.push(Some(state));
                self.names.push(name);
                self.grouped_names.push(None);
                idx
            }
        };
        self.index.insert(holder, idx);
        if !holder.tier.is_gpu() {
            self.lower_tier += 1;
        }
        let mut entry = self.by_rank.remove(&holder.rank).unwrap_or_default();
        entry.holders.push(idx);
        entry.holders.sort_by_key(|i| {
            let s = self.get(*i).map(|s| (s.tier, s.window.is_some(), s.group));
            (s, *i)
        });
        self.restatus(holder.rank, entry);
        idx
    }

    /// Recomputes whether `rank` (whose holders are `entry`) is grouped, and updates
    /// the counters and its holders' names.
    fn restatus(&mut self, rank: WorkerRank, mut entry: RankHolders) {
        let (was_grouped, was_full) = (entry.grouped, entry.full_gpu);
        let mut first_group = None;
        let (mut many, mut windowed, mut full_gpu) = (false, false, false);
        for state in entry.holders.iter().filter_map(|i| self.get(*i)) {
            many |= *first_group.get_or_insert(state.group) != state.group;
            windowed |= state.window.is_some();
            full_gpu |= state.tier.is_gpu() && state.window.is_none();
        }
        entry.grouped = many || windowed;
        entry.full_gpu = full_gpu;
        if was_grouped {
            self.grouped -= 1;
            self.grouped_without_full -= usize::from(!was_full);
        }
        if entry.grouped {
            self.grouped += 1;
            self.grouped_without_full += usize::from(!full_gpu);
        }
        match (entry.grouped, entry.slot) {
            (true, None) => {
                let next = self.free_grouped_slots.pop().unwrap_or_else(|| {
                    self.grouped_slots += 1;
                    self.grouped_slots - 1
                });
                entry.slot = Some(next);
            }
            (false, Some(slot)) => {
                self.free_grouped_slots.push(slot);
                entry.slot = None;
            }
            _ => {}
        }
        let rank_slot = entry.slot.unwrap_or_default();
        let gpu_groups = (entry.holders.iter())
            .filter_map(|i| self.get(*i))
            .filter(|s| s.tier.is_gpu())
            .count() as u32; // at most the holders of one rank
        for idx in &entry.holders {
            let slot = idx.0 as usize;
            let Some(state) = self.slots[slot].as_mut() else {
                continue;
            };
            state.grouped = entry.grouped;
            let gpu = state.tier.is_gpu();
            self.names[slot] = (gpu && !entry.grouped).then_some(rank);
            self.grouped_names[slot] = (gpu && entry.grouped).then_some(GroupedName {
                rank,
                window: state.window,
                gpu_groups,
                slot: rank_slot,
            });
        }
        self.by_rank.insert(rank, entry);
    }

    /// Every live holder of `rank`, sorted by (tier, full attention first, group).
    pub(crate) fn holders_of(&self, rank: WorkerRank) -> &[RankIdx] {
        self.by_rank
            .get(&rank)
            .map_or(&[], |entry| entry.holders.as_slice())
    }

    /// The window of `rank`'s group `group` if the rank has a holder of that group
    /// (on any tier): `Some(None)` for full attention.
    pub(crate) fn window_of(
        &self,
        rank: WorkerRank,
        group: Option<GroupId>,
    ) -> Option<Option<NonZeroU32>> {
        self.holders_of(rank)
            .iter()
            .filter_map(|i| self.get(*i))
            .find(|state| state.group == group)
            .map(|state| state.window)
    }

    /// True when some live holder is on a tier other than the GPU.
    #[inline]
    pub(crate) fn has_lower_tiers(&self) -> bool {
        self.lower_tier > 0
    }

    /// True when some rank is grouped.
    #[inline]
    pub(crate) fn has_grouped(&self) -> bool {
        self.grouped > 0
    }

    /// Holder indices are below this.
    pub(crate) fn slots_len(&self) -> usize {
        self.slots.len()
    }

    /// Dense numbers of grouped ranks are below this.
    pub(crate) fn grouped_slots(&self) -> u32 {
        self.grouped_slots
    }

    /// True when some grouped rank has no full-attention GPU group.
    pub(crate) fn has_grouped_without_full(&self) -> bool {
        self.grouped_without_full > 0
    }

    /// The worker rank behind a live index of any tier, for the any-tier walk; `None`
    /// for the holders of grouped ranks (they get no any-tier score).
    pub(crate) fn holder_of(&self, idx: RankIdx) -> Option<WorkerRank> {
        self.get(idx)
            .filter(|state| !state.grouped)
            .map(|state| state.rank)
    }

    /// The state of a live index.
    pub(crate) fn get(&self, idx: RankIdx) -> Option<&RankState> {
        self.slots.get(idx.0 as usize).and_then(Option::as_ref)
    }

    /// The mutable state of a live index.
    pub(crate) fn get_mut(&mut self, idx: RankIdx) -> Option<&mut RankState> {
        self.slots.get_mut(idx.0 as usize).and_then(Option::as_mut)
    }

    /// The worker rank behind a live GPU holder's index; `None` for a lower-tier
    /// holder (its blocks are not GPU overlap) and for a grouped rank's holder.
    #[inline]
    pub(crate) fn rank_of(&self, idx: RankIdx) -> Option<WorkerRank> {
        self.names.get(idx.0 as usize).copied().flatten()
    }

    /// The rank and window behind a GPU holder of a grouped rank; `None` otherwise.
    #[inline]
    pub(crate) fn grouped_name(&self, idx: RankIdx) -> Option<GroupedName> {
        self.grouped_names.get(idx.0 as usize).copied().flatten()
    }

    /// Forgets the holder at `idx` and returns its state; the index may be reused.
    /// The caller must already have dropped the holder from every node.
    pub(crate) fn release(&mut self, idx: RankIdx) -> Option<RankState> {
        let state = self.slots.get_mut(idx.0 as usize)?.take()?;
        self.index.remove(&state.holder());
        self.names[idx.0 as usize] = None;
        self.grouped_names[idx.0 as usize] = None;
        if !state.tier.is_gpu() {
            self.lower_tier -= 1;
        }
        self.free.push(idx);
        if let Some(mut entry) = self.by_rank.remove(&state.rank) {
            entry.holders.retain(|i| *i != idx);
            if entry.holders.is_empty() {
                if entry.grouped {
                    self.grouped -= 1;
                    self.grouped_without_full -= usize::from(!entry.full_gpu);
                }
                self.free_grouped_slots.extend(entry.slot);
            } else {
                self.restatus(state.rank, entry);
            }
        }
        Some(state)
    }

    /// Live holders with their states, in index order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (RankIdx, &RankState)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| slot.as_ref().map(|s| (RankIdx(i as u32), s)))
    }

    /// Every worker rank with a live holder, with its holders (see
    /// [`RankTable::holders_of`]).
    pub(crate) fn ranks(&self) -> impl Iterator<Item = (WorkerRank, &[RankIdx])> {
        self.by_rank
            .iter()
            .map(|(rank, entry)| (*rank, entry.holders.as_slice()))
    }

    /// Indices of every live holder of `worker_id`. O(live ranks).
    pub(crate) fn of_worker(&self, worker_id: WorkerId) -> Vec<RankIdx> {
        self.ranks()
            .filter(|(rank, _)| rank.worker_id == worker_id)
            .flat_map(|(_, holders)| holders.iter().copied())
            .collect()
    }

    /// Number of live holders.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Heap bytes of the table and every holder's maps, by capacity.
    pub(crate) fn memory_bytes(&self) -> usize {
        let index_entry = size_of::<(Holder, RankIdx)>() + 1;
        let rank_entry = size_of::<(WorkerRank, RankHolders)>() + 1;
        self.index.capacity() * index_entry
            + self.by_rank.capacity() * rank_entry
            + self
                .by_rank
                .values()
                .map(|e| e.holders.capacity() * size_of::<RankIdx>())
                .sum::<usize>()
            + self.slots.capacity() * size_of::<Option<RankState>>()
            + self.names.capacity() * size_of::<Option<WorkerRank>>()
            + self.grouped_names.capacity() * size_of::<Option<GroupedName>>()
            + self.free.capacity() * size_of::<RankIdx>()
            + self.free_grouped_slots.capacity() * size_of::<u32>()
            + self.iter().map(|(_, s)| s.heap_bytes()).sum::<usize>()
    }
}
