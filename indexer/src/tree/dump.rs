//! [`RadixTree::dump`]: the tree's state as KV events that rebuild it.
//!
//! A dump lets a fresh router (or a test) rebuild an index by replaying ordinary
//! `Stored` events, so no second serialization format exists. Per rank, the held
//! blocks are walked depth-first from the root and emitted as chains: one `Stored`
//! event per maximal run of single-child descent, whose `parent_hash` is an engine
//! hash the rank holds for the parent block. (Chains follow the rank's blocks, not
//! the tree's runs, so a dump does not depend on how runs happen to be split.) Cost: O(entries) time and memory, and
//! the result is about as large as the stream of stores that built the tree.
//!
//! Blocks a rank still holds below a block it removed are reproduced too: the removed
//! ancestors are emitted under placeholder engine hashes ([`placeholder_hash`]) so
//! the chain can reach them, and a final `Removed` event drops the placeholders. The
//! rebuilt tree therefore holds exactly the same entries, and a later `Stored` of the
//! removed block (under its real engine hash) reconnects the tail as it would have in
//! the original tree.

use super::RadixTree;
use super::arena::BlockId;
use super::ranks::RankState;
use kv_events::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, StoredBlock, WorkerId,
};
use kv_events::{LocalBlockHash, hash_block};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::collections::hash_map::Entry;

impl RadixTree {
    /// Events that rebuild this tree's prefix-match state when applied, in order, to
    /// an empty tree: one batch per worker (sorted by worker id) holding `Stored`
    /// events for each of its ranks, with `event_id`s counted from 0 per rank. A rank
    /// holding blocks on several storage tiers gets its GPU chains first, then each
    /// lower tier's, every event carrying its tier; a lower tier's blocks below
    /// blocks it does not hold itself reach them through placeholders like removed
    /// ancestors (below), so the rebuild does not depend on the other tiers.
    ///
    /// Every engine block hash a rank holds reachably from the root is included, so
    /// later `Removed` events from the engine still find their blocks. O(entries).
    pub fn dump(&self) -> Vec<KvEventBatch> {
        let mut states: Vec<&RankState> = self.ranks.iter().map(|(_, s)| s).collect();
        // GPU first per rank: a lower tier's chain may hang below GPU-held parents.
        states.sort_unstable_by_key(|s| (s.rank, s.tier));
        let mut per_worker: BTreeMap<WorkerId, Vec<KvCacheEvent>> = BTreeMap::new();
        let mut next_id: FxHashMap<kv_events::WorkerRank, u64> = FxHashMap::default();
        for state in states {
            let first = next_id.entry(state.rank).or_insert(0);
            let events = self.dump_rank(state, *first);
            *first += events.len() as u64;
            if !events.is_empty() {
                per_worker
                    .entry(state.rank.worker_id)
                    .or_default()
                    .extend(events);
            }
        }
        per_worker
            .into_iter()
            .map(|(worker_id, events)| KvEventBatch::new(worker_id, events))
            .collect()
    }

