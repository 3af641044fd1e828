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

/// `event` (a `Stored` or `Removed`) in KV cache group `id`, windowed when `window`
/// is given (it is ignored for a `Removed`, which names the group by id).
pub fn in_group(mut event: KvCacheEvent, id: u32, window: Option<u32>) -> KvCacheEvent {
    match &mut event.data {
        KvCacheEventData::Stored { group, .. } => {
            *group = Some(match window {
                Some(w) => kv_events::KvCacheGroup::windowed(id, w).expect("window ≥ 1"),
                None => kv_events::KvCacheGroup::full(id),
            });
        }
        KvCacheEventData::Removed { group, .. } => *group = Some(kv_events::GroupId(id)),
        KvCacheEventData::Cleared => {}
    }
    event
}

/// The windowed groups of the capture's model (vLLM, tiny Gemma-3: three
/// sliding-window groups of 128 tokens, block size 32, so 4 blocks) and its
/// full-attention group.
pub const WINDOWED: [u32; 3] = [0, 1, 2];
pub const FULL: u32 = 3;
pub const WINDOW: u32 = 4;

/// Prompt A's 11 blocks: local hashes 0..11, engine hashes 1000..1011.
pub fn a(k: u64) -> u64 {
    1000 + k
}

/// Worker 1 as vLLM publishes prompt A: the full group stores all 11 blocks, each
/// sliding-window group only the window before the hit point (positions 7..=10),
/// below the full group's block 6.
pub fn prompt_a() -> Vec<KvCacheEvent> {
    let mut events = vec![in_group(stored(0, None, &chain(1000, 11)), FULL, None)];
    let window: Vec<(u64, u64)> = (7..11).map(|k| (a(k), k)).collect();
    for g in WINDOWED {
        events.push(in_group(stored(0, Some(a(6)), &window), g, Some(WINDOW)));
    }
    events
}

/// A query of `len` blocks whose first `shared` are prompt A's.
pub fn query(shared: u64, len: u64) -> Vec<u64> {
    (0..len)
        .map(|k| if k < shared { k } else { 100 + k })
        .collect()
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
