//! Recent removals per rank, and the `{ns}.router.removals` service that answers
//! "did an eviction race this route?" ([`kv_events::routing::removals`]).
//!
//! **Why.** The gateway's cache-parity monitor sees an over-claim when the engine
//! evicted predicted prefix blocks after the route decision and before the
//! request's prefill (it then recomputes and re-stores them). That is no
//! disagreement: the picture was right when the router decided. Asking the index at
//! answer time cannot tell, since by then the request has re-stored the blocks; what
//! can is a memory of the *removals*: each rank keeps its last `Removed` blocks with
//! the [`EventPosition`] of their event, the route reply names the rank's position at
//! the decision, and an over-claim is excused only when a block of the prompt was
//! removed after it. A `Removed` event names the engine's block hash only, so a
//! removed block learns its [`LocalBlockHash`] (what a frontend can compute) from the
//! next `Stored` event of the same engine hash on that rank: the re-store by the
//! request that found it missing. An engine that never publishes `Removed` is never
//! excused.
//!
//! **Cost.** Bounded by `--removals-per-rank` removed blocks per rank (about 90
//! bytes each with their two maps; 1,024 by default, ~90 KB per rank that evicts:
//! on the quickstart, whose prompts evict hundreds of 512-token blocks at once, 256
//! let 1–4 races per 2,000 requests go unexplained, 1,024 none; docs/benchmarks.md). On
//! the event intake, per batch one lock and one rank lookup; per removed block one
//! ring push and one map insert, except that of a `Removed` larger than the ring
//! only its last `per_rank` blocks are recorded (a flood of 4,096-block eviction
//! sweeps cost the intake 1.8× what it costs without this memory, 1.2× since; 16-block
//! floods 1.5×); per stored block one map lookup while the rank remembers removals. A route decision reads one
//! position under the same lock. A query is at most
//! [`kv_events::routing::MAX_REMOVAL_HASHES`] map lookups.

use crate::metrics::counters::{Counters, MessageKind, Outcome};
use kv_events::limits::Limits;
use kv_events::routing::{
    EventPosition, RemovalsAnswer, RemovalsQuery, RemovalsReply, RouteError, RouteErrorCode,
};
use kv_events::{
    ExternalBlockHash, KvCacheEventData, KvEventBatch, LocalBlockHash, WorkerId, WorkerRank,
};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

/// Removed blocks remembered per rank by default (`--removals-per-rank`).
pub(crate) const DEFAULT_PER_RANK: usize = 1024;

/// The removals of every rank; shared by the event intake (writes), the routing
/// service (reads a position) and the removals service (answers queries).
#[derive(Debug)]
pub(crate) struct Removals {
    /// Removed blocks remembered per rank; 0 keeps none (and routes carry no position).
    per_rank: usize,
    ranks: Mutex<FxHashMap<WorkerRank, RankRemovals>>,
}

/// One removed block.
#[derive(Debug, Clone, Copy)]
struct Removal {
    at: EventPosition,
    external: ExternalBlockHash,
    /// Learned from the next store of `external` on the rank.
    local: Option<LocalBlockHash>,
}

/// One rank's memory.
#[derive(Debug)]
struct RankRemovals {
    /// The first event recorded: nothing before it is known.
    first: EventPosition,
    /// The last event recorded.
    last: EventPosition,
    /// Removed blocks, oldest first; `ring[i]` has number `base + i`.
    ring: VecDeque<Removal>,
    base: u64,
    /// The newest removal dropped from the ring (the memory is complete after it).
    forgotten: Option<EventPosition>,
    /// The last `Cleared` event.
    cleared: Option<EventPosition>,
    /// Each engine hash in the ring not stored again since, with its newest
    /// removal's number.
    by_external: FxHashMap<ExternalBlockHash, u64>,
    /// Each removed block stored again since, with its newest removal's position.
    restored: FxHashMap<LocalBlockHash, EventPosition>,
}

impl RankRemovals {
    fn new(at: EventPosition) -> Self {
        Self {
            first: at,
            last: at,
            ring: VecDeque::new(),
            base: 0,
            forgotten: None,
            cleared: None,
            by_external: FxHashMap::default(),
            restored: FxHashMap::default(),
        }
    }

    /// Records one `Removed` event's blocks. Of an event of at least `per_rank`
    /// blocks only the last `per_rank` are kept: the rest would leave the ring within
    /// the event, so they are counted as forgotten without passing through it.
    fn remove_all(&mut self, at: EventPosition, externals: &[ExternalBlockHash], per_rank: usize) {
        let kept = externals.len().min(per_rank);
        if kept == per_rank {
            self.forget_all();
            let skipped = externals.len() - kept;
            if skipped > 0 {
                self.base += skipped as u64;
                self.forgotten = self.forgotten.max(Some(at));
            }
        }
        for &external in &externals[externals.len() - kept..] {
            self.remove(at, external, per_rank);
        }
    }

