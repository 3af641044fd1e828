//! Run operations of the [`Arena`]: walking to the next block, extending a run in
//! place, splitting a run where its holders stop agreeing or a child branches off,
//! merging a run back into its parent when they agree again, and freeing runs left
//! with neither holders nor children.
//!
//! Costs: extending a run is O(1) amortised. A split or a merge moves the blocks of
//! one side (their hashes and ids, and their 8-byte slots in the block slab) and
//! re-parents the moved children: O(run length + children). Rank maps are never
//! touched, because they name blocks by stable [`BlockId`].

use super::arena::{Arena, BlockId, Node, NodeIdx, Slot, Tick};
use super::children::Children;
use super::rankset::{RankIdx, RankSet};
use kv_events::LocalBlockHash;
use std::sync::atomic::AtomicU32;

impl Arena {
    /// The run and the number of its blocks up to and including `cur` (the root and 0
    /// for [`BlockId::ROOT`]).
    fn after(&self, cur: BlockId) -> (NodeIdx, usize) {
        if cur == BlockId::ROOT {
            return (NodeIdx::ROOT, 0);
        }
        let Slot { node, offset } = self.slot(cur);
        (node, offset as usize + 1)
    }

    /// The block that continues `cur` with local hash `hash`, if any.
    pub(crate) fn next(&self, cur: BlockId, hash: LocalBlockHash) -> Option<BlockId> {
        let (node, end) = self.after(cur);
        let n = self.node(node);
        if end < n.hashes.len() {
            return (n.hashes[end] == hash).then(|| n.ids[end]);
        }
        let child = n.children.get(hash)?;
        Some(self.node(child).ids[0])
    }

    /// A new block `hash` below `cur`, held by `rank` alone, stamped `tick`. Extends
    /// `cur`'s run in place when `cur` ends a childless run held by `rank` alone (a
    /// chain appended by one rank), else starts a new run (splitting `cur`'s run after
    /// `cur` first if needed). `more` is how many blocks the caller will probably
    /// append after this one, so the run grows once per event.
    pub(crate) fn new_child(
        &mut self,
        cur: BlockId,
        hash: LocalBlockHash,
        rank: RankIdx,
        tick: u32,
        more: usize,
    ) -> BlockId {
        let (node, end) = self.after(cur);
        if node != NodeIdx::ROOT && self.is_sole_tail(node, end, rank) {
            return self.append(node, hash, tick, more);
        }
        if end < self.node(node).hashes.len() {
            self.split(node, end);
        }
        let mut hashes = Vec::with_capacity(more + 1);
        hashes.push(hash);
        let run = self.alloc_node(Node {
            hashes,
            ids: Vec::new(),
            parent: node,
            last_used: Tick(AtomicU32::new(tick)),
            children: Children::None,
            holders: RankSet::One(rank.0),
        });
        let id = self.alloc_id(run, 0);
        self.update(run, |r| {
            r.ids.reserve_exact(more + 1);
            r.ids.push(id);
        });
        self.update(node, |p| p.children.insert(hash, run));
        id
    }

    /// Appends a new block `hash` to the run `node`, stamped `tick`: the in-place
    /// extension of [`Arena::new_child`], for a caller that knows the run is not the
    /// root, has no children and is held by the storing rank alone. Reserves room for
    /// `more` blocks after this one when the run is full. O(1) amortised, and the
    /// heap total is touched only when the run's buffers grow.
    pub(crate) fn append(
        &mut self,
        node: NodeIdx,
        hash: LocalBlockHash,
        tick: u32,
        more: usize,
    ) -> BlockId {
        let end = self.node(node).hashes.len();
        let id = self.alloc_id(node, end);
        let n = &mut self.nodes[node.slot()];
        n.last_used.stored(tick);
        if n.hashes.len() == n.hashes.capacity() || n.ids.len() == n.ids.capacity() {
            let buffers = |n: &Node| {
                n.hashes.capacity() * size_of::<LocalBlockHash>()
                    + n.ids.capacity() * size_of::<BlockId>()
            };
            let before = buffers(n);
            n.hashes.reserve_exact(more + 1);
            n.ids.reserve_exact(more + 1);
            self.heap_bytes = self.heap_bytes - before + buffers(n);
        }
        n.hashes.push(hash);
        n.ids.push(id);
        id
    }

