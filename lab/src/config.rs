//! What one lab run simulates: the sweep point ([`Setting`]), the knobs shared by every
//! run ([`SimConfig`]) and the policy under test ([`LabPolicy`]).
//!
//! Plain data, validated once before a sweep starts, so a bad flag fails in
//! milliseconds rather than after minutes of simulation.

use crate::error::LabError;
use crate::fleet::{TierPricing, WorkerSpeeds};
use crate::serving::{ALWAYS_REMOTE, Serving, SplitFleet, SplitMode};
use engine_model::{CpuTierConfig, EngineModelConfig, HybridConfig, KvTransferConfig, TimingModel};
use kv_events::routing::PolicyKind;
use scheduler::policy::predicted_ttft::PredictedTtftConfig;
use scheduler::{DisaggregationConfig, SessionConfig};
use serde::{Deserialize, Serialize};
use std::num::NonZeroU64;

/// How many times faster than in the trace requests arrive: a finite number > 0.
/// Arrival `t` ms of the trace happens at `t / speedup` ms of simulated time; engine
/// speed is unchanged, so a speed-up multiplies the offered load.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Speedup(f64);

impl Speedup {
    /// Validates a speed-up factor.
    ///
    /// # Errors
    /// [`LabError::Speedup`] unless `factor` is finite and greater than 0.
    pub fn new(factor: f64) -> Result<Self, LabError> {
        if factor.is_finite() && factor > 0.0 {
            Ok(Self(factor))
        } else {
            Err(LabError::Speedup(factor))
        }
    }

    /// The factor.
    pub fn get(self) -> f64 {
        self.0
    }

    /// Simulated arrival time of a request the trace stamps `trace_ms`, in ns.
    pub fn arrival_ns(self, trace_ms: u64) -> u64 {
        ms_to_ns(trace_ms as f64 / self.0)
    }
}

impl std::str::FromStr for Speedup {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let factor: f64 = s.parse().map_err(|err| format!("{s:?}: {err}"))?;
        Speedup::new(factor).map_err(|err| err.to_string())
    }
}

impl std::fmt::Display for Speedup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x", self.0)
    }
}

/// One point of the sweep: cluster size and arrival speed-up.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Setting {
    /// Workers, each one dp rank running the engine model.
    pub workers: u32,
    /// Arrival speed-up.
    pub speedup: Speedup,
}

/// Knobs shared by every run of a sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// The engine model of every rank (block size, cache size, batch limits).
    pub engine: EngineModelConfig,
    /// The engines' step durations at speed 1 (the router keeps its own constants,
    /// see `ROUTER_TIMING`).
    pub timing: TimingModel,
    /// Each worker's engine speed: rank `i` runs `timing` at `speeds[i]`
    /// (see the `fleet` module).
    pub speeds: WorkerSpeeds,
    /// Delay between a step's end (when the live engine publishes its KV events) and
    /// the events reaching the router's index, in simulated ms; finite and ≥ 0.
    pub event_lag_ms: f64,
    /// Seed of every random choice (the scheduler's tie-breaks and samplers).
    pub seed: u64,
    /// Every engine's CPU tier (none by default).
    pub cpu_tier: CpuTierConfig,
    /// How the router prices blocks held only on the CPU tier.
    pub tier_pricing: TierPricing,
    /// Sample every rank's calibration estimates this often, in simulated ms, into
    /// [`crate::sim::RunResult::calibration`] (only under a `+cal` policy); `None`
    /// keeps only the final estimates. Finite and ≥ 1 when set.
    pub calibration_sample_ms: Option<f64>,
    /// Session affinity's knobs for `+sess` runs (`enabled` follows the policy:
    /// on for [`LabPolicy::Sessions`], off otherwise).
    pub sessions: SessionConfig,
    /// `predicted-ttft`'s knobs for every row of that policy (the step-time constants
    /// are the engines' own under [`LabPolicy::Tuned`]).
    pub predicted_ttft: PredictedTtftConfig,
    /// The engines' roles: aggregated (the default) or split into prefill and decode
    /// engines (`serving`).
    pub serving: Serving,
    /// The KV transfer to a split fleet's decode engines.
    pub transfer: KvTransferConfig,
    /// The router's conditional-disaggregation thresholds for a
    /// [`SplitMode::Conditional`] split (the scheduler's defaults unless set).
    pub conditional: DisaggregationConfig,
    /// The engines' hybrid-attention shape (sliding-window KV cache groups; a dense
    /// model by default).
    pub hybrid: HybridConfig,
    /// Which KV cache groups' events the router indexes.
    pub router_groups: RouterGroups,
    /// Measure the regret (`regret`) of every `n`-th request's decision (by
    /// trace order) into [`crate::sim::RunResult::regret`]; `None` (the default)
    /// measures none. Aggregated fleets only: a split fleet's decisions are not
    /// sampled.
    pub regret_every: Option<NonZeroU64>,
    /// Router replicas deciding in one queue group (one by default).
    pub replicas: RouterReplicas,
}

