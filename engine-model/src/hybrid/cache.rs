//! The paged KV cache of one hybrid dp rank: one pool of physical blocks shared by the
//! full-attention group and the sliding-window groups, per-group copies under each
//! block hash, one LRU over every group's unreferenced blocks, and the KV events of
//! every change (the rules are in the parent module's docs).
//!
//! # Capacity model
//! vLLM's hybrid manager allocates every group's blocks from one `BlockPool` and
//! evicts from one free queue, so the mock keeps one pool of `capacity` blocks and
//! one LRU: each group's blocks are evicted least recently released first, groups
//! independently of each other (a windowed group can lose a block the full group
//! keeps, and the reverse). A request occupies, from admission (reserved up front,
//! so a running request is never preempted, as in the dense model):
//! - in the full group, `ceil((prompt + max_tokens) / block_size)` blocks (its hit
//!   blocks referenced, the rest reserved), as a dense rank;
//! - in each windowed group a *working set*: while it prefills, its window plus the
//!   blocks one step can compute (`w + cdiv(max_num_batched_tokens, block_size) + 1`,
//!   at most its total blocks): vLLM allocates a whole prefill chunk in every group
//!   and frees the blocks that slid out of the window only at the next step; once
//!   the prefill is done, `w + 1` blocks. Its window hit blocks and the blocks it
//!   caches count towards the working set while referenced; they are released (to
//!   the LRU) when they slide out of the window, all of them when the prefill ends.
//!   The working set is topped up, evicting if needed, at the start of each step.
//!
//! Events (router protocol, GPU tier, every one with its group): evictions emit
//! `Removed` (consecutive evictions of one group coalesced); each request's blocks
//! completed in a step emit, in this order, the full group's `Stored` of the whole
//! range (parent = the block before it), then per windowed group one `Stored` per run
//! of consecutive cached blocks (parent = the block before the run, which the full
//! group holds) or, when the group caches nothing of the range, one empty `Stored`
//! (no parent), as vLLM publishes one `BlockStored` per group. Replaying them into a
//! multiset per group gives exactly the copies the cache holds. Evictions happen only
//! while a step is scheduled and stores only when it is applied, so a step's
//! removals always precede its stores.

use super::alloc::{HybridAllocation, Window};
use super::{BlockId, GroupStore, HybridHit, Layout};
use crate::kv_cache::{CacheInUse, Lru, Refs, hit_candidates, hit_cap_blocks};
use kv_events::{ExternalBlockHash, KvCacheEventData, StorageTier, StoredBlock};
use std::collections::HashMap;

/// One physical block: a copy of `hash` in group `group`.
#[derive(Debug, Clone)]
struct Physical {
    group: usize,
    hash: ExternalBlockHash,
    /// References, and the place in the LRU while unreferenced.
    refs: Refs,
}

/// A hybrid pool's capacity and what occupies it, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    /// Blocks in the pool, shared by every group.
    pub capacity: u64,
    /// Cached physical blocks over every group (copies counted).
    pub cached: u64,
    /// Blocks reserved by running requests, not cached.
    pub reserved: u64,
    /// Unreferenced cached blocks, which eviction may reclaim.
    pub evictable: u64,
}

impl Occupancy {
    /// Blocks in use: cached plus reserved.
    pub fn used(&self) -> u64 {
        self.cached + self.reserved
    }

    /// Blocks neither cached nor reserved.
    pub fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.used())
    }
}

/// The paged KV cache of one hybrid dp rank. See the module docs.
#[derive(Debug, Clone)]
pub struct HybridCache {
    block_size: u32,
    capacity: u64,
    pub(super) layout: Layout,
    /// Blocks one step can complete per request, plus one: `cdiv(budget, bs) + 1`.
    chunk_blocks: u64,
    blocks: HashMap<BlockId, Physical>,
    next_id: BlockId,
    /// Per group: the copies (physical blocks) of each cached hash, oldest first.
    groups: Vec<HashMap<ExternalBlockHash, Vec<BlockId>>>,
    /// Unreferenced cached blocks of every group, by release order.
    lru: Lru<BlockId>,
    reserved: u64,
    pub(super) events: Vec<KvCacheEventData>,
    stores: Vec<GroupStore>,
}