    /// True when run `node` ends at its block `end` (exclusive), has no children and
    /// only `rank` holds it: blocks can be appended there, or dropped from there back,
    /// without touching another run.
    pub(crate) fn is_sole_tail(&self, node: NodeIdx, end: usize, rank: RankIdx) -> bool {
        let n = self.node(node);
        n.holders == RankSet::One(rank.0) && n.children.is_empty() && end == n.hashes.len()
    }

    /// Splits run `node` before its block `at` (0 < `at` < length): `node` keeps the
    /// head, a new run (returned) gets the tail with the same holders and time, and
    /// the children.
    pub(crate) fn split(&mut self, node: NodeIdx, at: usize) -> NodeIdx {
        let (hashes, ids, children, holders, last_used) = self.update(node, |n| {
            let hashes = n.hashes.split_off(at);
            let ids = n.ids.split_off(at);
            n.hashes.shrink_to_fit();
            n.ids.shrink_to_fit();
            let children = std::mem::take(&mut n.children);
            (
                hashes,
                ids,
                children,
                n.holders.clone(),
                n.last_used.clone(),
            )
        });
        let first = hashes[0];
        let tail = self.alloc_node(Node {
            hashes,
            ids: Vec::new(),
            parent: node,
            last_used,
            children: Children::None,
            holders,
        });
        self.adopt(tail, children);
        self.update(tail, |t| t.ids = ids);
        self.place_run(tail, 0);
        self.update(node, |n| n.children = Children::One(first, tail));
        tail
    }

    /// Makes `children` the children of `node` (which has none) and re-parents them.
    fn adopt(&mut self, node: NodeIdx, children: Children) {
        let mut kids = Vec::new();
        children.each(|c| kids.push(c));
        for kid in kids {
            self.nodes[kid.slot()].parent = node;
        }
        self.update(node, |n| n.children = children);
    }

    /// Points the slots of `node`'s blocks from offset `from` on at `node`.
    fn place_run(&mut self, node: NodeIdx, from: usize) {
        let ids = std::mem::take(&mut self.nodes[node.slot()].ids);
        self.place(node, from, &ids[from..]);
        self.nodes[node.slot()].ids = ids;
    }

    /// Makes blocks `start..end` of run `node` a run of their own (splitting at most
    /// twice) and returns it.
    pub(crate) fn isolate(&mut self, node: NodeIdx, start: usize, end: usize) -> NodeIdx {
        if end < self.node(node).hashes.len() {
            self.split(node, end);
        }
        if start > 0 {
            self.split(node, start)
        } else {
            node
        }
    }

    /// Adds `rank` to the holders of blocks `start..end` of run `node` (which `rank`
    /// does not hold).
    pub(crate) fn add_holder(&mut self, node: NodeIdx, start: usize, end: usize, rank: RankIdx) {
        let run = self.isolate(node, start, end);
        self.update(run, |r| r.holders.insert(rank));
        self.try_merge(run);
    }

    /// Drops `rank` from blocks `start..end` of run `node`, then frees what is left
    /// empty and merges runs whose holders agree again. False (and nothing changes)
    /// when `rank` does not hold the run.
    pub(crate) fn drop_holder(
        &mut self,
        node: NodeIdx,
        start: usize,
        end: usize,
        rank: RankIdx,
    ) -> bool {
        if !self.node(node).holders.contains(rank) {
            return false;
        }
        if start > 0 && self.is_sole_tail(node, end, rank) {
            // The tail of a chain only `rank` holds: shorten the run.
            let gone = self.update(node, |n| {
                n.hashes.truncate(start);
                n.ids.split_off(start)
            });
            for id in gone {
                self.free_id(id);
            }
            return true;
        }
        let run = self.isolate(node, start, end);
        self.update(run, |r| r.holders.remove(rank));
        self.tidy(run);
        true
    }

