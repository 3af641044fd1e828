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
            RecoveryBody::Dump { chains, unheld }
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
mod tests {
    use super::*;
    use crate::codec::encode;

    fn chain(hashes: &[u64]) -> Vec<StoredBlock> {
        hashes
            .iter()
            .map(|h| StoredBlock {
                block_hash: ExternalBlockHash(*h),
                tokens_hash: LocalBlockHash(h * 10),
            })
            .collect()
    }

    fn stored(parent: Option<u64>, hashes: &[u64]) -> KvCacheEventData {
        KvCacheEventData::Stored {
            parent_hash: parent.map(ExternalBlockHash),
            blocks: chain(hashes),
            tier: StorageTier::Gpu,
        }
    }

    fn removed(hashes: &[u64]) -> KvCacheEventData {
        KvCacheEventData::Removed {
            block_hashes: hashes.iter().map(|h| ExternalBlockHash(*h)).collect(),
            tier: StorageTier::Gpu,
        }
    }

    fn journal(ring: usize) -> EventJournal {
        let config = JournalConfig {
            ring_capacity: ring,
            max_chunk_blocks: 2,
        };
        EventJournal::new(WorkerId(5), 42, config)
    }

    fn request(dp: u32, epoch: u64, start: u64) -> RecoveryRequest {
        RecoveryRequest {
            dp_rank: DpRank(dp),
            epoch,
            start_event_id: start,
            dump: false,
        }
    }

    #[test]
    fn numbers_events_per_rank_and_stamps_the_epoch() {
        let mut j = journal(8);
        let a = j.record_batch(DpRank(0), [stored(None, &[1, 2]), removed(&[2])]);
        let b = j.record_batch(DpRank(1), [stored(None, &[7])]);
        let c = j.record_batch(DpRank(0), [KvCacheEventData::Cleared]);
        let ids =
            |batch: &KvEventBatch| batch.events.iter().map(|e| e.event_id).collect::<Vec<_>>();
        assert_eq!((ids(&a), ids(&b), ids(&c)), (vec![0, 1], vec![0], vec![2]));
        assert_eq!((a.worker_id, a.epoch), (WorkerId(5), 42));
        assert_eq!(c.events[0].dp_rank, DpRank(0));
        assert_eq!(j.next_event_id(DpRank(0)), 3);
        assert_eq!((j.held_blocks(DpRank(0)), j.held_blocks(DpRank(1))), (0, 1));
    }

    #[test]
    fn buffered_ranges_are_replayed_as_events() {
        let mut j = journal(8);
        for i in 0..5 {
            j.record(DpRank(0), stored(None, &[i]));
        }
        let reply = j.replay(&request(0, 42, 2));
        assert_eq!(reply.next_event_id, 5);
        let RecoveryBody::Events { events } = reply.body else {
            panic!("expected events")
        };
        assert_eq!(
            events.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
        // Nothing missing: an empty events reply.
        let reply = j.replay(&request(0, 42, 5));
        assert_eq!(reply.body, RecoveryBody::Events { events: vec![] });
    }

    #[test]
    fn ranges_that_left_the_ring_other_epochs_and_forced_requests_get_a_dump() {
        let mut j = journal(3);
        j.record(DpRank(0), stored(None, &[1, 2, 3]));
        j.record(DpRank(0), stored(Some(2), &[4]));
        j.record(DpRank(0), stored(None, &[9]));
        j.record(DpRank(0), removed(&[9]));
        let is_dump = |r: &RecoveryReply| matches!(r.body, RecoveryBody::Dump { .. });
        assert!(
            is_dump(&j.replay(&request(0, 42, 0))),
            "event 0 left the ring"
        );
        assert!(!is_dump(&j.replay(&request(0, 42, 1))));
        assert!(is_dump(&j.replay(&request(0, 41, 1))), "old epoch");
        assert!(is_dump(&j.replay(&request(0, 42, 9))), "beyond the end");
        let forced = RecoveryRequest {
            dump: true,
            ..request(0, 42, 3)
        };
        let reply = j.replay(&forced);
        assert_eq!(reply.next_event_id, 4);
        let RecoveryBody::Dump { chains, unheld } = reply.body else {
            panic!("expected a dump")
        };
        assert!(unheld.is_empty());
        assert_eq!(
            chains,
            vec![
                StoredChain {
                    parent_hash: None,
                    blocks: chain(&[1, 2, 3]),
                    tier: StorageTier::Gpu
                },
                StoredChain {
                    parent_hash: Some(ExternalBlockHash(2)),
                    blocks: chain(&[4]),
                    tier: StorageTier::Gpu
                },
            ]
        );
        // A rank that never published: nothing is missing, and its dump is empty.
        let reply = j.replay(&request(3, 42, 0));
        assert_eq!(reply.next_event_id, 0);
        assert_eq!(reply.body, RecoveryBody::Events { events: vec![] });
        assert_eq!(
            j.dump(DpRank(3)).body,
            RecoveryBody::Dump {
                chains: vec![],
                unheld: vec![]
            }
        );
    }

    #[test]
    fn dumps_keep_blocks_below_a_removed_block_as_unheld_placeholders() {
        let mut j = journal(8);
        j.record(DpRank(0), stored(None, &[1, 2, 3]));
        j.record(DpRank(0), stored(Some(2), &[4]));
        j.record(DpRank(0), removed(&[2]));
        let dump = |j: &EventJournal| match j.dump(DpRank(0)).body {
            RecoveryBody::Dump { chains, unheld } => (
                chains
                    .iter()
                    .flat_map(|c| c.blocks.iter().map(|b| b.block_hash.0))
                    .collect::<Vec<_>>(),
                unheld.iter().map(|h| h.0).collect::<Vec<_>>(),
            ),
            other => panic!("expected a dump, got {other:?}"),
        };
        assert_eq!(dump(&j), (vec![1, 2, 3, 4], vec![2]));
        assert_eq!(j.held_blocks(DpRank(0)), 3);
        // Once nothing below it is held, the placeholder goes too.
        j.record(DpRank(0), removed(&[3, 4]));
        assert_eq!(dump(&j), (vec![1], vec![]));
        j.record(DpRank(0), stored(Some(1), &[2, 3]));
        j.record(DpRank(0), removed(&[2]));
        j.record(DpRank(0), stored(Some(1), &[2]));
        assert_eq!(
            dump(&j),
            (vec![1, 2, 3], vec![]),
            "stored again: held again"
        );
        j.record(DpRank(0), KvCacheEventData::Cleared);
        assert_eq!(dump(&j), (vec![], vec![]));
        assert_eq!(j.held_blocks(DpRank(0)), 0);
    }

    #[test]
    fn answers_raw_payloads_in_chunks_and_malformed_ones_with_an_error() {
        let mut j = journal(8);
        j.record(DpRank(0), stored(None, &[1, 2, 3, 4, 5]));
        let payload = encode(&RecoveryRequest {
            dump: true,
            ..request(0, 42, 0)
        })
        .unwrap();
        let chunks = j.answer(&payload);
        assert_eq!(chunks.len(), 3, "5 blocks at 2 per chunk");
        assert!(chunks[2].last && !chunks[0].last);
        let bad = j.answer(&[0xc1]);
        assert_eq!(bad.len(), 1);
        assert!(matches!(bad[0].body, RecoveryBody::Error { .. }));
    }
}
