//! The paged KV cache of one dp rank: block accounting, prefix reuse, LRU eviction and
//! the KV events that describe every change to the set of cached blocks.
//!
//! The cache holds `capacity` blocks of `block_size` tokens. A block is in one of three
//! states:
//! - **reserved**: space taken by a running request that is not (yet) a cached block —
//!   prompt blocks still being prefilled, the partial last prompt block and the decode
//!   tokens. Reserved blocks are anonymous; only their count is tracked.
//! - **cached, referenced**: a full prompt block identified by its engine hash, used by
//!   at least one running request (refcount > 0). Never evicted.
//! - **cached, unreferenced**: a full prompt block no request uses. It stays cached for
//!   prefix reuse and sits in an LRU list; it is evicted, least recently released first,
//!   only when an admission needs the space.
//!
//! Event rules: a block becoming cached emits `Stored` (consecutive blocks of one chain
//! are coalesced into one event with the right `parent_hash`), an eviction emits
//! `Removed`, [`KvCache::clear`] emits `Cleared`. Reserved blocks are never announced.
//! Replaying the emitted events into a set always yields exactly the cached blocks.
//! Every event above is on the GPU tier.
//!
//! # CPU tier
//! With [`KvCache::with_cpu_tier`] (vLLM's CPU KV offloading), a block evicted from
//! the GPU is kept in a CPU tier of its own capacity ([`cpu_tier`]): the eviction emits
//! `Stored` tier CPU for the block (before the GPU `Removed`, so its parent is still
//! held), and a block the full CPU tier drops, least recently used first, emits
//! `Removed` tier CPU. An admission whose prompt continues in the CPU tier past its
//! GPU prefix hit copies that run back ([`Allocation::loaded_blocks`]: the engine
//! charges a load time, not prefill): the blocks become cached GPU blocks again
//! (`Stored` tier GPU) and, as in vLLM, the CPU copy stays (marked recently used), so
//! the rank then holds the block on both tiers. A GPU eviction of a block the CPU tier
//! already holds only marks the CPU copy recently used (no event). The admission
//! evicts for its space before loading back, so on a CPU tier too small for both, the
//! blocks it offloads can push out blocks it would have loaded. `Cleared` drops
//! both tiers. Without a CPU tier (the default) nothing of this happens: evictions
//! emit `Removed` only, exactly as before.
//!
//! vLLM's offloading connector writes blocks to the CPU as they are computed; the mock
//! offloads at GPU eviction instead. The router sees the same holders once the GPU
//! copy is gone; it differs only while a block is on both tiers before any reload.
//!
//! Costs: one hash-map entry per cached block plus one ordered-map entry per
//! unreferenced block; admission is O(prompt blocks + evictions × log n). With a CPU
//! tier, each block also keeps its tokens when the request came with token ids.

mod cpu_tier;
mod lru;

use cpu_tier::{BlockCopy, CpuTier};
use kv_events::{
    ExternalBlockHash, KvCacheEventData, LocalBlockHash, StorageTier, StoredBlock, hash_block,
};
pub(crate) use lru::{Lru, Refs};
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

/// The engine hash of a block: xxh3-64 (seed [`kv_events::BLOCK_HASH_SEED`]) over the
/// little-endian bytes of the parent's engine hash followed by the block's
/// [`LocalBlockHash`]; a first block (no parent) hashes the local hash alone.
///
/// Chaining makes the engine hash identify the whole prefix up to and including this
/// block, as vLLM's prefix-cache hashes do, so equal token blocks at different prefixes
/// are different cache entries. (Implemented with [`kv_events::hash_block`], whose input
/// is little-endian `u32` words: two words per `u64`, low word first, which is the same
/// byte string.)
pub fn engine_block_hash(
    parent: Option<ExternalBlockHash>,
    local: LocalBlockHash,
) -> ExternalBlockHash {
    fn words(v: u64) -> [u32; 2] {
        // Truncation is the point: split the u64 into its low and high 32-bit words.
        [v as u32, (v >> 32) as u32]
    }
    let [l0, l1] = words(local.0);
    let hash = match parent {
        Some(p) => {
            let [p0, p1] = words(p.0);
            hash_block(&[p0, p1, l0, l1])
        }
        None => hash_block(&[l0, l1]),
    };
    ExternalBlockHash(hash.0)
}

