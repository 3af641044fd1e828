//! The bounded wait queue for route requests that arrive while every eligible rank is
//! busy.
//!
//! Order is priority (higher first), then first come, first served. A new request
//! joins the queue whenever the queue is non-empty, even if a rank has just freed, so
//! nobody overtakes a waiter. Waiters are released by events, never by polling:
//! whatever may reduce load — a lifecycle message, a peer's sync message, an expiry,
//! a worker added, fresh engine metrics — calls [`QueueState::release`], which routes
//! the waiters in order through [`scheduler::Scheduler::schedule_batch`] until ranks
//! are busy again. Each waiter holds the overlap scores computed when it arrived (a
//! few milliseconds stale at most under normal load). A full queue answers
//! `overloaded` at once; a waiter that outlives `max_wait` is withdrawn and answered
//! `overloaded` too, so a frontend never receives a booking it has given up on.
//!
//! Costs: one record per waiter (its prompt's block hashes and overlap scores); a
//! release is one scheduling pass over the waiters, stopping at the first unpinned
//! one that still finds every rank busy.

use crate::metrics::{QueueMetrics, QueueOutcomes};
use indexer::OverlapScores;
use kv_events::RequestId;
use scheduler::{BatchOrder, ScheduleRequest, Scheduler, SchedulerError, Selection};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Wait queue settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Most requests waiting at once; 0 disables waiting (all busy → `overloaded`).
    /// A waiting request holds one of the daemon's concurrent route slots, so this
    /// must stay below `--max-inflight-routes` (the daemon checks). Default 128.
    pub capacity: usize,
    /// Longest a request waits before it is answered `overloaded`. Keep it below the
    /// frontends' route request timeout. Default 5 s.
    #[serde(rename = "max_wait_ms", with = "scheduler::config::duration_ms")]
    pub max_wait: Duration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            capacity: 128,
            max_wait: Duration::from_secs(5),
        }
    }
}

/// Why a request could not join the queue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum QueueError {
    /// The queue holds `capacity` waiters already.
    #[error("every eligible worker is busy and the wait queue is full ({0} requests)")]
    Full(usize),
    /// A request with this id is already waiting.
    #[error("request {0} is already waiting")]
    Duplicate(RequestId),
    /// The daemon is shutting down.
    #[error("the router is shutting down")]
    Closed,
}

/// What a waiter is eventually told: its selection, or why it cannot be routed.
pub(crate) type WaitResult = Result<Selection, SchedulerError>;

/// A request's place in the queue.
#[derive(Debug)]
pub(crate) struct Ticket {
    key: Key,
    /// Resolves when the request is routed or refused; closed when the queue closes.
    pub receiver: oneshot::Receiver<WaitResult>,
}

type Key = (Reverse<i32>, u64);

struct Waiter {
    request: ScheduleRequest,
    overlaps: OverlapScores,
    enqueued: Instant,
    reply: oneshot::Sender<WaitResult>,
}

/// The queue's contents, behind [`WaitQueue::lock`]. Lock order: queue, then
/// scheduler.
#[derive(Default)]
pub struct QueueState {
    waiters: BTreeMap<Key, Waiter>,
    ids: HashSet<RequestId>,
    next_seq: u64,
    closed: bool,
}

/// Outcome counts of one [`QueueState::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Released {
    /// Waiters routed.
    pub routed: usize,
    /// Waiters answered with an error (e.g. their pinned rank disappeared).
    pub failed: usize,
}

/// The wait queue and its metrics.
pub struct WaitQueue {
    config: QueueConfig,
    state: Mutex<QueueState>,
    /// Depth gauge and wait-time histogram (`kv_router_queue_depth`,
    /// `kv_router_queue_wait_seconds`).
    metrics: QueueMetrics,
    outcomes: QueueOutcomes,
    /// The number of waiters, written under the queue lock wherever it changes, so
    /// that [`WaitQueue::may_have_waiters`] can skip the lock when nobody waits.
    waiting: AtomicUsize,
}

impl WaitQueue {
    /// An empty queue reporting to `metrics` and `outcomes`.
    pub(crate) fn new(config: QueueConfig, metrics: QueueMetrics, outcomes: QueueOutcomes) -> Self {
        Self {
            config,
            state: Mutex::new(QueueState::default()),
            metrics,
            outcomes,
            waiting: AtomicUsize::new(0),
        }
    }

    /// Whether anyone may wait, without taking the queue lock. Waiters are only added
    /// under both the queue and the scheduler lock, so a caller that changed the
    /// scheduler under its lock and then sees `false` here knows that every later
    /// waiter was queued after seeing that change (and so needs no release for it).
    pub(crate) fn may_have_waiters(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }

