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
//! Cost: one small message per lifecycle step per replica-booked request, fanned
//! out to every replica.

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
}
