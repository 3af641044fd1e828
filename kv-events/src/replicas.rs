//! Sequence sync between router replicas.
//!
//! Several `kv-router serve` replicas share the route queue group, so each books only
//! the requests NATS hands to it. Without sharing, each replica would see a fraction
//! of the cluster's load and they would all pile onto the same best-cached worker.
//! So every replica publishes each change to the requests it booked — booked,
//! prefill done, keep-alive, freed — as a [`SequenceSync`] on
//! `{ns}.router.sequences`; every replica applies the others' messages and ignores
//! its own (by [`RouterId`]). NATS keeps one publisher's messages on one subject in
//! order, so a replica always sees a request's booking before its later steps.
//!
//! A replica that starts while others are serving also needs the bookings they made
//! before it subscribed. It publishes one [`SnapshotRequest`] on
//! `{ns}.router.sequences.snapshot` with a reply inbox; every other replica answers
//! with its own in-flight requests as [`SnapshotReply`] chunks
//! ([`SnapshotReply::chunked`] keeps each under a byte budget, well below the NATS
//! payload limit).
//!
//! Cost: one small message per lifecycle step per replica-booked request, fanned
//! out to every replica; one snapshot per replica start-up, of about 9 bytes per
//! prompt block of every in-flight request.

use crate::ids::{DpRank, LocalBlockHash, RequestId, WorkerId};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Identity of one router replica, unique in a namespace: configured, or drawn at
/// random at start-up. Only used to recognise a replica's own sync messages.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct RouterId(pub u64);

impl fmt::Display for RouterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// One change to a request booked by the replica `router_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceSync {
    /// The replica that booked the request and publishes its changes.
    pub router_id: RouterId,
    /// The request, as named by the frontend.
    pub request_id: RequestId,
    /// What changed.
    pub update: SequenceUpdate,
}

/// The change carried by a [`SequenceSync`]; on the wire a map tagged by `"type"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SequenceUpdate {
    /// The request was routed and booked on a rank.
    Booked(BookedSequence),
    /// The request's prefill finished.
    PrefillDone,
    /// The request is still alive (refreshes its time-to-live).
    KeepAlive,
    /// The request ended, or its booking expired; its load is released.
    Freed,
}

/// Everything another replica needs to book the same load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookedSequence {
    /// The chosen worker.
    pub worker_id: WorkerId,
    /// The chosen data-parallel rank.
    pub dp_rank: DpRank,
    /// The prompt's block hashes, in prefix order (used to count shared prefix blocks
    /// once when the router assumes KV reuse).
    pub block_hashes: Vec<LocalBlockHash>,
    /// Prompt length in blocks, the partial last block counted.
    pub request_blocks: u32,
    /// Prompt tokens the rank has to prefill (not cached there), in tokens.
    pub prefill_tokens: u64,
    /// How long that prefill is expected to take, in milliseconds; absent when the
    /// booking replica has no estimate (then the prefill load does not decay).
    #[serde(default)]
    pub expected_prefill_ms: Option<u64>,
}

/// Asks every other replica for the requests it booked and has not freed yet.
/// Published once at start-up on `{ns}.router.sequences.snapshot`, with a reply inbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// The asking replica; a replica ignores its own request.
    pub router_id: RouterId,
}

/// One chunk of a replica's answer to a [`SnapshotRequest`], published to the
/// request's reply inbox. A replica with nothing booked answers with one empty chunk
/// flagged `last`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotReply {
    /// The answering replica, which booked every request of the reply.
    pub router_id: RouterId,
    /// Position of this chunk in the answer, from 0.
    #[serde(default)]
    pub chunk: u32,
    /// True on the answer's final chunk. Default true: an answer without chunking
    /// fields is a single chunk.
    #[serde(default = "single_chunk")]
    pub last: bool,
    /// Requests in this chunk, in no particular order.
    #[serde(default)]
    pub requests: Vec<SnapshotEntry>,
}

fn single_chunk() -> bool {
    true
}

/// One in-flight request in a [`SnapshotReply`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotEntry {
    /// The request, as named by the frontend.
    pub request_id: RequestId,
    /// Its booking, as the `booked` sync message carried it.
    pub booked: BookedSequence,
    /// Whether its prefill already completed (its prefill tokens are no longer load).
    /// Default false.
    #[serde(default)]
    pub prefill_done: bool,
}

/// Default byte budget of one [`SnapshotReply`] chunk: a quarter of the NATS default
/// `max_payload` (1 MiB). About 29,000 block hashes fit in one chunk.
pub const SNAPSHOT_CHUNK_BYTES: usize = 256 * 1024;

/// Upper bound of the encoded size of a [`SnapshotReply`] without its requests, in
/// bytes (map header, four keys, `router_id`, `chunk`, `last`, array header).
const REPLY_ENVELOPE_BOUND: usize = 64;

