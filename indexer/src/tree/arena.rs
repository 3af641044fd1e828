//! [`Arena`]: the tree's nodes in one `Vec`, addressed by 4-byte [`NodeIdx`].
//!
//! One slab instead of one heap allocation per node keeps nodes dense (48 bytes each,
//! asserted at compile time) and lets a freed node's slot be reused by the next
//! store, so the arena's length tracks the peak live node count rather than the
//! number of stores ever seen. Children are kept inline when there is one (the
//! middle of a chain), in a short boxed, unsorted `Vec` scanned linearly up to
//! [`FEW_CHILDREN`], and in a boxed hash map beyond, which is what the root and other
//! hot branching points become. Boxing the rare shapes keeps [`Children`] at 16 bytes:
//! most nodes hold one child (or none) and one holder, so the common node needs no
//! heap at all. Heap bytes owned by
//! child maps and holder sets are kept as a running total so that memory stats cost
//! O(1) here.
//!
//! For memory-bounded trees every node carries the logical time it was last used
//! (stored into or matched), and every slot a generation number, bumped when the slot
//! is freed, so that a per-rank reference to a pruned node can be recognised as stale
//! after the slot was reused (see `tree/prune.rs`). Generations live in a side vector:
//! they are only read when a rank has pruned entries.

use super::rankset::{RankIdx, RankSet};
use kv_events::LocalBlockHash;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU32, Ordering};

/// Index of a node in the arena. The root is slot 0 and is never freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct NodeIdx(u32);

impl NodeIdx {
    /// The root: the empty prefix, parent of every first block.
    pub(crate) const ROOT: NodeIdx = NodeIdx(0);

    fn slot(self) -> usize {
        self.0 as usize
    }
}

/// The bit of a [`Tick`] that says a query matched the node. Logical times use the
/// other 31 bits, so comparing two ticks as integers orders every block never matched
/// before every block matched, then by time: pruning eats a flood of stored-only
/// blocks before any prefix that served a route.
pub(crate) const MATCHED: u32 = 1 << 31;

/// The logical time a node was last stored into or matched, and whether it was ever
/// matched ([`MATCHED`]). Atomic so that a query holding only `&RadixTree` (possibly
/// shared between threads) can record its visit; relaxed ordering is enough, the
/// value is only a pruning hint.
#[derive(Debug, Default)]
pub(crate) struct Tick(AtomicU32);

impl Tick {
    pub(crate) fn get(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }

    /// A store at `tick`: the time moves, a past match is remembered.
    pub(crate) fn stored(&self, tick: u32) {
        self.set((tick & !MATCHED) | (self.get() & MATCHED));
    }

    /// A query matched the node at `tick`.
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

impl Default for NodeIdx {
    /// The root, which is also the parent recorded for the root itself.
    fn default() -> Self {
        NodeIdx::ROOT
    }
}

/// Most children a node keeps in a linear `Vec` before switching to a hash map.
const FEW_CHILDREN: usize = 8;
/// A hash map of children shrinks back to a `Vec` at this many entries (hysteresis,
/// so a node hovering at the limit does not convert on every store and remove).
const FEW_CHILDREN_AGAIN: usize = FEW_CHILDREN / 2;

/// The children of one node, keyed by the child's block hash.
///
/// The common shapes cost no heap at all: a leaf has `None`, and a node in the
/// middle of a chain keeps its one child inline.
#[derive(Debug, Clone, Default)]
pub(crate) enum Children {
    /// No child (a leaf).
    #[default]
    None,
    /// Exactly one child, inline.
    One(LocalBlockHash, NodeIdx),
    /// Two up to [`FEW_CHILDREN`], unsorted and sized exactly. Boxed on purpose: a
    /// thin pointer keeps `Children` (and every node) 8 bytes smaller, and few nodes
    /// branch.
    #[allow(clippy::box_collection)]
    Few(Box<Vec<(LocalBlockHash, NodeIdx)>>),
    /// More than [`FEW_CHILDREN`].
    Many(Box<FxHashMap<LocalBlockHash, NodeIdx>>),
}

impl Children {
    /// The child with block hash `hash`.
    pub(crate) fn get(&self, hash: LocalBlockHash) -> Option<NodeIdx> {
        match self {
            Children::None => None,
            Children::One(h, n) => (*h == hash).then_some(*n),
            Children::Few(few) => few.iter().find(|(h, _)| *h == hash).map(|(_, n)| *n),
            Children::Many(many) => many.get(&hash).copied(),
        }
    }

