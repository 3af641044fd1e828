//! Recovery messages: how a router fills a gap in a worker's KV events, and the index
//! snapshot format of the optional JetStream durability path.
//!
//! Publishers (the mock engine, the engine relay) keep a ring buffer of their recent
//! events and the set of blocks they hold ([`crate::journal::EventJournal`]). A router
//! that sees a gap in a (worker, dp_rank)'s `event_id`s, a `Stored` event with an
//! unknown parent, or that has just started, sends a [`RecoveryRequest`] to
//! `{ns}.kv.recovery.{worker_id}`. The publisher answers with the missing events when
//! they are still in its ring buffer, or else with a dump of every block the rank
//! holds, plus the `event_id` the router must continue from. No central log is
//! needed: each publisher is the source of truth for its own cache.
//!
//! A reply can be large (a dump of a big cache is megabytes), and a NATS message is
//! limited (1 MiB by default), so a reply travels as one or more [`RecoveryChunk`]s
//! published to the request's reply inbox, numbered from 0, the last one flagged.
//! [`RecoveryReply::into_chunks`] splits, [`ChunkAssembler`] joins and checks
//! (`assemble.rs`), refusing a reply past the receiver's [`ReplyLimits`] before it
//! decodes the chunk that crosses them.
//!
//! Costs: a dump is O(held blocks) to build and about 45 bytes per block on the wire
//! (named msgpack maps); an events reply is as large as the events it repeats.

mod assemble;

pub use assemble::{AssemblyError, ChunkAssembler, ReplyLimits};

use crate::events::{KvCacheEvent, KvCacheEventData, KvCacheGroup, StorageTier, StoredBlock};
use crate::ids::{DpRank, ExternalBlockHash, GroupId, WorkerId};
use serde::{Deserialize, Serialize};

/// Router → publisher, on `{ns}.kv.recovery.{worker_id}` with a reply inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryRequest {
    /// The data-parallel rank whose events are missing.
    #[serde(default)]
    pub dp_rank: DpRank,
    /// The publisher epoch the router knows for the rank (0 when it knows none).
    #[serde(default)]
    pub epoch: u64,
    /// The first `event_id` the router is missing.
    #[serde(default)]
    pub start_event_id: u64,
    /// Ask for a dump even if the events are still buffered (the router lost track of
    /// the rank's state, e.g. after a refused `Stored` or at start-up).
    #[serde(default)]
    pub dump: bool,
}

/// One chain of held blocks in a dump: `blocks` continue `parent_hash` (or start at
/// the root when it is `None`), exactly like a `Stored` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredChain {
    /// The engine hash of the block preceding `blocks[0]`; `None` at the root.
    pub parent_hash: Option<ExternalBlockHash>,
    /// The chain's blocks in prefix order.
    pub blocks: Vec<StoredBlock>,
    /// The tier the rank holds the chain on; GPU when absent on the wire (publishers'
    /// dumps name GPU blocks only, see [`crate::journal`]; a router's snapshot names
    /// every tier).
    #[serde(default, skip_serializing_if = "StorageTier::is_gpu")]
    pub tier: StorageTier,
    /// The KV cache group holding the chain; absent for a model with one group. A
    /// block held as several copies appears in as many chains.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<KvCacheGroup>,
}

impl StoredChain {
    /// The `Stored` event data that adds this chain.
    pub fn into_event_data(self) -> KvCacheEventData {
        KvCacheEventData::Stored {
            parent_hash: self.parent_hash,
            blocks: self.blocks,
            tier: self.tier,
            group: self.group,
        }
    }
}

/// Blocks of one KV cache group (see [`RecoveryBody::Dump`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupBlocks {
    /// The group.
    pub group: GroupId,
    /// The blocks' engine hashes.
    pub block_hashes: Vec<ExternalBlockHash>,
}