/// Router replicas of a run (`crate::replicas`): how many, and how late each learns
/// its peers' bookings and lifecycle steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterReplicas {
    /// Replicas in the route queue group, at least 1; each query goes to one drawn at
    /// random.
    pub count: usize,
    /// From a replica's booking or lifecycle step to its peers applying it, in
    /// simulated ms; finite and ≥ 0.
    pub sync_lag_ms: f64,
}

impl Default for RouterReplicas {
    /// One replica; a sync lag of [`DEFAULT_SYNC_LAG_MS`] if more are set.
    fn default() -> Self {
        Self {
            count: 1,
            sync_lag_ms: DEFAULT_SYNC_LAG_MS,
        }
    }
}

impl RouterReplicas {
    /// The sync lag in ns.
    pub fn sync_lag_ns(&self) -> u64 {
        ms_to_ns(self.sync_lag_ms)
    }
}

/// Default replica sync lag, in ms: the p50 bucket bound measured with 8 replicas on
/// one host (`docs/benchmarks.md`, "Router replicas"; p99 ≤ 10 ms).
pub const DEFAULT_SYNC_LAG_MS: f64 = 1.0;

/// Which KV cache groups' events the lab's router indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RouterGroups {
    /// Every group's, as the engines publish them: kv-router's group-aware index.
    #[default]
    All,
    /// Only the full-attention group's, without their group and held once per block
    /// (no copies); sliding-window groups' events are dropped: what routers that know
    /// neither groups nor copies see (Dynamo, llm-d; the `blind` module).
    FullAttentionOnly,
}

impl Default for SimConfig {
    /// Engine defaults (`EngineModelConfig::default`), `TimingModel::H100_8B` on every
    /// worker, an event lag of `DEFAULT_EVENT_LAG_MS` and seed 42.
    fn default() -> Self {
        Self {
            engine: EngineModelConfig::default(),
            timing: TimingModel::H100_8B,
            speeds: WorkerSpeeds::Uniform,
            event_lag_ms: DEFAULT_EVENT_LAG_MS,
            seed: 42,
            cpu_tier: CpuTierConfig::default(),
            tier_pricing: TierPricing::On,
            calibration_sample_ms: None,
            sessions: SessionConfig::default(),
            predicted_ttft: PredictedTtftConfig::default(),
            serving: Serving::Aggregated,
            transfer: KvTransferConfig::default(),
            conditional: DisaggregationConfig::default(),
            hybrid: HybridConfig::default(),
            router_groups: RouterGroups::All,
            regret_every: None,
            replicas: RouterReplicas::default(),
        }
    }
}

/// Default KV event lag, in simulated ms: a NATS hop plus the indexer's queue on a
/// healthy cluster is a few ms.
pub const DEFAULT_EVENT_LAG_MS: f64 = 5.0;

/// The step-time constants the router assumes: the scheduler's `predicted-ttft`
/// defaults (`StepTimeModel::default()`) and the lab prototypes' model. The engines
/// may differ (`SimConfig::timing`, `SimConfig::speeds`); the router does not learn it.
pub const ROUTER_TIMING: TimingModel = TimingModel::H100_8B;

impl SimConfig {
    /// Checks the engine model, the timing and the lag.
    ///
    /// # Errors
    /// [`LabError::Engine`] for a bad engine, CPU tier or transfer knob, [`LabError::Timing`] for a timing
    /// coefficient that is negative or not finite, [`LabError::EventLag`] for a
    /// negative or non-finite lag, [`LabError::Scheduler`] for a conditional threshold out of range,
    /// [`LabError::Replicas`] for no replica or replicas over a split fleet (the lab
    /// syncs whole requests' bookings only), [`LabError::SyncLag`] for a negative or
    /// non-finite sync lag.
    pub fn validate(&self) -> Result<(), LabError> {
        self.engine.validate()?;
        self.cpu_tier.validate()?;
        self.hybrid.validate()?;
        self.transfer.validate()?;
        self.conditional.validate()?;
        let t = &self.timing;
        for value in [
            t.step_base_ms,
            t.prefill_ms_per_token,
            t.decode_ms_per_seq,
            t.kv_read_ms_per_token,
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(LabError::Timing(value));
            }
        }
        if !(self.event_lag_ms.is_finite() && self.event_lag_ms >= 0.0) {
            return Err(LabError::EventLag(self.event_lag_ms));
        }
        if self.replicas.count == 0
            || (self.replicas.count > 1 && !matches!(self.serving, Serving::Aggregated))
        {
            return Err(LabError::Replicas(self.replicas.count));
        }
        let lag = self.replicas.sync_lag_ms;
        if !(lag.is_finite() && lag >= 0.0) {
            return Err(LabError::SyncLag(lag));
        }
        if let Some(ms) = self.calibration_sample_ms
            && !(ms.is_finite() && ms >= 1.0)
        {
            return Err(LabError::SampleInterval(ms));
        }
        Ok(())
    }

    /// The router's disaggregation thresholds in this run: [`Self::conditional`]
    /// for a conditional split, [`ALWAYS_REMOTE`] for a disaggregated one (an
    /// aggregated fleet has no prefill worker, so none apply).
    pub fn disaggregation(&self) -> DisaggregationConfig {
        match self.serving {
            Serving::Split(SplitFleet {
                mode: SplitMode::Disaggregated,
                ..
            }) => ALWAYS_REMOTE,
            _ => self.conditional,
        }
    }

    /// The event lag in ns.
    pub fn event_lag_ns(&self) -> u64 {
        ms_to_ns(self.event_lag_ms)
    }
}

