//! The candidates of one decision: the registered ranks a request (or one half of
//! it) may go to. A second `impl` block of [`Scheduler`], apart from the decision
//! paths in `lib.rs` and `pair.rs` that both start here; O(registered ranks) per
//! call, one registry lookup and one load projection each (`shortcut.rs` looks at
//! fewer ranks where that is exact).

use crate::Scheduler;
use crate::error::SchedulerError;
use crate::liveness::LoadReports;
use crate::overlap::Overlaps;
use crate::policy::{Candidate, PolicyConfig};
use crate::request::ScheduleRequest;
use crate::workers::Side;
use kv_events::WorkerRank;
use std::time::Instant;

/// One decision's inputs (shared by both sides of a pair decision).
pub(crate) struct Ask<'a, O: ?Sized> {
    /// The request.
    pub(crate) req: &'a ScheduleRequest,
    /// Each rank's overlap blocks for its prompt.
    pub(crate) overlaps: &'a O,
    /// The request's resolved policy (it picks the prefill rank).
    pub(crate) policy: &'a PolicyConfig,
    /// The prompt's chained block ids (empty without KV reuse).
    pub(crate) block_ids: &'a [u64],
    /// The decision time.
    pub(crate) now: Instant,
    /// Requests of the batch still to place, this one included.
    pub(crate) batch_remaining: usize,
}

/// What a candidate scan saw, for its error when no candidate is left.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Seen {
    any_registered: bool,
    pinned_exists: bool,
    any_allowed: bool,
}

impl Seen {
    /// Notes a rank admitted as a candidate without [`Scheduler::consider`] (the
    /// shortcut's ranks priced apart, which `consider` would admit).
    pub(crate) fn admit(&mut self) {
        self.any_registered = true;
        self.pinned_exists = true;
        self.any_allowed = true;
    }
}

impl Scheduler {
    /// Fills `self.candidates` with the ranks of `side` eligible for `req`: matching
    /// its pinned dp_rank, not excluded, not silent (quiet ones only when no live one
    /// is left) and not busy, with their overlap, load and new blocks.
    ///
    /// # Errors
    /// [`SchedulerError::NoWorkers`] when no rank of `side` is registered,
    /// [`SchedulerError::RankUnavailable`], [`SchedulerError::AllExcluded`] and
    /// [`SchedulerError::AllBusy`] as [`Scheduler::schedule`] documents.
    pub(crate) fn gather_candidates<O: Overlaps + ?Sized>(
        &mut self,
        req: &ScheduleRequest,
        overlaps: &O,
        block_ids: &[u64],
        now: Instant,
        side: Side,
    ) -> Result<(), SchedulerError> {
        self.candidates.clear();
        self.tiers.clear();
        let mut seen = Seen::default();
        for i in 0..self.workers.ranks().len() {
            let rank = self.workers.ranks()[i];
            self.consider(rank, req, overlaps, block_ids, now, side, &mut seen);
        }
        self.finish_candidates(req, seen)
    }

    /// Adds `rank` to `self.candidates` (and its tier to `self.tiers`) if it is
    /// eligible for `req`; notes in `seen` how far it got.
    #[allow(clippy::too_many_arguments)] // the scan's state, passed through
    pub(crate) fn consider<O: Overlaps + ?Sized>(
        &mut self,
        rank: WorkerRank,
        req: &ScheduleRequest,
        overlaps: &O,
        block_ids: &[u64],
        now: Instant,
        side: Side,
        seen: &mut Seen,
    ) {
        let Some(reg) = self.workers.get(rank.worker_id).filter(|r| side.admits(r)) else {
            return;
        };
        seen.any_registered = true;
        if req.dp_rank.is_some_and(|dp| dp != rank.dp_rank) {
            return;
        }
        seen.pinned_exists = true;
        if req.excludes(rank.worker_id) {
            return;
        }
        seen.any_allowed = true;
        let Some(tier) = self.reports.tier(&self.config.liveness, rank, now) else {
            return; // silent
        };
        let (load, new_blocks) =
            self.sequences
                .load_and_new_blocks(rank, now, block_ids, req.request_blocks);
        if self.config.busy.enabled()
            && self.config.busy.is_busy(&load, self.reports.get(rank), reg)
        {
            return;
        }
        self.tiers.push(tier);
        let overlap_blocks = overlaps.overlap(rank).min(req.reusable_blocks());
        self.candidates.push(Candidate {
            rank,
            overlap_blocks,
            any_tier_blocks: overlaps
                .overlap_any_tier(rank)
                .clamp(overlap_blocks, req.reusable_blocks()),
            load,
            new_blocks,
        });
    }

    /// Keeps the candidates of the best liveness tier; the scan's error when none
    /// is left.
    pub(crate) fn finish_candidates(
        &mut self,
        req: &ScheduleRequest,
        seen: Seen,
    ) -> Result<(), SchedulerError> {
        LoadReports::keep_best(&mut self.candidates, &self.tiers);
        match (
            seen.any_registered,
            req.dp_rank,
            seen.pinned_exists,
            seen.any_allowed,
            self.candidates.is_empty(),
        ) {
            (false, ..) => Err(SchedulerError::NoWorkers),
            (_, Some(dp), false, _, _) => Err(SchedulerError::RankUnavailable(dp)),
            (_, _, _, false, _) => Err(SchedulerError::AllExcluded),
            (_, _, _, _, true) => Err(SchedulerError::AllBusy),
            _ => Ok(()),
        }
    }
}