/// Chains `locals` (one per full prompt block, in prefix order) into engine hashes.
pub fn chain_block_hashes(locals: &[LocalBlockHash]) -> Vec<StoredBlock> {
    let mut parent = None;
    locals
        .iter()
        .map(|&tokens_hash| {
            let block_hash = engine_block_hash(parent, tokens_hash);
            parent = Some(block_hash);
            StoredBlock {
                block_hash,
                tokens_hash,
            }
        })
        .collect()
}

/// The prompt blocks an engine may serve from its prefix cache for a prompt of
/// `prompt_tokens` tokens, in blocks: `(prompt_tokens − 1) / block_size`.
///
/// vLLM never reports the last prompt token as cached (its logits give the first
/// output token), so an exactly block-aligned prompt of `n` cached blocks hits `n − 1`
/// blocks: the last block is computed again, and storing it finds the block already
/// cached. Both the dense and the hybrid cache apply this cap.
pub(crate) fn hit_cap_blocks(prompt_tokens: u64, block_size: u32) -> usize {
    let blocks = prompt_tokens.saturating_sub(1) / u64::from(block_size.max(1));
    usize::try_from(blocks).unwrap_or(usize::MAX)
}

/// `prompt` cut to the blocks [`hit_cap_blocks`] lets a hit cover.
pub(crate) fn hit_candidates(
    prompt: &[StoredBlock],
    prompt_tokens: u64,
    block_size: u32,
) -> &[StoredBlock] {
    &prompt[..hit_cap_blocks(prompt_tokens, block_size).min(prompt.len())]
}

/// The tokens of full prompt block `index` of a prompt of `block_size`-token blocks,
/// if the request came with its token ids (`token_ids`) and they reach that far.
pub(crate) fn prompt_block_tokens(
    token_ids: Option<&[u32]>,
    index: usize,
    block_size: u32,
) -> Option<&[u32]> {
    let bs = block_size as usize;
    token_ids?.get(index * bs..(index + 1) * bs)
}

/// The KV space one running request holds: the cached blocks it references (in prefix
/// order) and its count of reserved, not-yet-cached blocks.
///
/// Obtained from [`KvCache::try_allocate`]; must be handed back to [`KvCache::release`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    held: Vec<ExternalBlockHash>,
    reserved: u64,
    hit_blocks: usize,
    loaded_blocks: usize,
}

impl Allocation {
    /// Leading prompt blocks that were already cached at admission (prefix hit), in blocks.
    pub fn hit_blocks(&self) -> usize {
        self.hit_blocks
    }

    /// Prompt blocks after the GPU hit copied back from the CPU tier at admission, in
    /// blocks (0 without a CPU tier).
    pub fn loaded_blocks(&self) -> usize {
        self.loaded_blocks
    }

    /// Cached blocks referenced by the request, in prefix order.
    pub fn held(&self) -> &[ExternalBlockHash] {
        &self.held
    }

    /// Blocks reserved but not cached, in blocks.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// All blocks the request occupies (held + reserved), in blocks.
    pub fn total_blocks(&self) -> u64 {
        self.held.len() as u64 + self.reserved
    }
}

/// Why [`KvCache::clear`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("kv cache has {referenced} referenced and {reserved} reserved blocks")]
pub struct CacheInUse {
    /// Cached blocks with a non-zero refcount.
    pub referenced: u64,
    /// Reserved blocks.
    pub reserved: u64,
}

