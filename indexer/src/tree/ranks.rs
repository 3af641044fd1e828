//! [`RankTable`]: interning of holders (worker rank, storage tier) and each holder's
//! engine-hash map.
//!
//! Tree nodes name their holders by a 4-byte [`RankIdx`] instead of the 12-byte
//! [`WorkerRank`], which keeps holder sets small and makes them sortable by a plain
//! integer. Each (rank, [`StorageTier`]) is its own holder: a rank's GPU blocks and
//! its CPU-offloaded blocks are two holders, with two engine-hash maps (an engine
//! names a block by the same hash on both tiers, and removes it per tier). A GPU-only
//! cluster interns only GPU holders and pays nothing for the tiers; the prefix-match
//! walk over GPU holders reads only [`RankTable::rank_of`], which names GPU holders
//! alone, so a lower-tier holder in a run is carried along but never scored there. The table maps both ways and owns, per rank, the map from the engine's
//! [`ExternalBlockHash`] to the block it names (needed to find a `Stored` event's
//! parent and a `Removed` event's block). Released indices are reused, so the table
//! stays as large as the number of live ranks ever seen at once.

use super::arena::BlockId;
use super::rankset::RankIdx;
use kv_events::{ExternalBlockHash, StorageTier, WorkerId, WorkerRank};
use rustc_hash::FxHashMap;

/// A rank's reference to one of its blocks: the block's stable id and the id's
/// generation when the reference was made. The reference is stale (the block was
/// pruned) when the generations differ. 8 bytes, so a map entry stays 16. Runs may
/// split and merge under it: the id keeps naming the same block position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockRef {
    pub(crate) id: BlockId,
    pub(crate) generation: u32,
}

impl BlockRef {
    /// A tombstone: a block the index chose to forget (pruned, or stored below a
    /// pruned block). Never live: the root's generation is never bumped from 0.
    pub(crate) const FORGOTTEN: BlockRef = BlockRef {
        id: BlockId::ROOT,
        generation: u32::MAX,
    };
}

/// Everything the tree knows about one holder: a worker rank on one storage tier.
#[derive(Debug)]
pub(crate) struct RankState {
    /// The rank this state belongs to.
    pub(crate) rank: WorkerRank,
    /// The tier of the rank's KV cache these blocks are on.
    pub(crate) tier: StorageTier,
    /// Engine block hash → block, one entry per block the rank holds, plus
    /// `forgotten` stale entries (pruned blocks), dropped when next looked up.
    pub(crate) blocks: FxHashMap<ExternalBlockHash, BlockRef>,
    /// Entries of `blocks` that may be stale. While 0, every entry is live and no
    /// generation needs checking.
    pub(crate) forgotten: u64,
    /// Blocks that more than one engine hash of this rank map to, with the number of
    /// extra hashes. Only engines that cache identical content twice create these;
    /// the map is empty (and unallocated) otherwise. A node stays held until its last
    /// engine hash is removed.
    pub(crate) aliases: FxHashMap<BlockId, u32>,
}

impl RankState {
    fn new(rank: WorkerRank, tier: StorageTier) -> Self {
        Self {
            rank,
            tier,
            blocks: FxHashMap::default(),
            forgotten: 0,
            aliases: FxHashMap::default(),
        }
    }

    /// Probes the engine-hash map for every hash of an event before the event changes
    /// it. At millions of entries each probe is a cache miss on its control bytes;
    /// these probes are independent, so the CPU overlaps their misses, where the
    /// event's own probes (each followed by tree changes that depend on it) would take
    /// them one after another. Measured: +11 % bare-tree apply at 64 workers × 10M
    /// entries (`docs/benchmarks.md`, "Round three"). A no-op for one hash.
    pub(crate) fn warm<'a>(&self, hashes: impl ExactSizeIterator<Item = &'a ExternalBlockHash>) {
        if hashes.len() < 2 {
            return;
        }
        let mut held = 0usize;
        for hash in hashes {
            held += usize::from(self.blocks.contains_key(hash));
        }
        // Keeps the probes from being optimised away; the count itself is unused.
        std::hint::black_box(held);
    }

    /// Heap bytes of the two maps, by capacity (key + value + one control byte).
    fn heap_bytes(&self) -> usize {
        let block_entry = size_of::<(ExternalBlockHash, BlockRef)>() + 1;
        let alias_entry = size_of::<(BlockId, u32)>() + 1;
        self.blocks.capacity() * block_entry + self.aliases.capacity() * alias_entry
    }
}