impl HybridCache {
    /// An empty cache of `capacity` blocks of `block_size` tokens shared by the groups
    /// of `layout`, for steps of at most `max_num_batched_tokens` tokens.
    pub(crate) fn new(
        block_size: u32,
        capacity: u64,
        layout: Layout,
        max_num_batched_tokens: u64,
    ) -> Self {
        Self {
            block_size,
            capacity,
            layout,
            chunk_blocks: super::chunk_blocks(max_num_batched_tokens, block_size),
            blocks: HashMap::new(),
            next_id: 0,
            groups: vec![HashMap::new(); layout.full() + 1],
            lru: Lru::new(),
            reserved: 0,
            events: Vec::new(),
            stores: Vec::new(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The pool's capacity and what occupies it, in blocks.
    pub fn occupancy(&self) -> Occupancy {
        Occupancy {
            capacity: self.capacity,
            cached: self.blocks.len() as u64,
            reserved: self.reserved,
            evictable: self.lru.len() as u64,
        }
    }

    /// Groups of the rank: the windowed ones, then the full-attention group.
    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// Copies of `hash` that group `group` holds (0 when none or no such group).
    pub fn copies(&self, group: usize, hash: ExternalBlockHash) -> usize {
        self.groups
            .get(group)
            .and_then(|g| g.get(&hash))
            .map_or(0, Vec::len)
    }

    /// Every hash group `group` holds with its number of copies, in no order.
    pub fn group_blocks(&self, group: usize) -> impl Iterator<Item = (ExternalBlockHash, usize)> {
        self.groups
            .get(group)
            .into_iter()
            .flat_map(|g| g.iter().map(|(h, c)| (*h, c.len())))
    }

    /// The footprint of a request of `total_blocks` blocks at admission with no hit,
    /// in blocks: what the pool must be able to hold for it ever to run.
    pub fn footprint(&self, total_blocks: u64) -> u64 {
        self.layout.footprint(total_blocks, self.chunk_blocks)
    }

    /// The engine's hit of `prompt` (chained full prompt blocks) for a prompt of
    /// `prompt_tokens` tokens: see the parent module's rule. O(prompt blocks ×
    /// groups).
    pub fn hit(&self, prompt: &[StoredBlock], prompt_tokens: u64) -> HybridHit {
        let prompt = hit_candidates(prompt, prompt_tokens, self.block_size);
        let full = self.layout.full();
        let full_blocks = prompt
            .iter()
            .take_while(|b| self.groups[full].contains_key(&b.block_hash))
            .count();
        let w = self.layout.window_blocks as usize;
        let windows_hold = |b: &StoredBlock| {
            self.groups[..full]
                .iter()
                .all(|g| g.contains_key(&b.block_hash))
        };
        // Right to left, the first run of `w` blocks every window holds ends the hit;
        // without one, the run from block 0 is a hit shorter than the window.
        let mut run = 0;
        for i in (0..full_blocks).rev() {
            if !windows_hold(&prompt[i]) {
                run = 0;
                continue;
            }
            run += 1;
            if run >= w {
                return HybridHit {
                    blocks: i + w,
                    full_blocks,
                };
            }
        }
        HybridHit {
            blocks: run,
            full_blocks,
        }
    }

    /// Admits a request occupying `total_blocks` blocks in the full group whose full
    /// prompt blocks are `prompt` (of a `prompt_tokens`-token prompt): references its
    /// hit (the full group's blocks `0..L` and each window's `L − w .. L`), reserves
    /// the rest of the full group's footprint and each windowed group's working set,
    /// and evicts unreferenced blocks (LRU first, `Removed` each) if free space is
    /// short. Returns `None`, changing nothing, when even evicting every unreferenced
    /// block would not make room.
    pub fn try_allocate(
        &mut self,
        prompt: &[StoredBlock],
        prompt_tokens: u64,
        total_blocks: u64,
    ) -> Option<HybridAllocation> {
        let hit = self.hit(prompt, prompt_tokens);
        let (l, w) = (hit.blocks, self.layout.window_blocks as usize);
        let full = self.layout.full();
        let first_copy = |g: usize, pos: usize| self.groups[g][&prompt[pos].block_hash][0];
        let full_hits: Vec<BlockId> = (0..l).map(|pos| first_copy(full, pos)).collect();
        let window_hits: Vec<Vec<(usize, BlockId)>> = (0..full)
            .map(|g| {
                (l.saturating_sub(w)..l)
                    .map(|pos| (pos, first_copy(g, pos)))
                    .collect()
            })
            .collect();
        let unreferenced = full_hits
            .iter()
            .chain(window_hits.iter().flatten().map(|(_, id)| id))
            .filter(|id| self.blocks[id].refs.is_unreferenced())
            .count() as u64;
        let per_window = self
            .prefill_working(total_blocks)
            .saturating_sub(l.min(w) as u64);
        let full_reserved = total_blocks.saturating_sub(l as u64);
        let need = full_reserved + full as u64 * per_window;
        if self.occupancy().free() + self.lru.len() as u64 - unreferenced < need {
            return None;
        }
        for id in full_hits
            .iter()
            .chain(window_hits.iter().flatten().map(|(_, id)| id))
        {
            self.acquire(*id);
        }
        self.evict(need.saturating_sub(self.occupancy().free()));
        self.reserved += need;
        Some(HybridAllocation {
            hit,
            full: full_hits,
            full_reserved,
            windows: window_hits
                .into_iter()
                .map(|held| Window {
                    held,
                    reserved: per_window,
                })
                .collect(),
            replay_end: hit_cap_blocks(prompt_tokens, self.block_size),
            total_blocks,
            decoding: false,
        })
    }

    /// Caches the request's prompt blocks `alloc.committed_blocks() .. end` (of
    /// `prompt`), computed in this step: a new physical block each in the full group
    /// (a copy when the hash is already cached there) and in each windowed group the
    /// blocks its retention keeps. Emits the events and the [`GroupStore`]s of the
    /// module docs.
    pub fn commit(&mut self, alloc: &mut HybridAllocation, prompt: &[StoredBlock], end: usize) {
        let start = alloc.full.len();
        let end = end.min(prompt.len());
        if start >= end {
            return;
        }
        let range = &prompt[start..end];
        let parent_hash = start.checked_sub(1).map(|i| prompt[i].block_hash);
        let full = self.layout.full();
        for b in range {
            alloc.full_reserved = alloc.full_reserved.saturating_sub(1);
            self.reserved = self.reserved.saturating_sub(1);
            let id = self.insert(full, b.block_hash);
            alloc.full.push(id);
        }
        self.events.push(KvCacheEventData::Stored {
            parent_hash,
            blocks: range.to_vec(),
            tier: StorageTier::Gpu,
            group: Some(self.layout.group(full)),
        });
        for g in 0..full {
            let mut stored = Vec::new();
            for (pos, b) in (start..end).zip(range) {
                // A working set without room (only when other requests share its
                // blocks at a slide) leaves the block uncached rather than overfill.
                if !alloc.keeps(pos, &self.layout) || alloc.windows[g].reserved == 0 {
                    continue;
                }
                alloc.windows[g].reserved -= 1;
                self.reserved = self.reserved.saturating_sub(1);
                let id = self.insert(g, b.block_hash);
                alloc.windows[g].held.push((pos, id));
                stored.push((pos, *b));
            }
            self.push_runs(g, prompt, &stored);
            self.stores.push(GroupStore {
                group: self.layout.group(g),
                parent_hash,
                range: range.to_vec(),
                stored: stored.into_iter().map(|(_, b)| b).collect(),
            });
        }
        self.stores.push(GroupStore {
            group: self.layout.group(full),
            parent_hash,
            range: range.to_vec(),
            stored: range.to_vec(),
        });
    }

    /// Brings a running request's windowed working sets up to date at the start of a
    /// step, `computed_blocks` full prompt blocks computed so far: releases the
    /// cached blocks that slid out of the window (all of them once `prefill_done`)
    /// and tops each working set up to its size, evicting LRU blocks if free space is
    /// short (or shrinks it once the prefill is done).
    pub fn settle(
        &mut self,
        alloc: &mut HybridAllocation,
        computed_blocks: usize,
        prefill_done: bool,
    ) {
        if alloc.decoding {
            return;
        }
        alloc.decoding = prefill_done;
        let w = self.layout.window_blocks as usize;
        let (keep_from, size) = if prefill_done {
            (usize::MAX, self.decode_working(alloc.total_blocks))
        } else {
            (
                computed_blocks.saturating_sub(w),
                self.prefill_working(alloc.total_blocks),
            )
        };
        for g in 0..alloc.windows.len() {
            let split = alloc.windows[g]
                .held
                .partition_point(|(pos, _)| *pos < keep_from);
            let gone: Vec<(usize, BlockId)> = alloc.windows[g].held.drain(..split).collect();
            for (_, id) in gone.iter().rev() {
                self.release_block(*id);
            }
            let window = &mut alloc.windows[g];
            let want = size.saturating_sub(window.held.len() as u64);
            if want <= window.reserved {
                self.reserved = self.reserved.saturating_sub(window.reserved - want);
                window.reserved = want;
            } else {
                let more = want - window.reserved;
                self.evict(more.saturating_sub(self.occupancy().free()));
                let got = more.min(self.occupancy().free());
                self.reserved += got;
                alloc.windows[g].reserved += got;
            }
        }
    }

    /// Returns a finished request's space: reserved blocks become free, held blocks
    /// lose a reference (each group's blocks at refcount 0 join the LRU last block
    /// first, the windowed groups' before the full group's, as vLLM frees them).
    pub fn release(&mut self, alloc: HybridAllocation) {
        for window in &alloc.windows {
            self.reserved = self.reserved.saturating_sub(window.reserved);
            for (_, id) in window.held.iter().rev() {
                self.release_block(*id);
            }
        }
        self.reserved = self.reserved.saturating_sub(alloc.full_reserved);
        for id in alloc.full.iter().rev() {
            self.release_block(*id);
        }
    }

    /// Drops every cached block and emits `Cleared`.
    ///
    /// # Errors
    /// [`CacheInUse`] (changing nothing) if any block is referenced or reserved.
    pub fn clear(&mut self) -> Result<(), CacheInUse> {
        CacheInUse::check(self.blocks.len(), self.lru.len(), self.reserved)?;
        self.blocks.clear();
        self.lru.clear();
        for g in &mut self.groups {
            g.clear();
        }
        self.events.push(KvCacheEventData::Cleared);
        Ok(())
    }

    /// Takes the router-protocol events emitted since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvCacheEventData> {
        std::mem::take(&mut self.events)
    }

    /// Takes the vLLM-form stores emitted since the last call, in order (per request
    /// and step: the windowed groups in id order, then the full group).
    pub fn take_group_stores(&mut self) -> Vec<GroupStore> {
        std::mem::take(&mut self.stores)
    }

    fn prefill_working(&self, total_blocks: u64) -> u64 {
        self.layout.prefill_working(total_blocks, self.chunk_blocks)
    }

    fn decode_working(&self, total_blocks: u64) -> u64 {
        total_blocks.min(u64::from(self.layout.window_blocks) + 1)
    }

    /// A new referenced physical block of `hash` in group `g`.
    fn insert(&mut self, g: usize, hash: ExternalBlockHash) -> BlockId {
        let id = self.next_id;
        self.next_id += 1;
        self.blocks.insert(
            id,
            Physical {
                group: g,
                hash,
                refs: Refs::held(),
            },
        );
        self.groups[g].entry(hash).or_default().push(id);
        id
    }

    fn acquire(&mut self, id: BlockId) {
        if let Some(block) = self.blocks.get_mut(&id) {
            self.lru.acquire(&mut block.refs);
        }
    }

    fn release_block(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(&id) else {
            debug_assert!(false, "released block {id} is not cached");
            return;
        };
        self.lru.release(&mut block.refs, id);
    }

    /// Evicts up to `count` unreferenced blocks, LRU first, each emitting `Removed`
    /// in its group.
    fn evict(&mut self, count: u64) {
        for _ in 0..count {
            let Some(id) = self.lru.pop_oldest() else {
                break;
            };
            let Some(block) = self.blocks.remove(&id) else {
                continue;
            };
            let copies = self.groups[block.group].get_mut(&block.hash);
            if let Some(copies) = copies {
                copies.retain(|c| *c != id);
                if copies.is_empty() {
                    self.groups[block.group].remove(&block.hash);
                }
            }
            self.push_removed(block.group, block.hash);
        }
    }
}
