//! The hybrid cache's router-protocol events: a windowed group's sparse store as one
//! `Stored` per run of consecutive blocks (an empty one when it keeps nothing), and
//! evictions as `Removed` in their own group.

use super::cache::HybridCache;
use kv_events::{ExternalBlockHash, KvCacheEventData, StorageTier, StoredBlock};

impl HybridCache {
    /// Emits group `g`'s stores of `stored` (positions ascending): one `Stored` per
    /// run of consecutive positions, parent the block before it; one empty `Stored`
    /// when nothing was stored.
    pub(super) fn push_runs(
        &mut self,
        g: usize,
        prompt: &[StoredBlock],
        stored: &[(usize, StoredBlock)],
    ) {
        let group = Some(self.layout.group(g));
        if stored.is_empty() {
            self.events.push(KvCacheEventData::Stored {
                parent_hash: None,
                blocks: Vec::new(),
                tier: StorageTier::Gpu,
                group,
            });
            return;
        }
        let mut i = 0;
        while i < stored.len() {
            let first = stored[i].0;
            let mut j = i + 1;
            while j < stored.len() && stored[j].0 == stored[j - 1].0 + 1 {
                j += 1;
            }
            self.events.push(KvCacheEventData::Stored {
                parent_hash: first.checked_sub(1).map(|p| prompt[p].block_hash),
                blocks: stored[i..j].iter().map(|(_, b)| *b).collect(),
                tier: StorageTier::Gpu,
                group,
            });
            i = j;
        }
    }

    pub(super) fn push_removed(&mut self, g: usize, hash: ExternalBlockHash) {
        let group = Some(self.layout.group(g).id);
        if let Some(KvCacheEventData::Removed {
            block_hashes,
            group: last,
            ..
        }) = self.events.last_mut()
            && *last == group
        {
            block_hashes.push(hash);
            return;
        }
        self.events.push(KvCacheEventData::Removed {
            block_hashes: vec![hash],
            tier: StorageTier::Gpu,
            group,
        });
    }
}
