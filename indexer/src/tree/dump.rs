//! [`RadixTree::dump`]: the tree's state as KV events that rebuild it.
//!
//! A dump lets a fresh router (or a test) rebuild an index by replaying ordinary
//! `Stored` events, so no second serialization format exists. Per rank, the held
//! nodes are walked depth-first from the root and emitted as chains: one `Stored`
//! event per maximal run of single-child descent, whose `parent_hash` is an engine
//! hash the rank holds for the parent node. Cost: O(entries) time and memory, and
//! the result is about as large as the stream of stores that built the tree.
//!
//! What is not reproduced: blocks a rank still holds below a block it removed are
//! unreachable for that rank's prefix matches, and a `Stored` event cannot name a
//! parent the rank does not hold, so they are left out. Applying the dump therefore
//! gives the same [`RadixTree::find_matches`] answers for every query, and a later
//! engine `Removed` of such a block becomes an unknown-block no-op.

use super::RadixTree;
use super::arena::NodeIdx;
use super::ranks::RankState;
use kv_events::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, StoredBlock, WorkerId,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::collections::hash_map::Entry;

impl RadixTree {
    /// Events that rebuild this tree's prefix-match state when applied, in order, to
    /// an empty tree: one batch per worker (sorted by worker id) holding `Stored`
    /// events for each of its ranks, with `event_id`s counted from 0 per rank.
    ///
    /// Every engine block hash a rank holds reachably from the root is included, so
    /// later `Removed` events from the engine still find their blocks. O(entries).
    pub fn dump(&self) -> Vec<KvEventBatch> {
        let mut states: Vec<&RankState> = self.ranks.iter().map(|(_, s)| s).collect();
        states.sort_unstable_by_key(|s| s.rank);
        let mut per_worker: BTreeMap<WorkerId, Vec<KvCacheEvent>> = BTreeMap::new();
        for state in states {
            let events = self.dump_rank(state);
            if !events.is_empty() {
                per_worker
                    .entry(state.rank.worker_id)
                    .or_default()
                    .extend(events);
            }
        }
        per_worker
            .into_iter()
            .map(|(worker_id, events)| KvEventBatch { worker_id, events })
            .collect()
    }

    fn dump_rank(&self, state: &RankState) -> Vec<KvCacheEvent> {
        // The smallest engine hash of each held node names it in the dump; further
        // hashes of the same node (aliases) are replayed after the walk. Ordering by
        // engine hashes only makes the dump independent of arena slot numbers.
        let mut primary: FxHashMap<NodeIdx, ExternalBlockHash> = FxHashMap::default();
        let mut extra: Vec<(ExternalBlockHash, NodeIdx)> = Vec::new();
        for (hash, node) in &state.blocks {
            match primary.entry(*node) {
                Entry::Vacant(slot) => {
                    slot.insert(*hash);
                }
                Entry::Occupied(mut slot) => {
                    let larger = (*slot.get()).max(*hash);
                    slot.insert((*slot.get()).min(*hash));
                    extra.push((larger, *node));
                }
            }
        }
        // Held children of each held node (or of the root).
        let mut kids: FxHashMap<NodeIdx, Vec<NodeIdx>> = FxHashMap::default();
        for node in primary.keys() {
            kids.entry(self.arena.node(*node).parent)
                .or_default()
                .push(*node);
        }
        for list in kids.values_mut() {
            list.sort_unstable_by_key(|node| primary[node]);
        }
        extra.sort_unstable();

        let mut events = Vec::new();
        let mut emit = |data: KvCacheEventData| {
            let event_id = events.len() as u64;
            events.push(KvCacheEvent {
                event_id,
                dp_rank: state.rank.dp_rank,
                data,
            });
        };
        let parent_hash = |node: NodeIdx| {
            let parent = self.arena.node(node).parent;
            if parent == NodeIdx::ROOT {
                None
            } else {
                primary.get(&parent).copied()
            }
        };
        let block = |node: NodeIdx, block_hash: ExternalBlockHash| StoredBlock {
            block_hash,
            tokens_hash: self.arena.node(node).hash,
        };

        let mut emitted: FxHashSet<NodeIdx> = FxHashSet::default();
        let mut starts: Vec<NodeIdx> = kids.get(&NodeIdx::ROOT).cloned().unwrap_or_default();
        while let Some(start) = starts.pop() {
            let mut chain = Vec::new();
            let mut node = start;
            loop {
                chain.push(block(node, primary[&node]));
                emitted.insert(node);
                match kids.get(&node).map(Vec::as_slice) {
                    Some([first, rest @ ..]) => {
                        starts.extend_from_slice(rest);
                        node = *first;
                    }
                    _ => break,
                }
            }
            emit(KvCacheEventData::Stored {
                parent_hash: parent_hash(start),
                blocks: chain,
            });
        }
        for (hash, node) in extra {
            if emitted.contains(&node) {
                let blocks = vec![block(node, hash)];
                emit(KvCacheEventData::Stored {
                    parent_hash: parent_hash(node),
                    blocks,
                });
            }
        }
        events
    }
}
