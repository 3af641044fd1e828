//! The bounded shortcut: a `predicted-ttft` decision on a fleet where most ranks are
//! touched (booked, calibrated), exact, without pricing every rank.
//!
//! The ranks that can hold part of the prompt — the index's matches, the ranks with
//! an in-flight request starting with the prompt's first block, and the ranks whose
//! reports are no longer live — are priced as the full scan prices them. Every other
//! registered rank holds none of the prompt, so its cost has no reuse credit and
//! depends on its own state only: [`crate::cost_bound::BoundIndex`] finds the lowest
//! such cost and every rank at it, best bound first. The fleet-wide figures the
//! policy needs are kept exact:
//! - the smallest in-flight prefill (`P_min`, the credit of matching ranks): the
//!   ranks by ascending `P_floor` until it reaches the smallest `P(now)` seen; that
//!   rank is added as a candidate;
//! - the delay cap's gate (mean in-flight prefill over every candidate below
//!   `spare_steps` steps): decided from Σ `P_floor` ≤ Σ `P(now)` ≤ Σ total prefill,
//!   kept per rank change; only when the threshold lies between them are the booked
//!   ranks' decayed oldest prefills summed (O(booked ranks): an idle rank's `P(now)`
//!   is its `P_floor`, 0).
//!
//! It applies under the plain shortcut's conditions (`shortcut.rs`). The index holds
//! the ranks priced with their own calibration (every rank when calibration is off)
//! that are not busy: their keys change only with the rank's bookings or its own
//! samples, which both report the changed ranks (`take_changed`), so keeping it
//! costs O(log N) per change. The ranks still warming up (*cold*: priced with the
//! fleet prior, which moves with every other rank's samples; a worker that just
//! joined) are priced exactly on every decision, O(cold ranks). The candidates
//! handed to the policy are those priced ranks plus the best ones found, so its
//! choice has the full scan's cost and is uniform over the same exact-tie set.
//!
//! Under busy thresholds a rank is a candidate only while it is not busy, and its
//! busy state also changes with every engine report (its reported decode blocks and
//! prefill tokens) and with time (its decaying oldest prefill falling below the
//! prefill threshold, which no event marks). Busy ranks leave the index and wait in
//! `shortcut_busy.rs` (why that is exact, and its cost): a report of other load
//! re-evaluates its rank (O(log N)), and a rank busy by its decaying prefill alone
//! comes back at its computed crossing (a deadline heap). A decision time earlier
//! than one already seen (concurrent callers take `now` before the lock) also prices
//! the booked ranks exactly, and a fleet where every rank outside the priced ones is
//! busy (nothing to bound) is the full scan.

use crate::Scheduler;
use crate::candidates::{Ask, Seen};
use crate::cost_bound::{BoundIndex, Changed, RankTerms};
use crate::error::SchedulerError;
use crate::liveness::Tier;
use crate::overlap::Overlaps;
use crate::policy::Candidate;
use crate::policy::predicted_ttft::{PredictedTtftConfig, predicted_ttft_cost};
use crate::shortcut_busy::{Busy, BusyRanks};
use crate::workers::Side;
use kv_events::WorkerRank;
use std::time::Instant;

/// The bound index and what its keys were computed with.
#[derive(Debug, Default)]
pub(crate) struct Bounded {
    index: BoundIndex,
    /// The registered ranks still priced with the fleet prior (warming up): out of
    /// the index, since the prior moves with every other rank's samples; each
    /// decision prices them exactly.
    cold: Vec<WorkerRank>,
    /// Under busy thresholds, the ranks out of the index while busy
    /// (`shortcut_busy.rs`).
    busy: BusyRanks,
    /// The latest decision time synced at (under busy thresholds, an earlier one
    /// prices the booked ranks exactly).
    synced_at: Option<Instant>,
    /// The policy's timing and the block size the keys used; `None`: rebuild.
    built_for: Option<(crate::policy::predicted_ttft::StepTimeModel, u32)>,
}

impl Bounded {
    /// Rebuilds the index at the next bounded decision (a worker registered or
    /// left: ranks, capacities).
    pub(crate) fn invalidate(&mut self) {
        self.built_for = None;
    }

    /// Whether `rank` is held out of the index as busy.
    #[cfg(test)]
    pub(crate) fn holds_busy(&self, rank: WorkerRank) -> bool {
        self.busy.contains(rank)
    }
}