    fn remove(&mut self, at: EventPosition, external: ExternalBlockHash, per_rank: usize) {
        if self.ring.len() == per_rank
            && let Some(old) = self.ring.pop_front()
        {
            let number = self.base;
            self.base += 1;
            self.forgotten = self.forgotten.max(Some(old.at));
            if self.by_external.get(&old.external) == Some(&number) {
                self.by_external.remove(&old.external);
            }
            if let Some(local) = old.local
                && self.restored.get(&local) == Some(&old.at)
            {
                self.restored.remove(&local);
            }
        }
        let number = self.base + self.ring.len() as u64;
        self.ring.push_back(Removal {
            at,
            external,
            local: None,
        });
        self.by_external.insert(external, number);
    }

    /// Empties the ring and both maps, as if every entry had left it.
    fn forget_all(&mut self) {
        if let Some(newest) = self.ring.iter().map(|r| r.at).max() {
            self.forgotten = self.forgotten.max(Some(newest));
        }
        self.base += self.ring.len() as u64;
        self.ring.clear();
        // Every `restored` entry names a removal in the ring (it leaves with it).
        self.restored.clear();
        self.by_external.clear();
    }

    fn store(&mut self, external: ExternalBlockHash, local: LocalBlockHash) {
        let Some(&number) = self.by_external.get(&external) else {
            return;
        };
        // The number is in the ring: entries leave `by_external` when they leave it.
        let Some(removal) = usize::try_from(number - self.base)
            .ok()
            .and_then(|i| self.ring.get_mut(i))
        else {
            return;
        };
        removal.local = Some(local);
        self.restored.insert(local, removal.at);
        // Stored again: a later store of the same hash learns nothing new.
        self.by_external.remove(&external);
    }

    fn answer(&self, query: &RemovalsQuery) -> RemovalsAnswer {
        let after = query.after;
        let removed = (query.block_hashes.iter().zip(0u32..))
            .filter(|(hash, _)| self.restored.get(hash).is_some_and(|&at| at > after))
            .map(|(_, i)| i)
            .collect();
        RemovalsAnswer {
            removed,
            complete: self.first <= after && self.forgotten.is_none_or(|f| f <= after),
            cleared: self.cleared.is_some_and(|c| c > after),
        }
    }
}

impl Removals {
    /// Remembers up to `per_rank` removed blocks per rank (0: none).
    pub(crate) fn new(per_rank: usize) -> Self {
        Self {
            per_rank,
            ranks: Mutex::new(FxHashMap::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FxHashMap<WorkerRank, RankRemovals>> {
        // Every update leaves the map whole, so a poisoned one is still usable.
        self.ranks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the removals, stores and clears of `batch` (called as it is applied).
    pub(crate) fn record(&self, batch: &KvEventBatch) {
        if self.per_rank == 0 {
            return;
        }
        let mut ranks = self.lock();
        for event in &batch.events {
            let at = EventPosition {
                epoch: batch.epoch,
                event_id: event.event_id,
            };
            let rank = ranks
                .entry(WorkerRank::new(batch.worker_id, event.dp_rank))
                .or_insert_with(|| RankRemovals::new(at));
            rank.last = rank.last.max(at);
            match &event.data {
                KvCacheEventData::Removed { block_hashes, .. } => {
                    rank.remove_all(at, block_hashes, self.per_rank);
                }
                KvCacheEventData::Stored { blocks, .. } if !rank.by_external.is_empty() => {
                    for block in blocks {
                        rank.store(block.block_hash, block.tokens_hash);
                    }
                }
                KvCacheEventData::Stored { .. } => {}
                KvCacheEventData::Cleared => rank.cleared = Some(at),
            }
        }
    }

    /// The position of `rank` now, for a route reply: `None` when removals are not
    /// kept; the default (epoch 0, event 0) for a rank with no event yet.
    pub(crate) fn position(&self, rank: WorkerRank) -> Option<EventPosition> {
        (self.per_rank > 0).then(|| self.lock().get(&rank).map(|r| r.last).unwrap_or_default())
    }

    /// Forgets every rank of `worker` (it left the directory).
    pub(crate) fn forget_worker(&self, worker: WorkerId) {
        self.lock().retain(|rank, _| rank.worker_id != worker);
    }

    /// Answers `query`: which of its blocks were removed after its position.
    pub(crate) fn answer(&self, query: &RemovalsQuery) -> RemovalsAnswer {
        let rank = WorkerRank::new(query.worker_id, query.dp_rank);
        self.lock().get(&rank).map_or(
            RemovalsAnswer {
                removed: Vec::new(),
                complete: false,
                cleared: false,
            },
            |r| r.answer(query),
        )
    }
}

impl Removals {
    /// Decodes and answers one removals query received on `subject`, counted under
    /// `counters`; an undecodable or over-long one gets a `bad_request` reply.
    pub(crate) fn handle(
        &self,
        counters: &Counters,
        limits: &Limits,
        subject: &str,
        payload: &[u8],
    ) -> RemovalsReply {
        let kind = MessageKind::Removals;
        match crate::gate::admit::<RemovalsQuery>(counters, limits, kind, subject, payload) {
            Ok(query) => {
                counters.message(kind, Outcome::Ok);
                RemovalsReply::Answered(self.answer(&query))
            }
            Err(refusal) => RemovalsReply::Error(RouteError {
                code: RouteErrorCode::BadRequest,
                message: refusal.to_string(),
            }),
        }
    }
}

#[cfg(test)]
#[path = "removals_model.rs"]
mod model;
#[cfg(test)]
#[path = "removals_tests.rs"]
mod tests;