/// A routing policy under test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LabPolicy {
    /// A policy of the `scheduler` crate with its default knobs but online
    /// calibration off, so its rows show the policy with the configured constants;
    /// run through `scheduler::Scheduler` exactly as the daemon runs it.
    Scheduler(PolicyKind),
    /// The same with the scheduler's online calibration on (`scheduler::calibration`,
    /// default knobs; the daemon's default): each rank's step-time constants are
    /// learned from the TTFTs the run observes. Named `<kind>+cal`.
    Calibrated(PolicyKind),
    /// The same with session affinity (`scheduler::sessions`, default knobs), each
    /// request carrying the session derived from the trace's prefix chains
    /// (the `sessions` module). Named `<kind>+sess`.
    Sessions(PolicyKind),
    /// The same with its step-time constants set to the simulated engines' own
    /// (speed 1), as an operator who measured the engine exactly would configure it:
    /// the yardstick of "the gain it has when the constants are right". Only
    /// `predicted-ttft` has constants; other kinds run as [`LabPolicy::Scheduler`].
    /// Named `<kind>@engine`.
    Tuned(PolicyKind),
}

impl LabPolicy {
    /// Every scheduler policy, in `PolicyKind::ALL` order.
    pub fn all_scheduler() -> Vec<LabPolicy> {
        PolicyKind::ALL
            .into_iter()
            .map(LabPolicy::Scheduler)
            .collect()
    }

    /// Display and JSON name: the scheduler's wire name (`kv`, `round-robin`, …) with
    /// the variant's suffix.
    pub fn name(&self) -> String {
        match self {
            LabPolicy::Scheduler(kind) => kind.as_str().to_owned(),
            LabPolicy::Calibrated(kind) => format!("{}+cal", kind.as_str()),
            LabPolicy::Sessions(kind) => format!("{}+sess", kind.as_str()),
            LabPolicy::Tuned(kind) => format!("{}@engine", kind.as_str()),
        }
    }
}

/// `ms` milliseconds as whole nanoseconds (rounded; negative and NaN give 0).
pub fn ms_to_ns(ms: f64) -> u64 {
    // Saturating float-to-int conversion is the intent: durations are ≥ 0 and far
    // below u64::MAX ns (584 years).
    (ms * 1e6).round().max(0.0) as u64
}

/// `ns` nanoseconds as milliseconds.
pub fn ns_to_ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speedup_divides_arrival_times() {
        let s: Speedup = "4".parse().unwrap();
        assert_eq!(s.arrival_ns(1_000), 250_000_000);
        assert_eq!(s.to_string(), "4x");
        assert!("0".parse::<Speedup>().is_err());
        assert!("-2".parse::<Speedup>().is_err());
        assert!("inf".parse::<Speedup>().is_err());
        assert!("x".parse::<Speedup>().is_err());
    }

    #[test]
    fn config_validation_names_the_problem() {
        let ok = SimConfig::default();
        assert!(ok.validate().is_ok());
        let lag = SimConfig {
            event_lag_ms: -1.0,
            ..ok.clone()
        };
        assert!(matches!(lag.validate(), Err(LabError::EventLag(_))));
        let mut timing = ok.clone();
        timing.timing.prefill_ms_per_token = f64::INFINITY;
        assert!(matches!(timing.validate(), Err(LabError::Timing(_))));
        let mut engine = ok;
        engine.engine.block_size = 0;
        assert!(matches!(engine.validate(), Err(LabError::Engine(_))));
    }

    #[test]
    fn conversions_round_to_whole_ns() {
        assert_eq!(ms_to_ns(1.5), 1_500_000);
        assert_eq!(ms_to_ns(-3.0), 0);
        assert_eq!(ns_to_ms(2_500_000), 2.5);
    }

    #[test]
    fn policy_names() {
        assert_eq!(LabPolicy::Scheduler(PolicyKind::Kv).name(), "kv");
        assert_eq!(
            LabPolicy::Calibrated(PolicyKind::PredictedTtft).name(),
            "predicted-ttft+cal"
        );
        assert_eq!(LabPolicy::all_scheduler().len(), PolicyKind::ALL.len());
    }
}
