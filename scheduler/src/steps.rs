//! The write-model steps of a frontend's lifecycle event: one per booking it touches
//! (the request's, and its prefill half's when it is disaggregated). Pure: the same
//! for every replica, so a daemon can record them before it applies them
//! (`Scheduler::lifecycle` applies them; `lifecycle.rs` has the table).

use crate::sequences::Origin;
use kv_events::RequestId;
use kv_events::disaggregation::prefill_booking_id;
use kv_events::replicas::SequenceUpdate;
use kv_events::routing::LifecycleEvent;

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
