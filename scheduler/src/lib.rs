//! Worker selection and active-request load tracking for kv-router.
//!
//! Given a prompt's overlap blocks per (worker, dp_rank) — from the indexer — the
//! [`Scheduler`] picks the rank that should serve it and *books* the request there:
//! its uncached prompt tokens count as that rank's pending prefill until
//! [`Scheduler::mark_prefill_completed`], its prompt blocks as decode load until
//! [`Scheduler::free`]. The next decision sees that load at once, so a burst of
//! similar prompts spreads out instead of piling onto the best-cached rank.
//!
//! The scheduler is synchronous and single-owner: the daemon keeps it behind one
//! `Mutex`, making select-and-book atomic. A decision is O(registered ranks) with no
//! allocation once warm (a scratch candidate buffer is reused); lifecycle steps are O(1).
//!
//! # Layout
//! - [`config`]: [`SchedulerConfig`], [`PolicyConfig`] and [`KvPolicyConfig`] knobs.
//! - [`error`]: [`SchedulerError`], the crate's one error type.
//! - [`overlap`]: the [`Overlaps`] trait (per-rank overlap blocks) and [`NoOverlap`].
//! - [`request`]: [`ScheduleRequest`] in, [`Selection`] out.
//! - [`selector`]: the KV cost formula, softmax sampling, round-robin and random.
//! - [`sequences`]: [`ActiveSequences`], booked requests and per-rank [`RankLoad`].
//! - [`workers`]: [`WorkerRegistry`], registered workers and their ranks.

pub mod config;
pub mod error;
pub mod overlap;
pub mod request;
pub mod selector;
pub mod sequences;
pub mod workers;

pub use config::{KvPolicyConfig, PolicyConfig, SchedulerConfig};
pub use error::SchedulerError;
pub use overlap::{NoOverlap, Overlaps};
pub use request::{ScheduleRequest, Selection};
pub use sequences::{ActiveRequest, ActiveSequences, RankLoad};
pub use workers::WorkerRegistry;

use kv_events::discovery::WorkerRegistration;
use kv_events::routing::PolicyKind;
use kv_events::{LoadMetrics, RequestId, WorkerId, WorkerRank};
use rand::SeedableRng;
use rand::rngs::StdRng;
use selector::{Candidate, Selector};
use std::collections::HashMap;

