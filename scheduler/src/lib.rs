//! Worker selection and active-request load tracking for kv-router.
//!
//! Given a prompt's overlap blocks per (worker, dp_rank) — from the indexer — the
//! [`Scheduler`] picks the rank that should serve it and *books* the request there in
//! its write model, [`ActiveSequences`]: uncached prompt tokens as in-flight prefill
//! until [`Scheduler::mark_prefill_completed`], prompt blocks as decode load until
//! [`Scheduler::free`] (or until the request's TTL lapses without a lifecycle
//! message). Every decision reads a projection of that model at the decision time,
//! so a burst of similar prompts spreads out instead of piling onto the best-cached
//! rank. Bookings of peer router replicas are applied through [`Scheduler::apply`].
//! In a fleet with `prefill` workers, a request that allows it is placed as a pair
//! (a decode rank, and a prefill rank unless the decode rank should prefill it) and
//! booked once per half ([`disaggregation`]).
//!
//! The scheduler is synchronous, single-owner and clock-free: every call that depends
//! on time takes `now`, so the daemon passes the wall clock and tests or an offline
//! simulator pass a virtual one. The daemon keeps it behind one `Mutex`, making
//! select-and-book atomic. A `predicted-ttft` decision is O(touched ranks × prompt
//! blocks) (the blocks term only for the KV-reuse lookup): the ranks with a booking,
//! a report no longer live (or of load, under busy thresholds), their own warmed-up
//! calibration or overlap with the prompt, plus one idle rank
//! standing for the rest (`shortcut.rs`, exact). While more than half of the ranks
//! are touched (a warmed-up fleet), it is O((ranks that may hold the prompt + ranks
//! still warming up + ranks whose cost bound is within the best cost) × log N)
//! (`shortcut_bound.rs` over `cost_bound.rs`, exact; O(booked ranks) when the delay
//! cap's gate falls between its bounds; under busy thresholds the busy ranks wait
//! outside the index, `shortcut_busy.rs`, O(log N) per report of changed load). Other decisions are
//! O(registered ranks × prompt blocks). Scratch buffers are reused.
//!
//! # Layout
//! - [`load`]: [`PrefillLoadHint`] and [`RankLoad`], the values every other module
//!   shares (a leaf).
//! - [`config`]: [`SchedulerConfig`] and its sub-configs.
//! - [`policy`]: [`PolicyConfig`] (one variant per policy, one file each), the
//!   [`policy::Selector`] and sampling.
//! - [`sequences`]: [`ActiveSequences`], the write model, and [`RankLoad`], its
//!   projection.
//! - [`busy`]: [`BusyThresholds`], when a rank is skipped.
//! - [`request`]: [`ScheduleRequest`] in, [`Selection`] out.
//! - [`overlap`]: the [`Overlaps`] trait (per-rank overlap blocks) and [`NoOverlap`].
//! - [`workers`]: [`WorkerRegistry`], registered workers and their ranks.
//! - [`liveness`]: [`LivenessConfig`], [`Liveness`]: silent ranks are left out.
//! - [`error`]: [`SchedulerError`], the crate's one error type.
//! - [`calibration`]: [`CalibrationConfig`], [`Calibration`]: per-rank step-time
//!   constants learned from observed TTFTs (on by default).
//! - [`sessions`]: [`SessionConfig`], [`SessionTable`]: session affinity, a
//!   request's session's last rank preferred within a margin.
//! - `args` (feature `clap`): every scheduler flag, declared once for the daemon and
//!   the lab.
//! - [`disaggregation`]: [`DisaggregationConfig`], when a request that may run
//!   disaggregated is prefilled by its decode worker, and the decode cost.
//! - `candidates.rs`: the candidate scan, by worker role (`workers::Side`).
//! - `pair.rs`: pair selection and the two bookings of a disaggregated request.
//! - `lifecycle.rs`: [`Scheduler::lifecycle`], a frontend's lifecycle event applied
//!   to a request and its prefill half.
//! - [`freed_early`]: the ids a frontend freed before they were routed here
//!   (bounded, for a while), refused by a later route query for them.
//! - `steps.rs`: [`lifecycle_steps`] and [`LifecycleStep`], the steps one event
//!   means (a leaf, so the daemon can list them before applying them).
//! - `shortcut.rs`: the decision shortcut over the touched ranks and an idle
//!   stand-in.
//! - `shortcut_bound.rs`: the bounded shortcut for warmed-up fleets, over
//!   `cost_bound.rs` (the ranks that hold none of the prompt, ordered by a cost
//!   bound, kept per booking and calibration change) and `shortcut_busy.rs` (busy
//!   ranks out of the index until a report or their computed crossing).
//! - `fallbacks.rs`: the alternates a request asked for, ranked by the cost its
//!   choice used.
//! - `batch.rs`: [`Scheduler::schedule_batch`].
//! - `reads.rs`: the facade's read accessors (load, metrics, liveness, calibration).
//! - `writes.rs`: the write-model events after a booking (a peer's booking, prefill
//!   done, keep-alive, free, expiry).

