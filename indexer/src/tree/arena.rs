//! [`Arena`]: the tree's runs in one `Vec`, addressed by 4-byte [`NodeIdx`], and its
//! block positions in chunked slabs (`tree/chunks.rs`), addressed by 4-byte [`BlockId`].
//!
//! A node is a *run*: consecutive blocks of one prefix that share the same holder set,
//! their [`LocalBlockHash`]es contiguous in one `Vec` so that a query compares a whole
//! run against the prompt in one linear scan and looks at the run's holders once. A
//! run's blocks each have a [`BlockId`], stable for as long as the block position
//! lives: the per-rank engine-hash maps point at block ids, not at runs, so splitting
//! or merging runs only rewrites the moved blocks' slots in the block slab (node and
//! offset, 8 bytes), never a rank map — which is what keeps the tree correct for any
//! engine hashes (salted per worker, unchained) without storing them in the tree.
//!
//! One slab instead of one heap allocation per run keeps runs dense and lets a freed
//! slot be reused by the next store, so both slabs track the peak live count rather
//! than the number of stores ever seen. Heap bytes owned by runs (hash and id
//! vectors, child maps, holder sets) are kept as a running total so that memory stats
//! cost O(1) here.
//!
//! For memory-bounded trees every run carries the logical time it was last used
//! (stored into or matched), and every block slot a generation number, bumped when
//! the block is freed, so that a per-rank reference to a pruned block can be
//! recognised as stale after the slot was reused (see `tree/prune.rs`).
//!
//! The run operations (walk, extend, split, merge, free) are in `tree/runs.rs`.

use super::children::Children;
pub(crate) use super::children::NodeIdx;
use super::chunks::Chunks;
#[cfg(test)]
use super::rankset::RankIdx;
use super::rankset::RankSet;
use kv_events::LocalBlockHash;
use std::sync::atomic::{AtomicU32, Ordering};

/// Stable id of one block position (one block at one place of a prefix). Slot 0 is
/// reserved: it names the root (the position before every first block) and is never
/// allocated, so its generation stays 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub(crate) struct BlockId(pub(super) u32);

impl BlockId {
    /// The empty prefix (the root), as a position.
    pub(crate) const ROOT: BlockId = BlockId(0);
}

impl From<BlockId> for usize {
    /// The id's index in the block slab.
    fn from(id: BlockId) -> usize {
        id.0 as usize
    }
}

/// The bit of a [`Tick`] that says a query matched the run. Logical times use the
/// other 31 bits, so comparing two ticks as integers orders every block never matched
/// before every block matched, then by time: pruning eats a flood of stored-only
/// blocks before any prefix that served a route.
pub(crate) const MATCHED: u32 = 1 << 31;

/// The logical time a run was last stored into or matched, and whether it was ever
/// matched ([`MATCHED`]). Atomic so that a query holding only `&RadixTree` (possibly
/// shared between threads) can record its visit; relaxed ordering is enough, the
/// value is only a pruning hint.
#[derive(Debug, Default)]
pub(crate) struct Tick(pub(super) AtomicU32);

impl Tick {
    pub(crate) fn get(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }

    /// A store at `tick`: the time moves, a past match is remembered.
    pub(crate) fn stored(&self, tick: u32) {
        self.set((tick & !MATCHED) | (self.get() & MATCHED));
    }

    /// A query matched the run at `tick`.
    pub(crate) fn matched(&self, tick: u32) {
        self.set(tick | MATCHED);
    }

    fn set(&self, tick: u32) {
        // Skipping equal values keeps repeated queries from dirtying shared lines.
        if self.get() != tick {
            self.0.store(tick, Ordering::Relaxed);
        }
    }
}

impl Clone for Tick {
    fn clone(&self) -> Self {
        Tick(AtomicU32::new(self.get()))
    }
}

/// A run of consecutive blocks of one prefix held by the same ranks. Every block but
/// the last has exactly one continuation (the next block of the run); the last one's
/// continuations are `children`, keyed by their first block hash.
#[derive(Debug, Clone, Default)]
pub(crate) struct Node {
    /// The blocks' hashes, in prefix order; empty only for the root (and free slots).
    pub(crate) hashes: Vec<LocalBlockHash>,
    /// The blocks' stable ids, parallel to `hashes`.
    pub(crate) ids: Vec<BlockId>,
    /// The run this one continues; the root for a first run and for the root.
    pub(crate) parent: NodeIdx,
    /// When the run was last stored into or matched (see [`Tick`]).
    pub(crate) last_used: Tick,
    /// The runs continuing this one's last block.
    pub(crate) children: Children,
    /// The worker ranks holding every block of the run (and, normally, the prefix).
    pub(crate) holders: RankSet,
}

