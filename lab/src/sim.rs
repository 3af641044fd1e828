//! The discrete-event simulator: one trace, one cluster size, one speed-up, one policy.
//!
//! Simulated time is whole nanoseconds. Four kinds of things happen, and the clock
//! jumps straight from one to the next (no ticks), so the cost is proportional to the
//! work done — engine steps, arrivals, event deliveries, transfers — not to the
//! simulated span:
//!
//! - **arrival** of request `i` at `timestamp_ms / speedup`: route it (index lookup
//!   and scheduler decision), queue it on the chosen rank's [`EngineCore`] (in a split
//!   fleet, a disaggregated request's prefill half on its prefill rank), and start a
//!   step there if the rank is idle;
//! - **step end** of a rank, `duration_ms` after the step started: the step's first
//!   tokens and finished requests take effect (TTFT and end-to-end times are taken
//!   here; the router hears `prefill_done` / `freed` at once, and
//!   `remote_prefill_done` for a prefill half, whose end starts its KV transfer), its
//!   KV events leave for the index, and the next step starts if the rank has work;
//! - **event delivery**, `event_lag` after the step end that produced the events: they
//!   are applied to the index. With a lag of 0 they are applied at the step end, before
//!   anything else at that instant;
//! - **transfer end** of a disaggregated request (the `pair` module): its decode half
//!   joins its decode rank's queue.
//!
//! As in the live engine (`engine::rank`), a step's schedule is fixed when it starts
//! ([`EngineCore::step`]) and its outputs are published when it ends; requests that
//! arrive meanwhile wait for the next step. Ties at one instant are ordered: pending
//! step ends, deliveries and transfer ends before arrivals, and among them by creation
//! order, so a run is a pure function of its inputs (the scheduler's RNG is seeded).

use crate::calibration_point::CalibrationPoint;
use crate::config::{LabPolicy, Setting, SimConfig, ms_to_ns, ns_to_ms};
use crate::error::LabError;
use crate::fleet::at_speed;
use crate::log_entry::LogEntry;
use crate::metrics::{RequestRecord, RunMetrics};
use crate::regret::{RegretSample, RegretStats, counterfactual_ttft_ns};
use crate::router::Router;
use engine_model::{EngineCore, EngineRequest, KvTransferConfig, StepOutput};
use kv_events::disaggregation::is_prefill_booking_id;
use kv_events::{DpRank, KvCacheEvent, KvCacheEventData, RequestId, WorkerId, WorkerRank};
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap};

pub use crate::prepared::PreparedTrace;

#[path = "sim_pair.rs"]
mod pair;

/// The result of one simulated run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    /// One record per trace request, in trace order.
    pub records: Vec<RequestRecord>,
    /// KV events the index refused (should be 0).
    pub refused_events: u64,
    /// Engine steps simulated, over all ranks.
    pub steps: u64,
    /// Every rank's calibration estimates, at each sample time
    /// ([`SimConfig::calibration_sample_ms`]) and at the end of the run, in time
    /// order; empty unless the router calibrates.
    pub calibration: Vec<CalibrationPoint>,
    /// Bookings still active in the scheduler when every request had ended (both
    /// halves of a disaggregated request count); 0 unless the lifecycle leaks.
    pub open_bookings: usize,
    /// The sampled decisions' regret ([`SimConfig::regret_every`]); `None` when none
    /// was sampled.
    pub regret: Option<RegretStats>,
}

impl RunResult {
    /// The aggregate metrics of this run over `workers` workers.
    pub fn metrics(&self, workers: usize) -> RunMetrics {
        RunMetrics::from_records(&self.records, workers, self.refused_events)
    }
}

/// Something scheduled at a simulated instant.
#[derive(Debug)]
enum Event {
    /// Rank `rank`'s current step ends with `output`.
    StepEnd { rank: usize, output: StepOutput },
    /// Rank `rank`'s KV events reach the index.
    Deliver {
        rank: usize,
        events: Vec<KvCacheEvent>,
    },
    /// Request `index`'s KV reached its decode rank.
    TransferEnd { index: usize },
}

/// An [`Event`] with its time and a creation sequence number for tie-breaking.
#[derive(Debug)]
struct Timed {
    at: u64,
    seq: u64,
    event: Event,
}