    /// The events of one holder (a rank on one tier), numbered from `first_id`.
    fn dump_rank(&self, state: &RankState, first_id: u64) -> Vec<KvCacheEvent> {
        // The smallest engine hash of each held node names it in the dump; further
        // hashes of the same node (aliases) are replayed after the walk. Ordering by
        // engine hashes only makes the dump independent of arena slot numbers.
        let mut primary: FxHashMap<BlockId, ExternalBlockHash> = FxHashMap::default();
        let mut extra: Vec<(ExternalBlockHash, BlockId)> = Vec::new();
        let live = state
            .blocks
            .iter()
            .filter(|(_, held)| super::is_live(&self.arena, state, **held))
            .map(|(hash, held)| (hash, held.id));
        for (hash, node) in live {
            match primary.entry(node) {
                Entry::Vacant(slot) => {
                    slot.insert(*hash);
                }
                Entry::Occupied(mut slot) => {
                    let larger = (*slot.get()).max(*hash);
                    slot.insert((*slot.get()).min(*hash));
                    extra.push((larger, node));
                }
            }
        }
        // Ancestors the rank does not hold (it removed them) but needs, to place the
        // blocks it still holds below them: emitted, then removed again.
        let mut nodes: FxHashSet<BlockId> = primary.keys().copied().collect();
        for node in primary.keys() {
            let mut up = self.arena.block_parent(*node);
            while up != BlockId::ROOT && nodes.insert(up) {
                up = self.arena.block_parent(up);
            }
        }
        let mut kids: FxHashMap<BlockId, Vec<BlockId>> = FxHashMap::default();
        for node in &nodes {
            kids.entry(self.arena.block_parent(*node))
                .or_default()
                .push(*node);
        }
        extra.sort_unstable();

        let mut events = Vec::new();
        let mut emit = |data: KvCacheEventData| {
            let event_id = first_id + events.len() as u64;
            events.push(KvCacheEvent {
                event_id,
                dp_rank: state.rank.dp_rank,
                data,
            });
        };
        let block = |node: BlockId, block_hash: ExternalBlockHash| StoredBlock {
            block_hash,
            tokens_hash: self.arena.block_hash(node),
        };
        // Engine hash of every emitted node: the rank's own, or a placeholder.
        let mut names: FxHashMap<BlockId, ExternalBlockHash> = FxHashMap::default();
        // The children of `node` (named `name`, `None` for the root), named and
        // sorted by name so the dump does not depend on arena slots.
        let named_kids = |node: BlockId, name: Option<ExternalBlockHash>| {
            let mut out: Vec<(ExternalBlockHash, BlockId)> = kids
                .get(&node)
                .map(|list| {
                    list.iter()
                        .map(|kid| {
                            let kid_name = primary.get(kid).copied().unwrap_or_else(|| {
                                placeholder_hash(name, self.arena.block_hash(*kid))
                            });
                            (kid_name, *kid)
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.sort_unstable();
            out
        };
        let mut unheld = Vec::new();
        let mut starts: Vec<(Option<ExternalBlockHash>, ExternalBlockHash, BlockId)> =
            named_kids(BlockId::ROOT, None)
                .into_iter()
                .rev()
                .map(|(name, node)| (None, name, node))
                .collect();
        while let Some((parent_hash, start_name, start)) = starts.pop() {
            let mut chain = Vec::new();
            let (mut node, mut name) = (start, start_name);
            loop {
                names.insert(node, name);
                chain.push(block(node, name));
                if !primary.contains_key(&node) {
                    unheld.push(name);
                }
                match named_kids(node, Some(name)).as_slice() {
                    [(first_name, first), rest @ ..] => {
                        starts.extend(rest.iter().rev().map(|(n, k)| (Some(name), *n, *k)));
                        (node, name) = (*first, *first_name);
                    }
                    [] => break,
                }
            }
            emit(KvCacheEventData::Stored {
                group: None,
                parent_hash,
                blocks: chain,
                tier: state.tier,
            });
        }
        for (hash, node) in extra {
            let parent = self.arena.block_parent(node);
            let parent_hash = (parent != BlockId::ROOT).then(|| names[&parent]);
            emit(KvCacheEventData::Stored {
                group: None,
                parent_hash,
                blocks: vec![block(node, hash)],
                tier: state.tier,
            });
        }
        if !unheld.is_empty() {
            emit(KvCacheEventData::Removed {
                group: None,
                block_hashes: unheld,
                tier: state.tier,
            });
        }
        events
    }
}

/// Tags placeholder hashes so they differ from engine and approximate-mode hashes.
const PLACEHOLDER_TAG: u32 = 0x9057_0B10;

/// The engine hash a dump gives a removed ancestor of held blocks: xxh3-64 (seed
/// 1337) over a tag word, the parent's dump name and the block's local hash, as
/// little-endian `u32` words. Deterministic, so dumping a rebuilt tree gives the
/// same events.
fn placeholder_hash(parent: Option<ExternalBlockHash>, local: LocalBlockHash) -> ExternalBlockHash {
    let p = parent.map_or(0, |p| p.0);
    // Truncation is the point: each u64 becomes its low and high 32-bit words.
    let words = [
        PLACEHOLDER_TAG,
        p as u32,
        (p >> 32) as u32,
        local.0 as u32,
        (local.0 >> 32) as u32,
    ];
    ExternalBlockHash(hash_block(&words).0)
}