impl Scheduler {
    /// Brings the bound index (the ranks priced with their own calibration, not busy
    /// at `now`), the busy ranks and the cold ranks up to date for `config` and
    /// `block_size`: O(changed ranks × log N + cold ranks + ranks due), O(N log N)
    /// after a registration or a policy change.
    pub(crate) fn sync_bound(
        &mut self,
        config: &PredictedTtftConfig,
        block_size: u32,
        now: Instant,
    ) {
        let busy_checked = self.config.busy.enabled();
        self.bounded.synced_at = self.bounded.synced_at.max(Some(now));
        let n = self.workers.ranks().len();
        let (booked, calibrated, reported) = (
            self.sequences.take_changed(),
            self.calibration.take_changed(),
            self.reports.take_changed(),
        );
        // Reports change only busy states.
        let reported = if busy_checked {
            reported
        } else {
            Changed::default()
        };
        let key = (config.timing, block_size);
        if booked.all || calibrated.all || reported.all || self.bounded.built_for != Some(key) {
            self.bounded.index = BoundIndex::default();
            self.bounded.busy.clear();
            self.bounded.cold.clear();
            for i in 0..n {
                let r = self.workers.ranks()[i];
                if !self.index_rank(r, config, block_size, now) {
                    self.bounded.cold.push(r);
                }
            }
            self.bounded.built_for = Some(key);
            return;
        }
        let mut due = Vec::new();
        self.bounded.busy.take_due(now, &mut due);
        let changed = booked.ranks.into_iter().chain(calibrated.ranks);
        for r in changed.chain(reported.ranks).chain(due) {
            if self.workers.contains_rank(r) {
                self.index_rank(r, config, block_size, now);
            } else {
                self.bounded.index.remove(r);
                self.bounded.busy.release(r);
            }
        }
        let (workers, calibration) = (&self.workers, &self.calibration);
        self.bounded
            .cold
            .retain(|&r| workers.contains_rank(r) && !calibration.prices_apart(r));
        let held = self.bounded.index.len() + self.bounded.busy.len();
        if held + self.bounded.cold.len() != n {
            self.bounded.built_for = None; // a registration: rebuild
            self.sync_bound(config, block_size, now);
        }
    }

    /// Puts the registered `rank` in the index with its current terms, or among the
    /// busy ranks when it is busy at `now`, unless it is priced with the fleet prior
    /// (then false: it is cold, listed since the last rebuild, or registered since
    /// and found by the count check).
    fn index_rank(
        &mut self,
        rank: WorkerRank,
        config: &PredictedTtftConfig,
        block_size: u32,
        now: Instant,
    ) -> bool {
        if !self.calibration.prices_apart(rank) {
            return false;
        }
        match self.busy_state(rank, now) {
            Busy::Free => {
                self.bounded.busy.release(rank);
                let terms = self.rank_terms(rank, block_size);
                self.bounded.index.set(rank, &config.timing, &terms);
            }
            busy => {
                self.bounded.index.remove(rank);
                self.bounded.busy.hold(rank, busy);
            }
        }
        true
    }

    /// What `rank`'s bound is computed from, at `block_size` tokens per block.
    fn rank_terms(&self, rank: WorkerRank, block_size: u32) -> RankTerms {
        // Request and context counts do not decay: any `now` gives them.
        let load = self.sequences.load(rank, Instant::now());
        RankTerms {
            floor_prefill_tokens: self.sequences.floor_prefill_tokens(rank),
            total_prefill_tokens: self.sequences.total_prefill_tokens(rank),
            active_requests: load.active_requests as u64,
            context_tokens: load
                .active_context_blocks
                .saturating_mul(u64::from(block_size.max(1))),
            scale: self.calibration.scale(rank),
        }
    }

