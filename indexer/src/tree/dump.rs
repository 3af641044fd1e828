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
//!
//! KV cache groups are dumped holder by holder, full attention first, so that a
//! windowed group's sparse chains can name the full group's block before them as
//! their parent (as the engine does) instead of placeholders for the whole prefix
//! above them. Copies are replayed as one more `Stored` of the block per extra copy.

use super::RadixTree;
use super::arena::BlockId;
use super::ranks::RankState;
use kv_events::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheGroup, KvEventBatch, StoredBlock,
    WorkerId,
};
use kv_events::{LocalBlockHash, hash_block};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::collections::hash_map::Entry;

/// Blocks held by a rank's holders dumped earlier on the same tier, with the engine
/// hash naming each: a later holder's chain may hang below them.
type Borrowable = FxHashMap<BlockId, ExternalBlockHash>;

impl RadixTree {
    /// Events that rebuild this tree's prefix-match state when applied, in order, to
    /// an empty tree: one batch per worker (sorted by worker id) holding `Stored`
    /// events for each of its ranks, with `event_id`s counted from 0 per rank. A rank
    /// holding blocks on several storage tiers gets its GPU chains first, then each
    /// lower tier's, every event carrying its tier; a lower tier's blocks below
    /// blocks it does not hold itself reach them through placeholders like removed
    /// ancestors (below), so the rebuild does not depend on the other tiers.
    ///
    /// KV cache groups: each event carries its holder's group (with the group's
    /// window); on a tier, full-attention groups come first, then windowed ones, by
    /// group id. A group's chain whose parent block only an earlier group of the rank
    /// holds on that tier names that group's engine hash as its parent (the sparse
    /// form an engine publishes), when no holder of the rank uses that hash for
    /// another block; otherwise placeholders reach it. Placeholders are removed from
    /// their own group. A group that holds nothing is dumped as an empty `Stored`
    /// (which makes it known). A block held as `n` copies is stored once more for
    /// each extra copy.
    ///
    /// Every engine block hash a rank holds reachably from the root is included, so
    /// later `Removed` events from the engine still find their blocks. O(entries).
    pub fn dump(&self) -> Vec<KvEventBatch> {
        let mut states: Vec<&RankState> = self.ranks.iter().map(|(_, s)| s).collect();
        // GPU first per rank: a lower tier's chain may hang below GPU-held parents;
        // full attention first per tier: a windowed group's sparse chains hang below
        // its blocks.
        states.sort_unstable_by_key(|s| (s.rank, s.tier, s.window.is_some(), s.group));
        let mut per_worker: BTreeMap<WorkerId, Vec<KvCacheEvent>> = BTreeMap::new();
        let mut next_id: FxHashMap<kv_events::WorkerRank, u64> = FxHashMap::default();
        let mut borrowable = Borrowable::default();
        let mut previous = None;
        for state in states {
            if previous != Some((state.rank, state.tier)) {
                borrowable.clear();
                previous = Some((state.rank, state.tier));
            }
            let first = next_id.entry(state.rank).or_insert(0);
            let events = self.dump_rank(state, *first, &mut borrowable);
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

    /// True when `name` names no block but `node` in any holder of `state`'s rank, so
    /// that a chain stored with `name` as its parent hangs below `node` on replay.
    fn names_only(&self, state: &RankState, name: ExternalBlockHash, node: BlockId) -> bool {
        self.ranks.holders_of(state.rank).iter().all(|idx| {
            let Some(other) = self.ranks.get(*idx) else {
                return true;
            };
            other
                .blocks
                .get(&name)
                .is_none_or(|held| held.id == node && super::is_live(&self.arena, other, *held))
        })
    }

    /// The events of one holder (a rank's group on one tier), numbered from
    /// `first_id`. Adds the blocks it holds to `borrowable`.
    fn dump_rank(
        &self,
        state: &RankState,
        first_id: u64,
        borrowable: &mut Borrowable,
    ) -> Vec<KvCacheEvent> {
        // The smallest engine hash of each held node names it in the dump; further
        // hashes of the same node (aliases) are replayed after the walk. Ordering by
        // engine hashes only makes the dump independent of arena slot numbers.
        let mut primary: FxHashMap<BlockId, ExternalBlockHash> = FxHashMap::default();
        let mut extra: Vec<(ExternalBlockHash, BlockId)> = Vec::new();
        let mut copies: Vec<(ExternalBlockHash, BlockId, u32)> = Vec::new();
        let live = state
            .blocks
            .iter()
            .filter(|(_, held)| super::is_live(&self.arena, state, **held))
            .map(|(hash, held)| (hash, held.id));
        for (hash, node) in live {
            if let Some(n) = state.copies.get(hash) {
                copies.push((*hash, node, *n));
            }
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
        // Ancestors the holder does not hold (it removed them, or a sparse windowed
        // group never stored them) but needs, to place the blocks it holds below
        // them: emitted, then removed again — unless an earlier group of the rank
        // holds one, whose engine hash then serves as the parent.
        let mut nodes: FxHashSet<BlockId> = primary.keys().copied().collect();
        let mut borrowed: FxHashMap<BlockId, ExternalBlockHash> = FxHashMap::default();
        for node in primary.keys() {
            let mut up = self.arena.block_parent(*node);
            while up != BlockId::ROOT && !nodes.contains(&up) && !borrowed.contains_key(&up) {
                if let Some(&name) = borrowable.get(&up)
                    && self.names_only(state, name, up)
                {
                    borrowed.insert(up, name);
                    break;
                }
                nodes.insert(up);
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
        copies.sort_unstable();

        let mut events = Vec::new();
        let group = state.group.map(|id| KvCacheGroup {
            id,
            window_blocks: state.window,
        });
        let mut emit = |data: KvCacheEventData| {
            let event_id = first_id + events.len() as u64;
            events.push(KvCacheEvent {
                event_id,
                dp_rank: state.rank.dp_rank,
                data,
            });
        };
        let stored = |parent_hash, blocks| KvCacheEventData::Stored {
            group,
            parent_hash,
            blocks,
            tier: state.tier,
        };
        let block = |node: BlockId, block_hash: ExternalBlockHash| StoredBlock {
            block_hash,
            tokens_hash: self.arena.block_hash(node),
        };
        // Engine hash of every emitted node: the holder's own, or a placeholder; and
        // of every borrowed parent.
        let mut names = borrowed.clone();
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
        // Chains from the root first, then those below borrowed parents, each by name.
        let mut roots: Vec<(Option<ExternalBlockHash>, BlockId)> = vec![(None, BlockId::ROOT)];
        let mut below: Vec<(ExternalBlockHash, BlockId)> =
            borrowed.iter().map(|(node, name)| (*name, *node)).collect();
        below.sort_unstable();
        roots.extend(below.into_iter().map(|(name, node)| (Some(name), node)));
        let mut starts: Vec<(Option<ExternalBlockHash>, ExternalBlockHash, BlockId)> = roots
            .into_iter()
            .flat_map(|(name, node)| {
                named_kids(node, name)
                    .into_iter()
                    .map(move |(kid_name, kid)| (name, kid_name, kid))
            })
            .collect();
        starts.reverse();
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
            emit(stored(parent_hash, chain));
        }
        let parent_name = |node: BlockId| {
            let parent = self.arena.block_parent(node);
            (parent != BlockId::ROOT).then(|| names[&parent])
        };
        for (hash, node) in extra {
            emit(stored(parent_name(node), vec![block(node, hash)]));
        }
        for (hash, node, n) in copies {
            for _ in 0..n {
                emit(stored(parent_name(node), vec![block(node, hash)]));
            }
        }
        if !unheld.is_empty() {
            emit(KvCacheEventData::Removed {
                group: state.group,
                block_hashes: unheld,
                tier: state.tier,
            });
        }
        if primary.is_empty() && state.group.is_some() {
            emit(stored(None, Vec::new())); // a known group holding nothing
        } else if primary.is_empty() && state.grouped {
            // The group-less holder of a grouped rank, holding nothing: it still takes
            // part in the rank's hit (a full-attention group without the prefix), but
            // an empty store without a group makes nothing known. A placeholder
            // stored and removed again does.
            let name = placeholder_hash(None, LocalBlockHash(0));
            let tokens_hash = LocalBlockHash(0);
            emit(stored(
                None,
                vec![StoredBlock {
                    block_hash: name,
                    tokens_hash,
                }],
            ));
            emit(KvCacheEventData::Removed {
                group: None,
                block_hashes: vec![name],
                tier: state.tier,
            });
        }
        for (node, name) in primary {
            borrowable.entry(node).or_insert(name);
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
