//! Test helpers shared by the engine's unit tests: a reference model that replays KV
//! events into plain sets, one per tier, the way a router's indexer would.

use kv_events::{ExternalBlockHash, KvCacheEventData, StorageTier};
use std::collections::HashSet;

/// The blocks a consumer of the event stream believes are cached, per tier.
#[derive(Debug, Default)]
pub struct EventReplica {
    /// Blocks on the GPU.
    pub blocks: HashSet<ExternalBlockHash>,
    /// Blocks on the CPU tier.
    pub cpu: HashSet<ExternalBlockHash>,
}

impl EventReplica {
    /// Applies events in order, asserting the stream is self-consistent: a `Stored`
    /// chain's parent is held on some tier, stored blocks are new on their tier,
    /// removed blocks are known on theirs.
    pub fn apply(&mut self, events: &[KvCacheEventData]) {
        for event in events {
            match event {
                KvCacheEventData::Stored {
                    group: _,
                    parent_hash,
                    blocks,
                    tier,
                } => {
                    if let Some(parent) = parent_hash {
                        assert!(
                            self.blocks.contains(parent) || self.cpu.contains(parent),
                            "unknown parent {parent}"
                        );
                    }
                    let set = self.tier(*tier);
                    for b in blocks {
                        assert!(set.insert(b.block_hash), "stored twice on {tier}: {b:?}");
                    }
                }
                KvCacheEventData::Removed {
                    group: _,
                    block_hashes,
                    tier,
                } => {
                    let set = self.tier(*tier);
                    for h in block_hashes {
                        assert!(set.remove(h), "removed unknown block {h} from {tier}");
                    }
                }
                KvCacheEventData::Cleared => {
                    self.blocks.clear();
                    self.cpu.clear();
                }
            }
        }
    }

    /// The replica's GPU blocks as a sorted list, for equality checks.
    pub fn sorted(&self) -> Vec<ExternalBlockHash> {
        sorted(self.blocks.iter().copied())
    }

    /// The replica's CPU-tier blocks as a sorted list.
    pub fn sorted_cpu(&self) -> Vec<ExternalBlockHash> {
        sorted(self.cpu.iter().copied())
    }

    fn tier(&mut self, tier: StorageTier) -> &mut HashSet<ExternalBlockHash> {
        match tier {
            StorageTier::Gpu => &mut self.blocks,
            StorageTier::Cpu => &mut self.cpu,
            StorageTier::Disk => panic!("the mock engine has no disk tier"),
        }
    }
}

/// Sorts any iterator of hashes, to compare against [`EventReplica::sorted`].
pub fn sorted(hashes: impl Iterator<Item = ExternalBlockHash>) -> Vec<ExternalBlockHash> {
    let mut v: Vec<_> = hashes.collect();
    v.sort();
    v
}