impl CacheInUse {
    /// `Ok` for a cache of `cached` blocks, `evictable` of them unreferenced, and
    /// `reserved` reserved blocks that nothing uses; else what is in use.
    pub(crate) fn check(cached: usize, evictable: usize, reserved: u64) -> Result<(), Self> {
        let referenced = cached.saturating_sub(evictable) as u64;
        if referenced > 0 || reserved > 0 {
            return Err(Self {
                referenced,
                reserved,
            });
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct CachedBlock {
    /// References, and the place in the LRU list while unreferenced.
    refs: Refs,
    /// What the CPU tier keeps when the block is evicted.
    copy: BlockCopy,
}

/// The paged KV cache of one dp rank. See the module docs for states and event rules.
#[derive(Debug, Clone)]
pub struct KvCache {
    block_size: u32,
    capacity: u64,
    blocks: HashMap<ExternalBlockHash, CachedBlock>,
    /// Unreferenced cached blocks by release order.
    lru: Lru<ExternalBlockHash>,
    reserved: u64,
    events: Vec<KvCacheEventData>,
    /// `None` without a CPU tier.
    cpu: Option<CpuTier>,
    /// Tokens of the blocks in `events` that the cache stored from a copy (offloaded
    /// or loaded back), when known.
    event_tokens: HashMap<ExternalBlockHash, Arc<[u32]>>,
}

impl KvCache {
    /// An empty cache of `capacity` blocks of `block_size` tokens.
    pub fn new(block_size: u32, capacity: u64) -> Self {
        Self {
            block_size,
            capacity,
            blocks: HashMap::new(),
            lru: Lru::new(),
            reserved: 0,
            events: Vec::new(),
            cpu: None,
            event_tokens: HashMap::new(),
        }
    }

    /// Adds a CPU tier of `blocks` blocks (see the module docs); 0 leaves the cache
    /// without one.
    pub fn with_cpu_tier(mut self, blocks: u64) -> Self {
        self.cpu = (blocks > 0).then(|| CpuTier::new(blocks));
        self
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Capacity, in blocks.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Blocks in use: cached (referenced or not) plus reserved, in blocks.
    pub fn used_blocks(&self) -> u64 {
        self.blocks.len() as u64 + self.reserved
    }

    /// Blocks neither cached nor reserved, in blocks.
    pub fn free_blocks(&self) -> u64 {
        self.capacity.saturating_sub(self.used_blocks())
    }

    /// Cached blocks (referenced or not), in blocks.
    pub fn cached_blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Unreferenced cached blocks, which eviction may reclaim, in blocks.
    pub fn evictable_blocks(&self) -> u64 {
        self.lru.len() as u64
    }

    /// Whether the block with this engine hash is cached.
    pub fn contains(&self, hash: ExternalBlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Every cached block's engine hash, in no particular order.
    pub fn cached_hashes(&self) -> impl Iterator<Item = ExternalBlockHash> + '_ {
        self.blocks.keys().copied()
    }

    /// Unreferenced cached blocks from least to most recently used.
    pub fn lru_order(&self) -> impl Iterator<Item = ExternalBlockHash> + '_ {
        self.lru.iter()
    }

    /// Length of the leading run of `prompt` blocks that are cached, in blocks.
    pub fn prefix_hits(&self, prompt: &[StoredBlock]) -> usize {
        prompt
            .iter()
            .take_while(|b| self.blocks.contains_key(&b.block_hash))
            .count()
    }

    /// Admits a request occupying `total_blocks` blocks whose full prompt blocks are
    /// `prompt`: references the cached prefix, reserves the rest and evicts unreferenced
    /// blocks (LRU first, each emitting `Removed`) if free space is short. With a CPU
    /// tier, the run of prompt blocks after the GPU hit that the CPU tier holds is then
    /// copied back into the reserved space (see the module docs).
    ///
    /// Returns `None`, changing nothing, when even evicting every unreferenced block
    /// would not make room.
    pub fn try_allocate(
        &mut self,
        prompt: &[StoredBlock],
        total_blocks: u64,
    ) -> Option<Allocation> {
        let hits = &prompt[..self.prefix_hits(prompt)];
        let hit_count = hits.len() as u64;
        let hits_unreferenced = hits
            .iter()
            .filter(|b| {
                self.blocks
                    .get(&b.block_hash)
                    .is_some_and(|c| c.refs.is_unreferenced())
            })
            .count() as u64;
        let need = total_blocks.saturating_sub(hit_count);
        let evictable = self.evictable_blocks() - hits_unreferenced;
        if self.free_blocks() + evictable < need {
            return None;
        }
        let mut held = Vec::with_capacity(prompt.len());
        for b in hits {
            self.acquire(b.block_hash);
            held.push(b.block_hash);
        }
        let shortfall = need.saturating_sub(self.free_blocks());
        self.evict(shortfall);
        let hit_blocks = hits.len();
        let loaded = self.load_back(&prompt[hit_blocks..], &mut held);
        self.reserved += need - loaded as u64;
        Some(Allocation {
            held,
            reserved: need - loaded as u64,
            hit_blocks,
            loaded_blocks: loaded,
        })
    }

    /// Turns one reserved block of `alloc` into the cached block `block`, the next full
    /// prompt block of its chain (its parent is the last block `alloc` holds).
    /// `tokens` are the block's tokens when known; a cache with a CPU tier keeps them
    /// for the events of the block's later offload and reload.
    ///
    /// Emits `Stored` if the block was not cached yet; if another request cached the
    /// same block meanwhile, references that copy and frees the reservation instead.
    /// Returns true when the block was newly cached (a `Stored` was emitted).
    pub fn commit(
        &mut self,
        alloc: &mut Allocation,
        block: StoredBlock,
        tokens: Option<&[u32]>,
    ) -> bool {
        debug_assert!(alloc.reserved > 0, "commit without a reserved block");
        let parent = alloc.held.last().copied();
        alloc.reserved = alloc.reserved.saturating_sub(1);
        self.reserved = self.reserved.saturating_sub(1);
        match self.blocks.entry(block.block_hash) {
            Entry::Occupied(mut cached) => {
                self.lru.acquire(&mut cached.get_mut().refs);
                alloc.held.push(block.block_hash);
                false
            }
            Entry::Vacant(slot) => {
                let tokens = tokens.filter(|_| self.cpu.is_some()).map(Arc::from);
                slot.insert(CachedBlock {
                    refs: Refs::held(),
                    copy: BlockCopy {
                        block,
                        parent,
                        tokens,
                    },
                });
                self.push_stored(StorageTier::Gpu, parent, block);
                alloc.held.push(block.block_hash);
                true
            }
        }
    }

    /// Returns a finished request's space: reserved blocks become free and held blocks
    /// lose a reference. Blocks reaching refcount 0 join the LRU list tail first, so a
    /// chain is later evicted from its end towards its root.
    pub fn release(&mut self, alloc: Allocation) {
        self.reserved = self.reserved.saturating_sub(alloc.reserved);
        for hash in alloc.held.iter().rev() {
            let Some(block) = self.blocks.get_mut(hash) else {
                debug_assert!(false, "released block {hash} is not cached");
                continue;
            };
            self.lru.release(&mut block.refs, *hash);
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
        if let Some(cpu) = &mut self.cpu {
            cpu.clear();
        }
        self.events.push(KvCacheEventData::Cleared);
        Ok(())
    }

    /// Takes the KV events emitted since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvCacheEventData> {
        std::mem::take(&mut self.events)
    }

    /// Takes the tokens of the blocks the cache stored from a copy since the last call
    /// (CPU-tier offloads and reloads), when known. The tokens of newly computed
    /// blocks are the caller's (it passed them to [`Self::commit`]).
    pub fn take_event_tokens(&mut self) -> HashMap<ExternalBlockHash, Arc<[u32]>> {
        std::mem::take(&mut self.event_tokens)
    }

    fn acquire(&mut self, hash: ExternalBlockHash) {
        if let Some(block) = self.blocks.get_mut(&hash) {
            self.lru.acquire(&mut block.refs);
        }
    }

    /// Evicts `count` unreferenced blocks, LRU first. With a CPU tier each is offloaded
    /// first (its CPU `Stored` and the CPU tier's own `Removed`s precede the GPU
    /// `Removed`, so every `Stored` names a parent the rank still holds).
    fn evict(&mut self, count: u64) {
        let mut removed = Vec::new();
        let mut copies = Vec::new();
        for _ in 0..count {
            let Some(hash) = self.lru.pop_oldest() else {
                break;
            };
            if let Some(block) = self.blocks.remove(&hash)
                && self.cpu.is_some()
            {
                copies.push(block.copy);
            }
            removed.push(hash);
        }
        self.offload(copies);
        self.push_removed(StorageTier::Gpu, removed);
    }

    pub(super) fn push_removed(&mut self, tier: StorageTier, removed: Vec<ExternalBlockHash>) {
        if removed.is_empty() {
            return;
        }
        if let Some(KvCacheEventData::Removed {
            block_hashes,
            tier: last,
            group: None,
        }) = self.events.last_mut()
            && *last == tier
        {
            block_hashes.extend(removed);
        } else {
            self.events.push(KvCacheEventData::Removed {
                group: None,
                block_hashes: removed,
                tier,
            });
        }
    }

    pub(super) fn push_stored(
        &mut self,
        tier: StorageTier,
        parent: Option<ExternalBlockHash>,
        block: StoredBlock,
    ) {
        if let Some(KvCacheEventData::Stored {
            blocks, tier: last, ..
        }) = self.events.last_mut()
            && *last == tier
            && parent.is_some()
            && blocks.last().map(|b| b.block_hash) == parent
        {
            blocks.push(block);
            return;
        }
        self.events.push(KvCacheEventData::Stored {
            group: None,
            parent_hash: parent,
            blocks: vec![block],
            tier,
        });
    }
}

#[cfg(test)]
mod cpu_tests;
#[cfg(test)]
mod tests;
