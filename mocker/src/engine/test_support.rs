//! Test helpers shared by the engine's unit tests: a reference model that replays KV
//! events into a plain set, the way a router's indexer would.

use kv_events::{ExternalBlockHash, KvCacheEventData};
use std::collections::HashSet;

/// The set of blocks a consumer of the event stream believes are cached.
#[derive(Debug, Default)]
pub struct EventReplica {
    pub blocks: HashSet<ExternalBlockHash>,
}

impl EventReplica {
    /// Applies events in order, asserting the stream is self-consistent: a `Stored`
    /// chain's parent is known, stored blocks are new, removed blocks are known.
    pub fn apply(&mut self, events: &[KvCacheEventData]) {
        for event in events {
            match event {
                KvCacheEventData::Stored {
                    parent_hash,
                    blocks,
                    ..
                } => {
                    if let Some(parent) = parent_hash {
                        assert!(self.blocks.contains(parent), "unknown parent {parent}");
                    }
                    for b in blocks {
                        assert!(self.blocks.insert(b.block_hash), "stored twice {b:?}");
                    }
                }
                KvCacheEventData::Removed { block_hashes, .. } => {
                    for h in block_hashes {
                        assert!(self.blocks.remove(h), "removed unknown block {h}");
                    }
                }
                KvCacheEventData::Cleared => self.blocks.clear(),
            }
        }
    }

    /// The replica's blocks as a sorted list, for equality checks.
    pub fn sorted(&self) -> Vec<ExternalBlockHash> {
        let mut v: Vec<_> = self.blocks.iter().copied().collect();
        v.sort();
        v
    }
}

/// Sorts any iterator of hashes, to compare against [`EventReplica::sorted`].
pub fn sorted(hashes: impl Iterator<Item = ExternalBlockHash>) -> Vec<ExternalBlockHash> {
    let mut v: Vec<_> = hashes.collect();
    v.sort();
    v
}
