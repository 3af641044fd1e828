//! What a router that knows neither KV cache groups nor copies indexes of a hybrid
//! engine's KV events: the `group-blind` rows of `kv-mocker lab hybrid`, Dynamo's and
//! llm-d's view today (issue 28).
//!
//! Such a router keeps the full-attention group's events only (a sliding-window
//! group's are dropped, the full group's lose their group) and holds each block once
//! per rank: a store of a block it already holds (a copy the engine made when it
//! recomputed a prefix) changes nothing, and the first removal of a block drops it,
//! while the engine may still hold another copy. Emulated here, so that the row does
//! not depend on the index's own group and copy semantics. Cost: one hash-set entry
//! per block a rank is believed to hold.

use kv_events::{
    ExternalBlockHash, GroupId, KvCacheEvent, KvCacheEventData, StorageTier, WorkerId, WorkerRank,
};
use std::collections::{HashMap, HashSet};

/// The blind router's view of every rank.
#[derive(Debug, Default)]
pub(crate) struct BlindView {
    /// Groups seen storing with a window: their removals are dropped too.
    windowed: HashSet<GroupId>,
    /// The blocks each (rank, tier) is believed to hold, once each.
    held: HashMap<(WorkerRank, StorageTier), HashSet<ExternalBlockHash>>,
}

impl BlindView {
    /// The events the blind router applies for `event` of `worker_id`, in order.
    pub fn view(&mut self, worker_id: WorkerId, event: &KvCacheEvent) -> Vec<KvCacheEvent> {
        let rank = WorkerRank::new(worker_id, event.dp_rank);
        let with = |data| KvCacheEvent {
            event_id: event.event_id,
            dp_rank: event.dp_rank,
            data,
        };
        match &event.data {
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                tier,
                group,
            } => {
                if let Some(g) = group
                    && !g.is_full()
                {
                    self.windowed.insert(g.id);
                    return Vec::new();
                }
                let held = self.held.entry((rank, *tier)).or_default();
                // Runs of blocks not held yet, each below the block before it.
                let mut out = Vec::new();
                let mut parent = *parent_hash;
                let mut run = Vec::new();
                for block in blocks {
                    if held.insert(block.block_hash) {
                        run.push(*block);
                    } else if !run.is_empty() {
                        out.push(stored(std::mem::take(&mut run), parent, *tier));
                    }
                    if run.is_empty() {
                        parent = Some(block.block_hash);
                    }
                }
                if !run.is_empty() {
                    out.push(stored(run, parent, *tier));
                }
                out.into_iter().map(with).collect()
            }
            KvCacheEventData::Removed {
                block_hashes,
                tier,
                group,
            } => {
                if group.is_some_and(|id| self.windowed.contains(&id)) {
                    return Vec::new();
                }
                let held = self.held.entry((rank, *tier)).or_default();
                let gone: Vec<ExternalBlockHash> = block_hashes
                    .iter()
                    .copied()
                    .filter(|h| held.remove(h))
                    .collect();
                if gone.is_empty() {
                    return Vec::new();
                }
                vec![with(KvCacheEventData::Removed {
                    block_hashes: gone,
                    tier: *tier,
                    group: None,
                })]
            }
            KvCacheEventData::Cleared => {
                self.held.retain(|(r, _), _| *r != rank);
                vec![event.clone()]
            }
        }
    }
}

fn stored(
    blocks: Vec<kv_events::StoredBlock>,
    parent_hash: Option<ExternalBlockHash>,
    tier: StorageTier,
) -> KvCacheEventData {
    KvCacheEventData::Stored {
        parent_hash,
        blocks,
        tier,
        group: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::{DpRank, KvCacheGroup, LocalBlockHash, StoredBlock};

    fn block(h: u64) -> StoredBlock {
        StoredBlock {
            block_hash: ExternalBlockHash(h),
            tokens_hash: LocalBlockHash(h),
        }
    }

    fn event(data: KvCacheEventData) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 0,
            dp_rank: DpRank(0),
            data,
        }
    }

    fn store(parent: Option<u64>, hashes: &[u64], group: KvCacheGroup) -> KvCacheEvent {
        event(KvCacheEventData::Stored {
            parent_hash: parent.map(ExternalBlockHash),
            blocks: hashes.iter().map(|&h| block(h)).collect(),
            tier: StorageTier::Gpu,
            group: Some(group),
        })
    }

    fn remove(hashes: &[u64], group: u32) -> KvCacheEvent {
        event(KvCacheEventData::Removed {
            block_hashes: hashes.iter().map(|&h| ExternalBlockHash(h)).collect(),
            tier: StorageTier::Gpu,
            group: Some(GroupId(group)),
        })
    }

    /// `(parent, hashes)` of each stored event, `hashes` of each removal.
    fn shapes(events: &[KvCacheEvent]) -> Vec<(Option<u64>, Vec<u64>)> {
        events
            .iter()
            .map(|e| match &e.data {
                KvCacheEventData::Stored {
                    parent_hash,
                    blocks,
                    group: None,
                    ..
                } => (
                    parent_hash.map(|p| p.0),
                    blocks.iter().map(|b| b.block_hash.0).collect(),
                ),
                KvCacheEventData::Removed {
                    block_hashes,
                    group: None,
                    ..
                } => (None, block_hashes.iter().map(|h| h.0).collect()),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn windows_are_dropped_copies_ignored_and_the_first_removal_wins() {
        let mut blind = BlindView::default();
        let (w, full) = (KvCacheGroup::windowed(0, 2).unwrap(), KvCacheGroup::full(1));
        let worker = WorkerId(1);
        assert_eq!(
            shapes(&blind.view(worker, &store(None, &[1, 2, 3], full))),
            [(None, vec![1, 2, 3])]
        );
        assert!(blind.view(worker, &store(Some(1), &[2, 3], w)).is_empty());
        assert!(blind.view(worker, &remove(&[3], 0)).is_empty());
        // A recomputed prefix: the copies of 1 and 2 change nothing, 4 and 5 are new.
        let chain = store(None, &[1, 2, 4, 3, 5], full);
        assert_eq!(
            shapes(&blind.view(worker, &chain)),
            [(Some(2), vec![4]), (Some(3), vec![5])]
        );
        // The engine evicts one copy of 1: the blind router drops the block.
        assert_eq!(
            shapes(&blind.view(worker, &remove(&[1], 1))),
            [(None, vec![1])]
        );
        assert!(blind.view(worker, &remove(&[1], 1)).is_empty());
        // Another rank is another view.
        assert_eq!(blind.view(WorkerId(2), &store(None, &[1], full)).len(), 1);
    }
}
