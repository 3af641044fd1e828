//! A frontend's lifecycle events, applied to a request and its prefill half.
//!
//! Frontends name the request id only; a disaggregated request is booked twice (the
//! decode half under its id, the prefill half under `{id}#prefill`), so one event
//! means up to two write-model steps ([`lifecycle_steps`]):
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
//! request has none, and a half freed at `prefill_done` stays freed. Cost: at most
//! two hash lookups and the steps' own costs.

use crate::Scheduler;
use crate::error::SchedulerError;
use crate::sequences::Origin;
use kv_events::RequestId;
use kv_events::disaggregation::{is_prefill_booking_id, prefill_booking_id};
use kv_events::replicas::SequenceUpdate;
use kv_events::routing::LifecycleEvent;
use std::time::Instant;

/// One write-model step a lifecycle event applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LifecycleStep {
    /// The booking it touched: the request's id or its prefill half's.
    pub request_id: RequestId,
    /// What it did: [`SequenceUpdate::PrefillDone`], [`SequenceUpdate::KeepAlive`]
    /// or [`SequenceUpdate::Freed`] (never `Booked`).
    pub update: SequenceUpdate,
    /// Who booked it: a daemon relays the steps of its own ([`Origin::Local`])
    /// bookings to its peers.
    pub origin: Origin,
}

/// The steps `event` for request `id` means, in order: one per booking it touches
/// (module docs give the table). The same for every replica, so a daemon can record
/// them before it applies them.
pub fn lifecycle_steps(id: &RequestId, event: LifecycleEvent) -> Vec<(RequestId, SequenceUpdate)> {
    let half = || prefill_booking_id(id);
    match event {
        LifecycleEvent::RemotePrefillDone => vec![(half(), SequenceUpdate::PrefillDone)],
        LifecycleEvent::PrefillDone => vec![
            (id.clone(), SequenceUpdate::PrefillDone),
            (half(), SequenceUpdate::Freed),
        ],
        LifecycleEvent::KeepAlive => vec![
            (id.clone(), SequenceUpdate::KeepAlive),
            (half(), SequenceUpdate::KeepAlive),
        ],
        LifecycleEvent::Freed => vec![
            (id.clone(), SequenceUpdate::Freed),
            (half(), SequenceUpdate::Freed),
        ],
    }
}

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
                SequenceUpdate::Freed => self.free(&request_id, now),
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
