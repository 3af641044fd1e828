//! [`RankTable`]: interning of worker ranks and each rank's engine-hash map.
//!
//! Tree nodes name their holders by a 4-byte [`RankIdx`] instead of the 12-byte
//! [`WorkerRank`], which keeps holder sets small and makes them sortable by a plain
//! integer. The table maps both ways and owns, per rank, the map from the engine's
//! [`ExternalBlockHash`] to the block it names (needed to find a `Stored` event's
//! parent and a `Removed` event's block). Released indices are reused, so the table
//! stays as large as the number of live ranks ever seen at once.

use super::arena::BlockId;
use super::rankset::RankIdx;
use kv_events::{ExternalBlockHash, WorkerId, WorkerRank};
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

/// Everything the tree knows about one worker rank.
#[derive(Debug)]
pub(crate) struct RankState {
    /// The rank this state belongs to.
    pub(crate) rank: WorkerRank,
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
    fn new(rank: WorkerRank) -> Self {
        Self {
            rank,
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

/// Two-way interning of worker ranks plus their per-rank state.
#[derive(Debug, Default)]
pub(crate) struct RankTable {
    index: FxHashMap<WorkerRank, RankIdx>,
    slots: Vec<Option<RankState>>,
    /// The rank of each live slot, dense (16 bytes a slot), so that a query naming
    /// hundreds of scoring ranks reads a few contiguous cache lines instead of one
    /// `RankState` each.
    names: Vec<Option<WorkerRank>>,
    free: Vec<RankIdx>,
}

impl RankTable {
    /// The index of `rank`, if it is known.
    pub(crate) fn lookup(&self, rank: WorkerRank) -> Option<RankIdx> {
        self.index.get(&rank).copied()
    }

    /// The index of `rank`, interning it (with no blocks) when it is new.
    pub(crate) fn intern(&mut self, rank: WorkerRank) -> RankIdx {
        if let Some(idx) = self.lookup(rank) {
            return idx;
        }
        let idx = match self.free.pop() {
            Some(idx) => {
                self.slots[idx.0 as usize] = Some(RankState::new(rank));
                self.names[idx.0 as usize] = Some(rank);
                idx
            }
            None => {
                // Cannot overflow in practice: 2^32 live ranks would need far more
                // memory than any host has just for their states.
                let idx = RankIdx(u32::try_from(self.slots.len()).expect("fewer than 2^32 ranks"));
                self.slots.push(Some(RankState::new(rank)));
                self.names.push(Some(rank));
                idx
            }
        };
        self.index.insert(rank, idx);
        idx
    }

    /// The state of a live index.
    pub(crate) fn get(&self, idx: RankIdx) -> Option<&RankState> {
        self.slots.get(idx.0 as usize).and_then(Option::as_ref)
    }

    /// The mutable state of a live index.
    pub(crate) fn get_mut(&mut self, idx: RankIdx) -> Option<&mut RankState> {
        self.slots.get_mut(idx.0 as usize).and_then(Option::as_mut)
    }

    /// The worker rank behind a live index.
    pub(crate) fn rank_of(&self, idx: RankIdx) -> Option<WorkerRank> {
        self.names.get(idx.0 as usize).copied().flatten()
    }

    /// Forgets the rank at `idx` and returns its state; the index may be reused.
    /// The caller must already have dropped the rank from every node.
    pub(crate) fn release(&mut self, idx: RankIdx) -> Option<RankState> {
        let state = self.slots.get_mut(idx.0 as usize)?.take()?;
        self.index.remove(&state.rank);
        self.names[idx.0 as usize] = None;
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
        let index_entry = size_of::<(WorkerRank, RankIdx)>() + 1;
        self.index.capacity() * index_entry
            + self.slots.capacity() * size_of::<Option<RankState>>()
            + self.names.capacity() * size_of::<Option<WorkerRank>>()
            + self.free.capacity() * size_of::<RankIdx>()
            + self.iter().map(|(_, s)| s.heap_bytes()).sum::<usize>()
    }
}
