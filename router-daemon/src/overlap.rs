//! The `{ns}.router.overlap` service: how much of a prefix does a rank hold now
//! ([`kv_events::routing::overlap`])?
//!
//! **Why.** The gateway's cache-parity monitor sees an under-claim when an engine
//! served a prefix whose `Stored` events had not reached the index when the route was
//! decided. Asking the index again after the answer tells a late picture (the index
//! now holds the prefix) from a wrong one (it still does not: events that never arrive
//! or never match the router's hashes). Served on the main NATS connection with the
//! removals service, not on the route thread: a query is rare (a few per thousand
//! answers) and must not delay routing.
//!
//! **Cost.** Per query: one decode bounded by
//! [`kv_events::routing::overlap::MAX_OVERLAP_HASHES`] hashes, one index walk over
//! them (the walk a route request of that prompt does) and one position read under the
//! removals lock. Nothing is kept.

use crate::metrics::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use indexer::IndexerApi as _;
use kv_events::WorkerRank;
use kv_events::routing::overlap::{OverlapAnswer, OverlapQuery, OverlapReply};
use kv_events::routing::{RouteError, RouteErrorCode};

/// Decodes and answers one overlap query received on `subject`; an undecodable or
/// over-long one gets a `bad_request` reply, an index shutting down `internal`.
pub(crate) async fn handle(state: &RouterState, subject: &str, payload: &[u8]) -> OverlapReply {
    let kind = MessageKind::Overlap;
    let admitted =
        crate::gate::admit::<OverlapQuery>(&state.counters, &state.limits, kind, subject, payload);
    let query = match admitted {
        Ok(query) => query,
        Err(refusal) => return refused(RouteErrorCode::BadRequest, refusal.to_string()),
    };
    let rank = WorkerRank::new(query.worker_id, query.dp_rank);
    match state.indexer.find_matches(query.block_hashes).await {
        Ok(scores) => {
            state.counters.message(kind, Outcome::Ok);
            OverlapReply::Answered(OverlapAnswer {
                overlap_blocks: scores.get(rank),
                kv_position: state.removals.position(rank),
                approximate: state.indexer.is_approximate(),
            })
        }
        Err(e) => {
            state.counters.message(kind, Outcome::Rejected);
            refused(
                RouteErrorCode::Internal,
                format!("indexer unavailable: {e}"),
            )
        }
    }
}

fn refused(code: RouteErrorCode, message: String) -> OverlapReply {
    OverlapReply::Error(RouteError { code, message })
}

#[cfg(test)]
#[path = "overlap_tests.rs"]
mod tests;
