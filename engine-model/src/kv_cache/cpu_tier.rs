//! The CPU tier of one dp rank's KV cache: blocks evicted from the GPU, kept in host
//! memory up to their own capacity and evicted least recently used first.
//!
//! Each entry remembers what a `Stored` event and a copy back to the GPU need: the
//! block's parent and local hash, and its tokens when the request that computed it
//! came with token ids (vLLM-style publishing needs them). Cost: one hash-map entry and
//! one ordered-map entry per block, plus the tokens when known.

use super::{CachedBlock, KvCache, Refs};
use kv_events::{ExternalBlockHash, StorageTier, StoredBlock};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// One block as a tier holds it: its identity, its parent in the chain and its tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BlockCopy {
    /// Engine hash and local hash.
    pub block: StoredBlock,
    /// Engine hash of the previous block of the chain; `None` for a first block.
    pub parent: Option<ExternalBlockHash>,
    /// The block's tokens, when known.
    pub tokens: Option<Arc<[u32]>>,
}

#[derive(Debug, Clone)]
struct Entry {
    copy: BlockCopy,
    tick: u64,
}

/// Blocks kept in one offload, gathered leaf first, and the parent of the first.
#[derive(Debug, Clone, Default)]
struct Chain {
    leaf_first: Vec<StoredBlock>,
    parent: Option<ExternalBlockHash>,
}

/// What [`CpuTier::offload`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Offload {
    /// The block was not in the tier and now is (a `Stored` to publish).
    pub stored: bool,
    /// Blocks evicted to make room, least recently used first (a `Removed` each).
    pub evicted: Vec<ExternalBlockHash>,
}

/// An LRU set of at most `capacity` blocks.
#[derive(Debug, Clone)]
pub(super) struct CpuTier {
    capacity: u64,
    blocks: HashMap<ExternalBlockHash, Entry>,
    /// Blocks by last use (smallest tick = least recently used).
    lru: BTreeMap<u64, ExternalBlockHash>,
    next_tick: u64,
}

impl CpuTier {
    /// An empty tier of `capacity` blocks (≥ 1).
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
        }
    }

    /// Capacity, in blocks.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Blocks held, in blocks.
    pub fn len(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// The copy of `hash`, if held.
    pub fn get(&self, hash: ExternalBlockHash) -> Option<&BlockCopy> {
        self.blocks.get(&hash).map(|e| &e.copy)
    }

    /// Blocks from least to most recently used.
    pub fn lru_order(&self) -> impl Iterator<Item = ExternalBlockHash> + '_ {
        self.lru.values().copied()
    }

    /// Keeps `copy` (a block evicted from the GPU): a block already held is only
    /// marked most recently used; a new one evicts the least recently used blocks
    /// while the tier is full.
    pub fn offload(&mut self, copy: BlockCopy) -> Offload {
        let hash = copy.block.block_hash;
        if self.touch(hash) {
            return Offload::default();
        }
        let mut evicted = Vec::new();
        while self.len() >= self.capacity {
            let Some((_, old)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&old);
            evicted.push(old);
        }
        let tick = self.tick();
        self.lru.insert(tick, hash);
        self.blocks.insert(hash, Entry { copy, tick });
        Offload {
            stored: true,
            evicted,
        }
    }

    /// Marks `hash` most recently used; false if the tier does not hold it.
    pub fn touch(&mut self, hash: ExternalBlockHash) -> bool {
        let tick = self.next_tick;
        let Some(entry) = self.blocks.get_mut(&hash) else {
            return false;
        };
        self.next_tick += 1;
        self.lru.remove(&entry.tick);
        entry.tick = tick;
        self.lru.insert(tick, hash);
        true
    }

    /// Drops every block.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
    }

    fn tick(&mut self) -> u64 {
        let tick = self.next_tick;
        self.next_tick += 1;
        tick
    }
}

/// The CPU-tier side of [`KvCache`]: inspection, offload at eviction, load back at
/// admission.
impl KvCache {
    /// Capacity of the CPU tier, in blocks (0 without one).
    pub fn cpu_capacity(&self) -> u64 {
        self.cpu.as_ref().map_or(0, CpuTier::capacity)
    }