    /// Publishes the queue depth to the gauge and to [`WaitQueue::may_have_waiters`].
    /// Call under the queue lock.
    fn set_depth(&self, depth: usize) {
        self.waiting.store(depth, Ordering::Release);
        self.metrics.set_depth(depth);
    }
    pub(crate) fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The outcome counters.
    pub fn outcomes(&self) -> &QueueOutcomes {
        &self.outcomes
    }

    /// Locks the queue. A poisoned lock is recovered: the queue's invariants hold
    /// between statements, and routing must not stop.
    pub fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds a waiter (the caller found every rank busy, or the queue non-empty).
    ///
    /// # Errors
    /// [`QueueError`] when the queue is full, closed, or already holds this id.
    pub(crate) fn push(
        &self,
        state: &mut QueueState,
        request: ScheduleRequest,
        overlaps: OverlapScores,
        priority: i32,
        now: Instant,
    ) -> Result<Ticket, QueueError> {
        let refused = |e: QueueError| {
            self.outcomes.count("refused");
            e
        };
        if state.closed {
            return Err(refused(QueueError::Closed));
        }
        if state.waiters.len() >= self.config.capacity {
            return Err(refused(QueueError::Full(self.config.capacity)));
        }
        if !state.ids.insert(request.request_id.clone()) {
            return Err(refused(QueueError::Duplicate(request.request_id)));
        }
        let key = (Reverse(priority), state.next_seq);
        state.next_seq += 1;
        let (reply, receiver) = oneshot::channel();
        state.waiters.insert(
            key,
            Waiter {
                request,
                overlaps,
                enqueued: now,
                reply,
            },
        );
        self.set_depth(state.waiters.len());
        Ok(Ticket { key, receiver })
    }

    /// Withdraws a waiter whose caller stopped waiting; false when it was already
    /// answered (its result is then in its ticket's receiver).
    pub(crate) fn withdraw(&self, state: &mut QueueState, ticket: &Ticket) -> bool {
        let Some(waiter) = state.waiters.remove(&ticket.key) else {
            return false;
        };
        state.ids.remove(&waiter.request.request_id);
        self.set_depth(state.waiters.len());
        self.outcomes.count("timed_out");
        true
    }

    /// Routes waiters in queue order while ranks have room, at `now`. For each waiter
    /// routed, `on_routed` runs under both locks (the daemon publishes the booking to
    /// its replicas there, keeping sync messages in booking order), then the waiter
    /// gets its selection. Waiters that can never be routed as asked (pinned rank gone,
    /// no workers, freed by their frontend while they waited) get their error, even
    /// while every rank is busy; the rest keep their place.
    pub(crate) fn release(
        &self,
        state: &mut QueueState,
        scheduler: &mut Scheduler,
        now: Instant,
        mut on_routed: impl FnMut(&ScheduleRequest, &Selection),
    ) -> Released {
        let mut released = Released::default();
        if state.waiters.is_empty() {
            return released;
        }
        let keys: Vec<Key> = state.waiters.keys().copied().collect();
        let batch: Vec<(&ScheduleRequest, &OverlapScores)> = state
            .waiters
            .values()
            .map(|w| (&w.request, &w.overlaps))
            .collect();
        let results = scheduler.schedule_batch(&batch, BatchOrder::AsGiven, now);
        for (key, result) in keys.into_iter().zip(results) {
            if matches!(result, Err(SchedulerError::AllBusy)) {
                continue;
            }
            let Some(waiter) = state.waiters.remove(&key) else {
                continue;
            };
            state.ids.remove(&waiter.request.request_id);
            let outcome = match &result {
                Ok(selection) => {
                    on_routed(&waiter.request, selection);
                    released.routed += 1;
                    "routed"
                }
                Err(_) => {
                    released.failed += 1;
                    "failed"
                }
            };
            self.metrics
                .observe_wait(now.saturating_duration_since(waiter.enqueued));
            self.outcomes.count(outcome);
            // The waiter may have given up this instant; its booking then stays until
            // freed or expired, exactly like a frontend that vanishes after routing.
            let _ = waiter.reply.send(result);
        }
        self.set_depth(state.waiters.len());
        released
    }

    /// Refuses new waiters and drops the current ones (their receivers close).
    pub(crate) fn close(&self, state: &mut QueueState) {
        state.closed = true;
        state.waiters.clear();
        state.ids.clear();
        self.set_depth(0);
    }
}

impl QueueState {
    pub(crate) fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Number of waiters.
    pub fn len(&self) -> usize {
        self.waiters.len()
    }
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