impl Node {
    pub(super) fn heap_bytes(&self) -> usize {
        self.children.heap_bytes()
            + self.holders.heap_bytes()
            + self.hashes.capacity() * size_of::<LocalBlockHash>()
            + self.ids.capacity() * size_of::<BlockId>()
    }
}

// A block costs 8 (hash) + 4 (id) in its run, plus 8 (slot) + 4 (generation) in the
// block slab; a run costs 88 bytes plus its buffers, shared by all its blocks.
const _: () = assert!(size_of::<Children>() == 16);
const _: () = assert!(size_of::<Node>() <= 88);
const _: () = assert!(size_of::<Slot>() == 8);

/// Where a block lives: its run and its offset in the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) node: NodeIdx,
    pub(crate) offset: u32,
}

/// The two slabs with their free lists.
#[derive(Debug)]
pub(crate) struct Arena {
    pub(super) nodes: Vec<Node>,
    pub(super) free_nodes: Vec<NodeIdx>,
    /// Position of every block id; slot 0 is the root.
    pub(super) slots: Chunks<Slot>,
    /// Generation of every block slot, bumped each time the block is freed.
    pub(super) gens: Chunks<u32>,
    pub(super) free_ids: Vec<BlockId>,
    /// Sum of `Node::heap_bytes` over every run slot.
    pub(super) heap_bytes: usize,
}

impl Default for Arena {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
            free_nodes: Vec::new(),
            slots: [Slot::default()].into_iter().collect(),
            gens: [0].into_iter().collect(),
            free_ids: Vec::new(),
            heap_bytes: 0,
        }
    }
}

/// Grows the run slab by an eighth instead of doubling: at millions of runs a doubled
/// slab would be up to half unused.
fn reserve_eighth<T>(v: &mut Vec<T>) {
    if v.len() == v.capacity() {
        v.reserve_exact((v.len() / 8).max(1024));
    }
}

impl Arena {
    /// The run at `idx`. Indices come only from this arena, so they are in bounds.
    pub(crate) fn node(&self, idx: NodeIdx) -> &Node {
        &self.nodes[idx.slot()]
    }

    /// Runs `f` on a run and keeps the heap total in step with its buffers.
    pub(super) fn update<R>(&mut self, idx: NodeIdx, f: impl FnOnce(&mut Node) -> R) -> R {
        let node = &mut self.nodes[idx.slot()];
        let before = node.heap_bytes();
        let out = f(node);
        self.heap_bytes = self.heap_bytes - before + node.heap_bytes();
        out
    }

    /// The generation of the slot of block `id` (see the module docs).
    pub(crate) fn generation(&self, id: BlockId) -> u32 {
        self.gens[usize::from(id)]
    }

    /// The run and offset of block `id`.
    pub(crate) fn slot(&self, id: BlockId) -> Slot {
        self.slots[usize::from(id)]
    }

    /// The run holding block `id` (the root for [`BlockId::ROOT`]).
    pub(crate) fn run_of(&self, id: BlockId) -> NodeIdx {
        self.slots[usize::from(id)].node
    }

    /// The block before `id` in its prefix; [`BlockId::ROOT`] for a first block.
    pub(crate) fn block_parent(&self, id: BlockId) -> BlockId {
        let Slot { node, offset } = self.slot(id);
        let n = self.node(node);
        if offset > 0 {
            return n.ids[offset as usize - 1];
        }
        match self.node(n.parent).ids.last() {
            Some(last) => *last,
            None => BlockId::ROOT,
        }
    }

    /// The local hash of block `id`.
    pub(crate) fn block_hash(&self, id: BlockId) -> LocalBlockHash {
        let Slot { node, offset } = self.slot(id);
        self.node(node).hashes[offset as usize]
    }

    /// A fresh run slot holding `node`.
    pub(super) fn alloc_node(&mut self, node: Node) -> NodeIdx {
        self.heap_bytes += node.heap_bytes();
        match self.free_nodes.pop() {
            Some(idx) => {
                self.nodes[idx.slot()] = node;
                idx
            }
            None => {
                // Cannot overflow in practice: 2^32 runs of 88 bytes is 352 GiB.
                let idx = NodeIdx(u32::try_from(self.nodes.len()).expect("fewer than 2^32 runs"));
                reserve_eighth(&mut self.nodes);
                self.nodes.push(node);
                idx
            }
        }
    }

    /// Blanks the run slot `idx` and puts it on the free list; returns what it held.
    pub(super) fn free_node(&mut self, idx: NodeIdx) -> Node {
        let node = self.update(idx, std::mem::take);
        self.free_nodes.push(idx);
        node
    }

