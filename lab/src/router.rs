//! The router as the lab runs it: the real `indexer::RadixTree` fed with the engines'
//! KV events, and the real `scheduler::Scheduler` choosing and booking ranks —
//! in-process, no NATS.
//!
//! This is the daemon's routing path without its transport: a route request looks up
//! the prompt's overlap blocks in the tree, the scheduler picks and books a rank, and
//! the frontend's lifecycle (`prefill_done`, `freed`) releases the booking. All calls
//! that touch the scheduler's API live in this file, so API changes land here only.

use crate::blind::BlindView;
use crate::config::{LabPolicy, RouterGroups, SimConfig};
use crate::error::LabError;
use crate::fleet::TierPricing;
use crate::replicas::ReplicaSet;
use indexer::RadixTree;
use kv_events::disaggregation::{DisaggregationReason, KvTransfer, TransferProtocol, WorkerRole};
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{LifecycleEvent, PolicyKind, SessionId};
use kv_events::{KvCacheEvent, LocalBlockHash, RequestId, WorkerId, WorkerRank};
use scheduler::{
    CalibrationConfig, PolicyConfig, RankCalibration, ScheduleRequest, Scheduler, SchedulerConfig,
    SessionConfig,
};

/// Who decides: schedulers configured with one policy's default knobs, as `kv-router
/// serve --policy <kind>` runs it, one per router replica (`crate::replicas`; one
/// by default).
#[derive(Debug)]
enum Decider {
    Scheduler(ReplicaSet),
}

/// Where a request runs, by rank index: its decode rank (the rank of a whole
/// request) and, for a disaggregated request, its prefill rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Route {
    /// The rank that decodes (and, without `prefill`, prefills).
    pub decode: usize,
    /// The rank that prefills a disaggregated request.
    pub prefill: Option<usize>,
    /// Why the router placed it so, in a split fleet.
    pub reason: Option<DisaggregationReason>,
    /// The index's overlap on the rank that prefills it, in blocks.
    pub predicted_blocks: u32,
}

/// Index plus decider for one run; ranks are identified by their index in `ranks`.
#[derive(Debug)]
pub(super) struct Router {
    tree: RadixTree,
    ranks: Vec<WorkerRank>,
    block_size: u32,
    decider: Decider,
    refused_events: u64,
    /// With [`RouterGroups::FullAttentionOnly`], what a router that knows neither
    /// groups nor copies indexes.
    blind: Option<BlindView>,
    /// Whether route requests carry their derived session ([`LabPolicy::Sessions`]).
    sessions: bool,
    /// Whether route requests allow disaggregation (a split fleet).
    disaggregation: bool,
}

impl Router {
    /// A router over `ranks` (sorted, one dp rank per worker), all registered, worker
    /// `i` in role `roles[i]`.
    ///
    /// # Errors
    /// [`LabError::Scheduler`] if the scheduler refuses the configuration or a
    /// registration.
    pub fn new(
        policy: LabPolicy,
        ranks: &[WorkerRank],
        roles: &[WorkerRole],
        config: &SimConfig,
    ) -> Result<Self, LabError> {
        let replicas = config.replicas;
        let decider = match policy {
            LabPolicy::Scheduler(kind)
            | LabPolicy::Calibrated(kind)
            | LabPolicy::Sessions(kind)
            | LabPolicy::Tuned(kind) => Decider::Scheduler(ReplicaSet::new(
                replicas.count,
                replicas.sync_lag_ns(),
                config.seed,
                |replica| {
                    let scheduler_config = SchedulerConfig {
                        policy: policy_config(policy, kind, config),
                        calibration: CalibrationConfig {
                            enabled: matches!(policy, LabPolicy::Calibrated(_)),
                            ..CalibrationConfig::default()
                        },
                        sessions: SessionConfig {
                            enabled: matches!(policy, LabPolicy::Sessions(_)),
                            ..config.sessions
                        },
                        disaggregation: config.disaggregation(),
                        ..SchedulerConfig::default()
                    };
                    let seed = config.seed.wrapping_add(replica as u64);
                    let mut scheduler = Scheduler::new(scheduler_config, Some(seed))?;
                    for (rank, &role) in ranks.iter().zip(roles) {
                        scheduler.add_worker(WorkerRegistration {
                            worker_id: rank.worker_id,
                            dp_size: 1,
                            block_size: config.engine.block_size,
                            total_kv_blocks: config.engine.num_gpu_blocks,
                            url: None,
                            epoch: 0,
                            max_model_len: None,
                            role,
                            // Every engine of a split fleet speaks one protocol; which one
                            // does not change the decisions.
                            kv_transfer: (role != WorkerRole::Both).then_some(KvTransfer {
                                protocol: TransferProtocol::Vllm,
                                bootstrap_port: None,
                            }),
                        })?;
                    }
                    Ok(scheduler)
                },
            )?),
        };
        Ok(Self {
            tree: RadixTree::new(),
            ranks: ranks.to_vec(),
            block_size: config.engine.block_size,
            decider,
            refused_events: 0,
            blind: (config.router_groups == RouterGroups::FullAttentionOnly)
                .then(BlindView::default),
            sessions: matches!(policy, LabPolicy::Sessions(_)),
            disaggregation: roles.iter().any(|r| *r != WorkerRole::Both),
        })
    }

