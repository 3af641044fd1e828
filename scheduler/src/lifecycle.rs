//! A frontend's lifecycle events, applied to a request and its prefill half.
//!
//! Frontends name the request id only; a disaggregated request is booked twice (the
//! decode half under its id, the prefill half under `{id}#prefill`), so one event
//! means up to two write-model steps ([`crate::lifecycle_steps`]):
//!
//! | event | `{id}` | `{id}#prefill` |
//! |---|---|---|
//! | `remote_prefill_done` | — | prefill done |
//! | `prefill_done` | prefill done | freed (the transfer is over) |
//! | `keep_alive` | refreshed | refreshed |
//! | `freed` | freed | freed |
//!
//! [`Scheduler::lifecycle`] applies the steps whose booking exists and returns them,
//! so a daemon relays each to its peer replicas, whose copies are plain bookings by
//! id (peers' own steps still arrive one id at a time, through
//! [`Scheduler::apply`]). A step for an absent half is skipped: an aggregated
//! request has none, and a half freed at `prefill_done` stays freed. A `freed` for a
//! request not booked here is remembered for a while, and a route query for it
//! refused (`freed_early.rs`). Cost: at most two hash lookups and the steps' own
//! costs.

use crate::Scheduler;
use crate::error::SchedulerError;
use crate::steps::{LifecycleStep, lifecycle_steps};
use kv_events::RequestId;
use kv_events::disaggregation::is_prefill_booking_id;
use kv_events::replicas::SequenceUpdate;
use kv_events::routing::LifecycleEvent;
use std::time::Instant;

impl Scheduler {
    /// Applies a frontend's lifecycle `event` for request `id` at `now` to the
    /// request and its prefill half; returns the steps applied, in order.
    ///
    /// # Errors
    /// - [`SchedulerError::ReservedRequestId`] when `id` names a prefill half
    ///   (frontends name requests; the router derives the half).
    /// - [`SchedulerError::UnknownRequest`] naming `id` (its prefill half's id for
    ///   `remote_prefill_done`) when no booking the event touches is active
    ///   (freed, expired, never routed, or its worker left).
    pub fn lifecycle(
        &mut self,
        id: &RequestId,
        event: LifecycleEvent,
        now: Instant,
    ) -> Result<Vec<LifecycleStep>, SchedulerError> {
        if is_prefill_booking_id(id) {
            return Err(SchedulerError::ReservedRequestId(id.clone()));
        }
        let steps = lifecycle_steps(id, event);
        // The booking the event is about first: the request's, or for
        // `remote_prefill_done` its prefill half's.
        let named = steps.first().map_or_else(|| id.clone(), |s| s.0.clone());
        let mut applied = Vec::new();
        for (request_id, update) in steps {
            let result = match update {
                SequenceUpdate::PrefillDone => self.mark_prefill_completed(&request_id, now),
                SequenceUpdate::KeepAlive => self.keep_alive(&request_id, now),
                SequenceUpdate::Freed => {
                    let freed = self.free(&request_id, now);
                    // Freed before it was booked here: a query for it read later is
                    // stale (`freed_early.rs`).
                    if freed.is_err() && request_id == *id {
                        self.freed_early.remember(id, now);
                    }
                    freed
                }
                SequenceUpdate::Booked(_) => continue, // never planned
            };
            if let Ok(origin) = result {
                applied.push(LifecycleStep {
                    request_id,
                    update,
                    origin,
                });
            }
        }
        if applied.is_empty() {
            return Err(SchedulerError::UnknownRequest(named));
        }
        Ok(applied)
    }
}