impl PartialEq for Timed {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Timed {}

impl PartialOrd for Timed {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Timed {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// One simulated dp rank.
#[derive(Debug)]
struct SimRank {
    id: WorkerRank,
    core: EngineCore,
    /// A step is in flight (its end is in the queue).
    stepping: bool,
    /// When the step in flight ends, in ns (meaningless while not stepping).
    step_end_ns: u64,
    next_event_id: u64,
}

/// The state of one run.
struct Sim<'a> {
    trace: &'a PreparedTrace,
    lag_ns: u64,
    ranks: Vec<SimRank>,
    router: Router,
    transfer: KvTransferConfig,
    queue: BinaryHeap<Reverse<Timed>>,
    seq: u64,
    records: Vec<RequestRecord>,
    /// Engine request id → trace index, for requests queued or running on a rank (a
    /// prefill half under its `#prefill` id).
    active: HashMap<RequestId, usize>,
    steps: u64,
    /// Where route lookups and deliveries are recorded, when the caller asked.
    log: Option<&'a mut Vec<LogEntry>>,
    /// Calibration sample interval and the next sample time, in ns.
    sample_every_ns: Option<u64>,
    next_sample_ns: u64,
    calibration: Vec<CalibrationPoint>,
    /// Sample every n-th decision's regret, and the samples so far.
    regret_every: Option<u64>,
    regret: Vec<RegretSample>,
}

/// Simulates `trace` on `setting.workers` ranks under `policy`; rank `i` runs the
/// engines' timing at `config.speeds`' `i`-th speed, in the role `config.serving`
/// gives it.
///
/// # Errors
/// [`LabError`] if the configuration is invalid (engine model, timing, event lag, a
/// speed list that does not match the workers, a split without both roles), the block
/// size differs from the one the trace was prepared for, or the scheduler refuses its
/// configuration. Individual requests never fail the run: refusals are recorded.
pub fn simulate(
    trace: &PreparedTrace,
    setting: Setting,
    policy: LabPolicy,
    config: &SimConfig,
) -> Result<RunResult, LabError> {
    run_sim(trace, setting, policy, config, None)
}

/// Runs one simulation; when `log` is given, every route lookup and every KV event
/// delivery the index sees is appended to it, in order (see [`crate::log`]).
pub(super) fn run_sim(
    trace: &PreparedTrace,
    setting: Setting,
    policy: LabPolicy,
    config: &SimConfig,
    log: Option<&mut Vec<LogEntry>>,
) -> Result<RunResult, LabError> {
    config.validate()?;
    if config.engine.block_size != trace.block_size {
        return Err(LabError::BlockSizeMismatch {
            trace: trace.block_size,
            engine: config.engine.block_size,
        });
    }
    if setting.workers == 0 {
        return Err(LabError::NoWorkers);
    }
    let roles = config.serving.roles(setting.workers)?;
    let ids: Vec<WorkerRank> = (1..=u64::from(setting.workers))
        .map(|w| WorkerRank::new(WorkerId(w), DpRank(0)))
        .collect();
    let speeds = config.speeds.for_workers(setting.workers)?;
    let ranks = ids
        .iter()
        .zip(speeds)
        .map(|(&id, speed)| {
            Ok(SimRank {
                id,
                core: EngineCore::new(config.engine, at_speed(config.timing, speed))?
                    .with_cpu_tier(config.cpu_tier)?
                    .with_hybrid(config.hybrid)?,
                stepping: false,
                step_end_ns: 0,
                next_event_id: 0,
            })
        })
        .collect::<Result<Vec<_>, LabError>>()?;
    let mut sim = Sim {
        trace,
        lag_ns: config.event_lag_ns(),
        ranks,
        router: Router::new(policy, &ids, &roles, config)?,
        transfer: config.transfer,
        queue: BinaryHeap::new(),
        seq: 0,
        records: trace
            .requests
            .iter()
            .map(|r| RequestRecord {
                arrival_ns: setting.speedup.arrival_ns(r.timestamp_ms),
                prompt_tokens: r.prompt_tokens,
                ..RequestRecord::default()
            })
            .collect(),
        active: HashMap::new(),
        steps: 0,
        log,
        sample_every_ns: config.calibration_sample_ms.map(|ms| ms_to_ns(ms).max(1)),
        next_sample_ns: 0,
        calibration: Vec::new(),
        regret_every: config.regret_every.map(|n| n.get()),
        regret: Vec::new(),
    };
    sim.run();
    let end_ns = sim
        .records
        .iter()
        .filter_map(|r| r.finish_ns)
        .max()
        .unwrap_or(0);
    sim.sample_calibration(end_ns);
    Ok(RunResult {
        refused_events: sim.router.refused_events(),
        open_bookings: sim.router.open_bookings(),
        steps: sim.steps,
        records: sim.records,
        calibration: sim.calibration,
        regret: config
            .regret_every
            .and_then(|n| RegretStats::of(&sim.regret, n.get())),
    })
}

impl Sim<'_> {
    fn run(&mut self) {
        let mut next = 0;
        loop {
            let arrival = self.records.get(next).map(|r| r.arrival_ns);
            let due = self.queue.peek().map(|Reverse(t)| t.at);
            let event_first = match (due, arrival) {
                (Some(at), Some(a)) => at <= a,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            if let Some(every) = self.sample_every_ns {
                let now = if event_first { due } else { arrival }.unwrap_or(0);
                while self.next_sample_ns <= now {
                    self.sample_calibration(self.next_sample_ns);
                    self.next_sample_ns += every;
                }
            }
            if event_first {
                if let Some(Reverse(timed)) = self.queue.pop() {
                    self.handle(timed.at, timed.event);
                }
            } else if let Some(at) = arrival {
                self.arrive(next, at);
                next += 1;
            }
        }
    }

    fn push(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse(Timed {
            at,
            seq: self.seq,
            event,
        }));
    }