    /// True when the node has no children.
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            Children::None => true,
            Children::One(..) => false,
            Children::Few(few) => few.is_empty(),
            Children::Many(many) => many.is_empty(),
        }
    }

    /// Every child, in no particular order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> Vec<NodeIdx> {
        match self {
            Children::None => Vec::new(),
            Children::One(_, n) => vec![*n],
            Children::Few(few) => few.iter().map(|(_, n)| *n).collect(),
            Children::Many(many) => many.values().copied().collect(),
        }
    }

    /// Adds a child; the caller has checked that `hash` is not present.
    fn insert(&mut self, hash: LocalBlockHash, child: NodeIdx) {
        match self {
            Children::None => *self = Children::One(hash, child),
            Children::One(h, n) => {
                *self = Children::Few(Box::new(vec![(*h, *n), (hash, child)]));
            }
            Children::Few(few) if few.len() < FEW_CHILDREN => {
                few.reserve_exact(1);
                few.push((hash, child));
            }
            Children::Few(few) => {
                let mut many: FxHashMap<_, _> = few.drain(..).collect();
                many.insert(hash, child);
                *self = Children::Many(Box::new(many));
            }
            Children::Many(many) => {
                many.insert(hash, child);
            }
        }
    }

    /// Removes the child with block hash `hash`, if any.
    fn remove(&mut self, hash: LocalBlockHash) {
        match self {
            Children::None => {}
            Children::One(h, _) if *h == hash => *self = Children::None,
            Children::One(..) => {}
            Children::Few(few) => {
                if let Some(at) = few.iter().position(|(h, _)| *h == hash) {
                    few.swap_remove(at);
                    if let [(h, n)] = few.as_slice() {
                        *self = Children::One(*h, *n);
                    }
                }
            }
            Children::Many(many) => {
                many.remove(&hash);
                if many.len() <= FEW_CHILDREN_AGAIN {
                    let rest: Vec<_> = many.drain().collect();
                    *self = match rest.as_slice() {
                        [] => Children::None,
                        [(h, n)] => Children::One(*h, *n),
                        _ => Children::Few(Box::new(rest)),
                    };
                }
            }
        }
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Children::None | Children::One(..) => 0,
            Children::Few(few) => {
                size_of::<Vec<(LocalBlockHash, NodeIdx)>>()
                    + few.capacity() * size_of::<(LocalBlockHash, NodeIdx)>()
            }
            Children::Many(many) => {
                size_of::<FxHashMap<LocalBlockHash, NodeIdx>>()
                    + many.capacity() * (size_of::<(LocalBlockHash, NodeIdx)>() + 1)
            }
        }
    }
}

/// One block at one position of a prefix.
#[derive(Debug, Clone, Default)]
pub(crate) struct Node {
    /// The block's hash; meaningless for the root.
    pub(crate) hash: LocalBlockHash,
    /// The node of the preceding block; the root for a first block and for the root.
    pub(crate) parent: NodeIdx,
    /// When the node was last stored into or matched (see [`Tick`]).
    pub(crate) last_used: Tick,
    /// The next blocks of every prefix continuing this one.
    pub(crate) children: Children,
    /// The worker ranks holding this block (and, normally, the whole prefix).
    pub(crate) holders: RankSet,
}

impl Node {
    fn heap_bytes(&self) -> usize {
        self.children.heap_bytes() + self.holders.heap_bytes()
    }
}