    /// Routes and books, at simulated time `now_ns`, a prompt of `block_hashes` (one
    /// per engine block, the last may be partial) and `num_tokens` tokens of the
    /// derived session `session` (sent only under [`LabPolicy::Sessions`]); returns the
    /// chosen rank's index.
    ///
    /// # Errors
    /// [`LabError::Scheduler`] when the scheduler refuses (e.g. a duplicate id), or
    /// [`LabError::NoRank`] when the decision names a rank the lab does not run.
    pub fn route(
        &mut self,
        id: &RequestId,
        block_hashes: &[LocalBlockHash],
        num_tokens: u64,
        session: u32,
        now_ns: u64,
    ) -> Result<Route, LabError> {
        let scores = self.tree.find_matches(block_hashes);
        match &mut self.decider {
            Decider::Scheduler(replicas) => {
                let mut request = ScheduleRequest::new(
                    id.clone(),
                    block_hashes.to_vec(),
                    num_tokens,
                    self.block_size,
                );
                request.allow_disaggregation = self.disaggregation;
                if self.sessions {
                    // A short ASCII name is always a valid id.
                    request.session_id = SessionId::new(&format!("s{session}")).ok();
                }
                let selection = replicas.schedule(&request, &scores, now_ns)?;
                let pair = selection.disaggregation;
                let prefill_rank = pair.and_then(|p| p.prefill).map(|p| p.rank);
                Ok(Route {
                    decode: self.index(selection.rank)?,
                    prefill: prefill_rank.map(|r| self.index(r)).transpose()?,
                    reason: pair.map(|p| p.reason),
                    // The index's match, capped before the last prompt token as the
                    // scheduler caps it (engines never serve that token from cache).
                    predicted_blocks: scores
                        .get(prefill_rank.unwrap_or(selection.rank))
                        .min(request.reusable_blocks()),
                })
            }
        }
    }

    fn index(&self, rank: WorkerRank) -> Result<usize, LabError> {
        self.ranks
            .binary_search(&rank)
            .map_err(|_| LabError::NoRank(rank))
    }

    /// A disaggregated request's prefill rank answered at simulated time `now_ns`.
    pub fn remote_prefill_done(&mut self, id: &RequestId, now_ns: u64) {
        self.lifecycle(id, LifecycleEvent::RemotePrefillDone, now_ns);
    }

    /// The request's first token arrived at simulated time `now_ns` (for a
    /// disaggregated request, from its decode rank: the prefill half is released).
    pub fn prefill_done(&mut self, id: &RequestId, now_ns: u64) {
        self.lifecycle(id, LifecycleEvent::PrefillDone, now_ns);
    }

