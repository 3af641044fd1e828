//! [`EventJournal`]: the publisher side of KV event ordering and recovery.
//!
//! A publisher (the mock engine, the engine relay) numbers its KV events per
//! (worker, dp_rank) from 0 and stamps every batch with its epoch. It also keeps, per
//! rank, a ring buffer of its most recent events and the set of blocks it currently
//! holds, so that it can answer a router's [`RecoveryRequest`]: with the missing
//! events while they are still buffered, or else with a dump of its blocks and the
//! `event_id` to continue from. That makes every publisher the source of truth for
//! its own cache: routers recover from gaps, restarts and late starts without a
//! central log.
//!
//! Synchronous and runtime-free: the owner wraps it in whatever lock it uses and
//! publishes what [`EventJournal::record_batch`] returns; [`EventJournal::answer`]
//! turns a raw request payload into the reply chunks to publish.
//!
//! The held set and the dump cover the GPU tier only: a `Stored` or `Removed` of a
//! lower [`crate::StorageTier`] is numbered, buffered and replayed like any event, but
//! a router that recovers from a dump relearns the rank's lower tiers only from later
//! events. On the GPU the held set keeps what a router's index keeps: per KV cache
//! group of a hybrid model, the blocks and how many copies of each (a `Stored` of a
//! block the group holds adds a copy, a `Removed` drops one); a dump rebuilds exactly
//! that (per-group chains, one more chain per extra copy; see `journal/held.rs`).
//!
//! Costs per rank: `ring_capacity` events (the ring), plus about 40 bytes per block
//! (engine hash → parent and tokens hash) and 16 per (group, held block). Recording is
//! O(blocks) per event; a dump is O(blocks × groups).

mod held;

use crate::events::{KvCacheEvent, KvCacheEventData, KvEventBatch};
use crate::ids::{DpRank, WorkerId};
use crate::recovery::{RecoveryBody, RecoveryChunk, RecoveryReply, RecoveryRequest};
use held::HeldSet;
use std::collections::{BTreeMap, VecDeque};

/// Sizes of an [`EventJournal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalConfig {
    /// Recent events kept per rank for range replies, in events. A request for older
    /// events is answered with a dump. Default 4096.
    pub ring_capacity: usize,
    /// Most blocks per reply chunk (see [`RecoveryReply::into_chunks`]). Default 4096,
    /// about 200 KB of msgpack, well under NATS's default 1 MiB payload limit.
    pub max_chunk_blocks: usize,
}

impl Default for JournalConfig {
    fn default() -> Self {
        Self {
            ring_capacity: 4096,
            max_chunk_blocks: 4096,
        }
    }
}

#[derive(Debug, Default)]
struct RankJournal {
    next_event_id: u64,
    recent: VecDeque<KvCacheEvent>,
    held: HeldSet,
}

/// One publisher's event numbering, recent-event ring and held-block set, per rank.
/// See the module docs.
#[derive(Debug)]
pub struct EventJournal {
    worker_id: WorkerId,
    epoch: u64,
    config: JournalConfig,
    ranks: BTreeMap<DpRank, RankJournal>,
}

impl EventJournal {
    /// An empty journal for `worker_id`. `epoch` must be larger than the epoch of any
    /// earlier run of this worker id (the start time in microseconds since the Unix
    /// epoch is the usual choice, see [`unix_epoch_micros`]); 0 opts out of restart
    /// detection.
    pub fn new(worker_id: WorkerId, epoch: u64, config: JournalConfig) -> Self {
        Self {
            worker_id,
            epoch,
            config: JournalConfig {
                ring_capacity: config.ring_capacity.max(1),
                max_chunk_blocks: config.max_chunk_blocks.max(1),
            },
            ranks: BTreeMap::new(),
        }
    }

    /// The worker this journal publishes for.
    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// The publisher epoch stamped on every batch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Numbers `data` as the next event of `dp_rank`, remembers it, and returns it.
    pub fn record(&mut self, dp_rank: DpRank, data: KvCacheEventData) -> KvCacheEvent {
        let capacity = self.config.ring_capacity;
        let rank = self.ranks.entry(dp_rank).or_default();
        rank.held.apply(&data);
        let event = KvCacheEvent {
            event_id: rank.next_event_id,
            dp_rank,
            data,
        };
        rank.next_event_id += 1;
        if rank.recent.len() == capacity {
            rank.recent.pop_front();
        }
        rank.recent.push_back(event.clone());
        event
    }