#[cfg(feature = "clap")]
pub mod args;
mod batch;
pub mod busy;
pub mod calibration;
mod candidates;
pub mod config;
mod cost_bound;
pub mod disaggregation;
pub mod duration_ms;
pub mod error;
mod fallbacks;
pub mod freed_early;
mod lifecycle;
pub mod liveness;
pub mod load;
pub mod overlap;
mod pair;
pub mod policy;
mod reads;
pub mod request;
pub mod sequences;
pub mod sessions;
mod shortcut;
mod shortcut_bound;
mod shortcut_busy;
mod steps;
pub mod workers;
mod writes;

pub use busy::{BusyThresholds, Threshold};
pub use calibration::{Calibration, CalibrationConfig, RankCalibration};
pub use config::{PrefillDurationModel, SchedulerConfig, SequencesConfig};
pub use disaggregation::DisaggregationConfig;
pub use error::SchedulerError;
pub use liveness::{Liveness, LivenessConfig};
pub use overlap::{NoOverlap, Overlaps};
pub use policy::{
    CacheAwareThresholdConfig, KvNormalizedConfig, KvPolicyConfig, PolicyConfig,
    PredictedTtftConfig, TimingScale,
};
pub use request::{
    Fallback, Fallbacks, PairDecision, PrefillChoice, RequestShape, ScheduleRequest, Selection,
};
pub use sequences::{
    ActiveRequest, ActiveSequences, AddRequest, Origin, PrefillLoadHint, RankLoad, SequenceEvent,
};
pub use sessions::{SessionConfig, SessionOutcome, SessionTable};
pub use steps::{LifecycleStep, lifecycle_steps};
pub use workers::WorkerRegistry;

use kv_events::disaggregation::is_prefill_booking_id;
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::PolicyKind;
use kv_events::{WorkerId, WorkerRank};
use liveness::{LoadReports, Tier};
use policy::{Candidate, Selector};
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::time::Instant;

/// In which order [`Scheduler::schedule_batch`] places a batch (a wire type: a
/// batch route request names it).
pub use kv_events::routing::BatchOrder;

/// The scheduling facade: workers, booked load, engine-reported metrics and the
/// selector, updated together.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    workers: WorkerRegistry,
    sequences: ActiveSequences,
    selector: Selector,
    /// Latest engine-reported sample per registered rank and when it came (busy
    /// checks, liveness, reporting).
    reports: LoadReports,
    /// Per-rank step-time constants learned from observed TTFTs.
    calibration: Calibration,
    /// Each session's last rank (session affinity).
    sessions: SessionTable,
    /// Scratch buffers reused by every decision: the candidates, their tiers,
    /// their calibrated step-time multipliers and decode costs (`pair.rs`).
    candidates: Vec<Candidate>,
    tiers: Vec<Tier>,
    scales: Vec<TimingScale>,
    decode_keys: Vec<(f64, f64)>,
    /// The shortcut's touched ranks (`shortcut.rs`), and whether it is on (tests
    /// turn it off to compare with the full scan).
    touched: Vec<WorkerRank>,
    /// Scratch for ordering the shortcuts' touched ranks
    /// (`WorkerRegistry::keep_registered_in_order`).
    touched_bits: Vec<u64>,
    /// Scratch of the ranks a stand-in decision prices apart (`shortcut.rs`).
    apart: shortcut::PricedApart,
    shortcut: bool,
    /// The bounded shortcut's index of every rank's cost bound (`shortcut_bound.rs`).
    bounded: shortcut_bound::Bounded,
    /// Ids a frontend freed before they were booked here (`freed_early.rs`).
    freed_early: freed_early::FreedEarly,
}

impl Scheduler {
    /// A scheduler with no workers. `rng_seed` makes every random choice (tie-breaks,
    /// softmax sampling, the random policy) reproducible; `None` seeds from the OS.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] naming the first bad field.
    pub fn new(config: SchedulerConfig, rng_seed: Option<u64>) -> Result<Self, SchedulerError> {
        config.validate()?;
        let rng = match rng_seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Ok(Self {
            sequences: ActiveSequences::new(config.sequences),
            calibration: Calibration::new(config.calibration, &config.policy),
            sessions: SessionTable::new(config.sessions),
            config,
            workers: WorkerRegistry::new(),
            selector: Selector::new(rng),
            reports: LoadReports::default(),
            candidates: Vec::new(),
            tiers: Vec::new(),
            scales: Vec::new(),
            decode_keys: Vec::new(),
            touched: Vec::new(),
            touched_bits: Vec::new(),
            apart: shortcut::PricedApart::default(),
            shortcut: true,
            bounded: shortcut_bound::Bounded::default(),
            freed_early: freed_early::FreedEarly::default(),
        })
    }

