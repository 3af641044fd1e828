//! What the indexer asks its owner to fetch when it cannot apply a worker rank's
//! events in order: [`RecoveryNeed`].
//!
//! The indexer never does I/O. When it detects a gap in a rank's `event_id`s, a
//! `Stored` event whose parent it does not hold, an overflowing recovery buffer, or is
//! asked to resync a rank, it emits a `RecoveryNeed`: the
//! `RecoveryRequest` to send to the rank's
//! publisher and a [`RecoveryToken`] identifying this attempt. The owner (the daemon's
//! recovery task, or a test) fetches the reply and hands it back with the token
//! (`apply_recovered`), or reports that it gave up (`abandon_recovery`). A reply whose
//! token is not the rank's current one (superseded by a newer need, or the worker was
//! removed meanwhile) is ignored, so late or duplicated replies are harmless.

use kv_events::WorkerRank;
use kv_events::recovery::RecoveryRequest;
use std::fmt;

/// Identifies one recovery attempt of one rank; unique within an indexer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecoveryToken(pub u64);

impl fmt::Display for RecoveryToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// Why a recovery was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryReason {
    /// An event arrived ahead of the next expected `event_id`.
    Gap {
        /// The `event_id` the rank's cursor expected.
        expected: u64,
        /// The `event_id` that arrived.
        received: u64,
    },
    /// An in-order `Stored` event named a parent block the rank does not hold: the
    /// index has diverged from the publisher, a dump is requested.
    UnknownParent,
    /// The rank's recovery buffer overflowed while waiting; a dump replaces it.
    BufferOverflow,
    /// An event arrived further ahead of the cursor than the recovery buffer holds
    /// (no journal serves such a range, and a forged id would pin the buffer): the
    /// event is dropped and a dump, which covers it if it was real, is requested.
    FarAhead {
        /// The `event_id` the rank's cursor expected.
        expected: u64,
        /// The `event_id` that arrived.
        received: u64,
    },
    /// The owner asked for the rank's full state (daemon start-up).
    Resync,
    /// A recovery reply left a gap or could not be used; asking again.
    Retry,
}

impl RecoveryReason {
    /// A short lowercase name, for log fields and metric labels.
    pub fn label(&self) -> &'static str {
        match self {
            RecoveryReason::Gap { .. } => "gap",
            RecoveryReason::UnknownParent => "unknown_parent",
            RecoveryReason::BufferOverflow => "buffer_overflow",
            RecoveryReason::FarAhead { .. } => "far_ahead",
            RecoveryReason::Resync => "resync",
            RecoveryReason::Retry => "retry",
        }
    }
}

/// A recovery the indexer needs its owner to perform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryNeed {
    /// The worker rank to recover; the request goes to its worker's recovery subject.
    pub rank: WorkerRank,
    /// Pass back with the reply.
    pub token: RecoveryToken,
    /// What to ask the publisher.
    pub request: RecoveryRequest,
    /// Why.
    pub reason: RecoveryReason,
}