    /// A fresh block id at (`node`, `offset`).
    pub(super) fn alloc_id(&mut self, node: NodeIdx, offset: usize) -> BlockId {
        // Runs are far shorter than 2^32 blocks (a run never outgrows the tree).
        let slot = Slot {
            node,
            offset: offset as u32,
        };
        match self.free_ids.pop() {
            Some(id) => {
                self.slots[usize::from(id)] = slot;
                id
            }
            None => {
                // Cannot overflow in practice: 2^32 blocks would need ~100 GiB.
                let id = BlockId(u32::try_from(self.slots.len()).expect("fewer than 2^32 blocks"));
                self.slots.push(slot);
                self.gens.push(0);
                id
            }
        }
    }

    /// Frees block `id`: its generation moves on, so references to it go stale.
    pub(super) fn free_id(&mut self, id: BlockId) {
        self.gens[usize::from(id)] = self.gens[usize::from(id)].wrapping_add(1);
        self.slots[usize::from(id)] = Slot::default();
        self.free_ids.push(id);
    }

    /// Points the blocks `ids` at `node`, from offset `first` on.
    pub(super) fn place(&mut self, node: NodeIdx, first: usize, ids: &[BlockId]) {
        for (i, id) in ids.iter().enumerate() {
            self.slots[usize::from(*id)] = Slot {
                node,
                offset: (first + i) as u32,
            };
        }
    }

    /// Live block positions (distinct (prefix, block) pairs), the root not counted.
    pub(crate) fn live_blocks(&self) -> usize {
        self.slots.len() - self.free_ids.len() - 1
    }

    /// Live runs, the root not counted.
    pub(crate) fn live_runs(&self) -> usize {
        self.nodes.len() - self.free_nodes.len() - 1
    }

    /// Block slots ever allocated (live or free), the root included.
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Approximate heap bytes: both slabs by capacity plus the runs' buffers.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>()
            + self.free_nodes.capacity() * size_of::<NodeIdx>()
            + self.slots.heap_bytes()
            + self.gens.heap_bytes()
            + self.free_ids.capacity() * size_of::<BlockId>()
            + self.heap_bytes
    }

    /// Asserts the structural invariants (parent/child links agree, runs are
    /// non-empty with parallel ids, every block slot points back at its run, no
    /// empty leaf survives, free slots are blank, the heap total is exact) and
    /// returns every live block with its run's holders.
    #[cfg(test)]
    pub(crate) fn check(&self) -> Vec<(BlockId, Vec<RankIdx>)> {
        use std::collections::HashSet;
        let free: HashSet<NodeIdx> = self.free_nodes.iter().copied().collect();
        assert_eq!(free.len(), self.free_nodes.len(), "run freed twice");
        assert!(!free.contains(&NodeIdx::ROOT), "root freed");
        let free_ids: HashSet<BlockId> = self.free_ids.iter().copied().collect();
        assert_eq!(free_ids.len(), self.free_ids.len(), "block freed twice");
        assert!(!free_ids.contains(&BlockId::ROOT), "root block freed");
        let recomputed: usize = self.nodes.iter().map(Node::heap_bytes).sum();
        assert_eq!(self.heap_bytes, recomputed, "heap total out of step");
        let mut live = Vec::new();
        for (slot, node) in self.nodes.iter().enumerate() {
            let idx = NodeIdx(slot as u32);
            if free.contains(&idx) {
                assert!(
                    node.holders.is_empty() && node.children.is_empty() && node.ids.is_empty(),
                    "dirty free slot"
                );
                continue;
            }
            assert_eq!(node.hashes.len(), node.ids.len(), "ids parallel to hashes");
            for child in node.children.iter() {
                assert!(!free.contains(&child), "child {child:?} of {idx:?} is free");
                let c = self.node(child);
                assert_eq!(c.parent, idx, "parent link of {child:?}");
                assert_eq!(node.children.get(c.hashes[0]), Some(child));
            }
            for (offset, id) in node.ids.iter().enumerate() {
                assert!(!free_ids.contains(id), "live block {id:?} is free");
                assert_eq!(
                    self.slot(*id),
                    Slot {
                        node: idx,
                        offset: offset as u32
                    },
                    "slot of {id:?}"
                );
                live.push((*id, node.holders.to_vec()));
            }
            if idx == NodeIdx::ROOT {
                assert!(
                    node.hashes.is_empty() && node.holders.is_empty(),
                    "root run"
                );
                continue;
            }
            assert!(!node.hashes.is_empty(), "empty run {idx:?}");
            assert!(!free.contains(&node.parent), "parent of {idx:?} is free");
            assert_eq!(
                self.node(node.parent).children.get(node.hashes[0]),
                Some(idx)
            );
            assert!(
                !node.holders.is_empty() || !node.children.is_empty(),
                "empty leaf {idx:?} not pruned"
            );
        }
        for id in &self.free_ids {
            assert_eq!(self.slot(*id), Slot::default(), "dirty free block");
        }
        assert_eq!(live.len(), self.live_blocks(), "live block count");
        live
    }
}