impl SnapshotEntry {
    /// An upper bound of this entry's size in a named msgpack encoding, in bytes: 192
    /// bytes of keys and scalars, the request id, and 9 bytes per block hash (a u64
    /// is at most 9 bytes in msgpack). Cheap: nothing is encoded.
    pub fn encoded_len_bound(&self) -> usize {
        192 + self.request_id.0.len() + 9 * self.booked.block_hashes.len()
    }
}

impl SnapshotReply {
    /// Splits `requests` into the chunks of one answer, in order: chunk numbers from
    /// 0, `last` on the final one, each at most `max_bytes` encoded (by
    /// [`SnapshotEntry::encoded_len_bound`]) unless it holds a single request that is
    /// larger on its own. Always at least one chunk: no requests give one empty
    /// chunk flagged `last`.
    pub fn chunked(
        router_id: RouterId,
        requests: Vec<SnapshotEntry>,
        max_bytes: usize,
    ) -> Vec<SnapshotReply> {
        let mut groups: Vec<Vec<SnapshotEntry>> = Vec::new();
        let mut current: Vec<SnapshotEntry> = Vec::new();
        let mut size = REPLY_ENVELOPE_BOUND;
        for entry in requests {
            let len = entry.encoded_len_bound();
            if !current.is_empty() && size + len > max_bytes {
                groups.push(std::mem::take(&mut current));
                size = REPLY_ENVELOPE_BOUND;
            }
            size += len;
            current.push(entry);
        }
        if !current.is_empty() || groups.is_empty() {
            groups.push(current);
        }
        let count = groups.len();
        groups
            .into_iter()
            .enumerate()
            .map(|(i, requests)| SnapshotReply {
                router_id,
                chunk: u32::try_from(i).unwrap_or(u32::MAX),
                last: i + 1 == count,
                requests,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    #[test]
    fn sync_messages_round_trip() {
        let booked = SequenceSync {
            router_id: RouterId(u64::MAX),
            request_id: "r1".into(),
            update: SequenceUpdate::Booked(BookedSequence {
                worker_id: WorkerId(4),
                dp_rank: DpRank(1),
                block_hashes: vec![LocalBlockHash(9), LocalBlockHash(u64::MAX)],
                request_blocks: 3,
                prefill_tokens: 130,
                expected_prefill_ms: Some(25),
            }),
        };
        assert_eq!(
            decode::<SequenceSync>(&encode(&booked).unwrap()).unwrap(),
            booked
        );
        for update in [
            SequenceUpdate::PrefillDone,
            SequenceUpdate::KeepAlive,
            SequenceUpdate::Freed,
        ] {
            let msg = SequenceSync {
                router_id: RouterId(1),
                request_id: "r1".into(),
                update,
            };
            assert_eq!(decode::<SequenceSync>(&encode(&msg).unwrap()).unwrap(), msg);
        }
    }

    #[test]
    fn update_is_tagged_and_expected_duration_is_optional() {
        #[derive(Serialize)]
        struct Booked {
            r#type: &'static str,
            worker_id: u64,
            dp_rank: u32,
            block_hashes: Vec<u64>,
            request_blocks: u32,
            prefill_tokens: u64,
        }
        let bytes = encode(&Booked {
            r#type: "booked",
            worker_id: 2,
            dp_rank: 0,
            block_hashes: vec![],
            request_blocks: 1,
            prefill_tokens: 10,
        })
        .unwrap();
        match decode::<SequenceUpdate>(&bytes).unwrap() {
            SequenceUpdate::Booked(b) => assert_eq!(b.expected_prefill_ms, None),
            other => panic!("decoded as {other:?}"),
        }
        assert_eq!(RouterId(255).to_string(), "00000000000000ff");
    }

    fn entry(id: &str, blocks: usize) -> SnapshotEntry {
        SnapshotEntry {
            request_id: id.into(),
            booked: BookedSequence {
                worker_id: WorkerId(u64::MAX),
                dp_rank: DpRank(u32::MAX),
                block_hashes: (0..blocks)
                    .map(|i| LocalBlockHash(u64::MAX - i as u64))
                    .collect(),
                request_blocks: u32::MAX,
                prefill_tokens: u64::MAX,
                expected_prefill_ms: Some(u64::MAX),
            },
            prefill_done: true,
        }
    }

    #[test]
    fn snapshot_messages_round_trip() {
        let request = SnapshotRequest {
            router_id: RouterId(3),
        };
        assert_eq!(
            decode::<SnapshotRequest>(&encode(&request).unwrap()).unwrap(),
            request
        );
        let reply = SnapshotReply {
            router_id: RouterId(u64::MAX),
            chunk: 2,
            last: false,
            requests: vec![entry("a", 3), entry("b", 0)],
        };
        assert_eq!(
            decode::<SnapshotReply>(&encode(&reply).unwrap()).unwrap(),
            reply
        );
    }

    #[test]
    fn encoded_length_bound_holds_for_the_largest_values() {
        for (id, blocks) in [("", 0), ("r", 1), (&*"x".repeat(300), 5000)] {
            let e = entry(id, blocks);
            let actual = encode(&e).unwrap().len();
            assert!(
                actual <= e.encoded_len_bound(),
                "{actual} > {} for {blocks} blocks",
                e.encoded_len_bound()
            );
            let reply = SnapshotReply {
                router_id: RouterId(u64::MAX),
                chunk: u32::MAX,
                last: false,
                requests: vec![e.clone()],
            };
            assert!(encode(&reply).unwrap().len() <= REPLY_ENVELOPE_BOUND + e.encoded_len_bound());
        }
    }

    #[test]
    fn chunks_stay_under_the_budget_and_keep_order() {
        let per_entry = entry("r00", 100).encoded_len_bound();
        // Exactly three entries fit in a chunk; a fourth would not.
        let budget = REPLY_ENVELOPE_BOUND + 3 * per_entry;
        let entries: Vec<SnapshotEntry> = (0..7).map(|i| entry(&format!("r{i:02}"), 100)).collect();
        let chunks = SnapshotReply::chunked(RouterId(9), entries.clone(), budget);
        let sizes: Vec<usize> = chunks.iter().map(|c| c.requests.len()).collect();
        assert_eq!(sizes, [3, 3, 1]);
        for (i, c) in chunks.iter().enumerate() {
            assert_eq!(c.chunk as usize, i);
            assert_eq!(c.last, i == chunks.len() - 1);
            assert_eq!(c.router_id, RouterId(9));
            assert!(encode(c).unwrap().len() <= budget);
        }
        let rejoined: Vec<SnapshotEntry> = chunks.into_iter().flat_map(|c| c.requests).collect();
        assert_eq!(rejoined, entries);

        // One byte less and only two fit.
        let chunks = SnapshotReply::chunked(RouterId(9), entries.clone(), budget - 1);
        assert_eq!(
            chunks.iter().map(|c| c.requests.len()).collect::<Vec<_>>(),
            [2, 2, 2, 1]
        );

        // Nothing booked: one empty, final chunk.
        let empty = SnapshotReply::chunked(RouterId(9), Vec::new(), budget);
        assert_eq!(empty.len(), 1);
        assert!(empty[0].last && empty[0].requests.is_empty() && empty[0].chunk == 0);

        // A request larger than the budget travels alone.
        let big = vec![entry("small", 1), entry("big", 1000), entry("small2", 1)];
        let chunks = SnapshotReply::chunked(RouterId(9), big, 2048);
        assert_eq!(
            chunks.iter().map(|c| c.requests.len()).collect::<Vec<_>>(),
            [1, 1, 1]
        );
        assert_eq!(chunks[1].requests[0].request_id, "big".into());
    }

    #[test]
    fn default_budget_fits_thousands_of_blocks_under_the_nats_limit() {
        let entries: Vec<SnapshotEntry> = (0..50).map(|i| entry(&format!("{i}"), 4000)).collect();
        let chunks = SnapshotReply::chunked(RouterId(1), entries, SNAPSHOT_CHUNK_BYTES);
        assert!(chunks.len() > 1);
        for c in &chunks {
            let len = encode(c).unwrap().len();
            assert!(len <= SNAPSHOT_CHUNK_BYTES, "{len}");
        }
    }

    #[test]
    fn reply_without_the_optional_fields_decodes_with_defaults() {
        #[derive(Serialize)]
        struct Booked {
            worker_id: u64,
            dp_rank: u32,
            block_hashes: Vec<u64>,
            request_blocks: u32,
            prefill_tokens: u64,
        }
        #[derive(Serialize)]
        struct Entry {
            request_id: &'static str,
            booked: Booked,
        }
        #[derive(Serialize)]
        struct Reply {
            router_id: u64,
            requests: Vec<Entry>,
        }
        let bytes = encode(&Reply {
            router_id: 5,
            requests: vec![Entry {
                request_id: "r1",
                booked: Booked {
                    worker_id: 2,
                    dp_rank: 0,
                    block_hashes: vec![7],
                    request_blocks: 1,
                    prefill_tokens: 4,
                },
            }],
        })
        .unwrap();
        let reply: SnapshotReply = decode(&bytes).unwrap();
        assert_eq!((reply.chunk, reply.last), (0, true));
        assert!(!reply.requests[0].prefill_done);
        assert_eq!(reply.requests[0].booked.expected_prefill_ms, None);
        // Only the router id is required.
        #[derive(Serialize)]
        struct Bare {
            router_id: u64,
        }
        let bare: SnapshotReply = decode(&encode(&Bare { router_id: 5 }).unwrap()).unwrap();
        assert!(bare.last && bare.requests.is_empty());
        assert!(decode::<SnapshotReply>(&[0xc1]).is_err());
    }
}