/// The scheduling facade: workers, booked load, engine-reported metrics and the
/// selector, updated together.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    workers: WorkerRegistry,
    sequences: ActiveSequences,
    selector: Selector,
    /// Latest engine-reported sample per registered rank (reporting only).
    load_metrics: HashMap<WorkerRank, LoadMetrics>,
    /// Scratch buffer reused by every [`Scheduler::schedule`] call.
    candidates: Vec<Candidate>,
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
            config,
            workers: WorkerRegistry::new(),
            sequences: ActiveSequences::new(),
            selector: Selector::new(rng),
            load_metrics: HashMap::new(),
            candidates: Vec::new(),
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
        for rank in self.workers.add(reg)? {
            let dropped = self.sequences.remove_rank(rank);
            self.load_metrics.remove(&rank);
            tracing::debug!(%rank, dropped, "rank vanished on re-registration");
        }
        Ok(())
    }

    /// Unregisters a worker (its lease expired): its ranks are no longer selectable,
    /// and its booked requests and metrics are dropped. Returns how many active
    /// requests were dropped; 0 also when the worker was unknown.
    pub fn remove_worker(&mut self, id: WorkerId) -> usize {
        self.workers.remove(id);
        self.load_metrics.retain(|rank, _| rank.worker_id != id);
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

    /// Chooses a rank for `req` and books it there (prefill tokens
    /// `num_tokens − min(num_tokens, overlap_blocks × block_size)`, decode blocks
    /// `request_blocks`). `overlaps` gives each rank's overlap blocks for this prompt;
    /// values above `request_blocks` are clamped.
    ///
    /// # Errors
    /// - [`SchedulerError::DuplicateRequest`] if `req.request_id` is already active.
    /// - [`SchedulerError::NoWorkers`] if no rank is registered.
    ///
    /// On error nothing is booked.
    pub fn schedule(
        &mut self,
        req: &ScheduleRequest,
        overlaps: &impl Overlaps,
    ) -> Result<Selection, SchedulerError> {
        if self.sequences.contains(&req.request_id) {
            return Err(SchedulerError::DuplicateRequest(req.request_id.clone()));
        }
        let policy = self.resolve_policy(req.policy);
        self.candidates.clear();
        self.candidates
            .extend(self.workers.ranks().iter().map(|&rank| Candidate {
                rank,
                overlap_blocks: overlaps.overlap(rank).min(req.request_blocks),
                active_decode_blocks: self.sequences.load(rank).active_decode_blocks,
            }));
        let choice = self
            .selector
            .select(&policy, req.request_blocks, &self.candidates)?;
        let chosen = self.candidates[choice.index];
        let prefill_tokens = req.uncached_tokens(chosen.overlap_blocks);
        self.sequences.add_request(
            req.request_id.clone(),
            chosen.rank,
            prefill_tokens,
            req.request_blocks,
        )?;
        tracing::debug!(
            request_id = %req.request_id,
            rank = %chosen.rank,
            policy = %policy.kind(),
            overlap_blocks = chosen.overlap_blocks,
            request_blocks = req.request_blocks,
            prefill_tokens,
            cost = ?choice.cost,
            "request scheduled",
        );
        Ok(Selection {
            rank: chosen.rank,
            overlap_blocks: chosen.overlap_blocks,
            policy: policy.kind(),
            cost: choice.cost,
        })
    }

    /// The request produced its first token: its prefill tokens leave its rank's load.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn mark_prefill_completed(&mut self, id: &RequestId) -> Result<(), SchedulerError> {
        self.sequences.mark_prefill_completed(id)
    }

    /// The request ended: everything it booked is released.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn free(&mut self, id: &RequestId) -> Result<(), SchedulerError> {
        self.sequences.free(id).map(drop)
    }

    /// Stores the latest engine-reported sample for its rank. Samples from ranks that
    /// are not registered are ignored (returns `false`), which bounds memory against
    /// metrics from departed or unknown workers.
    pub fn update_load_metrics(&mut self, m: LoadMetrics) -> bool {
        let rank = WorkerRank::new(m.worker_id, m.dp_rank);
        if !self.workers.contains_rank(rank) {
            return false;
        }
        self.load_metrics.insert(rank, m);
        true
    }

    /// The latest engine-reported sample of `rank`, if any.
    pub fn load_metrics(&self, rank: WorkerRank) -> Option<&LoadMetrics> {
        self.load_metrics.get(&rank)
    }

    /// The load booked on `rank` by this scheduler; zeros when none.
    pub fn rank_load(&self, rank: WorkerRank) -> RankLoad {
        self.sequences.load(rank)
    }

    /// Booked load of every registered rank, in rank order.
    pub fn rank_loads(&self) -> impl Iterator<Item = (WorkerRank, RankLoad)> + '_ {
        self.workers
            .ranks()
            .iter()
            .map(|&rank| (rank, self.sequences.load(rank)))
    }

    /// Number of booked, not yet freed requests over all ranks.
    pub fn active_requests(&self) -> usize {
        self.sequences.len()
    }

    /// Read access to the booked requests.
    pub fn sequences(&self) -> &ActiveSequences {
        &self.sequences
    }

    /// The policy for one request: the daemon's, or the override. A `Kv` override
    /// keeps the daemon's KV knobs when the daemon runs KV, else uses the defaults.
    fn resolve_policy(&self, kind: Option<PolicyKind>) -> PolicyConfig {
        match (kind, self.config.policy) {
            (None, daemon) => daemon,
            (Some(PolicyKind::Kv), PolicyConfig::Kv(kv)) => PolicyConfig::Kv(kv),
            (Some(PolicyKind::Kv), _) => PolicyConfig::Kv(KvPolicyConfig::default()),
            (Some(PolicyKind::RoundRobin), _) => PolicyConfig::RoundRobin,
            (Some(PolicyKind::Random), _) => PolicyConfig::Random,
        }
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