/// Two-way interning of holders (worker rank, tier) plus their per-holder state.
#[derive(Debug, Default)]
pub(crate) struct RankTable {
    index: FxHashMap<(WorkerRank, StorageTier), RankIdx>,
    slots: Vec<Option<RankState>>,
    /// The rank of each live GPU holder's slot, dense (16 bytes a slot), so that a
    /// query naming hundreds of scoring ranks reads a few contiguous cache lines
    /// instead of one `RankState` each. `None` for free slots and lower-tier holders.
    names: Vec<Option<WorkerRank>>,
    free: Vec<RankIdx>,
    /// Live holders on a tier other than the GPU; while 0, queries skip the any-tier
    /// walk.
    lower_tier: usize,
}

impl RankTable {
    /// The index of `rank` on `tier`, if it is known.
    pub(crate) fn lookup(&self, rank: WorkerRank, tier: StorageTier) -> Option<RankIdx> {
        self.index.get(&(rank, tier)).copied()
    }

    /// The index of `rank` on `tier`, interning it (with no blocks) when it is new.
    pub(crate) fn intern(&mut self, rank: WorkerRank, tier: StorageTier) -> RankIdx {
        if let Some(idx) = self.lookup(rank, tier) {
            return idx;
        }
        let name = tier.is_gpu().then_some(rank);
        let idx = match self.free.pop() {
            Some(idx) => {
                self.slots[idx.0 as usize] = Some(RankState::new(rank, tier));
                self.names[idx.0 as usize] = name;
                idx
            }
            None => {
                // Cannot overflow in practice: 2^32 live ranks would need far more
                // memory than any host has just for their states.
                let idx = RankIdx(u32::try_from(self.slots.len()).expect("fewer than 2^32 ranks"));
                self.slots.push(Some(RankState::new(rank, tier)));
                self.names.push(name);
                idx
            }
        };
        self.index.insert((rank, tier), idx);
        if !tier.is_gpu() {
            self.lower_tier += 1;
        }
        idx
    }

    /// Indices of every live holder of `rank`, one per tier it holds blocks on, GPU
    /// first.
    pub(crate) fn tiers_of(&self, rank: WorkerRank) -> impl Iterator<Item = RankIdx> + '_ {
        StorageTier::ALL
            .into_iter()
            .filter_map(move |tier| self.lookup(rank, tier))
    }

    /// True when some live holder is on a tier other than the GPU.
    #[inline]
    pub(crate) fn has_lower_tiers(&self) -> bool {
        self.lower_tier > 0
    }

    /// The worker rank behind a live index of any tier.
    pub(crate) fn holder_of(&self, idx: RankIdx) -> Option<WorkerRank> {
        self.get(idx).map(|state| state.rank)
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
    /// holder (its blocks are not GPU overlap).
    pub(crate) fn rank_of(&self, idx: RankIdx) -> Option<WorkerRank> {
        self.names.get(idx.0 as usize).copied().flatten()
    }

    /// Forgets the rank at `idx` and returns its state; the index may be reused.
    /// The caller must already have dropped the rank from every node.
    pub(crate) fn release(&mut self, idx: RankIdx) -> Option<RankState> {
        let state = self.slots.get_mut(idx.0 as usize)?.take()?;
        self.index.remove(&(state.rank, state.tier));
        self.names[idx.0 as usize] = None;
        if !state.tier.is_gpu() {
            self.lower_tier -= 1;
        }
        self.free.push(idx);
        Some(state)
    }

    /// Live ranks with their states, in index order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (RankIdx, &RankState)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| slot.as_ref().map(|s| (RankIdx(i as u32), s)))
    }

    /// Indices of every live rank of `worker_id`. O(live ranks).
    pub(crate) fn of_worker(&self, worker_id: WorkerId) -> Vec<RankIdx> {
        self.iter()
            .filter(|(_, state)| state.rank.worker_id == worker_id)
            .map(|(idx, _)| idx)
            .collect()
    }

    /// Number of live ranks.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Heap bytes of the table and every rank's maps, by capacity.
    pub(crate) fn memory_bytes(&self) -> usize {
        let index_entry = size_of::<((WorkerRank, StorageTier), RankIdx)>() + 1;
        self.index.capacity() * index_entry
            + self.slots.capacity() * size_of::<Option<RankState>>()
            + self.names.capacity() * size_of::<Option<WorkerRank>>()
            + self.free.capacity() * size_of::<RankIdx>()
            + self.iter().map(|(_, s)| s.heap_bytes()).sum::<usize>()
    }
}