    /// Fills `self.candidates` for the bounded shortcut (module docs) and returns the
    /// delay cap's gate; `Ok(None)`, with nothing gathered, where it does not apply.
    /// `touched` holds the ranks the index matched (any order, possibly unregistered),
    /// and is reused as scratch.
    ///
    /// # Errors
    /// As [`Scheduler::gather_candidates`].
    pub(crate) fn gather_bounded<O: Overlaps + ?Sized>(
        &mut self,
        ask: &Ask<'_, O>,
        config: &PredictedTtftConfig,
        touched: &mut Vec<WorkerRank>,
    ) -> Result<Option<bool>, SchedulerError> {
        let (req, now) = (ask.req, ask.now);
        let shape = req.shape();
        // An earlier decision time than one synced at (callers whose clocks
        // disagree): an indexed rank free then may be busy now by a prefill that
        // decayed since, so the booked ranks (the only ones whose busy state moves
        // with time) are priced exactly: O(booked ranks).
        let rewound = self.config.busy.enabled() && self.bounded.synced_at.is_some_and(|t| now < t);
        self.sync_bound(config, shape.block_size, now);
        if rewound {
            touched.extend(self.sequences.booked_ranks());
        }
        touched.extend_from_slice(&self.bounded.cold);
        // Ranks that may hold part of the prompt, or may not be in the preferred tier.
        if config.credit.in_flight
            && let Some(&first) = ask.block_ids.first()
        {
            touched.extend(self.sequences.ranks_holding_first(first));
        }
        self.reports
            .visit_unlike_unreported(&self.config.liveness, false, now, |r| touched.push(r));
        (self.workers).keep_registered_in_order(touched, &mut self.touched_bits);
        let priced = touched.len();
        if priced == self.workers.ranks().len() {
            return Ok(None); // no rank left to bound: the full scan
        }
        let is_priced = |r: &WorkerRank| touched[..priced].binary_search(r).is_ok();
        // The lowest cost among the others, and every rank at it.
        let exact = |r: WorkerRank| -> f64 {
            let c = Candidate {
                rank: r,
                overlap_blocks: 0,
                any_tier_blocks: 0,
                load: self.sequences.load(r, now),
                new_blocks: req.request_blocks,
            };
            let own = PredictedTtftConfig {
                timing: config.timing.scaled(self.calibration.scale(r)),
                ..*config
            };
            predicted_ttft_cost(&own, &shape, &c, 0)
        };
        let best = self
            .bounded
            .index
            .search(&config.timing, shape.num_tokens, |r| {
                (!is_priced(&r)).then(|| exact(r))
            });
        // Every other rank is busy (a saturated fleet): the full scan decides, since
        // the figures below assume a preferred candidate outside the priced ones.
        let Some(best) = best else {
            return Ok(None);
        };
        let mut extra: Vec<WorkerRank> = best.ranks;
        // The smallest backlog over every candidate (matching ranks' credit).
        let mut min_pending = touched[..priced]
            .iter()
            .filter(|&&r| self.is_open(r, now))
            .map(|&r| self.sequences.load(r, now).active_prefill_tokens)
            .min()
            .unwrap_or(u64::MAX);
        let mut min_rank = None;
        for (floor, r) in self.bounded.index.by_floor() {
            if floor >= min_pending {
                break;
            }
            if is_priced(&r) {
                continue;
            }
            let p = self.sequences.load(r, now).active_prefill_tokens;
            if p < min_pending {
                (min_pending, min_rank) = (p, Some(r));
            }
        }
        extra.extend(min_rank);
        let gate = self.delay_cap_gate(config, &touched[..priced], now);
        touched.extend(extra);
        touched.sort_unstable();
        touched.dedup();
        self.candidates.clear();
        self.tiers.clear();
        let mut seen = Seen::default();
        for &r in touched.iter() {
            self.consider(
                r,
                req,
                ask.overlaps,
                ask.block_ids,
                now,
                Side::Whole,
                &mut seen,
            );
        }
        self.finish_candidates(req, seen)?;
        Ok(Some(gate))
    }

    /// Whether `rank` is a candidate of the preferred liveness tier at `now` (never
    /// reported, or live; not busy): a candidate whenever any rank outside the priced
    /// ones is.
    fn is_open(&self, rank: WorkerRank, now: Instant) -> bool {
        self.reports.tier(&self.config.liveness, rank, now) == Some(Tier::Preferred)
            && !self.is_busy_at(rank, now)
    }

    /// Whether the delay cap applies over every registered rank as a candidate: the
    /// `priced` ranks (their live candidates) and every other indexed rank.
    fn delay_cap_gate(
        &self,
        config: &PredictedTtftConfig,
        priced: &[WorkerRank],
        now: Instant,
    ) -> bool {
        let cap = &config.delay_cap;
        if !cap.enabled {
            return false;
        }
        let (mut lo, mut hi) = self.bounded.index.prefill_sums();
        let mut count = self.bounded.index.len();
        let mut exact = 0u128;
        for &r in priced {
            if let Some((floor, total)) = self.bounded.index.prefill_of(r) {
                lo -= u128::from(floor);
                hi -= u128::from(total);
                count -= 1;
            }
            if self.is_open(r, now) {
                exact += u128::from(self.sequences.load(r, now).active_prefill_tokens);
                count += 1;
            }
        }
        let threshold = cap.spare_steps * config.timing.max_num_batched_tokens.max(1) as f64;
        let mean = |sum: u128| (sum as f64) / count.max(1) as f64;
        if count == 0 {
            return false;
        }
        if mean(exact + hi) < threshold {
            return true;
        }
        if mean(exact + lo) >= threshold {
            return false;
        }
        // A rank's `P(now)` exceeds its `P_floor` only by its decaying oldest
        // prefill, so only booked ranks add to `lo`: O(booked ranks).
        let decayed: u128 = self
            .sequences
            .booked_ranks()
            .filter(|r| priced.binary_search(r).is_err())
            .filter_map(|r| {
                let (floor, _) = self.bounded.index.prefill_of(r)?;
                let p = self.sequences.load(r, now).active_prefill_tokens;
                Some(u128::from(p.saturating_sub(floor)))
            })
            .sum();
        mean(exact + lo + decayed) < threshold
    }
}
