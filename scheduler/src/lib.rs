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
//!
//! The scheduler is synchronous, single-owner and clock-free: every call that depends
//! on time takes `now`, so the daemon passes the wall clock and tests or an offline
//! simulator pass a virtual one. The daemon keeps it behind one `Mutex`, making
//! select-and-book atomic. A decision is O(eligible ranks × prompt blocks) (the
//! blocks term only for the KV-reuse lookup), with scratch buffers reused.
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
//! - `batch.rs`: [`Scheduler::schedule_batch`].
//! - `reads.rs`: the facade's read accessors (load, metrics, liveness, calibration).

#[cfg(feature = "clap")]
pub mod args;
mod batch;
pub mod busy;
pub mod calibration;
pub mod config;
pub mod duration_ms;
pub mod error;
pub mod liveness;
pub mod load;
pub mod overlap;
pub mod policy;
mod reads;
pub mod request;
pub mod sequences;
pub mod sessions;
pub mod workers;

pub use busy::{BusyThresholds, Threshold};
pub use calibration::{Calibration, CalibrationConfig, RankCalibration};
pub use config::{PrefillDurationModel, SchedulerConfig, SequencesConfig};
pub use error::SchedulerError;
pub use liveness::{Liveness, LivenessConfig};
pub use overlap::{NoOverlap, Overlaps};
pub use policy::{
    CacheAwareThresholdConfig, KvNormalizedConfig, KvPolicyConfig, PolicyConfig,
    PredictedTtftConfig, TimingScale,
};
pub use request::{RequestShape, ScheduleRequest, Selection};
pub use sequences::{
    ActiveRequest, ActiveSequences, AddRequest, Origin, PrefillLoadHint, RankLoad, SequenceEvent,
};
pub use sessions::{SessionConfig, SessionOutcome, SessionTable};
pub use workers::WorkerRegistry;

use kv_events::discovery::WorkerRegistration;
use kv_events::routing::PolicyKind;
use kv_events::{RequestId, WorkerId, WorkerRank};
use liveness::{LoadReports, Tier};
use policy::{Candidate, SelectContext, Selector};
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
    /// Scratch buffers reused by every decision: the candidates, their tiers and
    /// their calibrated step-time multipliers.
    candidates: Vec<Candidate>,
    tiers: Vec<Tier>,
    scales: Vec<TimingScale>,
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
    /// above `request_blocks` are clamped. Candidates are the registered ranks that
    /// match `req.dp_rank` (if set), are not in `req.exclude_workers`, are not busy
    /// and are not silent ([`liveness`]); quiet ranks only when no live one is left.
    ///
    /// # Errors
    /// - [`SchedulerError::DuplicateRequest`] if `req.request_id` is already active.
    /// - [`SchedulerError::InvalidOverride`] for a bad per-request override.
    /// - [`SchedulerError::NoWorkers`] if no rank is registered.
    /// - [`SchedulerError::RankUnavailable`] if no registered worker has the pinned
    ///   dp_rank.
    /// - [`SchedulerError::AllExcluded`] if the request excludes every registered
    ///   worker (that has the pinned dp_rank, if any).
    /// - [`SchedulerError::AllBusy`] if every candidate is busy or silent.
    ///
    /// On error nothing is booked.
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
        if self.sequences.contains(&req.request_id) {
            return Err(SchedulerError::DuplicateRequest(req.request_id.clone()));
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
        self.gather_candidates(req, overlaps, &block_ids, now)?;
        self.calibration
            .timing_scales(&policy, &self.candidates, &mut self.scales);
        let ctx = SelectContext {
            request: req.shape(),
            candidates: &self.candidates,
            batch_remaining,
            timing_scales: &self.scales,
        };
        let choice = self.selector.select(&policy, &ctx)?;
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
        let tokens = req.uncached_tokens(chosen.overlap_blocks);
        let prefill = PrefillLoadHint {
            initial_effective_prefill_tokens: tokens,
            expected_prefill_duration: self.config.prefill_duration.expected(tokens),
        };
        self.sequences.add_request(
            AddRequest {
                request_id: req.request_id.clone(),
                rank: chosen.rank,
                block_hashes: req.block_hashes.clone(),
                request_blocks: req.request_blocks,
                prefill,
                origin: Origin::Local,
                session_id: None,
            },
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
            policy: policy.kind(),
            cost,
            prefill,
            session,
        })
    }

    /// Fills `self.candidates` with the eligible ranks for `req`.
    fn gather_candidates<O: Overlaps + ?Sized>(
        &mut self,
        req: &ScheduleRequest,
        overlaps: &O,
        block_ids: &[u64],
        now: Instant,
    ) -> Result<(), SchedulerError> {
        if self.workers.ranks().is_empty() {
            return Err(SchedulerError::NoWorkers);
        }
        self.candidates.clear();
        self.tiers.clear();
        let mut pinned_exists = false;
        let mut any_allowed = false;
        for &rank in self.workers.ranks() {
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
                && let Some(reg) = self.workers.get(rank.worker_id)
                && self.config.busy.is_busy(&load, self.reports.get(rank), reg)
            {
                continue;
            }
            self.tiers.push(tier);
            let overlap_blocks = overlaps.overlap(rank).min(req.request_blocks);
            self.candidates.push(Candidate {
                rank,
                overlap_blocks,
                any_tier_blocks: overlaps
                    .overlap_any_tier(rank)
                    .clamp(overlap_blocks, req.request_blocks),
                load,
                new_blocks: self
                    .sequences
                    .new_blocks(rank, block_ids, req.request_blocks),
            });
        }
        LoadReports::keep_best(&mut self.candidates, &self.tiers);
        match (
            req.dp_rank,
            pinned_exists,
            any_allowed,
            self.candidates.is_empty(),
        ) {
            (Some(dp), false, _, _) => Err(SchedulerError::RankUnavailable(dp)),
            (_, _, false, _) => Err(SchedulerError::AllExcluded),
            (_, _, _, true) => Err(SchedulerError::AllBusy),
            _ => Ok(()),
        }
    }

    /// Applies one write-model event at `now` — the entry point for bookings and
    /// lifecycle steps learned from peer router replicas. Returns the origin of the
    /// request touched.
    ///
    /// # Errors
    /// [`SchedulerError::UnregisteredRank`] for a booking on a rank that is not
    /// registered here; otherwise as [`ActiveSequences::apply`].
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
                let sequences = &self.sequences;
                let features = self.calibration.peer_features(
                    add.prefill.initial_effective_prefill_tokens,
                    || sequences.load(add.rank, now),
                    reg.block_size,
                );
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
#[path = "scheduler_batch_tests.rs"]
mod batch_tests;

#[cfg(test)]
#[path = "scheduler_liveness_tests.rs"]
mod liveness_tests;

#[cfg(test)]
#[path = "scheduler_calibration_tests.rs"]
mod calibration_tests;
