//! Event builders shared by the indexer's integration tests.

#![allow(dead_code)] // each test binary uses a different subset

use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    StoredBlock, WorkerId, WorkerRank,
};

pub fn wr(worker: u64, dp: u32) -> WorkerRank {
    WorkerRank::new(WorkerId(worker), DpRank(dp))
}

pub fn q(hashes: &[u64]) -> Vec<LocalBlockHash> {
    hashes.iter().map(|h| LocalBlockHash(*h)).collect()
}

/// A `Stored` event of rank `dp`; `blocks` are (engine hash, local hash) pairs.
pub fn stored(dp: u32, parent: Option<u64>, blocks: &[(u64, u64)]) -> KvCacheEvent {
    KvCacheEvent {
        event_id: 0,
        dp_rank: DpRank(dp),
        data: KvCacheEventData::Stored {
            group: None,
            parent_hash: parent.map(ExternalBlockHash),
            blocks: blocks
                .iter()
                .map(|(e, l)| StoredBlock {
                    block_hash: ExternalBlockHash(*e),
                    tokens_hash: LocalBlockHash(*l),
                })
                .collect(),
            tier: kv_events::StorageTier::Gpu,
        },
    }
}

pub fn removed(dp: u32, hashes: &[u64]) -> KvCacheEvent {
    KvCacheEvent {
        event_id: 0,
        dp_rank: DpRank(dp),
        data: KvCacheEventData::Removed {
            group: None,
            block_hashes: hashes.iter().map(|h| ExternalBlockHash(*h)).collect(),
            tier: kv_events::StorageTier::Gpu,
        },
    }
}

/// `event` (a `Stored` or `Removed`) on storage tier `tier` instead of the GPU.
pub fn on_tier(mut event: KvCacheEvent, on: kv_events::StorageTier) -> KvCacheEvent {
    if let KvCacheEventData::Stored { tier, .. } | KvCacheEventData::Removed { tier, .. } =
        &mut event.data
    {
        *tier = on;
    }
    event
}

pub fn cleared(dp: u32) -> KvCacheEvent {
    KvCacheEvent {
        event_id: 0,
        dp_rank: DpRank(dp),
        data: KvCacheEventData::Cleared,
    }
}

pub fn batch(worker: u64, events: Vec<KvCacheEvent>) -> KvEventBatch {
    KvEventBatch::new(WorkerId(worker), events)
}

/// A chain of `len` blocks starting at the root whose local hashes are `0..len` and
/// engine hashes `base..base + len`.
pub fn chain(base: u64, len: u64) -> Vec<(u64, u64)> {
    (0..len).map(|i| (base + i, i)).collect()
}

/// Numbers events per (worker, dp_rank) from 0, as a publisher does, so that test
/// batches pass the indexer's ordering rules.
#[derive(Debug, Default)]
pub struct Numbering(std::collections::HashMap<(WorkerId, DpRank), u64>);

impl Numbering {
    /// Rewrites the `event_id`s of `batch` to each rank's next ids.
    pub fn number(&mut self, mut batch: KvEventBatch) -> KvEventBatch {
        for event in &mut batch.events {
            let next = self.0.entry((batch.worker_id, event.dp_rank)).or_insert(0);
            event.event_id = *next;
            *next += 1;
        }
        batch
    }
}

/// Engine hash of a block for the differential tests: chained over the parent like
/// real engines, plus a salt so that the same content can occasionally get a second
/// engine hash (an alias).
pub fn engine_hash(parent: Option<u64>, local: u64, salt: u8) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (parent, local, salt).hash(&mut h);
    h.finish()
}

/// A block's path: the local hashes from the root to it, inclusive.
pub type Path = Vec<u64>;

/// The reference model of the differential tests: per rank, engine hash → the path of
/// the block it names (held blocks only). Each test adds the operations it models.
#[derive(Debug, Default)]
pub struct Model {
    /// Held blocks per rank on the GPU.
    pub ranks: std::collections::BTreeMap<WorkerRank, std::collections::BTreeMap<u64, Path>>,
    /// Held blocks per rank on a lower storage tier (CPU, disk); empty in the tests
    /// that store on the GPU only.
    pub lower: std::collections::BTreeMap<
        (WorkerRank, kv_events::StorageTier),
        std::collections::BTreeMap<u64, Path>,
    >,
}

impl Model {
    /// Engine hashes `rank` holds, in order.
    pub fn held(&self, rank: WorkerRank) -> Vec<u64> {
        self.ranks
            .get(&rank)
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }
}