    /// Rank `rank`'s KV events reach the index (and the log, if kept).
    fn deliver(&mut self, rank: usize, events: Vec<KvCacheEvent>) {
        let worker_id = self.ranks[rank].id.worker_id;
        self.router.apply(worker_id, &events);
        if let Some(log) = self.log.as_mut() {
            log.push(LogEntry::Events { worker_id, events });
        }
    }

    fn arrive(&mut self, index: usize, now: u64) {
        let trace = self.trace;
        let request = &trace.requests[index];
        if let Some(log) = self.log.as_mut() {
            log.push(LogEntry::Route {
                block_hashes: request.block_hashes.clone(),
            });
        }
        let id = request_id(index);
        let route = match self.router.route(
            &id,
            &request.block_hashes,
            request.prompt_tokens,
            request.session,
            now,
        ) {
            Ok(route) => route,
            Err(err) => {
                tracing::debug!(request = index, %err, "route refused");
                self.records[index].rejected = true;
                return;
            }
        };
        let record = &mut self.records[index];
        record.worker = Some(route.decode);
        record.prefill_worker = route.prefill;
        record.predicted_tokens = (u64::from(route.predicted_blocks) * u64::from(trace.block_size))
            .min(request.prompt_tokens);
        record.reason = route.reason;
        let overlap = record.predicted_tokens as f64 / request.prompt_tokens.max(1) as f64;
        if route.prefill.is_none()
            && self
                .regret_every
                .is_some_and(|n| (index as u64).is_multiple_of(n))
        {
            self.sample_regret(index, route.decode, overlap, now);
        }
        match route.prefill {
            Some(prefill) => self.admit(index, prefill, pair::Part::PrefillHalf, now),
            None => self.admit(index, route.decode, pair::Part::Request, now),
        }
    }

    fn start_step(&mut self, rank: usize, now: u64) {
        let output = self.ranks[rank].core.step();
        self.steps += 1;
        self.ranks[rank].stepping = true;
        // A step with work has a positive duration; max(1) keeps time moving even for
        // a degenerate timing model of all zeros.
        let end = now + ms_to_ns(output.duration_ms).max(1);
        self.ranks[rank].step_end_ns = end;
        self.push(end, Event::StepEnd { rank, output });
    }

    fn handle(&mut self, now: u64, event: Event) {
        match event {
            Event::StepEnd { rank, output } => self.end_step(rank, now, output),
            Event::Deliver { rank, events } => self.deliver(rank, events),
            Event::TransferEnd { index } => self.end_transfer(index, now),
        }
    }

