//! [`Reference`]: the simplest model of a KV block index the benches trust.
//!
//! Every stored block is keyed by its whole prefix: the key of block `i` is a hash of
//! the key of its parent and its own local hash, so two blocks have the same key
//! exactly when they end the same prefix (up to 64-bit hash collisions). One map takes
//! a worker's engine hash to that key (engine hashes are resolved per worker, so any
//! engine hashing works, salted or not), another takes a key to the workers holding it.
//! A query walks its prefix keys and counts, per worker, the leading blocks it holds.
//!
//! It is slow and large on purpose (two hash maps, one allocation per shared key) and
//! has no ordering rules: events are applied as given, a `Stored` event whose parent
//! the worker does not hold is skipped and counted.
//! Cost: about 100 bytes per (worker, block) entry.

use kv_events::{ExternalBlockHash, KvCacheEvent, KvCacheEventData, LocalBlockHash, WorkerId};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// Key of the empty prefix.
const ROOT: u64 = 0x243F_6A88_85A3_08D3;

/// Prefix key of a block with `local` content ending the prefix `parent`.
fn child(parent: u64, local: LocalBlockHash) -> u64 {
    let mut z = parent.rotate_left(29) ^ local.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Workers holding one prefix; most prefixes have one holder.
#[derive(Debug)]
enum Holders {
    One(WorkerId),
    Many(Vec<WorkerId>),
}

impl Holders {
    fn contains(&self, w: WorkerId) -> bool {
        match self {
            Holders::One(h) => *h == w,
            Holders::Many(v) => v.contains(&w),
        }
    }

    fn iter(&self) -> impl Iterator<Item = WorkerId> + '_ {
        let (one, many) = match self {
            Holders::One(h) => (Some(*h), &[][..]),
            Holders::Many(v) => (None, v.as_slice()),
        };
        one.into_iter().chain(many.iter().copied())
    }
}

/// Which worker holds which prefix, keyed by whole prefixes. See the module docs.
#[derive(Debug, Default)]
pub struct Reference {
    /// (worker, engine hash) → prefix key.
    blocks: FxHashMap<(WorkerId, ExternalBlockHash), u64>,
    /// Prefix key → its holders.
    holders: FxHashMap<u64, Holders>,
    skipped: u64,
}

impl Reference {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// `Stored` events skipped because their parent was not held by the worker.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// (worker, block) entries held.
    pub fn entries(&self) -> usize {
        self.blocks.len()
    }

