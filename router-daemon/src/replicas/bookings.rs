//! The records behind a replica's side of the sync, below admission: its own
//! in-flight bookings (to answer peers' snapshot requests from), the steps it saw
//! while its own start-up snapshot was pending, and the one way a peer's booking —
//! live or from a snapshot reply — becomes a scheduler event.
//!
//! Costs: 8 bytes per prompt block hash of each own in-flight request (shared with
//! the published message), and at most [`RECENT_STEPS_CAPACITY`] recorded steps
//! during start-up.

use kv_events::replicas::BookedSequence;
use kv_events::{RequestId, RouterId, WorkerRank};
use scheduler::{AddRequest, Origin, PrefillLoadHint, Scheduler, SequenceEvent};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// Most steps recorded while the start-up snapshot is pending; beyond it the oldest
/// are forgotten. Bounds memory when start-up waits long (etcd down) under load.
pub(crate) const RECENT_STEPS_CAPACITY: usize = 100_000;

/// Own bookings are pruned when they reach this many entries, and then at twice the
/// number left.
const MIN_PRUNE_AT: usize = 1024;

/// A step recorded while the start-up snapshot is pending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecentStep {
    /// The request's prefill completed.
    PrefillDone,
    /// The request was freed (dominates a prefill-done).
    Freed,
}

/// Steps seen since the sequences subscription started, by request id, bounded by
/// [`RECENT_STEPS_CAPACITY`] (oldest forgotten first).
#[derive(Debug, Default)]
pub(crate) struct RecentSteps {
    steps: HashMap<RequestId, RecentStep>,
    order: VecDeque<RequestId>,
}

impl RecentSteps {
    /// Records `step` for `id`; a freed request stays freed.
    pub(crate) fn note(&mut self, id: &RequestId, step: RecentStep) {
        if let Some(known) = self.steps.get_mut(id) {
            if step == RecentStep::Freed {
                *known = RecentStep::Freed;
            }
            return;
        }
        if self.order.len() >= RECENT_STEPS_CAPACITY
            && let Some(oldest) = self.order.pop_front()
        {
            self.steps.remove(&oldest);
        }
        self.steps.insert(id.clone(), step);
        self.order.push_back(id.clone());
    }

    /// The step recorded for `id`, if any.
    pub(crate) fn get(&self, id: &RequestId) -> Option<RecentStep> {
        self.steps.get(id).copied()
    }
}

/// This replica's own in-flight bookings, as they were published, to answer
/// snapshot requests from. Entries are added at booking and removed when the
/// request is freed or expires; requests dropped with their worker leave stale
/// entries, which answers skip and which are pruned once the map doubles.
#[derive(Debug)]
pub(crate) struct OwnBookings {
    map: HashMap<RequestId, Arc<BookedSequence>>,
    prune_at: usize,
}

impl Default for OwnBookings {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            prune_at: MIN_PRUNE_AT,
        }
    }
}

impl OwnBookings {
    /// Keeps a booking. Returns true when the map has grown enough to be pruned.
    pub(crate) fn insert(&mut self, id: RequestId, booked: Arc<BookedSequence>) -> bool {
        self.map.insert(id, booked);
        self.map.len() >= self.prune_at
    }

    /// Forgets a booking.
    pub(crate) fn remove(&mut self, id: &RequestId) {
        self.map.remove(id);
    }

    /// Entries kept (stale ones included).
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Drops the entries the scheduler no longer holds as our own.
    pub(crate) fn prune(&mut self, scheduler: &Scheduler) {
        self.map.retain(|id, _| is_own(scheduler, id));
        self.prune_at = (self.map.len() * 2).max(MIN_PRUNE_AT);
    }

    /// The bookings the scheduler still holds as our own, with whether their prefill
    /// completed: the body of a snapshot answer. Cheap (reference counts only), so
    /// it can run under the scheduler lock.
    pub(crate) fn current(
        &self,
        scheduler: &Scheduler,
    ) -> Vec<(RequestId, Arc<BookedSequence>, bool)> {
        self.map
            .iter()
            .filter_map(|(id, booked)| {
                let active = scheduler.sequences().get(id)?;
                (active.origin == Origin::Local)
                    .then(|| (id.clone(), booked.clone(), active.prefill_done))
            })
            .collect()
    }
}

fn is_own(scheduler: &Scheduler, id: &RequestId) -> bool {
    scheduler
        .sequences()
        .get(id)
        .is_some_and(|r| r.origin == Origin::Local)
}

/// The write-model event booking `booked` for the peer `router_id`: a live `booked`
/// message and a snapshot reply entry take this same path.
pub(crate) fn booked_event(
    router_id: RouterId,
    request_id: RequestId,
    b: BookedSequence,
) -> SequenceEvent {
    SequenceEvent::AddRequest(AddRequest {
        request_id,
        rank: WorkerRank::new(b.worker_id, b.dp_rank),
        block_hashes: b.block_hashes,
        request_blocks: b.request_blocks,
        prefill: PrefillLoadHint {
            initial_effective_prefill_tokens: b.prefill_tokens,
            expected_prefill_duration: b.expected_prefill_ms.map(Duration::from_millis),
        },
        origin: Origin::Peer(router_id),
        session_id: b.session_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booked(worker: u64) -> BookedSequence {
        BookedSequence {
            worker_id: kv_events::WorkerId(worker),
            dp_rank: kv_events::DpRank(0),
            block_hashes: vec![kv_events::LocalBlockHash(1), kv_events::LocalBlockHash(2)],
            request_blocks: 3,
            prefill_tokens: 12,
            expected_prefill_ms: None,
            session_id: None,
        }
    }

    #[test]
    fn recent_steps_keep_freed_and_forget_the_oldest() {
        let mut steps = RecentSteps::default();
        steps.note(&"a".into(), RecentStep::Freed);
        steps.note(&"a".into(), RecentStep::PrefillDone);
        assert_eq!(steps.get(&"a".into()), Some(RecentStep::Freed));
        steps.note(&"b".into(), RecentStep::PrefillDone);
        steps.note(&"b".into(), RecentStep::Freed);
        assert_eq!(steps.get(&"b".into()), Some(RecentStep::Freed));
        for i in 0..RECENT_STEPS_CAPACITY {
            steps.note(&format!("r{i}").into(), RecentStep::Freed);
        }
        assert_eq!(
            steps.get(&"a".into()),
            None,
            "the oldest is forgotten first"
        );
        assert_eq!(steps.get(&"r0".into()), Some(RecentStep::Freed));
        assert_eq!(steps.steps.len(), RECENT_STEPS_CAPACITY);
    }

    #[test]
    fn own_bookings_ask_to_be_pruned_when_they_double() {
        let mut own = OwnBookings::default();
        let wants: Vec<bool> = (0..MIN_PRUNE_AT)
            .map(|i| own.insert(format!("r{i}").into(), Arc::new(booked(1))))
            .collect();
        assert!(wants[..MIN_PRUNE_AT - 1].iter().all(|w| !w));
        assert!(wants[MIN_PRUNE_AT - 1]);
        own.remove(&"r0".into());
        assert_eq!(own.len(), MIN_PRUNE_AT - 1);
    }
}