    /// The validated configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Registers a worker (ranks `0..dp_size`), replacing an earlier registration with
    /// the same id. If a re-registration shrinks `dp_size`, requests booked on and
    /// metrics of the vanished ranks are dropped.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidRegistration`] when `dp_size` or `block_size` is 0;
    /// nothing changes.
    pub fn add_worker(&mut self, reg: WorkerRegistration) -> Result<(), SchedulerError> {
        let vanished = self.workers.add(reg)?;
        self.bounded.invalidate();
        self.reports.retain(|rank| !vanished.contains(&rank));
        self.calibration
            .remove_ranks(|rank| vanished.contains(&rank));
        self.sessions.remove_ranks(|rank| vanished.contains(&rank));
        for rank in vanished {
            let dropped = self.sequences.remove_rank(rank);
            tracing::debug!(%rank, dropped, "rank vanished on re-registration");
        }
        Ok(())
    }

    /// Unregisters a worker (its lease expired): its ranks are no longer selectable,
    /// and its booked requests and metrics are dropped. Returns how many active
    /// requests were dropped; 0 also when the worker was unknown.
    pub fn remove_worker(&mut self, id: WorkerId) -> usize {
        self.workers.remove(id);
        self.bounded.invalidate();
        self.reports.remove_worker(id);
        self.calibration.remove_ranks(|rank| rank.worker_id == id);
        self.sessions.remove_worker(id);
        let dropped = self.sequences.remove_worker(id);
        tracing::debug!(worker_id = %id, dropped, "worker removed");
        dropped
    }

    /// Registered workers, in worker id order.
    pub fn workers(&self) -> impl ExactSizeIterator<Item = &WorkerRegistration> {
        self.workers.list()
    }

    /// Every registered rank, sorted by (worker id, dp_rank).
    pub fn ranks(&self) -> &[WorkerRank] {
        self.workers.ranks()
    }

    /// Chooses a rank for `req` at time `now` and books it there with prefill tokens
    /// `num_tokens − min(num_tokens, overlap_blocks × block_size)` (and the expected
    /// duration of [`SchedulerConfig::prefill_duration`]) and `request_blocks` decode
    /// blocks. `overlaps` gives each rank's overlap blocks for this prompt; values
    /// above `request_blocks` are clamped. Candidates are the ranks of registered
    /// workers that decode (role `both` or `decode`) that match `req.dp_rank` (if
    /// set), are not in `req.exclude_workers`, are in `req.eligible_workers` (when
    /// set), are not busy and are not silent
    /// ([`liveness`]); quiet ranks only when no live one is left.
    ///
    /// A request with `allow_disaggregation` while a `prefill` worker is registered
    /// gets a decode rank and a disaggregation decision instead, and may be booked
    /// twice: the decode half under its id, the prefill half on a prefill rank under
    /// `{id}#prefill` ([`Selection::disaggregation`], [`disaggregation`]); the same
    /// candidate rules apply to both sides. Otherwise the choice is the policy's as
    /// described above.
    ///
    /// # Errors
    /// - [`SchedulerError::ReservedRequestId`] if `req.request_id` ends with
    ///   `#prefill` (reserved for prefill halves).
    /// - [`SchedulerError::DuplicateRequest`] if `req.request_id` (or, for a request
    ///   that may be disaggregated, its prefill half) is already active.
    /// - [`SchedulerError::FreedBeforeRouted`] if a frontend freed `req.request_id`
    ///   before it was booked here, within [`freed_early::REMEMBER_FOR`]
    ///   ([`Scheduler::lifecycle`]).
    /// - [`SchedulerError::InvalidOverride`] for a bad per-request override.
    /// - [`SchedulerError::NoWorkers`] if no rank of a worker that decodes is
    ///   registered.
    /// - [`SchedulerError::RankUnavailable`] if no registered worker has the pinned
    ///   dp_rank.
    /// - [`SchedulerError::AllExcluded`] if the request excludes every registered
    ///   worker (that has the pinned dp_rank, if any).
    /// - [`SchedulerError::AllBusy`] if every candidate is busy or silent.
    ///
    /// On error nothing is booked (neither half).
    pub fn schedule<O: Overlaps + ?Sized>(
        &mut self,
        req: &ScheduleRequest,
        overlaps: &O,
        now: Instant,
    ) -> Result<Selection, SchedulerError> {
        self.schedule_one(req, overlaps, now, 1)
    }