// The memory target is ≤ 100 bytes per (rank, block) entry, and most entries are the
// only holder of their node: a node is 48 bytes (hash 8, parent 4, last use 4,
// children 16, holders 16).
const _: () = assert!(size_of::<Children>() == 16);
const _: () = assert!(size_of::<Node>() <= 48);

/// The slab of nodes with its free list.
#[derive(Debug)]
pub(crate) struct Arena {
    nodes: Vec<Node>,
    /// Generation of every slot, bumped each time the slot is freed.
    gens: Vec<u32>,
    free: Vec<NodeIdx>,
    /// Sum of `Node::heap_bytes` over every slot.
    heap_bytes: usize,
}

impl Default for Arena {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
            gens: vec![0],
            free: Vec::new(),
            heap_bytes: 0,
        }
    }
}

impl Arena {
    /// The node at `idx`. Indices come only from this arena, so they are in bounds.
    pub(crate) fn node(&self, idx: NodeIdx) -> &Node {
        &self.nodes[idx.slot()]
    }

    /// Runs `f` on a node and keeps the heap total in step with its buffers.
    fn update<R>(&mut self, idx: NodeIdx, f: impl FnOnce(&mut Node) -> R) -> R {
        let node = &mut self.nodes[idx.slot()];
        let before = node.heap_bytes();
        let out = f(node);
        self.heap_bytes = self.heap_bytes - before + node.heap_bytes();
        out
    }

    /// The generation of the slot of `idx` (see the module docs).
    pub(crate) fn generation(&self, idx: NodeIdx) -> u32 {
        self.gens[idx.slot()]
    }

    /// The child of `parent` with block hash `hash`, created when missing; either way
    /// its last use becomes `tick`.
    pub(crate) fn child_or_insert(
        &mut self,
        parent: NodeIdx,
        hash: LocalBlockHash,
        tick: u32,
    ) -> NodeIdx {
        if let Some(child) = self.node(parent).children.get(hash) {
            self.node(child).last_used.stored(tick);
            return child;
        }
        let fresh = Node {
            hash,
            parent,
            last_used: Tick(AtomicU32::new(tick)),
            ..Node::default()
        };
        let child = match self.free.pop() {
            Some(idx) => {
                self.nodes[idx.slot()] = fresh;
                idx
            }
            None => {
                // Cannot overflow in practice: 2^32 nodes of 64 bytes is 256 GiB.
                let idx = NodeIdx(u32::try_from(self.nodes.len()).expect("fewer than 2^32 nodes"));
                if self.nodes.len() == self.nodes.capacity() {
                    // Grow by an eighth instead of doubling: at millions of nodes a
                    // doubled slab would be up to half unused.
                    let more = (self.nodes.len() / 8).max(1024);
                    self.nodes.reserve_exact(more);
                    self.gens.reserve_exact(more);
                }
                self.nodes.push(fresh);
                self.gens.push(0);
                idx
            }
        };
        self.update(parent, |p| p.children.insert(hash, child));
        child
    }

    /// Adds `rank` to the holders of `node`; false when it already held it.
    pub(crate) fn add_holder(&mut self, node: NodeIdx, rank: RankIdx) -> bool {
        self.update(node, |n| n.holders.insert(rank))
    }

    /// Drops `rank` from the holders of `node`, then frees the node and every
    /// ancestor left with neither holders nor children. False when `rank` did not
    /// hold `node` (nothing changes then).
    pub(crate) fn drop_holder(&mut self, node: NodeIdx, rank: RankIdx) -> bool {
        if !self.update(node, |n| n.holders.remove(rank)) {
            return false;
        }
        self.free_empty_from(node);
        true
    }

