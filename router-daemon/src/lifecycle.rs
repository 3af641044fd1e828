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

use crate::admission::Admission;
use crate::gate::admit;
use crate::metrics::counters::{Counters, MessageKind, Outcome};
use kv_events::disaggregation::prefill_booking_id;
use kv_events::limits::Limits;
use kv_events::replicas::SequenceUpdate;
use kv_events::routing::{LifecycleEvent, LifecycleMessage};
use std::time::Instant;
use tracing::debug;

/// Applies one lifecycle payload received on `subject` to the scheduler.
pub fn handle_lifecycle(
    admission: &Admission,
    counters: &Counters,
    limits: &Limits,
    subject: &str,
    payload: &[u8],
) {
    let Ok(msg) =
        admit::<LifecycleMessage>(counters, limits, MessageKind::Lifecycle, subject, payload)
    else {
        return; // counted and logged by `admit`
    };
    let now = Instant::now();
    let id = &msg.request_id;
    // Before the scheduler lock, for the start-up snapshot (`crate::replica_sync::snapshot`).
    admission.replicas.note_lifecycle(id, msg.event);
    let half;
    let id = if msg.event == LifecycleEvent::RemotePrefillDone {
        half = prefill_booking_id(id);
        &half
    } else {
        id
    };
    let result = {
        let mut scheduler = admission.scheduler();
        let (result, update) = match msg.event {
            LifecycleEvent::RemotePrefillDone => (
                scheduler.mark_prefill_completed(id, now),
                SequenceUpdate::PrefillDone,
            ),
            LifecycleEvent::PrefillDone => (
                scheduler.mark_prefill_completed(id, now),
                SequenceUpdate::PrefillDone,
            ),
            LifecycleEvent::KeepAlive => (scheduler.keep_alive(id, now), SequenceUpdate::KeepAlive),
            LifecycleEvent::Freed => (scheduler.free(id, now), SequenceUpdate::Freed),
        };
        if let Ok(origin) = result {
            admission.relay_step(origin, id, update);
        }
        result
    };
    match result {
        Ok(_) => {
            counters.message(MessageKind::Lifecycle, Outcome::Ok);
            if msg.event != LifecycleEvent::KeepAlive {
                admission.release_waiters();
            }
        }
        Err(e) => {
            counters.message(MessageKind::Lifecycle, Outcome::Rejected);
            debug!(subject, request_id = %id, error = %e, "lifecycle message ignored");
        }
    }
}