    pub(crate) fn schedule_one<O: Overlaps + ?Sized>(
        &mut self,
        req: &ScheduleRequest,
        overlaps: &O,
        now: Instant,
        batch_remaining: usize,
    ) -> Result<Selection, SchedulerError> {
        if is_prefill_booking_id(&req.request_id) {
            return Err(SchedulerError::ReservedRequestId(req.request_id.clone()));
        }
        if self.sequences.contains(&req.request_id) {
            return Err(SchedulerError::DuplicateRequest(req.request_id.clone()));
        }
        if self.freed_early.contains(&req.request_id, now) {
            return Err(SchedulerError::FreedBeforeRouted(req.request_id.clone()));
        }
        let policy = self
            .resolve_policy(req.policy)
            .with_overrides(&req.overrides)?;
        let block_ids = if self.config.sequences.assume_kv_reuse {
            let hashed = req.block_hashes.len().min(req.request_blocks as usize);
            sequences::chain_block_ids(&req.block_hashes[..hashed])
        } else {
            Vec::new()
        };
        let ask = candidates::Ask {
            req,
            overlaps,
            policy: &policy,
            block_ids: &block_ids,
            now,
            batch_remaining,
        };
        if req.allow_disaggregation && self.workers.has_prefill_workers() {
            return self.schedule_pair(&ask);
        }
        let choice = self.choose_whole(&ask)?;
        let selector = &self.selector;
        let (index, session) = self.sessions.steer(
            req.session_id.as_ref(),
            policy.kind(),
            choice.index,
            &self.candidates,
            |i| selector.cost_of(&policy, i),
            now,
        );
        let cost = if index == choice.index {
            choice.cost
        } else {
            selector.cost_of(&policy, index)
        };
        let chosen = self.candidates[index];
        // Blocks held by requests booked there: the request's blocks not new there.
        let in_flight_blocks = (req.request_blocks.saturating_sub(chosen.new_blocks))
            .min(req.reusable_blocks())
            .saturating_sub(chosen.overlap_blocks);
        let fallbacks = self.fallbacks(&policy, index, req);
        let tokens = req.uncached_tokens(chosen.overlap_blocks);
        let prefill = self.prefill_hint(tokens);
        // The chained ids computed for scoring are the booking's: no second pass over
        // the prompt, no copy of its hashes.
        self.sequences.add_chained(
            AddRequest {
                request_id: req.request_id.clone(),
                rank: chosen.rank,
                block_hashes: Vec::new(),
                request_blocks: req.request_blocks,
                prefill,
                origin: Origin::Local,
                session_id: None,
            },
            block_ids,
            now,
        )?;
        if let Some(id) = &req.session_id {
            self.sessions.record(id, chosen.rank, now);
        }
        self.calibration
            .book_local(&policy, &req.shape(), &chosen, &req.request_id, now);
        tracing::debug!(
            request_id = %req.request_id,
            rank = %chosen.rank,
            policy = %policy.kind(),
            overlap_blocks = chosen.overlap_blocks,
            any_tier_blocks = chosen.any_tier_blocks,
            request_blocks = req.request_blocks,
            prefill_tokens = tokens,
            cost = ?cost,
            session = ?session,
            "request scheduled",
        );
        Ok(Selection {
            rank: chosen.rank,
            overlap_blocks: chosen.overlap_blocks,
            in_flight_blocks,
            policy: policy.kind(),
            cost,
            prefill,
            session,
            disaggregation: None,
            fallbacks,
        })
    }

    /// The prefill load of a booking of `tokens` prompt tokens: the tokens and their
    /// expected duration under [`SchedulerConfig::prefill_duration`].
    fn prefill_hint(&self, tokens: u64) -> PrefillLoadHint {
        PrefillLoadHint {
            initial_effective_prefill_tokens: tokens,
            expected_prefill_duration: self.config.prefill_duration.expected(tokens),
        }
    }

    /// The policy for one request: the daemon's, or the override. An override of the
    /// daemon's own kind keeps the daemon's knobs; another kind gets its defaults.
    fn resolve_policy(&self, kind: Option<PolicyKind>) -> PolicyConfig {
        match kind {
            Some(k) if k != self.config.policy.kind() => PolicyConfig::default_for(k),
            _ => self.config.policy,
        }
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "scheduler_fallback_tests.rs"]
mod fallback_tests;

#[cfg(test)]
#[path = "scheduler_batch_tests.rs"]
mod batch_tests;

#[cfg(test)]
#[path = "scheduler_liveness_tests.rs"]
mod liveness_tests;

#[cfg(test)]
#[path = "scheduler_calibration_tests.rs"]
mod calibration_tests;

#[cfg(test)]
#[path = "scheduler_pair_tests.rs"]
mod pair_tests;

#[cfg(test)]
#[path = "scheduler_pair_lifecycle_tests.rs"]
mod pair_lifecycle_tests;

#[cfg(test)]
#[path = "scheduler_pair_diff_tests.rs"]
mod pair_diff_tests;

#[cfg(test)]
#[path = "shortcut_tests.rs"]
mod shortcut_tests;
