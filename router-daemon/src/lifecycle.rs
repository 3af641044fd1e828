//! Lifecycle messages from frontends: `prefill_done` moves a request's prefill tokens
//! out of the worker's load, `keep_alive` refreshes its TTL, `freed` releases its
//! decode blocks. Every one of them restarts the request's TTL.
//!
//! Every replica receives every lifecycle message. The replica that booked the
//! request relays the step to its peers on the sequences subject (see
//! [`crate::replicas`]); a step that frees load releases queued requests.
//!
//! A message for an unknown request (already freed or expired, not yet synced from
//! another replica, or sent twice) is counted as rejected and otherwise ignored:
//! load accounting is advisory and must never fail on a frontend's retry.

use crate::admission::{relay_step, release_waiters};
use crate::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use kv_events::decode;
use kv_events::replicas::SequenceUpdate;
use kv_events::routing::{LifecycleEvent, LifecycleMessage};
use std::time::Instant;
use tracing::{debug, warn};

/// Applies one lifecycle payload received on `subject`.
pub fn handle_lifecycle(state: &RouterState, subject: &str, payload: &[u8]) {
    let msg: LifecycleMessage = match decode(payload) {
        Ok(m) => m,
        Err(e) => {
            state
                .counters
                .message(MessageKind::Lifecycle, Outcome::Malformed);
            warn!(subject, error = %e, "malformed lifecycle message skipped");
            return;
        }
    };
    let now = Instant::now();
    let id = &msg.request_id;
    // Before the scheduler lock, for the start-up snapshot (`crate::replica_snapshot`).
    state.admission.replicas.note_lifecycle(id, msg.event);
    let result = {
        let mut scheduler = state.scheduler();
        let (result, update) = match msg.event {
            LifecycleEvent::PrefillDone => (
                scheduler.mark_prefill_completed(id, now),
                SequenceUpdate::PrefillDone,
            ),
            LifecycleEvent::KeepAlive => (scheduler.keep_alive(id, now), SequenceUpdate::KeepAlive),
            LifecycleEvent::Freed => (scheduler.free(id, now), SequenceUpdate::Freed),
        };
        if let Ok(origin) = result {
            relay_step(state, origin, id, update);
        }
        result
    };
    match result {
        Ok(_) => {
            state.counters.message(MessageKind::Lifecycle, Outcome::Ok);
            if msg.event != LifecycleEvent::KeepAlive {
                release_waiters(state);
            }
        }
        Err(e) => {
            state
                .counters
                .message(MessageKind::Lifecycle, Outcome::Rejected);
            debug!(subject, request_id = %id, error = %e, "lifecycle message ignored");
        }
    }
}
