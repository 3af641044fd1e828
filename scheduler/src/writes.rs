//! The facade's write-model events after a booking: a peer replica's booking, prefill
//! done, keep-alive, free and expiry. A second `impl` block of [`Scheduler`], kept
//! apart from the decision path in `lib.rs` (as `reads.rs` keeps the reads); each is
//! O(log n + prompt blocks) in the active requests `n` (see [`crate::ActiveSequences`]).

use crate::sequences::{ActiveRequest, Origin, SequenceEvent};
use crate::{Scheduler, SchedulerError};
use kv_events::RequestId;
use kv_events::disaggregation::WorkerRole;
use std::time::Instant;

impl Scheduler {
    /// Applies one write-model event at `now` — the entry point for bookings and
    /// lifecycle steps learned from peer router replicas. Returns the origin of the
    /// request touched.
    ///
    /// # Errors
    /// [`SchedulerError::UnregisteredRank`] for a booking on a rank that is not
    /// registered here; otherwise as [`crate::ActiveSequences::apply`].
    pub fn apply(&mut self, event: SequenceEvent, now: Instant) -> Result<Origin, SchedulerError> {
        match event {
            SequenceEvent::AddRequest(mut add) => {
                let Some(reg) = self
                    .workers
                    .get(add.rank.worker_id)
                    .filter(|_| self.workers.contains_rank(add.rank))
                else {
                    return Err(SchedulerError::UnregisteredRank(add.rank));
                };
                // A peer's session decision: the session's next turn may reach us.
                if let Some(session) = add.session_id.take() {
                    self.sessions.record(&session, add.rank, now);
                }
                // What the rank held before this booking: the features the policy
                // would have priced.
                // A decode worker's booking without prefill tokens is, but for a fully
                // cached prompt, the decode half of a disaggregated request: its
                // first token waits for another engine's prefill and the transfer,
                // which this rank's model does not predict, so it is not learned from.
                let remote_decode = reg.role == WorkerRole::Decode
                    && add.prefill.initial_effective_prefill_tokens == 0;
                let sequences = &self.sequences;
                let features = self
                    .calibration
                    .peer_features(
                        add.prefill.initial_effective_prefill_tokens,
                        || sequences.load(add.rank, now),
                        reg.block_size,
                    )
                    .filter(|_| !remote_decode);
                let (id, rank) = (add.request_id.clone(), add.rank);
                let origin = self.sequences.apply(SequenceEvent::AddRequest(add), now)?;
                if let Some(features) = features {
                    self.calibration.book(&id, rank, features, now);
                }
                Ok(origin)
            }
            SequenceEvent::MarkPrefillCompleted(id) => self.mark_prefill_completed(&id, now),
            SequenceEvent::KeepAlive(id) => self.keep_alive(&id, now),
            SequenceEvent::Free(id) => self.free(&id, now),
        }
    }

    /// The request produced its first token: its prefill tokens leave its rank's load.
    /// Refreshes its TTL.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn mark_prefill_completed(
        &mut self,
        id: &RequestId,
        now: Instant,
    ) -> Result<Origin, SchedulerError> {
        let origin = self.sequences.mark_prefill_completed(id, now)?;
        self.calibration.prefill_done(id, now);
        Ok(origin)
    }

    /// The request is still running: refreshes its TTL.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn keep_alive(&mut self, id: &RequestId, now: Instant) -> Result<Origin, SchedulerError> {
        self.sequences.keep_alive(id, now)
    }

    /// The request ended: everything it booked is released.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn free(&mut self, id: &RequestId, now: Instant) -> Result<Origin, SchedulerError> {
        let origin = self.sequences.free(id, now).map(|r| r.origin)?;
        self.calibration.forget(id);
        Ok(origin)
    }

    /// Frees every request whose TTL lapsed at or before `now`; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<(RequestId, ActiveRequest)> {
        let expired = self.sequences.expire(now);
        for (id, _) in &expired {
            self.calibration.forget(id);
        }
        expired
    }

    /// When the next request expires, if any is active.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.sequences.next_deadline()
    }
}