    /// Applies one event of `worker` (dp ranks are not told apart).
    pub fn apply(&mut self, worker: WorkerId, event: &KvCacheEvent) {
        match &event.data {
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                ..
            } => {
                let mut key = match parent_hash {
                    None => ROOT,
                    Some(p) => match self.blocks.get(&(worker, *p)) {
                        Some(k) => *k,
                        None => {
                            self.skipped += 1;
                            return;
                        }
                    },
                };
                for b in blocks {
                    key = child(key, b.tokens_hash);
                    self.blocks.insert((worker, b.block_hash), key);
                    self.hold(worker, key);
                }
            }
            KvCacheEventData::Removed { block_hashes, .. } => {
                for h in block_hashes {
                    if let Some(key) = self.blocks.remove(&(worker, *h)) {
                        self.release(worker, key);
                    }
                }
            }
            KvCacheEventData::Cleared => {
                let mine: Vec<_> = self
                    .blocks
                    .keys()
                    .filter(|(w, _)| *w == worker)
                    .copied()
                    .collect();
                for k in mine {
                    if let Some(key) = self.blocks.remove(&k) {
                        self.release(worker, key);
                    }
                }
            }
        }
    }

    fn hold(&mut self, worker: WorkerId, key: u64) {
        match self.holders.get_mut(&key) {
            None => {
                self.holders.insert(key, Holders::One(worker));
            }
            Some(h) if h.contains(worker) => {}
            Some(Holders::One(other)) => {
                let other = *other;
                self.holders.insert(key, Holders::Many(vec![other, worker]));
            }
            Some(Holders::Many(v)) => v.push(worker),
        }
    }

    fn release(&mut self, worker: WorkerId, key: u64) {
        let empty = match self.holders.get_mut(&key) {
            Some(Holders::One(h)) => *h == worker,
            Some(Holders::Many(v)) => {
                v.retain(|w| *w != worker);
                v.is_empty()
            }
            None => false,
        };
        if empty {
            self.holders.remove(&key);
        }
    }

    /// For every worker holding at least the first block of `query`, the number of
    /// leading blocks of `query` it holds; workers holding none are absent.
    pub fn scores(&self, query: &[LocalBlockHash]) -> BTreeMap<WorkerId, u32> {
        let mut scores = BTreeMap::new();
        let mut key = ROOT;
        for (i, local) in query.iter().enumerate() {
            key = child(key, *local);
            let Some(holders) = self.holders.get(&key) else {
                break;
            };
            let mut any = false;
            for w in holders.iter() {
                let depth = scores.entry(w).or_insert(0);
                if *depth == i as u32 {
                    *depth += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        scores.retain(|_, d| *d > 0);
        scores
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::{DpRank, StoredBlock};

    fn stored(parent: Option<u64>, blocks: &[(u64, u64)]) -> KvCacheEvent {
        KvCacheEvent {
            event_id: 0,
            dp_rank: DpRank(0),
            data: KvCacheEventData::Stored {
                group: None,
                parent_hash: parent.map(ExternalBlockHash),
                blocks: blocks
                    .iter()
                    .map(|&(e, l)| StoredBlock {
                        block_hash: ExternalBlockHash(e),
                        tokens_hash: LocalBlockHash(l),
                    })
                    .collect(),
                tier: kv_events::StorageTier::Gpu,
            },
        }
    }

    fn q(locals: &[u64]) -> Vec<LocalBlockHash> {
        locals.iter().copied().map(LocalBlockHash).collect()
    }

    #[test]
    fn salted_engine_hashes_still_share_a_prefix() {
        let mut r = Reference::new();
        // Same content (locals 1, 2) under different engine hashes per worker.
        r.apply(WorkerId(1), &stored(None, &[(10, 1), (11, 2)]));
        r.apply(WorkerId(2), &stored(None, &[(20, 1)]));
        r.apply(WorkerId(2), &stored(Some(20), &[(21, 2), (22, 3)]));
        let s = r.scores(&q(&[1, 2, 3, 4]));
        assert_eq!(s.get(&WorkerId(1)), Some(&2));
        assert_eq!(s.get(&WorkerId(2)), Some(&3));
    }

    #[test]
    fn same_local_hash_under_another_prefix_does_not_match() {
        let mut r = Reference::new();
        r.apply(WorkerId(1), &stored(None, &[(10, 1), (11, 2)]));
        // Worker 2 holds local 2, but after local 9: not the prefix [1, 2].
        r.apply(WorkerId(2), &stored(None, &[(20, 9), (21, 2)]));
        let s = r.scores(&q(&[1, 2]));
        assert_eq!(s.len(), 1);
        assert_eq!(s.get(&WorkerId(1)), Some(&2));
    }

    #[test]
    fn removal_cuts_the_count_and_unknown_parents_are_skipped() {
        let mut r = Reference::new();
        r.apply(WorkerId(1), &stored(None, &[(10, 1), (11, 2), (12, 3)]));
        let removed = KvCacheEvent {
            event_id: 1,
            dp_rank: DpRank(0),
            data: KvCacheEventData::Removed {
                group: None,
                block_hashes: vec![ExternalBlockHash(11)],
                tier: kv_events::StorageTier::Gpu,
            },
        };
        r.apply(WorkerId(1), &removed);
        assert_eq!(r.scores(&q(&[1, 2, 3])).get(&WorkerId(1)), Some(&1));
        r.apply(WorkerId(1), &stored(Some(99), &[(13, 4)]));
        assert_eq!(r.skipped(), 1);
        assert_eq!(r.entries(), 2);
        let cleared = KvCacheEvent {
            event_id: 2,
            dp_rank: DpRank(0),
            data: KvCacheEventData::Cleared,
        };
        r.apply(WorkerId(1), &cleared);
        assert!(r.scores(&q(&[1])).is_empty());
    }
}