    /// Blocks the CPU tier holds, in blocks.
    pub fn cpu_blocks(&self) -> u64 {
        self.cpu.as_ref().map_or(0, CpuTier::len)
    }

    /// Whether the CPU tier holds the block with this engine hash.
    pub fn cpu_contains(&self, hash: ExternalBlockHash) -> bool {
        self.cpu.as_ref().is_some_and(|c| c.get(hash).is_some())
    }

    /// CPU-tier blocks from least to most recently used.
    pub fn cpu_lru_order(&self) -> Vec<ExternalBlockHash> {
        self.cpu
            .as_ref()
            .map_or_else(Vec::new, |c| c.lru_order().collect())
    }

    /// Copies the leading run of `rest` that the CPU tier holds (and the GPU does not)
    /// into the GPU as blocks referenced by the request holding `held`; returns the
    /// run's length. The space is part of the request's `need`, already free.
    pub(super) fn load_back(
        &mut self,
        rest: &[StoredBlock],
        held: &mut Vec<ExternalBlockHash>,
    ) -> usize {
        let Some(cpu) = &self.cpu else {
            return 0;
        };
        let copies: Vec<BlockCopy> = rest
            .iter()
            .map_while(|b| {
                cpu.get(b.block_hash)
                    .filter(|_| !self.contains(b.block_hash))
            })
            .cloned()
            .collect();
        // Most recent last: touching leaf first keeps a chain evicted from its end.
        for copy in copies.iter().rev() {
            if let Some(cpu) = &mut self.cpu {
                cpu.touch(copy.block.block_hash);
            }
        }
        for copy in &copies {
            let hash = copy.block.block_hash;
            self.push_stored(StorageTier::Gpu, held.last().copied(), copy.block);
            if let Some(tokens) = &copy.tokens {
                self.event_tokens.insert(hash, tokens.clone());
            }
            self.blocks.insert(
                hash,
                CachedBlock {
                    refs: Refs::held(),
                    copy: BlockCopy {
                        parent: held.last().copied(),
                        ..copy.clone()
                    },
                },
            );
            held.push(hash);
        }
        copies.len()
    }

    /// Keeps the blocks `evicted` from the GPU (in eviction order) in the CPU tier,
    /// if there is one, and emits its events in order: each newly kept block's
    /// `Stored` and each block the full tier drops's `Removed`. A chain is evicted
    /// from its end, so consecutive kept blocks of one chain are gathered and stored
    /// as one event, root first. Every parent a `Stored` names is still held: it is
    /// on the GPU until the caller's GPU `Removed`, or kept earlier in this event (a
    /// GPU block's parent is evicted after it, never before).
    pub(super) fn offload(&mut self, evicted: Vec<BlockCopy>) {
        let Some(mut cpu) = self.cpu.take() else {
            return;
        };
        let mut chain = Chain::default();
        for copy in evicted {
            let (hash, parent, block) = (copy.block.block_hash, copy.parent, copy.block);
            let tokens = copy.tokens.clone();
            let done = cpu.offload(copy);
            if !done.evicted.is_empty() {
                self.flush(&mut chain);
                self.push_removed(StorageTier::Cpu, done.evicted);
            }
            if !done.stored {
                continue;
            }
            if let Some(tokens) = tokens {
                self.event_tokens.insert(hash, tokens);
            }
            if chain.leaf_first.is_empty() || chain.parent != Some(hash) {
                self.flush(&mut chain);
            }
            chain.leaf_first.push(block);
            chain.parent = parent;
        }
        self.flush(&mut chain);
        self.cpu = Some(cpu);
    }

    /// Emits the gathered chain's CPU `Stored`, root first, and empties it.
    fn flush(&mut self, chain: &mut Chain) {
        let mut parent = chain.parent;
        for block in chain.leaf_first.drain(..).rev() {
            self.push_stored(StorageTier::Cpu, parent, block);
            parent = Some(block.block_hash);
        }
    }
}
