//! Busy ranks and the bounded search (`shortcut_bound.rs`): under busy thresholds a
//! rank is a candidate only while it is not busy, so the bound index holds exactly
//! the indexed ranks that are not busy, and the busy ones wait here until they may
//! be free again.
//!
//! Why this is exact with O(log N) work per change: a rank's busy state
//! ([`crate::BusyThresholds::is_busy`], both thresholds, absolute or a fraction of
//! its registered capacity) reads its booked decode blocks and prefill tokens, its
//! latest reported decode blocks and prefill tokens, and its registration. Between
//! two events of the rank, only the booked prefill moves, and only downwards: the
//! oldest in-flight prefill decays linearly toward `P_floor`, the tokens booked
//! behind it (`sequences/rank.rs`). So
//! - a rank that is not busy stays so until its next event (a booking, a prefill
//!   completion, a free or expiry — `ActiveSequences::take_changed` —, a report of
//!   other decode blocks or prefill tokens — `LoadReports::take_changed` —, its own
//!   calibration, or a registration, which rebuilds);
//! - a rank busy with its prefill at `P_floor` stays busy until its next event;
//! - any other busy rank is busy by its decaying oldest prefill, and becomes free at
//!   one instant, found once by a doubling-then-bisection search over the load
//!   projection (≈ 20–30 O(1) projections, to [`PRECISION`]); the rank waits in a
//!   deadline heap, and the first decision after its last busy instant re-evaluates
//!   it (busy → another search; free → back in the index).
//!
//! The search keeps a *last busy* instant (never one after the crossing), so a rank
//! is never out of the index while free. A rank out of the index is busy at any
//! earlier time too (its prefill was higher then); one in the index may not be free
//! at a decision time earlier than its evaluation (callers that read the clock
//! before the scheduler's lock), so such a decision prices the booked ranks, the
//! only ones whose busy state moves with time, exactly (`shortcut_bound.rs`). Cost: one busy check per changed rank (O(1)), plus a
//! search when it is busy by its decaying prefill alone (≈ 1 µs), plus O(log N) per
//! heap entry; stale heap entries (a rank re-evaluated before its deadline) are
//! dropped when they come due, and the heap is rebuilt from the live entries when
//! stale ones outnumber them.

use crate::Scheduler;
use kv_events::WorkerRank;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

/// How close to the crossing the searched *last busy* instant is (at most this early).
pub(crate) const PRECISION: Duration = Duration::from_micros(1);

/// The first step of the doubling search past a decision time.
const FIRST_STEP: Duration = Duration::from_millis(1);

/// A rank's busy state at a decision time, and how long it lasts without an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    /// Not busy: a candidate until its next event.
    Free,
    /// Busy until its next event (time alone does not free it).
    UntilEvent,
    /// Busy at least through this instant (its decaying oldest prefill), free soon
    /// after it unless an event comes first.
    Through(Instant),
}

/// The ranks out of the bound index while busy, and when each may be free.
#[derive(Debug, Default)]
pub(crate) struct BusyRanks {
    /// Each busy rank's last known busy instant (`None`: until its next event).
    until: HashMap<WorkerRank, Option<Instant>>,
    /// `(last busy instant, rank)`, earliest first; an entry is stale once `until`
    /// no longer holds it.
    deadlines: BinaryHeap<Reverse<(Instant, WorkerRank)>>,
}

impl BusyRanks {
    /// Busy ranks held here.
    pub(crate) fn len(&self) -> usize {
        self.until.len()
    }

    /// Forgets every rank (a rebuild).
    pub(crate) fn clear(&mut self) {
        self.until.clear();
        self.deadlines.clear();
    }

    /// Whether `rank` is held here as busy.
    #[cfg(test)]
    pub(crate) fn contains(&self, rank: WorkerRank) -> bool {
        self.until.contains_key(&rank)
    }

    /// Holds `rank` as `busy` (not [`Busy::Free`]): O(log N).
    pub(crate) fn hold(&mut self, rank: WorkerRank, busy: Busy) {
        let deadline = match busy {
            Busy::Free => {
                self.release(rank);
                return;
            }
            Busy::UntilEvent => None,
            Busy::Through(t) => Some(t),
        };
        self.until.insert(rank, deadline);
        if let Some(t) = deadline {
            self.deadlines.push(Reverse((t, rank)));
        }
        if self.deadlines.len() > 2 * self.until.len() + 64 {
            let live = self.until.iter().filter_map(|(&r, &t)| Some((t?, r)));
            self.deadlines = live.map(Reverse).collect();
        }
    }

    /// Lets `rank` go (free, or deregistered).
    pub(crate) fn release(&mut self, rank: WorkerRank) {
        self.until.remove(&rank);
    }

    /// Moves into `due` (and out of here) every rank whose last busy instant is
    /// before `now`: they may be free at `now`.
    pub(crate) fn take_due(&mut self, now: Instant, due: &mut Vec<WorkerRank>) {
        while let Some(&Reverse((t, rank))) = self.deadlines.peek() {
            if t >= now {
                break;
            }
            self.deadlines.pop();
            if self.until.get(&rank) == Some(&Some(t)) {
                self.until.remove(&rank);
                due.push(rank);
            }
        }
    }
}

impl Scheduler {
    /// `rank`'s busy state at `now` under the configured busy thresholds (module
    /// docs); [`Busy::Free`] when none is set or the rank is not registered.
    pub(crate) fn busy_state(&self, rank: WorkerRank, now: Instant) -> Busy {
        let busy = &self.config.busy;
        if !busy.enabled() {
            return Busy::Free;
        }
        let Some(reg) = self.workers.get(rank.worker_id) else {
            return Busy::Free;
        };
        let reported = self.reports.get(rank);
        let busy_at = |t: Instant| busy.is_busy(&self.sequences.load(rank, t), reported, reg);
        if !busy_at(now) {
            return Busy::Free;
        }
        let mut settled = self.sequences.load(rank, now);
        settled.active_prefill_tokens = self.sequences.floor_prefill_tokens(rank);
        if busy.is_busy(&settled, reported, reg) {
            return Busy::UntilEvent;
        }
        // Busy by the decaying oldest prefill alone, which reaches `P_floor` (free)
        // within its expected duration: the doubling step ends the loop.
        let (mut lo, mut step) = (Duration::ZERO, FIRST_STEP);
        let mut hi = loop {
            let Some(t) = now.checked_add(step) else {
                return Busy::Through(now + lo); // beyond the clock: re-checked then
            };
            if !busy_at(t) {
                break step;
            }
            lo = step;
            step = step.saturating_mul(2);
        };
        while hi - lo > PRECISION {
            let mid = lo + (hi - lo) / 2;
            if busy_at(now + mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Busy::Through(now + lo)
    }
}
