//! In-flight prefixes: the prompt blocks of requests the router has sent to a rank but
//! that the index cannot know yet.
//!
//! A rank announces a block only after prefilling it, and the announcement reaches the
//! index a lag later. Under load a request waits in the rank's queue for seconds, so
//! the next turn of the same conversation often arrives before the first turn's blocks
//! are indexed; a router that only reads the index then sees no overlap anywhere and
//! scatters the conversation. This tracker remembers, per rank, the full prompt blocks
//! of every booked request until it is freed (by then the rank has announced them),
//! in a second `RadixTree` fed with synthetic `Stored` / `Removed` events, reference
//! counted so shared prefixes of concurrent requests stay until the last one ends.
//!
//! Cost per request: one chained hash per full block, one hash-map update per block on
//! booking and on release, and the tree operations of one `Stored` and one `Removed`.

use crate::engine::chain_block_hashes;
use indexer::{OverlapScores, RadixTree};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, LocalBlockHash, RequestId,
    WorkerRank,
};
use std::collections::HashMap;

/// Booked prompt blocks per rank, reference counted.
#[derive(Debug, Default)]
pub struct InFlight {
    tree: RadixTree,
    refs: HashMap<(WorkerRank, ExternalBlockHash), u32>,
    requests: HashMap<RequestId, (WorkerRank, Vec<ExternalBlockHash>)>,
}

impl InFlight {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leading blocks of `full_blocks` (the prompt's full blocks, in prefix order) that
    /// requests in flight on each rank will have computed.
    pub fn overlaps(&self, full_blocks: &[LocalBlockHash]) -> OverlapScores {
        self.tree.find_matches(full_blocks)
    }

    /// Records that `id`, whose full prompt blocks are `full_blocks`, was booked on
    /// `rank`. A second booking of the same id is ignored.
    pub fn book(&mut self, id: &RequestId, rank: WorkerRank, full_blocks: &[LocalBlockHash]) {
        if self.requests.contains_key(id) {
            return;
        }
        let chain = chain_block_hashes(full_blocks);
        // Blocks already referenced on this rank form a leading run (every booking
        // holds a whole prefix); the rest are new.
        let known = chain
            .iter()
            .take_while(|b| self.refs.contains_key(&(rank, b.block_hash)))
            .count();
        for b in &chain {
            *self.refs.entry((rank, b.block_hash)).or_insert(0) += 1;
        }
        if known < chain.len() {
            let parent = known.checked_sub(1).map(|i| chain[i].block_hash);
            self.apply(
                rank,
                KvCacheEventData::Stored {
                    parent_hash: parent,
                    blocks: chain[known..].to_vec(),
                    tier: kv_events::StorageTier::Gpu,
                },
            );
        }
        let hashes = chain.iter().map(|b| b.block_hash).collect();
        self.requests.insert(id.clone(), (rank, hashes));
    }

    /// Forgets `id`'s booking; blocks no other in-flight request on its rank holds
    /// leave the tracker. Unknown ids are ignored.
    pub fn release(&mut self, id: &RequestId) {
        let Some((rank, hashes)) = self.requests.remove(id) else {
            return;
        };
        let mut gone = Vec::new();
        for hash in hashes.iter().rev() {
            if let Some(count) = self.refs.get_mut(&(rank, *hash)) {
                *count -= 1;
                if *count == 0 {
                    self.refs.remove(&(rank, *hash));
                    gone.push(*hash);
                }
            }
        }
        if !gone.is_empty() {
            self.apply(
                rank,
                KvCacheEventData::Removed {
                    block_hashes: gone,
                    tier: kv_events::StorageTier::Gpu,
                },
            );
        }
    }

    fn apply(&mut self, rank: WorkerRank, data: KvCacheEventData) {
        let event = KvCacheEvent {
            event_id: 0,
            dp_rank: rank.dp_rank,
            data,
        };
        // Parents are always present (leading runs are reference counted), so the tree
        // accepts every event; a refusal would only lose a routing hint.
        let _ = self.tree.apply_event(rank.worker_id, &event);
    }
}

/// The rank id the lab uses for worker `w` (one dp rank per worker).
pub fn lab_rank(worker: u64) -> WorkerRank {
    WorkerRank::new(kv_events::WorkerId(worker), DpRank(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(ids: &[u64]) -> Vec<LocalBlockHash> {
        ids.iter().copied().map(LocalBlockHash).collect()
    }

    #[test]
    fn shared_prefixes_stay_until_the_last_request_leaves() {
        let mut f = InFlight::new();
        let (r1, r2) = (lab_rank(1), lab_rank(2));
        let (a, b, c) = (
            RequestId::from("a"),
            RequestId::from("b"),
            RequestId::from("c"),
        );
        f.book(&a, r1, &blocks(&[1, 2, 3]));
        f.book(&b, r1, &blocks(&[1, 2, 4, 5]));
        f.book(&c, r2, &blocks(&[1]));
        let q = blocks(&[1, 2, 4, 5, 6]);
        assert_eq!(f.overlaps(&q).get(r1), 4);
        assert_eq!(f.overlaps(&q).get(r2), 1);
        f.release(&b);
        assert_eq!(f.overlaps(&q).get(r1), 2, "a still holds 1, 2");
        assert_eq!(f.overlaps(&blocks(&[1, 2, 3])).get(r1), 3);
        f.release(&a);
        f.release(&a);
        assert_eq!(f.overlaps(&q).get(r1), 0);
        assert_eq!(f.overlaps(&q).get(r2), 1);
        f.release(&c);
        assert!(f.overlaps(&q).is_empty() || f.overlaps(&q).max() == 0);
    }
}
