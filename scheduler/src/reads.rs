//! The facade's read accessors and engine-reported samples: booked load, the
//! engines' load metrics and their liveness, busy checks and calibration estimates.
//! A second `impl` block of [`Scheduler`], kept apart from the write path in
//! `lib.rs`; every read is O(1) or O(registered ranks).

use crate::Scheduler;
use crate::calibration::RankCalibration;
use crate::liveness::Liveness;
use crate::sequences::{ActiveSequences, RankLoad};
use kv_events::{LoadMetrics, WorkerRank};
use std::time::Instant;

impl Scheduler {
    /// Stores the latest engine-reported sample for its rank, heard at `now` (a sign
    /// of life, see [`crate::liveness`]). Samples of unregistered ranks are ignored (returns
    /// `false`), which bounds memory against departed or unknown workers.
    pub fn update_load_metrics(&mut self, m: LoadMetrics, now: Instant) -> bool {
        let rank = WorkerRank::new(m.worker_id, m.dp_rank);
        if !self.workers.contains_rank(rank) {
            return false;
        }
        self.reports.insert(rank, m, now);
        true
    }

    /// The latest engine-reported sample of `rank`, if any.
    pub fn load_metrics(&self, rank: WorkerRank) -> Option<&LoadMetrics> {
        self.reports.get(rank)
    }

    /// What the silence of `rank`'s load metrics says at `now`, and since when it
    /// reported last (`None`: never since it registered).
    pub fn liveness(&self, rank: WorkerRank, now: Instant) -> (Liveness, Option<Instant>) {
        let heard = self.reports.heard(rank);
        (self.config.liveness.classify(heard, now), heard)
    }

    /// The load booked on `rank` now (wall clock); zeros when none.
    pub fn rank_load(&self, rank: WorkerRank) -> RankLoad {
        self.rank_load_at(rank, Instant::now())
    }

    /// The load booked on `rank` at `now`; zeros when none.
    pub fn rank_load_at(&self, rank: WorkerRank, now: Instant) -> RankLoad {
        self.sequences.load(rank, now)
    }

    /// Booked load of every registered rank now (wall clock), in rank order.
    pub fn rank_loads(&self) -> impl Iterator<Item = (WorkerRank, RankLoad)> + '_ {
        let now = Instant::now();
        self.workers
            .ranks()
            .iter()
            .map(move |&rank| (rank, self.sequences.load(rank, now)))
    }

    /// Whether `rank` is registered and busy at `now` (see [`crate::BusyThresholds`]).
    pub fn is_busy_at(&self, rank: WorkerRank, now: Instant) -> bool {
        self.workers.get(rank.worker_id).is_some_and(|reg| {
            rank.dp_rank.0 < reg.dp_size
                && self.config.busy.is_busy(
                    &self.sequences.load(rank, now),
                    self.reports.get(rank),
                    reg,
                )
        })
    }

    /// Number of booked, not yet freed requests over all ranks.
    pub fn active_requests(&self) -> usize {
        self.sequences.len()
    }

    /// Read access to the booked requests.
    pub fn sequences(&self) -> &ActiveSequences {
        &self.sequences
    }

    /// What online calibration learned about `rank` (`None` when it is off).
    pub fn calibration(&self, rank: WorkerRank) -> Option<RankCalibration> {
        self.calibration.report(rank)
    }

    /// Sessions held by session affinity (at most its capacity).
    pub fn sessions_held(&self) -> usize {
        self.sessions.len()
    }
}