    fn end_step(&mut self, rank: usize, now: u64, output: StepOutput) {
        let events = self.number_events(rank, output.kv_events);
        if !events.is_empty() {
            if self.lag_ns == 0 {
                self.deliver(rank, events);
            } else {
                self.push(now + self.lag_ns, Event::Deliver { rank, events });
            }
        }
        for first in output.first_tokens {
            let Some(&index) = self.active.get(&first.request_id) else {
                continue;
            };
            let record = &mut self.records[index];
            let half = is_prefill_booking_id(&first.request_id);
            // The prompt's cache hit is where it was prefilled.
            if half || record.prefill_worker.is_none() {
                record.cached_tokens = first.cached_tokens;
                record.loaded_tokens = first.loaded_tokens;
            }
            let id = request_id(index);
            if half {
                self.router.remote_prefill_done(&id, now);
            } else {
                record.first_token_ns = Some(now);
                self.router.prefill_done(&id, now);
            }
        }
        for done in output.finished {
            let Some(index) = self.active.remove(&done.request_id) else {
                continue;
            };
            if is_prefill_booking_id(&done.request_id) {
                self.start_transfer(index, now);
            } else {
                let record = &mut self.records[index];
                record.finish_ns = Some(now);
                record.output_tokens = done.output_tokens;
                self.router.free(&request_id(index), now);
            }
        }
        self.ranks[rank].stepping = false;
        if self.ranks[rank].core.has_work() {
            self.start_step(rank, now);
        }
    }

    /// Records the regret of routing request `index` to rank `chosen` at `now`, the
    /// router having predicted an overlap of `overlap_share` of the prompt there
    /// (see [`crate::regret`]). A rank whose core would refuse the request is not a
    /// candidate; nothing is recorded if the chosen one would.
    fn sample_regret(&mut self, index: usize, chosen: usize, overlap_share: f64, now: u64) {
        let request = &self.trace.requests[index];
        let ttft: Vec<Option<u64>> = self
            .ranks
            .iter()
            .map(|r| {
                let engine_request = EngineRequest {
                    request_id: request_id(index),
                    block_hashes: request.block_hashes.clone(),
                    prompt_tokens: request.prompt_tokens,
                    max_tokens: request.max_tokens,
                    token_ids: None,
                };
                let step_end = r.stepping.then_some(r.step_end_ns);
                counterfactual_ttft_ns(&r.core, step_end, now, engine_request)
            })
            .collect();
        let (Some(chosen_ns), Some(best_ns)) = (ttft[chosen], ttft.iter().flatten().min()) else {
            return;
        };
        let active: u64 = self.ranks.iter().map(|r| r.core.active_requests()).sum();
        self.regret.push(RegretSample {
            prompt_tokens: request.prompt_tokens,
            overlap_share,
            load_per_rank: active as f64 / self.ranks.len() as f64,
            regret_ns: chosen_ns - best_ns,
        });
    }

    /// Records every rank's calibration estimates at `now_ns` (nothing when the
    /// router does not calibrate).
    fn sample_calibration(&mut self, now_ns: u64) {
        for worker in 0..self.ranks.len() {
            if let Some(c) = self.router.calibration(worker) {
                self.calibration
                    .push(CalibrationPoint::new(ns_to_ms(now_ns), worker + 1, &c));
            }
        }
    }

    /// Gives a step's events the rank's next event ids, as the live engine does.
    fn number_events(&mut self, rank: usize, data: Vec<KvCacheEventData>) -> Vec<KvCacheEvent> {
        let r = &mut self.ranks[rank];
        data.into_iter()
            .map(|data| {
                let event_id = r.next_event_id;
                r.next_event_id += 1;
                KvCacheEvent {
                    event_id,
                    dp_rank: r.id.dp_rank,
                    data,
                }
            })
            .collect()
    }
}

/// The request id of trace request `index` (the router's and the decode half's; the
/// prefill half runs under its `#prefill` id).
fn request_id(index: usize) -> RequestId {
    RequestId(index.to_string())
}

impl RunResult {
    /// Each rank's last calibration point, by worker.
    pub fn final_calibration(&self) -> Vec<CalibrationPoint> {
        let mut last: Vec<CalibrationPoint> = Vec::new();
        for p in self.calibration.iter().rev() {
            if !last.iter().any(|q| q.worker == p.worker) {
                last.push(*p);
            }
        }
        last.sort_by_key(|p| p.worker);
        last
    }
}
