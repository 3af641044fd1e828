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
//! events.
//!
//! Costs per rank: `ring_capacity` events (the ring), plus about 40 bytes per held
//! block (engine hash → parent and tokens hash). Recording is O(blocks) per event; a
//! dump is O(held blocks).

use crate::events::{KvCacheEvent, KvCacheEventData, KvEventBatch, StorageTier, StoredBlock};
use crate::ids::{DpRank, ExternalBlockHash, LocalBlockHash, WorkerId};
use crate::recovery::{RecoveryBody, RecoveryChunk, RecoveryReply, RecoveryRequest, StoredChain};
use std::collections::{BTreeMap, HashMap, VecDeque};

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

/// A block the rank holds, or held and removed while blocks below it are still held
/// (`held: false`, kept only to place those descendants in a dump).
#[derive(Debug, Clone, Copy)]
struct HeldBlock {
    parent: Option<ExternalBlockHash>,
    tokens_hash: LocalBlockHash,
    /// Blocks (held or not) whose parent this block is.
    children: u32,
    held: bool,
}

#[derive(Debug, Default)]
struct RankJournal {
    next_event_id: u64,
    recent: VecDeque<KvCacheEvent>,
    blocks: HashMap<ExternalBlockHash, HeldBlock>,
    held: usize,
}

impl RankJournal {
    fn apply(&mut self, data: &KvCacheEventData) {
        match data {
            // The held set is the rank's GPU blocks: a dump rebuilds the GPU tier only
            // (lower tiers come back as the engine offloads again).
            KvCacheEventData::Stored { tier, .. } | KvCacheEventData::Removed { tier, .. }
                if !tier.is_gpu() => {}
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                ..
            } => {
                let mut parent = *parent_hash;
                for block in blocks {
                    self.store(block, parent);
                    parent = Some(block.block_hash);
                }
            }
            KvCacheEventData::Removed { block_hashes, .. } => {
                for hash in block_hashes {
                    self.remove(*hash);
                }
            }
            KvCacheEventData::Cleared => {
                self.blocks.clear();
                self.held = 0;
            }
        }
    }

    fn store(&mut self, block: &StoredBlock, parent: Option<ExternalBlockHash>) {
        if let Some(known) = self.blocks.get_mut(&block.block_hash) {
            if !known.held {
                known.held = true;
                self.held += 1;
            }
            return;
        }
        self.blocks.insert(
            block.block_hash,
            HeldBlock {
                parent,
                tokens_hash: block.tokens_hash,
                children: 0,
                held: true,
            },
        );
        self.held += 1;
        if let Some(p) = parent.and_then(|p| self.blocks.get_mut(&p)) {
            p.children += 1;
        }
    }

    /// Unholds `hash`; forgets it (and ancestors kept only for it) once nothing below
    /// it is held.
    fn remove(&mut self, hash: ExternalBlockHash) {
        let Some(block) = self.blocks.get_mut(&hash) else {
            return;
        };
        if !block.held {
            return;
        }
        block.held = false;
        self.held -= 1;
        let mut cur = hash;
        loop {
            let Some(block) = self.blocks.get(&cur).copied() else {
                return;
            };
            if block.held || block.children > 0 {
                return;
            }
            self.blocks.remove(&cur);
            let Some(parent) = block.parent else {
                return;
            };
            match self.blocks.get_mut(&parent) {
                Some(p) => p.children -= 1,
                None => return,
            }
            cur = parent;
        }
    }

    /// Blocks reachable from the root, as chains, parents first, and the blocks among
    /// them that are not held (see [`RecoveryBody::Dump`]). Held blocks whose chain
    /// does not reach the root (their first `Stored` named a parent this journal never
    /// saw) are left out: a router would refuse them too.
    fn chains(&self) -> (Vec<StoredChain>, Vec<ExternalBlockHash>) {
        let mut children: HashMap<Option<ExternalBlockHash>, Vec<ExternalBlockHash>> =
            HashMap::new();
        for (hash, block) in &self.blocks {
            children.entry(block.parent).or_default().push(*hash);
        }
        for list in children.values_mut() {
            list.sort_unstable();
        }
        let block = |hash: ExternalBlockHash| StoredBlock {
            block_hash: hash,
            tokens_hash: self.blocks[&hash].tokens_hash,
        };
        let mut chains = Vec::new();
        let mut unheld = Vec::new();
        // Chain starts, each with its parent; roots first.
        let mut starts: Vec<(Option<ExternalBlockHash>, ExternalBlockHash)> = children
            .get(&None)
            .map(|roots| roots.iter().rev().map(|h| (None, *h)).collect())
            .unwrap_or_default();
        while let Some((parent_hash, start)) = starts.pop() {
            let mut blocks = Vec::new();
            let mut node = start;
            loop {
                blocks.push(block(node));
                if !self.blocks[&node].held {
                    unheld.push(node);
                }
                match children.get(&Some(node)).map(Vec::as_slice) {
                    Some([first, rest @ ..]) => {
                        starts.extend(rest.iter().rev().map(|h| (Some(node), *h)));
                        node = *first;
                    }
                    _ => break,
                }
            }
            chains.push(StoredChain {
                group: None,
                parent_hash,
                blocks,
                tier: StorageTier::Gpu,
            });
        }
        (chains, unheld)
    }
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
        rank.apply(&data);
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

    /// Blocks `dp_rank` holds now.
    pub fn held_blocks(&self, dp_rank: DpRank) -> usize {
        self.ranks.get(&dp_rank).map_or(0, |r| r.held)
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
            let (chains, unheld) = rank.chains();
            RecoveryBody::Dump {
                unheld_in_groups: Vec::new(),
                chains,
                unheld,
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
#[path = "journal_tests.rs"]
mod tests;