    /// Records every event of `data` for `dp_rank` and returns them as one batch
    /// ready to publish on the worker's events subject.
    pub fn record_batch(
        &mut self,
        dp_rank: DpRank,
        data: impl IntoIterator<Item = KvCacheEventData>,
    ) -> KvEventBatch {
        let events = data.into_iter().map(|d| self.record(dp_rank, d)).collect();
        self.batch(events)
    }

    /// Wraps already recorded events in a batch with this journal's worker and epoch.
    pub fn batch(&self, events: Vec<KvCacheEvent>) -> KvEventBatch {
        KvEventBatch {
            worker_id: self.worker_id,
            epoch: self.epoch,
            events,
        }
    }

    /// The id the next event of `dp_rank` will get.
    pub fn next_event_id(&self, dp_rank: DpRank) -> u64 {
        self.ranks.get(&dp_rank).map_or(0, |r| r.next_event_id)
    }

    /// Blocks `dp_rank` holds now on the GPU, in at least one KV cache group (a block
    /// held by several groups or as several copies counts once).
    pub fn held_blocks(&self, dp_rank: DpRank) -> usize {
        self.ranks.get(&dp_rank).map_or(0, |r| r.held.held())
    }

    /// Ranks that have recorded at least one event.
    pub fn ranks(&self) -> impl Iterator<Item = DpRank> + '_ {
        self.ranks.keys().copied()
    }

    /// The reply to `request`: the events from `start_event_id` when they are all
    /// still in the ring and the request's epoch is ours, else a dump. A rank that
    /// never published is answered with an empty dump at event 0.
    pub fn replay(&self, request: &RecoveryRequest) -> RecoveryReply {
        let empty = RankJournal::default();
        let rank = self.ranks.get(&request.dp_rank).unwrap_or(&empty);
        let oldest = rank
            .recent
            .front()
            .map_or(rank.next_event_id, |e| e.event_id);
        let in_ring =
            request.start_event_id >= oldest && request.start_event_id <= rank.next_event_id;
        let body = if request.dump || request.epoch != self.epoch || !in_ring {
            let dump = rank.held.dump();
            RecoveryBody::Dump {
                chains: dump.chains,
                unheld: dump.unheld,
                unheld_in_groups: dump.unheld_in_groups,
            }
        } else {
            let skip = usize::try_from(request.start_event_id - oldest).unwrap_or(usize::MAX);
            RecoveryBody::Events {
                events: rank.recent.iter().skip(skip).cloned().collect(),
            }
        };
        RecoveryReply {
            worker_id: self.worker_id,
            dp_rank: request.dp_rank,
            epoch: self.epoch,
            next_event_id: rank.next_event_id,
            body,
        }
    }

    /// A dump of `dp_rank`: every block it holds and the next event id.
    pub fn dump(&self, dp_rank: DpRank) -> RecoveryReply {
        self.replay(&RecoveryRequest {
            dp_rank,
            epoch: self.epoch,
            start_event_id: 0,
            dump: true,
        })
    }

    /// Answers a raw request payload received on the recovery subject: the chunks to
    /// publish, in order, to the request's reply inbox. A payload that does not decode
    /// gets one `error` chunk.
    pub fn answer(&self, payload: &[u8]) -> Vec<RecoveryChunk> {
        let reply = match crate::codec::decode::<RecoveryRequest>(payload) {
            Ok(request) => self.replay(&request),
            Err(err) => RecoveryReply {
                worker_id: self.worker_id,
                dp_rank: DpRank(0),
                epoch: self.epoch,
                next_event_id: 0,
                body: RecoveryBody::Error {
                    message: format!("malformed recovery request: {err}"),
                },
            },
        };
        reply.into_chunks(self.config.max_chunk_blocks)
    }
}

/// Microseconds since the Unix epoch: a publisher epoch that increases across
/// restarts as long as the clock does not step back. 1 if the clock is before 1970.
pub fn unix_epoch_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| {
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
        })
}

#[cfg(test)]
mod group_tests;
#[cfg(test)]
mod tests;
