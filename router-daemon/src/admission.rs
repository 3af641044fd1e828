//! Admission: turning a route query into a booking — now, after a wait in the queue,
//! or never — and keeping booked load honest afterwards.
//!
//! ```text
//!  route query ──► queue empty? ──yes──► Scheduler::schedule ──ok──► booked ──► reply
//!                     │ no                      │ AllBusy                 │
//!                     ▼                         ▼                         └─► sync "booked"
//!                  WaitQueue::push ◄────────────┘   (full → overloaded)
//!                     │ wait ≤ max_wait (→ overloaded)
//!                     ▼
//!  load frees ──► release_waiters ──► Scheduler::schedule_batch (queue order) ──► reply
//!   (lifecycle, peer sync, expiry, worker added/removed, engine metrics)
//!
//!  expiry task: sleep until the earliest request deadline (woken early by a booking
//!  with an earlier one, `crate::expiry`) ──► Scheduler::expire ──► sync "freed" for
//!  own ──► release_waiters
//! ```
//!
//! A batch route ([`Admission::admit_batch`]) books every entry it can at once, in one
//! scheduler critical section, and never waits: entries that find every rank busy, or
//! arrive while others wait, are refused.
//!
//! Locks are taken queue first, then scheduler, never the other way round. Sync
//! messages are queued while the scheduler lock is held, so peers see a replica's
//! steps in the order it applied them.
//!
//! Admission owns the scheduler lock: *select* and *book* are a single atomic step,
//! so two concurrent queries can never both see a worker as idle and pile onto it.
//! The critical section is a scan over registered ranks (microseconds), so the lock is
//! not a throughput limit at the query rates a router replica sees. Everything else
//! that reads or changes booked load (lifecycle, replica sync, discovery, metrics)
//! takes the lock through [`Admission::scheduler`].

use crate::expiry::ExpiryWake;
use crate::metrics::{AdmissionMetrics, QueueMetrics};
use crate::queue::{QueueConfig, QueueError, WaitQueue};
use crate::replicas::{ReplicaConfig, Replicas};
use indexer::OverlapScores;
use kv_events::replicas::SequenceUpdate;
use prometheus::IntCounter;
pub use scheduler::Origin;
use scheduler::{BatchOrder, ScheduleRequest, Scheduler, SchedulerError, Selection};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

/// Settings of admission: the wait queue and replica sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// The wait queue for requests that find every rank busy.
    pub queue: QueueConfig,
    /// This replica's identity and sync switch.
    pub replicas: ReplicaConfig,
}

/// Why a request was not booked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AdmitError {
    /// The scheduler refused it (no workers, pinned rank unavailable, bad override,
    /// duplicate id).
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// It could not wait (queue full, duplicate waiter, shutting down).
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// It waited the maximum time without a rank freeing up.
    #[error("every eligible worker stayed busy for {0:?}")]
    TimedOut(Duration),
    /// Part of a batch that arrived while other requests wait for a free rank: a
    /// batch does not wait, and does not overtake the waiters.
    #[error("requests are waiting for a free worker; a batch does not wait")]
    WaitersAhead,
}

/// The scheduler and everything that decides when a request is booked.
pub struct Admission {
    /// Worker selection and active-request load.
    scheduler: Mutex<Scheduler>,
    /// Requests waiting for a rank to have room.
    pub queue: WaitQueue,
    /// Sequence sync with peer replicas.
    pub replicas: Replicas,
    /// Wakes the expiry task when a booking's deadline comes before the one it sleeps
    /// until.
    pub expiry: ExpiryWake,
    /// `kv_router_requests_expired_total`: bookings dropped because no lifecycle
    /// message arrived within the request TTL.
    pub expired: IntCounter,
}

impl Admission {
    /// Admission over `scheduler`; the queue reports depth and wait time to
    /// `queue_metrics`, and the other counters go to `metrics`.
    pub fn new(
        config: &AdmissionConfig,
        scheduler: Scheduler,
        queue_metrics: QueueMetrics,
        metrics: AdmissionMetrics,
    ) -> Self {
        Self {
            scheduler: Mutex::new(scheduler),
            queue: WaitQueue::new(config.queue, queue_metrics, metrics.outcomes),
            replicas: Replicas::new(config.replicas, metrics.sync),
            expiry: ExpiryWake::default(),
            expired: metrics.expired,
        }
    }

