//! Sequence sync between router replicas.
//!
//! Several `kv-router serve` replicas share the route queue group, so each books only
//! the requests NATS hands to it. Without sharing, each replica would see a fraction
//! of the cluster's load and they would all pile onto the same best-cached worker.
//! So every replica publishes each change to the requests it booked — booked,
//! prefill done, keep-alive, freed — on `{ns}.router.sequences`, as many as are
//! queued in one [`SequenceSyncBatch`] (older replicas: one [`SequenceSync`] per
//! change); every replica applies the others' messages and ignores its own (by
//! [`RouterId`]). NATS keeps one publisher's messages on one subject in order, and a
//! batch lists its steps in order, so a replica always sees a request's booking
//! before its later steps.
//!
//! A replica publishes its steps only once it has heard another replica (any of
//! these messages under another [`RouterId`]); alone it publishes only an empty
//! batch, its hello, when it starts, and one more whenever it hears a replica for
//! the first time, so every pair of replicas hears each other.
//!
//! A replica that starts while others are serving also needs the bookings they made
//! before it subscribed. It publishes one [`SnapshotRequest`] on
//! `{ns}.router.sequences.snapshot` with a reply inbox; every other replica answers
//! with its own in-flight requests as [`SnapshotReply`] chunks
//! ([`SnapshotReply::chunked`] keeps each under a byte budget, well below the NATS
//! payload limit).
//!
//! Cost: one small message per lifecycle step per replica-booked request at low load
//! (fewer under load, when a batch carries several steps), fanned out to every
//! replica; one snapshot per replica start-up, of about 9 bytes per
//! prompt block of every in-flight request.

use crate::ids::{DpRank, LocalBlockHash, RequestId, WorkerId};
use crate::routing::SessionId;
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

impl RouterId {
    /// Reads the [`fmt::Display`] form back: exactly 16 hex digits (as the
    /// [`crate::ROUTER_ID_HEADER`] carries it); `None` for anything else.
    pub fn parse_hex(text: &str) -> Option<Self> {
        (text.len() == 16 && text.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u64::from_str_radix(text, 16).ok().map(Self))
            .flatten()
    }
}

/// A router replica's answer to a roll call ([`crate::Subjects::router_roll_call`]):
/// `{"router_id": u64}`, also carried as the reply's [`crate::ROUTER_ID_HEADER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollCallReply {
    /// The replica answering.
    pub router_id: RouterId,
}

/// One change to a request booked by the replica `router_id`: the single-step form of
/// a sync message, which replicas before [`SequenceSyncBatch`] publish (still decoded
/// as a batch of one).
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
///
/// `Serialize` writes its block hashes as an array (the form every replica decodes);
/// a batch for peers that accept packed hashes writes them packed
/// ([`SequenceSyncBatch::with_hashes`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BookedSequence {
    /// The chosen worker.
    pub worker_id: WorkerId,
    /// The chosen data-parallel rank.
    pub dp_rank: DpRank,
    /// The prompt's block hashes, in prefix order (used to count shared prefix blocks
    /// once when the router assumes KV reuse). Decoded from an array or a packed
    /// `bin` (`codec::packed`).
    #[serde(deserialize_with = "crate::codec::packed::deserialize")]
    pub block_hashes: Vec<LocalBlockHash>,
    /// Prompt length in blocks, the partial last block counted.
    pub request_blocks: u32,
    /// Prompt tokens the rank has to prefill (not cached there), in tokens.
    pub prefill_tokens: u64,
    /// How long that prefill is expected to take, in milliseconds; absent when the
    /// booking replica has no estimate (then the prefill load does not decay).
    #[serde(default)]
    pub expected_prefill_ms: Option<u64>,
    /// The session the request belongs to (the route request's `session_id`), so every
    /// replica records the chosen rank as the session's last rank: a session's next
    /// turn may reach any replica of the queue group. Absent without a session, and
    /// from replicas that predate it (their sessions stay per replica).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
}

/// One change to one request, as listed in a [`SequenceSyncBatch`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SequenceStep {
    /// The request, as named by the frontend.
    pub request_id: RequestId,
    /// What changed.
    pub update: SequenceUpdate,
}

impl SequenceStep {
    /// An upper bound of this step's size in a named msgpack encoding, in bytes: 192
    /// bytes of keys and scalars, the request id, and for a booking 9 bytes per block
    /// hash and its session id. Cheap: nothing is encoded.
    pub fn encoded_len_bound(&self) -> usize {
        let booked = match &self.update {
            SequenceUpdate::Booked(b) => Some(b),
            SequenceUpdate::PrefillDone | SequenceUpdate::KeepAlive | SequenceUpdate::Freed => None,
        };
        len_bound(&self.request_id, booked)
    }
}