    /// Frees `node` and then every ancestor left with neither holders nor children,
    /// stopping at the first that still has either (or at the root), which it returns.
    fn free_empty_from(&mut self, node: NodeIdx) -> NodeIdx {
        let mut idx = node;
        while idx != NodeIdx::ROOT {
            let n = self.node(idx);
            if !n.holders.is_empty() || !n.children.is_empty() {
                break;
            }
            let (parent, hash) = (n.parent, n.hash);
            self.update(parent, |p| p.children.remove(hash));
            self.update(idx, |n| *n = Node::default());
            self.gens[idx.slot()] = self.gens[idx.slot()].wrapping_add(1);
            self.free.push(idx);
            idx = parent;
        }
        idx
    }

    /// Takes every holder of the leaf `node`, then frees it and every ancestor left
    /// empty. Returns the holders and the nearest surviving ancestor (possibly the
    /// root); `None`, and nothing changes, if `node` is the root, has children or has
    /// no holders.
    pub(crate) fn prune_leaf(&mut self, node: NodeIdx) -> Option<(RankSet, NodeIdx)> {
        let n = self.node(node);
        if node == NodeIdx::ROOT || !n.children.is_empty() || n.holders.is_empty() {
            return None;
        }
        let holders = self.update(node, |n| std::mem::take(&mut n.holders));
        let survivor = self.free_empty_from(node);
        Some((holders, survivor))
    }

    /// Every live leaf (a node without children, the root excluded) with its last use.
    /// O(slots).
    pub(crate) fn leaves(&self) -> Vec<(u32, NodeIdx)> {
        let mut out = Vec::new();
        for (slot, node) in self.nodes.iter().enumerate().skip(1) {
            // Free slots are blank: no children and no holders.
            if node.children.is_empty() && !node.holders.is_empty() {
                out.push((node.last_used.get(), NodeIdx(slot as u32)));
            }
        }
        out
    }

    /// Live nodes, the root not counted.
    pub(crate) fn live_nodes(&self) -> usize {
        self.nodes.len() - self.free.len() - 1
    }

    /// Slots ever allocated (live or free), the root included.
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.nodes.len()
    }

    /// Asserts the structural invariants (parent/child links agree, no empty leaf
    /// survives, free slots are blank, the heap total is exact) and returns the
    /// holders of every live node, the root included.
    #[cfg(test)]
    pub(crate) fn check(&self) -> Vec<(NodeIdx, Vec<RankIdx>)> {
        let free: std::collections::HashSet<NodeIdx> = self.free.iter().copied().collect();
        assert_eq!(free.len(), self.free.len(), "slot freed twice");
        assert!(!free.contains(&NodeIdx::ROOT), "root freed");
        let recomputed: usize = self.nodes.iter().map(Node::heap_bytes).sum();
        assert_eq!(self.heap_bytes, recomputed, "heap total out of step");
        let mut live = Vec::new();
        for (slot, node) in self.nodes.iter().enumerate() {
            let idx = NodeIdx(slot as u32);
            if free.contains(&idx) {
                assert!(
                    node.holders.is_empty() && node.children.is_empty(),
                    "dirty free slot"
                );
                continue;
            }
            for child in node.children.iter() {
                assert!(!free.contains(&child), "child {child:?} of {idx:?} is free");
                assert_eq!(self.node(child).parent, idx, "parent link of {child:?}");
                assert_eq!(node.children.get(self.node(child).hash), Some(child));
            }
            if idx != NodeIdx::ROOT {
                assert!(!free.contains(&node.parent), "parent of {idx:?} is free");
                assert_eq!(self.node(node.parent).children.get(node.hash), Some(idx));
                assert!(
                    !node.holders.is_empty() || !node.children.is_empty(),
                    "empty leaf {idx:?} not pruned"
                );
            }
            live.push((idx, node.holders.to_vec()));
        }
        live
    }

    /// Approximate heap bytes: every slot by capacity plus child and holder buffers.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>()
            + self.gens.capacity() * size_of::<u32>()
            + self.free.capacity() * size_of::<NodeIdx>()
            + self.heap_bytes
    }
}