    /// Locks the scheduler. A panic while holding the lock cannot leave the scheduler
    /// half-updated in a way that matters more than stopping routing would, so a
    /// poisoned lock is recovered rather than propagated.
    pub(crate) fn scheduler(&self) -> MutexGuard<'_, Scheduler> {
        self.scheduler
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Books `request` at once if a rank has room and nobody waits; otherwise waits in
    /// the queue (FCFS within `priority`) up to the configured maximum.
    ///
    /// # Errors
    /// [`AdmitError`]; nothing is booked on error.
    pub(crate) async fn admit(
        &self,
        request: ScheduleRequest,
        overlaps: OverlapScores,
        priority: i32,
    ) -> Result<Selection, AdmitError> {
        let mut ticket = {
            let mut queue = self.queue.lock();
            let mut scheduler = self.scheduler();
            // Read under the lock: decision times then never step back between
            // decisions (an earlier one makes the bounded search price every booked
            // rank, `scheduler/src/shortcut_bound.rs`).
            let now = Instant::now();
            if queue.is_empty() {
                match scheduler.schedule(&request, &overlaps, now) {
                    Ok(selection) => {
                        self.replicas.booked(&request, &selection);
                        self.expiry.booked(&scheduler);
                        drop(scheduler);
                        drop(queue);
                        return Ok(selection);
                    }
                    Err(SchedulerError::AllBusy) => self
                        .queue
                        .push(&mut queue, request, overlaps, priority, now)?,
                    Err(e) => return Err(e.into()),
                }
            } else {
                if scheduler.sequences().contains(&request.request_id) {
                    return Err(SchedulerError::DuplicateRequest(request.request_id).into());
                }
                // Behind the waiters, then one release pass in queue order: earlier waiters
                // keep their turn, and a waiter pinned to a busy rank does not block this
                // request if another rank has room.
                let ticket = self
                    .queue
                    .push(&mut queue, request, overlaps, priority, now)?;
                let released = self.queue.release(&mut queue, &mut scheduler, now, |r, s| {
                    self.replicas.booked(r, s);
                });
                if released.routed > 0 {
                    self.expiry.booked(&scheduler);
                }
                ticket
            }
        };
        let max_wait = self.queue.config().max_wait;
        match tokio::time::timeout(max_wait, &mut ticket.receiver).await {
            Ok(Ok(result)) => result.map_err(AdmitError::from),
            Ok(Err(_closed)) => Err(QueueError::Closed.into()),
            Err(_elapsed) => {
                let withdrawn = {
                    let mut queue = self.queue.lock();
                    self.queue.withdraw(&mut queue, &ticket)
                };
                if withdrawn {
                    return Err(AdmitError::TimedOut(max_wait));
                }
                // Released in the instant the timer fired: the answer is already there.
                match ticket.receiver.try_recv() {
                    Ok(result) => result.map_err(AdmitError::from),
                    Err(_) => Err(QueueError::Closed.into()),
                }
            }
        }
    }

    /// Books a batch at once ([`scheduler::Scheduler::schedule_batch`]): each request is
    /// placed seeing the bookings of those placed before it, in `order`. A batch never
    /// waits: while requests wait in the queue every entry fails with
    /// [`AdmitError::WaitersAhead`] (the waiters keep their turn), and an entry that finds
    /// every eligible rank busy fails with `AllBusy`. Returns one result per request, in
    /// input order; each booked one is announced to peer replicas.
    pub(crate) fn admit_batch(
        &self,
        batch: &[(ScheduleRequest, OverlapScores)],
        order: BatchOrder,
    ) -> Vec<Result<Selection, AdmitError>> {
        let queue = self.queue.lock();
        if !queue.is_empty() {
            return batch
                .iter()
                .map(|_| Err(AdmitError::WaitersAhead))
                .collect();
        }
        let results = {
            let mut scheduler = self.scheduler();
            let results = scheduler.schedule_batch(batch, order, Instant::now());
            for ((request, _), result) in batch.iter().zip(&results) {
                if let Ok(selection) = result {
                    self.replicas.booked(request, selection);
                }
            }
            if results.iter().any(Result::is_ok) {
                self.expiry.booked(&scheduler);
            }
            results
        };
        drop(queue);
        results
            .into_iter()
            .map(|r| r.map_err(AdmitError::from))
            .collect()
    }

    /// Routes queued requests while ranks have room. Call after anything that may have
    /// reduced load or changed the ranks.
    pub(crate) fn release_waiters(&self) {
        // Every route's `freed` comes here; without waiters, skip the queue lock that
        // the route tasks hold while they book.
        if !self.queue.may_have_waiters() {
            return;
        }
        let mut queue = self.queue.lock();
        if queue.is_empty() {
            return;
        }
        let released = {
            let mut scheduler = self.scheduler();
            let released = self.queue.release(
                &mut queue,
                &mut scheduler,
                Instant::now(),
                |request, selection| {
                    self.replicas.booked(request, selection);
                },
            );
            if released.routed > 0 {
                self.expiry.booked(&scheduler);
            }
            released
        };
        drop(queue);
        if released.routed > 0 {
            debug!(
                routed = released.routed,
                failed = released.failed,
                "queued requests released"
            );
        }
    }

    /// Queues the sync message for a lifecycle step of a request, if this replica booked
    /// it. Call under the scheduler lock, with the origin the scheduler reported.
    pub(crate) fn relay_step(
        &self,
        origin: Origin,
        request_id: &kv_events::RequestId,
        update: SequenceUpdate,
    ) {
        if origin == Origin::Local {
            self.replicas.step(request_id, update);
        }
    }

    /// Frees requests whose TTL lapsed, until `stop`. Sleeps until the earliest deadline;
    /// a new booking wakes it to look again. No polling: with nothing booked it waits for
    /// a booking.
    pub(crate) async fn expire_requests(self: Arc<Self>, stop: CancellationToken) {
        loop {
            let next = {
                let scheduler = self.scheduler();
                let next = scheduler.next_expiry();
                self.expiry.arm(next);
                next
            };
            let wake = self.expiry.notified();
            tokio::select! {
                () = stop.cancelled() => return,
                () = wake => continue,
                () = sleep_until(next) => {}
            }
            let now = Instant::now();
            let expired = {
                let mut scheduler = self.scheduler();
                let expired = scheduler.expire(now);
                for (id, request) in &expired {
                    self.relay_step(request.origin, id, SequenceUpdate::Freed);
                }
                expired
            };
            if expired.is_empty() {
                continue;
            }
            self.expired.inc_by(expired.len() as u64);
            for (id, request) in &expired {
                info!(request_id = %id, rank = %request.rank, "request expired: no lifecycle message within the request ttl");
            }
            self.release_waiters();
        }
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}
