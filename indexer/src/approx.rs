//! Approximate mode: the router indexes its own routing decisions, with a TTL.
//!
//! Engines that publish no KV events still cache the prompts they serve. In
//! approximate mode the daemon, after booking a request on a rank, inserts the
//! prompt's blocks for that rank as if the engine had stored them, and they expire
//! after a TTL (a guess of how long the engine keeps them). Engine hashes are
//! synthesised by chaining the local hashes ([`approximate_block_hash`]), so routing
//! the same prefix again refreshes the same entries instead of adding new ones.
//!
//! `ExpiryQueue` keeps one deadline per (rank, block) in a map plus a min-heap of
//! (deadline, rank, block). Refreshing pushes a new heap entry and leaves the old one
//! to be skipped when it surfaces; the heap is rebuilt when it grows past twice the
//! map. Cost: O(log n) per inserted block, about 70 bytes per tracked block.

use kv_events::{ExternalBlockHash, LocalBlockHash, WorkerId, WorkerRank, hash_block};
use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// Marks synthesised hashes so they cannot equal an engine's chained hash of the
/// same blocks (different input length and a leading tag word).
const APPROXIMATE_TAG: u32 = 0x0A99_80C5;

/// The engine hash the router gives block `local` below `parent` (`None` at the root)
/// in approximate mode: xxh3-64 (seed 1337) over a tag word, the parent's hash and the
/// local hash as little-endian `u32` words.
pub fn approximate_block_hash(
    parent: Option<ExternalBlockHash>,
    local: LocalBlockHash,
) -> ExternalBlockHash {
    let p = parent.map_or(0, |p| p.0);
    // Truncation is the point: each u64 becomes its low and high 32-bit words.
    let words = [
        APPROXIMATE_TAG,
        p as u32,
        (p >> 32) as u32,
        u32::from(parent.is_some()),
        local.0 as u32,
        (local.0 >> 32) as u32,
    ];
    ExternalBlockHash(hash_block(&words).0)
}

type Key = (WorkerRank, ExternalBlockHash);

/// Deadlines of approximate blocks. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct ExpiryQueue {
    deadlines: FxHashMap<Key, Instant>,
    heap: BinaryHeap<Reverse<(Instant, WorkerRank, ExternalBlockHash)>>,
}

impl ExpiryQueue {
    /// Sets the deadline of `(rank, block)` to `deadline`, or keeps a later one.
    pub(crate) fn insert(&mut self, rank: WorkerRank, block: ExternalBlockHash, deadline: Instant) {
        let slot = self.deadlines.entry((rank, block)).or_insert(deadline);
        if *slot < deadline {
            *slot = deadline;
        } else if *slot > deadline {
            return;
        }
        self.heap.push(Reverse((*slot, rank, block)));
        if self.heap.len() > 2 * self.deadlines.len() + 1024 {
            self.heap = self
                .deadlines
                .iter()
                .map(|((r, b), d)| Reverse((*d, *r, *b)))
                .collect();
        }
    }

    /// Removes and returns every block whose deadline is at or before `now`.
    pub(crate) fn pop_expired(&mut self, now: Instant) -> Vec<Key> {
        let mut out = Vec::new();
        while let Some(Reverse((deadline, rank, block))) = self.heap.peek().copied() {
            if deadline > now {
                break;
            }
            self.heap.pop();
            if self.deadlines.get(&(rank, block)) == Some(&deadline) {
                self.deadlines.remove(&(rank, block));
                out.push((rank, block));
            }
        }
        out
    }

    /// The earliest deadline in the queue (possibly of a refreshed entry, which only
    /// causes an early wake-up that expires nothing).
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((d, _, _))| *d)
    }

    /// Forgets every block of `worker`. O(tracked blocks).
    pub(crate) fn remove_worker(&mut self, worker: WorkerId) {
        self.deadlines
            .retain(|(rank, _), _| rank.worker_id != worker);
    }

    /// Blocks tracked.
    pub(crate) fn len(&self) -> usize {
        self.deadlines.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::DpRank;
    use std::time::Duration;

    #[test]
    fn refreshed_blocks_expire_at_their_latest_deadline() {
        let t0 = Instant::now();
        let rank = WorkerRank::new(WorkerId(1), DpRank(0));
        let (a, b) = (ExternalBlockHash(1), ExternalBlockHash(2));
        let mut q = ExpiryQueue::default();
        q.insert(rank, a, t0 + Duration::from_secs(10));
        q.insert(rank, b, t0 + Duration::from_secs(10));
        q.insert(rank, a, t0 + Duration::from_secs(30));
        q.insert(rank, b, t0 + Duration::from_secs(5)); // earlier: ignored
        assert_eq!(q.next_deadline(), Some(t0 + Duration::from_secs(10)));
        assert_eq!(q.pop_expired(t0 + Duration::from_secs(9)), vec![]);
        assert_eq!(q.pop_expired(t0 + Duration::from_secs(10)), vec![(rank, b)]);
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop_expired(t0 + Duration::from_secs(29)), vec![]);
        assert_eq!(q.pop_expired(t0 + Duration::from_secs(30)), vec![(rank, a)]);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn synthesised_hashes_chain_and_differ_from_the_root_hash() {
        let l = LocalBlockHash(5);
        let root = approximate_block_hash(None, l);
        assert_eq!(root, approximate_block_hash(None, l));
        assert_ne!(root, approximate_block_hash(Some(ExternalBlockHash(0)), l));
        assert_ne!(root, approximate_block_hash(Some(root), l));
    }
}