    /// The request ended (finished or refused by its engine) at simulated time
    /// `now_ns`: both halves are released.
    pub fn free(&mut self, id: &RequestId, now_ns: u64) {
        self.lifecycle(id, LifecycleEvent::Freed, now_ns);
    }

    /// A frontend's lifecycle event, as the daemon applies it.
    fn lifecycle(&mut self, id: &RequestId, event: LifecycleEvent, now_ns: u64) {
        match &mut self.decider {
            // An unknown id means the request was never booked (or this half was
            // already released); nothing to release.
            Decider::Scheduler(replicas) => replicas.lifecycle(id, event, now_ns),
        }
    }

    /// Bookings still active (both halves of a disaggregated request count); expires
    /// them all, so call it at the end of a run.
    pub fn open_bookings(&mut self) -> usize {
        match &mut self.decider {
            Decider::Scheduler(replicas) => replicas.open_bookings(),
        }
    }

    /// Applies one rank's KV events, in order, as the router sees them
    /// ([`RouterGroups`]). Refused events are counted (see [`Router::refused_events`]).
    pub fn apply(&mut self, worker_id: WorkerId, events: &[KvCacheEvent]) {
        for event in events {
            let viewed = match &mut self.blind {
                None => vec![event.clone()],
                Some(blind) => blind.view(worker_id, event),
            };
            for event in &viewed {
                if self.tree.apply_event(worker_id, event).is_err() {
                    self.refused_events += 1;
                }
            }
        }
    }

    /// What online calibration learned about rank `index` (`None` when the decider
    /// does not calibrate).
    pub fn calibration(&self, index: usize) -> Option<RankCalibration> {
        match &self.decider {
            Decider::Scheduler(replicas) => replicas.first().calibration(*self.ranks.get(index)?),
        }
    }

    /// Events the index refused so far; non-zero only if events arrive out of order.
    pub fn refused_events(&self) -> u64 {
        self.refused_events
    }
}

/// The scheduler policy `kind` as the run `config` sets it up for `policy`: its
/// defaults with the run's delay cap, the engines' own constants under
/// [`LabPolicy::Tuned`], and lower tiers priced per the run's [`TierPricing`].
fn policy_config(policy: LabPolicy, kind: PolicyKind, config: &SimConfig) -> PolicyConfig {
    let mut policy_config = PolicyConfig::default_for(kind);
    if let PolicyConfig::PredictedTtft(c) = &mut policy_config {
        *c = config.predicted_ttft;
    }
    if matches!(policy, LabPolicy::Tuned(_)) {
        engines_constants(&mut policy_config, config);
    }
    tier_priced(policy_config, config.tier_pricing)
}

/// Sets `predicted-ttft`'s step-time constants to the simulated engines' own (at
/// speed 1) and its batch budget to theirs; other policies have no constants.
fn engines_constants(policy: &mut PolicyConfig, config: &SimConfig) {
    if let PolicyConfig::PredictedTtft(c) = policy {
        let t = config.timing;
        c.timing.step_base_ms = t.step_base_ms;
        c.timing.prefill_ms_per_token = t.prefill_ms_per_token;
        c.timing.decode_ms_per_seq = t.decode_ms_per_seq;
        c.timing.kv_read_ms_per_token = t.kv_read_ms_per_token;
        c.timing.max_num_batched_tokens = config.engine.max_num_batched_tokens;
    }
}

/// `policy` with blocks held only on a lower tier priced per `pricing`: unchanged
/// when on; when off, `predicted-ttft` charges them the prefill cost per token and
/// `kv` gives them no credit (other policies never price tiers).
fn tier_priced(mut policy: PolicyConfig, pricing: TierPricing) -> PolicyConfig {
    if pricing == TierPricing::Off {
        match &mut policy {
            PolicyConfig::Kv(c) => c.lower_tier_credit = 0.0,
            PolicyConfig::PredictedTtft(c) => {
                c.timing.tier_load_ms_per_token = c.timing.prefill_ms_per_token;
            }
            _ => {}
        }
    }
    policy
}