/// The changes one replica publishes in one message on `{ns}.router.sequences`: the
/// steps its publisher found queued at one wake-up, in the order they were applied.
/// Under load one message carries many steps, so a route costs its replica a fraction
/// of a sync publication instead of two.
///
/// On the wire a map `{router_id, steps: [{request_id, update}, …], queued_at_us,
/// accepts_packed}` (the last two optional); `Serialize` writes bookings' block
/// hashes as arrays, [`Self::with_hashes`] in the form asked. Decoding also
/// accepts the single-step form of a [`SequenceSync`] (`{router_id, request_id,
/// update}`, what replicas before the batch form publish) as a batch of one, so a
/// rolling upgrade keeps applying the older replicas' messages. A map with both forms'
/// fields, or with neither, does not decode.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "SyncWire")]
pub struct SequenceSyncBatch {
    /// The replica that booked the requests and publishes their changes.
    pub router_id: RouterId,
    /// The changes, in the order the replica applied them.
    pub steps: Vec<SequenceStep>,
    /// When the publishing replica queued the batch's first (oldest) step — the
    /// moment it decided that step — in microseconds since the Unix epoch, by its
    /// clock. Peers measure the replication lag from it (only as exact as the two
    /// hosts' clocks agree). Absent from older replicas and from the single-step
    /// form.
    pub queued_at_us: Option<u64>,
    /// The publishing replica decodes bookings whose block hashes are packed
    /// ([`HashForm::Packed`]); absent (false) from replicas before the packed form,
    /// which decode only arrays. A replica packs its bookings only while every peer
    /// it has heard accepts them.
    pub accepts_packed: bool,
}

/// Bytes of steps (by [`SequenceStep::encoded_len_bound`]) after which a publisher
/// stops adding steps to a [`SequenceSyncBatch`]: 64 KiB, a sixteenth of NATS's
/// default `max_payload`. A message holds at most this plus one step.
pub const SYNC_BATCH_BYTES: usize = 64 * 1024;

/// Either form of a sync message, as read from the wire.
#[derive(Deserialize)]
struct SyncWire {
    router_id: RouterId,
    #[serde(default)]
    request_id: Option<RequestId>,
    #[serde(default)]
    update: Option<SequenceUpdate>,
    #[serde(default)]
    steps: Option<Vec<SequenceStep>>,
    #[serde(default)]
    queued_at_us: Option<u64>,
    #[serde(default)]
    accepts_packed: bool,
}

impl TryFrom<SyncWire> for SequenceSyncBatch {
    type Error = &'static str;

    fn try_from(wire: SyncWire) -> Result<Self, Self::Error> {
        let steps = match (wire.request_id, wire.update, wire.steps) {
            (None, None, Some(steps)) => steps,
            (Some(request_id), Some(update), None) => vec![SequenceStep { request_id, update }],
            _ => return Err("a sequence sync carries either `steps` or `request_id` and `update`"),
        };
        Ok(Self {
            router_id: wire.router_id,
            steps,
            queued_at_us: wire.queued_at_us,
            accepts_packed: wire.accepts_packed,
        })
    }
}

impl From<SequenceSync> for SequenceSyncBatch {
    fn from(msg: SequenceSync) -> Self {
        Self {
            router_id: msg.router_id,
            steps: vec![SequenceStep {
                request_id: msg.request_id,
                update: msg.update,
            }],
            queued_at_us: None,
            accepts_packed: false,
        }
    }
}

/// Asks every other replica for the requests it booked and has not freed yet.
/// Published once at start-up on `{ns}.router.sequences.snapshot`, with a reply inbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// The asking replica; a replica ignores its own request.
    pub router_id: RouterId,
    /// The asking replica accepts packed bookings (as on [`SequenceSyncBatch`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accepts_packed: bool,
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
    /// Requests in this chunk, in no particular order; their block hashes are
    /// arrays, whoever asks (a snapshot is answered once per replica start-up).
    #[serde(default)]
    pub requests: Vec<SnapshotEntry>,
    /// The answering replica accepts packed bookings (as on [`SequenceSyncBatch`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accepts_packed: bool,
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
/// bytes (map header, five keys, `router_id`, `chunk`, `last`, array header,
/// `accepts_packed`: 67 at most).
const REPLY_ENVELOPE_BOUND: usize = 80;

impl SnapshotEntry {
    /// An upper bound of this entry's size in a named msgpack encoding, in bytes: 192
    /// bytes of keys and scalars, the request id, 9 bytes per block hash (a u64 is at
    /// most 9 bytes in msgpack) and the session id. Cheap: nothing is encoded.
    pub fn encoded_len_bound(&self) -> usize {
        len_bound(&self.request_id, Some(&self.booked))
    }
}

/// An upper bound of the encoded size of one request's entry (a sync step or a
/// snapshot entry), with its booking if it is one, in bytes: a session id adds its
/// key (11 bytes), a string header (at most 3) and its bytes.
fn len_bound(request_id: &RequestId, booked: Option<&BookedSequence>) -> usize {
    let (hashes, session) = booked.map_or((0, 0), |b| {
        let session = b.session_id.as_ref().map_or(0, |s| 14 + s.as_str().len());
        (b.block_hashes.len(), session)
    });
    192 + request_id.0.len() + 9 * hashes + session
}

impl SnapshotReply {
    /// Splits `requests` into the chunks of one answer, in order: chunk numbers from
    /// 0, `last` on the final one, `accepts_packed` on each (this crate decodes packed
    /// bookings), each at most `max_bytes` encoded (by
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
                accepts_packed: true,
            })
            .collect()
    }
}

mod wire;
pub use wire::HashForm;

#[cfg(test)]
mod tests;
