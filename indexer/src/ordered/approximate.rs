//! Approximate mode on an [`OrderedIndex`]: routing decisions indexed as if the rank
//! had cached the prompt, until a TTL ends. No publisher numbers these entries, so
//! they bypass the cursors and go straight to the tree, marked in the expiry queue.

use super::OrderedIndex;
use crate::approx::approximate_block_hash;
use crate::counters::Counter;
use crate::tree::ApplyOutcome;
use kv_events::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, LocalBlockHash, StorageTier, StoredBlock,
    WorkerRank,
};
use std::collections::BTreeMap;
use std::time::Instant;

impl OrderedIndex {
    /// Indexes a routing decision (approximate mode): `rank` is assumed to cache the
    /// prompt `hashes` until `expires_at`. Re-inserting a prefix refreshes it.
    pub fn insert_routed(
        &mut self,
        rank: WorkerRank,
        hashes: &[LocalBlockHash],
        expires_at: Instant,
    ) -> ApplyOutcome {
        let mut parent = None;
        let blocks: Vec<StoredBlock> = hashes
            .iter()
            .map(|&tokens_hash| {
                let block_hash = approximate_block_hash(parent, tokens_hash);
                parent = Some(block_hash);
                StoredBlock {
                    block_hash,
                    tokens_hash,
                }
            })
            .collect();
        for block in &blocks {
            self.expiry.insert(rank, block.block_hash, expires_at);
        }
        // Refreshing a prefix stores it again: no copies, so that its expiry's one
        // `Removed` per block drops it.
        let outcome = self.tree.store_refreshing(rank, &blocks);
        self.counters.record_outcome(&outcome);
        self.counters
            .add(Counter::ApproximateBlocks, outcome.stored);
        outcome
    }

    /// Drops the approximate blocks whose TTL ended at or before `now`; returns how
    /// many were dropped.
    pub fn expire(&mut self, now: Instant) -> u64 {
        let mut by_rank: BTreeMap<WorkerRank, Vec<ExternalBlockHash>> = BTreeMap::new();
        for (rank, block) in self.expiry.pop_expired(now) {
            by_rank.entry(rank).or_default().push(block);
        }
        let mut dropped = 0;
        for (rank, block_hashes) in by_rank {
            let event = KvCacheEvent {
                event_id: 0,
                dp_rank: rank.dp_rank,
                data: KvCacheEventData::Removed {
                    group: None,
                    block_hashes,
                    tier: StorageTier::Gpu,
                },
            };
            if let Ok(outcome) = self.tree.apply_event(rank.worker_id, &event) {
                self.counters.record_outcome(&outcome);
                dropped += outcome.removed;
            }
        }
        self.counters.add(Counter::ExpiredBlocks, dropped);
        dropped
    }

    /// When the next approximate block expires, if any is tracked.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.expiry.next_deadline()
    }
}
