//! Lifecycle messages from frontends: `prefill_done` moves a request's prefill tokens
//! out of the worker's load, `keep_alive` refreshes its TTL, `freed` releases its
//! decode blocks; for a disaggregated request `remote_prefill_done` moves the prefill
//! half's tokens out of the prefill worker's load, and every event also applies to
//! that half ([`scheduler::lifecycle_steps`]: `prefill_done` frees it). Every one of
//! them restarts the TTL of what it touches.
//!
//! Every replica receives every lifecycle message. The replica that booked the
//! request relays each step it applied to its peers on the sequences subject (see
//! [`crate::replicas`]), one step per booking (request and prefill half); a step
//! that frees load releases queued requests.
//!
//! A message for an unknown request (already freed or expired, not yet synced from
//! another replica, or sent twice), or naming a prefill half's reserved id itself,
//! is counted as rejected and otherwise ignored: load accounting is advisory and
//! must never fail on a frontend's retry.
//!
//! A payload is one message or a batch of them ([`LifecycleBatch`], the gateway's
//! form under load); a batch's messages apply in their order, as if each had come
//! alone.

use crate::admission::Admission;
use crate::gate::admit;
use crate::metrics::counters::{Counters, MessageKind, Outcome};
use kv_events::disaggregation::is_prefill_booking_id;
use kv_events::limits::Limits;
use kv_events::replicas::SequenceUpdate;
use kv_events::routing::LifecycleBatch;
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
    handle_lifecycle_batch(admission, counters, limits, [(subject, payload)]);
}

/// Applies lifecycle payloads, each with its subject and each a single message or a
/// [`LifecycleBatch`], every message in order, under one scheduler lock. A payload
/// refused whole (malformed, over a limit) is counted once and skipped; the others
/// still apply. The intake hands over every message already received (one route's `freed`
/// typically arrives beside others'), so a busy daemon takes the lock, and wakes the
/// queue, once per batch rather than once per message: per message, the lock was
/// contended with the route tasks and each contention cost a futex sleep and wake.
pub(crate) fn handle_lifecycle_batch<'a>(
    admission: &Admission,
    counters: &Counters,
    limits: &Limits,
    payloads: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) {
    let mut messages = Vec::new();
    for (subject, payload) in payloads {
        let Ok(batch) =
            admit::<LifecycleBatch>(counters, limits, MessageKind::Lifecycle, subject, payload)
        else {
            continue; // counted and logged by `admit`; the other payloads still apply
        };
        messages.extend(batch.messages.into_iter().map(|msg| (subject, msg)));
    }
    messages.retain(|(subject, msg)| {
        if is_prefill_booking_id(&msg.request_id) {
            counters.message(MessageKind::Lifecycle, Outcome::Rejected);
            debug!(subject, request_id = %msg.request_id, "lifecycle message for a reserved prefill-half id ignored");
            return false;
        }
        // Before the scheduler lock, for the start-up snapshot (`crate::replica_sync::snapshot`);
        // listing the steps allocates, so only while one is pending.
        if admission.replicas.is_recording() {
            for (request_id, update) in scheduler::lifecycle_steps(&msg.request_id, msg.event) {
                admission.replicas.note_step(&request_id, &update);
            }
        }
        true
    });
    if messages.is_empty() {
        return;
    }
    let mut frees = false;
    {
        let now = Instant::now();
        let mut scheduler = admission.scheduler();
        for (subject, msg) in &messages {
            let id = &msg.request_id;
            match scheduler.lifecycle(id, msg.event, now) {
                Ok(steps) => {
                    for step in &steps {
                        admission.relay_step(step.origin, &step.request_id, step.update.clone());
                    }
                    counters.message(MessageKind::Lifecycle, Outcome::Ok);
                    frees |= steps.iter().any(|s| s.update != SequenceUpdate::KeepAlive);
                }
                Err(e) => {
                    counters.message(MessageKind::Lifecycle, Outcome::Rejected);
                    debug!(subject, request_id = %id, error = %e, "lifecycle message ignored");
                }
            }
        }
    }
    if frees {
        admission.release_waiters();
    }
}

#[cfg(test)]
#[path = "lifecycle_tests.rs"]
mod tests;