/// What a recovery reply carries.
///
/// On the wire a map tagged by `"type"`: `{"type": "events", "events": […]}`,
/// `{"type": "dump", "chains": […]}` or `{"type": "error", "message": "…"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RecoveryBody {
    /// The events from the requested `start_event_id` up to (not including) the
    /// reply's `next_event_id`, in order.
    Events {
        /// The missing events.
        events: Vec<KvCacheEvent>,
    },
    /// Every block the rank holds, as chains ordered so that a chain's parent block
    /// is always in an earlier chain. Replace the rank's state with it: clear the
    /// rank, store the chains in order, then remove the `unheld` blocks.
    Dump {
        /// The rank's blocks.
        chains: Vec<StoredChain>,
        /// Blocks that appear in `chains` only to place their descendants: the rank
        /// removed them, but still holds blocks below them (an engine that evicted an
        /// interior block). Empty in the common case.
        #[serde(default)]
        unheld: Vec<ExternalBlockHash>,
        /// The same for chains of a hybrid model's KV cache groups: per group, the
        /// blocks to remove from that group after the chains are stored. Absent on
        /// the wire when empty.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        unheld_in_groups: Vec<GroupBlocks>,
    },
    /// The request could not be served (malformed, unknown rank); lowercase reason.
    Error {
        /// What went wrong.
        message: String,
    },
}

/// A complete (assembled) recovery reply for one worker rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryReply {
    /// The publishing worker.
    pub worker_id: WorkerId,
    /// The rank the reply describes.
    #[serde(default)]
    pub dp_rank: DpRank,
    /// The publisher's current epoch.
    #[serde(default)]
    pub epoch: u64,
    /// The `event_id` of the next event the publisher will publish for the rank: the
    /// router continues from here (live events below it are already covered).
    pub next_event_id: u64,
    /// Events or a dump.
    pub body: RecoveryBody,
}

/// One message of a possibly multi-message reply. Chunk 0 comes first; the chunk with
/// `last: true` ends the reply. Every chunk repeats the reply's header fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryChunk {
    /// The publishing worker.
    pub worker_id: WorkerId,
    /// The rank the reply describes.
    #[serde(default)]
    pub dp_rank: DpRank,
    /// The publisher's current epoch.
    #[serde(default)]
    pub epoch: u64,
    /// See [`RecoveryReply::next_event_id`].
    pub next_event_id: u64,
    /// Position of this chunk in the reply, from 0.
    pub chunk: u32,
    /// True on the final chunk.
    pub last: bool,
    /// This chunk's part of the body (same variant in every chunk).
    pub body: RecoveryBody,
}

impl RecoveryBody {
    /// Blocks the body names (stored blocks in events and chains); used to size chunks.
    pub fn block_count(&self) -> usize {
        match self {
            RecoveryBody::Events { events } => {
                events.iter().map(|e| e.data.block_count().max(1)).sum()
            }
            RecoveryBody::Dump { chains, .. } => chains.iter().map(|c| c.blocks.len()).sum(),
            RecoveryBody::Error { .. } => 0,
        }
    }

    pub(crate) fn kind(&self) -> u8 {
        match self {
            RecoveryBody::Events { .. } => 0,
            RecoveryBody::Dump { .. } => 1,
            RecoveryBody::Error { .. } => 2,
        }
    }
}

impl RecoveryReply {
    /// Splits the reply into chunks of at most about `max_blocks` blocks each (an
    /// event larger than that travels alone; dump chains are cut, the second part
    /// naming the first part's last block as its parent). Always at least one chunk.
    pub fn into_chunks(self, max_blocks: usize) -> Vec<RecoveryChunk> {
        let max_blocks = max_blocks.max(1);
        let bodies: Vec<RecoveryBody> = match self.body {
            RecoveryBody::Events { events } => split_events(events, max_blocks),
            RecoveryBody::Dump {
                chains,
                unheld,
                unheld_in_groups,
            } => split_chains(chains, unheld, unheld_in_groups, max_blocks),
            error @ RecoveryBody::Error { .. } => vec![error],
        };
        let n = bodies.len();
        bodies
            .into_iter()
            .enumerate()
            .map(|(i, body)| RecoveryChunk {
                worker_id: self.worker_id,
                dp_rank: self.dp_rank,
                epoch: self.epoch,
                next_event_id: self.next_event_id,
                // A reply has far fewer than 2^32 chunks (each holds ≥ 1 block).
                chunk: u32::try_from(i).unwrap_or(u32::MAX),
                last: i + 1 == n,
                body,
            })
            .collect()
    }
}

