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

pub mod busy;
pub mod config;
pub mod duration_ms;
pub mod error;
pub mod liveness;
pub mod load;
pub mod overlap;
pub mod policy;
pub mod request;
pub mod sequences;
pub mod workers;

pub use busy::{BusyThresholds, Threshold};
pub use config::{PrefillDurationModel, SchedulerConfig, SequencesConfig};
pub use error::SchedulerError;
pub use liveness::{Liveness, LivenessConfig};
pub use overlap::{NoOverlap, Overlaps};
pub use policy::{
    CacheAwareThresholdConfig, KvNormalizedConfig, KvPolicyConfig, PolicyConfig,
    PredictedTtftConfig,
};
pub use request::{RequestShape, ScheduleRequest, Selection};
pub use sequences::{
    ActiveRequest, ActiveSequences, AddRequest, Origin, PrefillLoadHint, RankLoad, SequenceEvent,
};
pub use workers::WorkerRegistry;

use kv_events::discovery::WorkerRegistration;
use kv_events::routing::PolicyKind;
use kv_events::{DpRank, LoadMetrics, RequestId, WorkerId, WorkerRank};
use liveness::{LoadReports, Tier};
use policy::{Candidate, SelectContext, Selector};
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::borrow::Borrow;
use std::cmp::Reverse;
use std::collections::HashSet;
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
    /// Scratch buffers reused by every decision: the candidates and their tiers.
    candidates: Vec<Candidate>,
    tiers: Vec<Tier>,
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
            config,
            workers: WorkerRegistry::new(),
            selector: Selector::new(rng),
            reports: LoadReports::default(),
            candidates: Vec::new(),
            tiers: Vec::new(),
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

    /// Schedules several requests routed together, each seeing the bookings of the
    /// ones placed before it (`kv-normalized` also sizes its fair share with the
    /// requests still to place). Returns one result per request, in input order.
    /// Once an unpinned request finds every rank busy, later unpinned ones fail with
    /// [`SchedulerError::AllBusy`] without another scan (bookings only add load);
    /// likewise per pinned dp_rank.
    pub fn schedule_batch<R: Borrow<ScheduleRequest>, O: Overlaps>(
        &mut self,
        batch: &[(R, O)],
        order: BatchOrder,
        now: Instant,
    ) -> Vec<Result<Selection, SchedulerError>> {
        let mut sequence: Vec<usize> = (0..batch.len()).collect();
        if order == BatchOrder::GroupByPrefix {
            sequence.sort_by_key(|&i| {
                let r = batch[i].0.borrow();
                (
                    r.dp_rank.is_none(),
                    r.block_hashes.first().copied(),
                    Reverse(r.num_tokens),
                )
            });
        }
        let mut results: Vec<Result<Selection, SchedulerError>> =
            batch.iter().map(|_| Err(SchedulerError::AllBusy)).collect();
        let mut all_busy = false;
        let mut busy_pins: HashSet<DpRank> = HashSet::new();
        for (k, &i) in sequence.iter().enumerate() {
            let (req, overlaps) = (batch[i].0.borrow(), &batch[i].1);
            // A request with exclusions has fewer candidates than the others, so what
            // it finds says nothing about them, nor theirs about it.
            let excludes = !req.exclude_workers.is_empty();
            let known_busy = match req.dp_rank {
                _ if excludes => false,
                None => all_busy,
                Some(dp) => busy_pins.contains(&dp),
            };
            if known_busy && !self.sequences.contains(&req.request_id) {
                continue; // stays AllBusy
            }
            let result = self.schedule_one(req, overlaps, now, batch.len() - k);
            if matches!(result, Err(SchedulerError::AllBusy)) && !excludes {
                match req.dp_rank {
                    None => all_busy = true,
                    Some(dp) => {
                        busy_pins.insert(dp);
                    }
                }
            }
            results[i] = result;
        }
        results
    }

    fn schedule_one<O: Overlaps + ?Sized>(
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
        let ctx = SelectContext {
            request: req.shape(),
            candidates: &self.candidates,
            batch_remaining,
        };
        let choice = self.selector.select(&policy, &ctx)?;
        let chosen = self.candidates[choice.index];
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
            },
            now,
        )?;
        tracing::debug!(
            request_id = %req.request_id,
            rank = %chosen.rank,
            policy = %policy.kind(),
            overlap_blocks = chosen.overlap_blocks,
            request_blocks = req.request_blocks,
            prefill_tokens = tokens,
            cost = ?choice.cost,
            "request scheduled",
        );
        Ok(Selection {
            rank: chosen.rank,
            overlap_blocks: chosen.overlap_blocks,
            policy: policy.kind(),
            cost: choice.cost,
            prefill,
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
            self.candidates.push(Candidate {
                rank,
                overlap_blocks: overlaps.overlap(rank).min(req.request_blocks),
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
        if let SequenceEvent::AddRequest(add) = &event
            && !self.workers.contains_rank(add.rank)
        {
            return Err(SchedulerError::UnregisteredRank(add.rank));
        }
        self.sequences.apply(event, now)
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
        self.sequences.mark_prefill_completed(id, now)
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
        self.sequences.free(id, now).map(|r| r.origin)
    }

    /// Frees every request whose TTL lapsed at or before `now`; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<(RequestId, ActiveRequest)> {
        self.sequences.expire(now)
    }

    /// When the next request expires, if any is active.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.sequences.next_deadline()
    }

    /// Stores the latest engine-reported sample for its rank, heard at `now` (a sign
    /// of life, see [`liveness`]). Samples of unregistered ranks are ignored (returns
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

    /// Whether `rank` is registered and busy at `now` (see [`BusyThresholds`]).
    pub fn is_busy_at(&self, rank: WorkerRank, now: Instant) -> bool {
        self.workers.get(rank.worker_id).is_some_and(|reg| {
            self.workers.contains_rank(rank)
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