    /// After `node`'s holders shrank: frees it (and ancestors) if left empty, else
    /// merges it with its neighbours if their holders now agree.
    pub(crate) fn tidy(&mut self, node: NodeIdx) {
        let n = self.node(node);
        if n.holders.is_empty() && n.children.is_empty() {
            let survivor = self.free_empty_from(node);
            self.try_merge(survivor);
        } else {
            self.try_merge(node);
        }
    }

    /// Merges `node` into its parent, and its only child into it, where the two runs
    /// have the same holders and nothing else branches in between. Keeps runs long,
    /// so a prefix stored in pieces by several ranks is one run again once all hold
    /// all of it.
    pub(crate) fn try_merge(&mut self, node: NodeIdx) {
        if node == NodeIdx::ROOT {
            return;
        }
        let mut node = node;
        let parent = self.node(node).parent;
        if parent != NodeIdx::ROOT
            && self.node(parent).children.only() == Some(node)
            && self.node(parent).holders == self.node(node).holders
        {
            self.absorb(parent, node);
            node = parent;
        }
        if let Some(child) = self.node(node).children.only()
            && self.node(child).holders == self.node(node).holders
        {
            self.absorb(node, child);
        }
    }

    /// Appends the run `child` (the only child of `node`) to `node` and frees it.
    fn absorb(&mut self, node: NodeIdx, child: NodeIdx) {
        let c = self.free_node(child);
        let from = self.node(node).hashes.len();
        let tick = self.node(node).last_used.get().max(c.last_used.get());
        self.update(node, |n| {
            n.hashes.extend_from_slice(&c.hashes);
            n.ids.extend_from_slice(&c.ids);
            n.children = Children::None;
            n.last_used = Tick(AtomicU32::new(tick));
        });
        self.place_run(node, from);
        self.adopt(node, c.children);
    }

    /// Frees `node` (and its blocks) if it has neither holders nor children, then
    /// every ancestor left so, stopping at the first that still has either (or at the
    /// root), which it returns.
    pub(crate) fn free_empty_from(&mut self, node: NodeIdx) -> NodeIdx {
        let mut idx = node;
        while idx != NodeIdx::ROOT {
            let n = self.node(idx);
            if !n.holders.is_empty() || !n.children.is_empty() {
                break;
            }
            idx = self.free_run(idx);
        }
        idx
    }

    /// Unlinks run `node` from its parent and frees it with its blocks; returns the
    /// parent.
    fn free_run(&mut self, node: NodeIdx) -> NodeIdx {
        let n = self.free_node(node);
        self.update(n.parent, |p| p.children.remove(n.hashes[0]));
        for id in n.ids {
            self.free_id(id);
        }
        n.parent
    }

    /// Forgets the last block of the leaf run `node` (for pruning) and returns its id,
    /// with the nearest surviving ancestor when the run is left empty and freed.
    /// `None`, and nothing changes, if `node` is the root, has children or has no
    /// holders (a free slot).
    pub(crate) fn pop_leaf_block(&mut self, node: NodeIdx) -> Option<(BlockId, Option<NodeIdx>)> {
        let n = self.node(node);
        if node == NodeIdx::ROOT || !n.children.is_empty() || n.holders.is_empty() {
            return None;
        }
        let &id = n.ids.last()?;
        if n.ids.len() == 1 {
            let parent = self.free_run(node);
            return Some((id, Some(self.free_empty_from(parent))));
        }
        self.update(node, |n| {
            n.hashes.pop();
            n.ids.pop();
        });
        self.free_id(id);
        Some((id, None))
    }

    /// Every live leaf run (no children, some holders, the root excluded) with its
    /// last use. O(runs).
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
}
