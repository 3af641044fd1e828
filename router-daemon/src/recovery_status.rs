//! What the recovery service tells the rest of the daemon about ranks in trouble:
//! [`RecoveryStatus`], a table the service replaces after each step and
//! `/debug/workers` reads. It knows nothing of the service, so the router state can
//! hold it without importing the service.

use kv_events::WorkerRank;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::time::Instant;

/// Why a rank was degraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DegradeReason {
    /// Its publisher answered, but the replies never closed the rank's hole (e.g.
    /// events numbered far ahead of what the publisher has).
    HoleNotClosed,
    /// Its publisher could not be reached, refused, or answered garbage or an error.
    Unreachable,
}

impl DegradeReason {
    /// The metric label and JSON value: `hole_not_closed` or `unreachable`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            DegradeReason::HoleNotClosed => "hole_not_closed",
            DegradeReason::Unreachable => "unreachable",
        }
    }
}

/// Where a rank with recovery trouble stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecoveryPhase {
    /// A recovery is in flight or due now.
    Recovering,
    /// Earlier recoveries did not close the hole; the next one waits until `until`.
    BackingOff,
    /// The budget is spent: needs are given up without a request until `until`.
    Degraded(DegradeReason),
}

/// One rank's entry in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RankStatus {
    /// Where it stands.
    pub phase: RecoveryPhase,
    /// Recoveries in a row that did not close its hole.
    pub failures: u32,
    /// When the backoff or the degraded cool-down ends.
    pub until: Option<Instant>,
    /// Needs given up without a request while degraded.
    pub skipped: u64,
}

/// The `recovery` field of a rank in `/debug/workers`; absent when the rank's
/// events are in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum RankRecoveryView {
    /// A recovery request is in flight or due now.
    Recovering {
        /// Recoveries in a row that did not close the hole.
        failures: u32,
    },
    /// Waiting before the next recovery.
    BackingOff {
        /// Recoveries in a row that did not close the hole.
        failures: u32,
        /// Time until the next request may go out, in ms.
        retry_in_ms: u64,
    },
    /// Not asked any more until the cool-down ends (or the publisher restarts).
    Degraded {
        /// `hole_not_closed` or `unreachable`.
        reason: &'static str,
        /// Recoveries in a row that did not close the hole.
        failures: u32,
        /// Needs given up without a request since it was degraded.
        needs_skipped: u64,
        /// Time until the cool-down ends, in ms.
        retry_after_ms: u64,
    },
}

/// Ranks with recovery trouble, replaced by the recovery service after each step.
/// Ranks in order are absent. Reading costs one lock and a hash lookup.
#[derive(Debug, Default)]
pub struct RecoveryStatus {
    ranks: Mutex<HashMap<WorkerRank, RankStatus>>,
}

impl RecoveryStatus {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerRank, RankStatus>> {
        self.ranks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the table.
    pub(crate) fn publish(&self, ranks: HashMap<WorkerRank, RankStatus>) {
        *self.lock() = ranks;
    }

    /// The entry of `rank`, if it has trouble.
    pub(crate) fn get(&self, rank: WorkerRank) -> Option<RankStatus> {
        self.lock().get(&rank).copied()
    }

    /// The view of `rank` at `now`, for `/debug/workers`.
    pub(crate) fn view(&self, rank: WorkerRank, now: Instant) -> Option<RankRecoveryView> {
        let status = self.get(rank)?;
        let left = |until: Option<Instant>| {
            until.map_or(0, |u| {
                u64::try_from(u.saturating_duration_since(now).as_millis()).unwrap_or(u64::MAX)
            })
        };
        Some(match status.phase {
            RecoveryPhase::Recovering => RankRecoveryView::Recovering {
                failures: status.failures,
            },
            RecoveryPhase::BackingOff => RankRecoveryView::BackingOff {
                failures: status.failures,
                retry_in_ms: left(status.until),
            },
            RecoveryPhase::Degraded(reason) => RankRecoveryView::Degraded {
                reason: reason.label(),
                failures: status.failures,
                needs_skipped: status.skipped,
                retry_after_ms: left(status.until),
            },
        })
    }
}
