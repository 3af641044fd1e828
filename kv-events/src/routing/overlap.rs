//! The overlap query: how much of a prompt's prefix does a rank hold *now*?
//!
//! **Why.** A route decision reads the index at one moment. An engine may serve a
//! prefix from its cache whose `Stored` events were still on their way to the router
//! at that moment (stored by a request already freed, so no booking's
//! [`super::RouteDecision::in_flight_blocks`] names them): it then reports more cached
//! tokens than the router predicted although the router's picture was only late, not
//! wrong. A frontend that sees such an under-claim asks `{ns}.router.overlap`
//! ([`crate::Subjects::router_overlap`]) how many leading blocks of the prefix the
//! engine served the chosen rank holds now. Prefix match is deterministic, so an index
//! that now holds the prefix either learned it after the decision or not at all: a
//! worker whose events never arrive or never match the router's hashes (hash seed,
//! salt, block size, tokenizer) never gets its under-claims confirmed this way.
//!
//! The request that was served does not store the blocks it found cached (it did not
//! compute them), so its own `Stored` events cannot make the index hold the served
//! prefix. In approximate mode (no KV events) the index holds what the router itself
//! routed, including the request being judged: the answer says so
//! ([`OverlapAnswer::approximate`]) and proves nothing.

use super::RouteError;
use super::removals::EventPosition;
use crate::ids::{DpRank, LocalBlockHash, WorkerId};
use serde::{Deserialize, Serialize};

/// The most block hashes one [`OverlapQuery`] may carry: 4,096 blocks (64Ki tokens at
/// 16 tokens a block) covers the cached prefix of all but the longest prompts, keeps a
/// query under 40 KB of msgpack, and bounds the router's work per query to one index
/// walk of that many blocks.
pub const MAX_OVERLAP_HASHES: usize = 4096;

/// "How many leading blocks of `block_hashes` does this rank hold now?", asked on
/// `{ns}.router.overlap` (queue group `{ns}-router`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapQuery {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
    /// Block hashes of the prompt from its first block, in prompt order, at most
    /// [`MAX_OVERLAP_HASHES`] (more is a `bad_request`).
    #[serde(
        serialize_with = "crate::codec::packed::serialize",
        deserialize_with = "crate::codec::packed::deserialize"
    )]
    pub block_hashes: Vec<LocalBlockHash>,
}

/// What the router's index holds of a prefix on one rank now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapAnswer {
    /// Leading blocks of the query's `block_hashes` the rank holds on the GPU tier
    /// (the prefix match a route decision scores), in blocks; 0 for a rank the router
    /// does not know.
    pub overlap_blocks: u32,
    /// The rank's KV event position now (as in the route reply's `kv_position`):
    /// comparing it with the decision's tells whether events were applied since.
    /// Absent when the router keeps no removals (`--removals-per-rank 0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_position: Option<EventPosition>,
    /// True when the router indexes its own routing decisions instead of KV events
    /// (approximate mode): the overlap then includes the prompts it routed, and says
    /// nothing of what the engine stored.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approximate: bool,
}

/// The reply to an [`OverlapQuery`]: `{"status": "answered", ...answer}` or
/// `{"status": "error", "code": ..., "message": ...}` (code `bad_request` for an
/// undecodable or over-long query, `internal` when the index is shutting down).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum OverlapReply {
    /// The router's answer.
    Answered(OverlapAnswer),
    /// The query was refused.
    Error(RouteError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::RouteErrorCode;
    use crate::{decode, encode};

    /// The query and both replies round-trip; an answer with no position from a KV
    /// events router names neither optional field, and decodes without them.
    #[test]
    fn overlap_messages_round_trip() {
        let query = OverlapQuery {
            worker_id: WorkerId(7),
            dp_rank: DpRank(1),
            block_hashes: vec![LocalBlockHash(u64::MAX), LocalBlockHash(3)],
        };
        assert_eq!(
            decode::<OverlapQuery>(&encode(&query).unwrap()).unwrap(),
            query
        );
        let plain = OverlapReply::Answered(OverlapAnswer {
            overlap_blocks: 2,
            kv_position: None,
            approximate: false,
        });
        let bytes = encode(&plain).unwrap();
        for key in [&b"kv_position"[..], b"approximate"] {
            assert!(!bytes.windows(key.len()).any(|w| w == key));
        }
        assert_eq!(decode::<OverlapReply>(&bytes).unwrap(), plain);
        let full = OverlapReply::Answered(OverlapAnswer {
            overlap_blocks: 0,
            kv_position: Some(EventPosition {
                epoch: 1,
                event_id: 4,
            }),
            approximate: true,
        });
        assert_eq!(
            decode::<OverlapReply>(&encode(&full).unwrap()).unwrap(),
            full
        );
        let refused = OverlapReply::Error(RouteError {
            code: RouteErrorCode::BadRequest,
            message: "too many".into(),
        });
        assert_eq!(
            decode::<OverlapReply>(&encode(&refused).unwrap()).unwrap(),
            refused
        );
    }
}