fn split_events(events: Vec<KvCacheEvent>, max_blocks: usize) -> Vec<RecoveryBody> {
    let mut out = Vec::new();
    let mut current = Vec::new();
    let mut size = 0;
    for event in events {
        let blocks = event.data.block_count().max(1);
        if !current.is_empty() && size + blocks > max_blocks {
            out.push(RecoveryBody::Events {
                events: std::mem::take(&mut current),
            });
            size = 0;
        }
        size += blocks;
        current.push(event);
    }
    out.push(RecoveryBody::Events { events: current });
    out
}

/// Cuts chains into bodies of at most `max_blocks` blocks (empty chains, which make
/// a group known, ride along in order); `unheld` and
/// `unheld_in_groups` go with the last body, so they are removed only after every
/// chain is stored.
fn split_chains(
    chains: Vec<StoredChain>,
    unheld: Vec<ExternalBlockHash>,
    unheld_in_groups: Vec<GroupBlocks>,
    max_blocks: usize,
) -> Vec<RecoveryBody> {
    let mut out = Vec::new();
    let mut current: Vec<StoredChain> = Vec::new();
    let mut size = 0;
    for chain in chains {
        if chain.blocks.is_empty() {
            // A known group holding nothing: kept, so the router knows the group.
            current.push(chain);
            continue;
        }
        let mut parent_hash = chain.parent_hash;
        let mut rest = chain.blocks.as_slice();
        while !rest.is_empty() {
            let (head, tail) = rest.split_at(rest.len().min(max_blocks - size));
            current.push(StoredChain {
                parent_hash,
                blocks: head.to_vec(),
                tier: chain.tier,
                group: chain.group,
            });
            size += head.len();
            parent_hash = head.last().map(|b| b.block_hash);
            rest = tail;
            if size == max_blocks {
                out.push(RecoveryBody::Dump {
                    chains: std::mem::take(&mut current),
                    unheld: Vec::new(),
                    unheld_in_groups: Vec::new(),
                });
                size = 0;
            }
        }
    }
    match out.last_mut() {
        Some(RecoveryBody::Dump {
            unheld: last,
            unheld_in_groups: last_in_groups,
            ..
        }) if current.is_empty() => {
            *last = unheld;
            *last_in_groups = unheld_in_groups;
        }
        _ => out.push(RecoveryBody::Dump {
            chains: current,
            unheld,
            unheld_in_groups,
        }),
    }
    out
}

/// The ordering state of one worker rank inside an index snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankCursor {
    /// The worker.
    pub worker_id: WorkerId,
    /// The rank.
    pub dp_rank: DpRank,
    /// The publisher epoch the index follows.
    pub epoch: u64,
    /// The next `event_id` the index expects.
    pub next_event_id: u64,
}

/// A router's whole index as data: per-worker `Stored` events that rebuild the radix
/// tree (see the indexer's `dump`), plus each rank's event cursor, so that a restored
/// index continues exactly where the snapshot was taken. Stored by the JetStream
/// durability path together with the stream sequence it covers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexSnapshot {
    /// Events rebuilding the tree, one batch per worker.
    pub batches: Vec<crate::events::KvEventBatch>,
    /// The event cursor of every rank the index follows.
    pub cursors: Vec<RankCursor>,
}

#[cfg(test)]
mod tests;
