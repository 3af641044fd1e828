//! Waking the request-expiry task only when it has to look again.
//!
//! The expiry task ([`crate::admission::Admission::expire_requests`]) sleeps until
//! the earliest request deadline. Every booking adds a deadline, and used to wake the
//! task, which then locked the scheduler, found the same earliest deadline and re-armed
//! its timer: one more task wake-up (often a thread wake-up) and one more scheduler
//! lock per route (`route_bench`, docs/benchmarks.md). A booking's deadline is its
//! time plus the request TTL, so it is almost never earlier than the one the task
//! sleeps until. Now the task records that deadline ([`ExpiryWake::arm`]), and a
//! booking wakes it only when the scheduler's earliest deadline is earlier, or when
//! it sleeps without one ([`ExpiryWake::booked`]).
//!
//! Both sides read and write the recorded deadline under the scheduler lock, so either
//! a booking sees the deadline the task computed after it, or the task's next look
//! (under the same lock) sees the booking. A deadline that moved later (a freed or
//! refreshed request) only makes the task wake early, find nothing and look again.
//! Cost: one atomic load and one ordered-map lookup per booking.

use scheduler::Scheduler;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;

/// The recorded deadline when the task sleeps without one.
const UNARMED: u64 = u64::MAX;

/// The expiry task's wake-up: the deadline it sleeps until, and its notification.
pub struct ExpiryWake {
    notify: Notify,
    /// The deadline the task sleeps until, in ns after `origin`, or [`UNARMED`].
    /// Relaxed: only read and written under the scheduler lock.
    armed: AtomicU64,
    /// Before every deadline (taken before the scheduler books anything).
    origin: Instant,
}

impl Default for ExpiryWake {
    fn default() -> Self {
        Self {
            notify: Notify::new(),
            armed: AtomicU64::new(UNARMED),
            origin: Instant::now(),
        }
    }
}

impl ExpiryWake {
    /// Wakes the task if `scheduler`'s earliest deadline comes before the one it sleeps
    /// until. Call under the scheduler lock after booking one or more requests.
    pub(crate) fn booked(&self, scheduler: &Scheduler) {
        let Some(next) = scheduler.next_expiry() else {
            return;
        };
        let next = self.nanos(next);
        if next < self.armed.load(Ordering::Relaxed) {
            self.armed.store(next, Ordering::Relaxed);
            self.notify.notify_one();
        }
    }

    /// Records the deadline the task is about to sleep until (`None`: no request is
    /// active). Call under the scheduler lock, with the deadline read under it.
    pub(crate) fn arm(&self, deadline: Option<Instant>) {
        let armed = deadline.map_or(UNARMED, |at| self.nanos(at));
        self.armed.store(armed, Ordering::Relaxed);
    }

    /// Resolves once [`Self::booked`] wakes the task (also when it did so before this
    /// was awaited).
    pub(crate) fn notified(&self) -> Notified<'_> {
        self.notify.notified()
    }

    /// `at` in ns after the origin, below [`UNARMED`].
    fn nanos(&self, at: Instant) -> u64 {
        let ns = at.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(ns).unwrap_or(UNARMED - 1).min(UNARMED - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;
    use indexer::OverlapScores;
    use kv_events::discovery::WorkerRegistration;
    use kv_events::{LocalBlockHash, WorkerId};
    use scheduler::{ScheduleRequest, SchedulerConfig};
    use std::time::Duration;

    fn scheduler() -> Scheduler {
        let mut s = Scheduler::new(SchedulerConfig::default(), Some(1)).expect("default config");
        s.add_worker(WorkerRegistration {
            worker_id: WorkerId(1),
            dp_size: 1,
            block_size: 16,
            total_kv_blocks: 100,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        })
        .expect("a valid registration");
        s
    }

    fn book(s: &mut Scheduler, id: &str, at: Instant) {
        let request = ScheduleRequest::new(id, vec![LocalBlockHash(id.len() as u64)], 16, 16);
        s.schedule(&request, &OverlapScores::new(), at)
            .expect("an idle worker");
    }

    fn woken(wake: &ExpiryWake) -> bool {
        wake.notified().now_or_never().is_some()
    }

    #[test]
    fn a_booking_wakes_the_task_only_before_the_deadline_it_sleeps_until() {
        let (wake, mut s) = (ExpiryWake::default(), scheduler());
        let t0 = Instant::now();
        // Nothing booked: the task sleeps without a deadline; the first booking wakes it.
        wake.arm(s.next_expiry());
        book(&mut s, "a", t0);
        wake.booked(&s);
        assert!(woken(&wake));
        // It sleeps until a's deadline: later bookings expire later and do not wake it.
        wake.arm(s.next_expiry());
        book(&mut s, "bb", t0 + Duration::from_secs(1));
        wake.booked(&s);
        assert!(!woken(&wake), "a later deadline does not wake the task");
        // Armed later than the earliest deadline (say the TTL shrank): woken once.
        wake.arm(s.next_expiry().map(|d| d + Duration::from_secs(3600)));
        wake.booked(&s);
        wake.booked(&s);
        assert!(woken(&wake));
        assert!(
            !woken(&wake),
            "the first wake-up already lowered the armed deadline"
        );
    }
}
