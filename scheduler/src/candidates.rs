//! The candidates of one decision: the registered ranks a request (or one half of
//! it) may go to. A second `impl` block of [`Scheduler`], apart from the decision
//! paths in `lib.rs` and `pair.rs` that both start here; O(registered ranks) per
//! call, one registry lookup and one load projection each.

use crate::Scheduler;
use crate::error::SchedulerError;
use crate::liveness::LoadReports;
use crate::overlap::Overlaps;
use crate::policy::Candidate;
use crate::request::ScheduleRequest;
use crate::workers::Side;
use std::time::Instant;

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
        let mut any_registered = false;
        let mut pinned_exists = false;
        let mut any_allowed = false;
        for &rank in self.workers.ranks() {
            let Some(reg) = self.workers.get(rank.worker_id).filter(|r| side.admits(r)) else {
                continue;
            };
            any_registered = true;
            if req.dp_rank.is_some_and(|dp| dp != rank.dp_rank) {
                continue;
            }
            pinned_exists = true;
            if req.excludes(rank.worker_id) {
                continue;
            }
            any_allowed = true;
            let Some(tier) = self.reports.tier(&self.config.liveness, rank, now) else {
                continue; // silent
            };
            let load = self.sequences.load(rank, now);
            if self.config.busy.enabled()
                && self.config.busy.is_busy(&load, self.reports.get(rank), reg)
            {
                continue;
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
                new_blocks: self
                    .sequences
                    .new_blocks(rank, block_ids, req.request_blocks),
            });
        }
        LoadReports::keep_best(&mut self.candidates, &self.tiers);
        match (
            any_registered,
            req.dp_rank,
            pinned_exists,
            any_allowed,
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
