//! The booking of a picked request, and moving it when the proxy served another pod.
//!
//! The picker names an ordered list (`primary,fb1,…`); the router books the primary
//! only. A proxy that retried down the list reports the pod that answered
//! (`x-gateway-destination-endpoint-served`, in the response's `envoy.lb` metadata or
//! as a response header). When that pod is another registered worker, the load
//! belongs there: the picker routes the request again with that worker as the only
//! eligible one, pinned to the dp_rank it told the proxy (the dp-rank header travels
//! with every retry), and once that booking exists frees the original — the new
//! booking first, so the request is never counted nowhere, and a failed re-route
//! keeps the original. All of it runs in a task of its own after the response
//! headers are answered, so the response path never waits for the router. The
//! re-route repeats the prompt the router saw (block hashes or token ids, kept per
//! open stream: 8 bytes per block or 4 per token).
//!
//! Why a new route query rather than a new lifecycle message: it uses the public
//! protocol as it is (older routers serve it), and the router prices the move as any
//! booking (overlap on the served worker, its prefill tokens), so a move costs one
//! route round trip, only on a mismatch.

use crate::metrics::EppMetrics;
use kv_events::routing::{Prompt, RouteRequest, SessionId};
use kv_events::{DpRank, WorkerId};
use kv_gateway::router::{Booking, RouterClient};
use std::sync::{Arc, Mutex, MutexGuard};
use tracing::{debug, warn};

/// What routing the request again needs.
pub struct Reroute {
    /// The prompt as the router saw it.
    pub prompt: Prompt,
    /// The request's session, if any.
    pub session: Option<SessionId>,
    /// The dp_rank the proxy was told (its header goes with every retry).
    pub dp_rank: DpRank,
}

struct State {
    booking: Option<Booking>,
    worker: WorkerId,
    first_token: bool,
    ended: bool,
}

/// The booking of one picked request, as the stream and a re-booking task share it.
/// Dropping it frees the booking (whichever worker holds it by then).
pub struct Held {
    state: Arc<Mutex<State>>,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock leaves plain flags behind: still usable.
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Held {
    /// Holds `booking`, made on `worker`.
    pub fn new(booking: Booking, worker: WorkerId) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                booking: Some(booking),
                worker,
                first_token: false,
                ended: false,
            })),
        }
    }

    /// The worker holding the booking now.
    pub fn worker(&self) -> WorkerId {
        lock(&self.state).worker
    }

    /// The first response body chunk passed: `prefill_done` (and again on a booking
    /// that moves later).
    pub fn prefill_done(&self) {
        let mut state = lock(&self.state);
        state.first_token = true;
        if let Some(booking) = state.booking.as_mut() {
            booking.prefill_done();
        }
    }

    /// The request ended: `freed` now; a move still under way frees its booking as
    /// soon as it is made.
    pub fn free(&self) {
        let mut state = lock(&self.state);
        state.ended = true;
        let booking = state.booking.take();
        drop(state);
        drop(booking);
    }

    /// Moves the booking to `served` in a task of its own (module docs): routes
    /// `reroute` with `served` as the only eligible worker under a new request id,
    /// then frees the original. Counted as `moved` or `failed`.
    pub fn move_to(
        &self,
        served: WorkerId,
        reroute: Reroute,
        router: RouterClient,
        metrics: EppMetrics,
    ) {
        let state = self.state.clone();
        tokio::spawn(async move {
            let request = RouteRequest {
                dp_rank: Some(reroute.dp_rank),
                eligible_workers: vec![served],
                session_id: reroute.session,
                ..RouteRequest::new(router.request_id(), reroute.prompt)
            };
            let (decision, mut booking) = match router.route_request(&request).await {
                Ok(routed) => routed,
                Err(e) => {
                    warn!(worker = %served, error = %e.message, "the booking stays on the picked worker");
                    metrics.rebooked("failed");
                    return;
                }
            };
            let mut guard = lock(&state);
            if guard.ended {
                drop(guard);
                drop(booking); // the request ended meanwhile: freed at once
                metrics.rebooked("moved");
                return;
            }
            if guard.first_token {
                booking.prefill_done();
            }
            let old = guard.booking.replace(booking);
            guard.worker = decision.worker_id;
            drop(guard);
            debug!(worker = %decision.worker_id, "booking moved to the served worker");
            drop(old);
            metrics.rebooked("moved");
        });
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.free();
    }
}
