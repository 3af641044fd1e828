//! The batch routing service: `RouteBatchRequest` in, `RouteBatchReply` out, on
//! `{ns}.router.route_batch` in the same queue group as single queries.
//!
//! Why a batch: requests that arrive together (parallel sampling with `n > 1`, an
//! offline batch API) placed one query at a time each see the others' bookings only
//! in arrival order and pay one round trip each. Routed together they are placed in
//! one scheduler critical section, in prefix-grouped order by default (TensorRT-LLM's
//! ADP router), and `kv-normalized` sizes its fair share with the whole batch.
//!
//! Per batch: validate every entry (a bad entry fails alone), ask the indexer for
//! every prompt's prefix matches concurrently, then book everything bookable at once
//! ([`crate::admission::Admission::admit_batch`]). A batch never waits in the queue. Cost: one
//! decode and one reply for the batch; the indexer and scheduler work is the same as
//! for single queries.

use crate::metrics::counters::{MessageKind, Outcome};
use crate::route::{admit_error, error, no_block_size, routed, schedule_request};
use crate::state::RouterState;
use futures::future::join_all;
use indexer::IndexerApi as _;
use kv_events::limits::decode_within;
use kv_events::routing::{
    RouteBatchReply, RouteBatchRequest, RouteError, RouteErrorCode, RouteReply,
};
use scheduler::ScheduleRequest;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

fn refuse(code: RouteErrorCode, message: impl Into<String>) -> RouteBatchReply {
    RouteBatchReply::Error(RouteError {
        code,
        message: message.into(),
    })
}

/// Answers one batch payload of at most `max_batch` requests. Counts the batch under
/// `route_batch` and observes every entry's reply in the route metrics.
pub(crate) async fn handle_route_batch(
    state: &RouterState,
    payload: &[u8],
    max_batch: usize,
) -> RouteBatchReply {
    let started = Instant::now();
    let batch: RouteBatchRequest = match decode_within(payload, &state.limits) {
        Ok(b) => b,
        Err(refusal) => {
            let subject = state.subjects.route_batch();
            state
                .counters
                .refused(MessageKind::RouteBatch, &subject, &refusal);
            return refuse(
                RouteErrorCode::BadRequest,
                format!("route batch refused: {refusal}"),
            );
        }
    };
    let count = batch.requests.len();
    if count == 0 || count > max_batch {
        state
            .counters
            .message(MessageKind::RouteBatch, Outcome::Rejected);
        return refuse(
            RouteErrorCode::BadRequest,
            format!("a batch holds 1 to {max_batch} requests, got {count}"),
        );
    }
    let replies = route_batch(state, batch).await;
    state.counters.message(MessageKind::RouteBatch, Outcome::Ok);
    let elapsed = started.elapsed();
    for reply in &replies {
        let outcome = match reply {
            RouteReply::Routed(_) => Outcome::Ok,
            RouteReply::Error(_) => Outcome::Rejected,
        };
        state.counters.message(MessageKind::Route, outcome);
        state.counters.metrics.route.observe(reply, elapsed);
    }
    RouteBatchReply::Answered { replies }
}

async fn route_batch(state: &RouterState, batch: RouteBatchRequest) -> Vec<RouteReply> {
    let order = batch.order;
    let Some(block_size) = state.block_size.get() else {
        return batch.requests.iter().map(|_| no_block_size()).collect();
    };
    // Entries that fail validation keep their error reply; the rest are scheduled.
    let mut replies: Vec<Option<RouteReply>> = Vec::with_capacity(batch.requests.len());
    let mut valid: Vec<(usize, ScheduleRequest)> = Vec::new();
    for (i, request) in batch.requests.into_iter().enumerate() {
        match schedule_request(request, block_size.get()) {
            Ok(schedule) => {
                replies.push(None);
                valid.push((i, schedule));
            }
            Err(reply) => replies.push(Some(reply)),
        }
    }
    let matches = join_all(
        valid
            .iter()
            .map(|(_, s)| state.indexer.find_matches(s.block_hashes.clone())),
    )
    .await;
    let mut bookable = Vec::with_capacity(valid.len());
    let mut positions = Vec::with_capacity(valid.len());
    for ((i, schedule), overlaps) in valid.into_iter().zip(matches) {
        match overlaps {
            Ok(overlaps) => {
                positions.push(i);
                bookable.push((schedule, overlaps));
            }
            Err(e) => {
                replies[i] = Some(error(
                    RouteErrorCode::Internal,
                    format!("indexer unavailable: {e}"),
                ));
            }
        }
    }
    let results = state.admission.admit_batch(&bookable, order);
    let approximate = state.indexer.is_approximate();
    for ((i, (schedule, _)), result) in positions.into_iter().zip(bookable).zip(results) {
        replies[i] = Some(match result {
            Ok(sel) => {
                let hashes = approximate.then(|| schedule.block_hashes.clone());
                routed(
                    state,
                    schedule.request_id,
                    schedule.request_blocks,
                    &sel,
                    hashes,
                )
                .await
            }
            Err(e) => admit_error(e),
        });
    }
    replies
        .into_iter()
        .map(|r| {
            // Every position was filled above: validation, indexer or admission.
            r.unwrap_or_else(|| error(RouteErrorCode::Internal, "request not answered"))
        })
        .collect()
}

/// Serves the batch route subjects (the queue group's and this replica's own) until
/// `intake` is cancelled; batches already being handled are answered before this
/// returns. Every reply carries the `answered_by` headers ([`kv_events::ROUTER_ID_HEADER`]).
pub(crate) async fn serve(
    state: Arc<RouterState>,
    client: async_nats::Client,
    subscribers: Vec<async_nats::Subscriber>,
    max_inflight: usize,
    max_batch: usize,
    intake: CancellationToken,
    answered_by: async_nats::HeaderMap,
) {
    let service = crate::service::Service {
        client,
        max_inflight,
        intake,
        kind: MessageKind::RouteBatch,
        headers: Some(answered_by),
    };
    crate::service::serve_requests(
        state,
        subscribers,
        service,
        move |state, payload| async move { handle_route_batch(&state, &payload, max_batch).await },
    )
    .await;
}
