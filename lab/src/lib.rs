//! The routing-quality lab: replay a request trace offline against a simulated
//! cluster, under every routing policy and several cluster sizes and loads, in one
//! command, and report the table, a JSON file and charts.
//!
//! Why offline: the online replay (`kv-mocker replay` / `quickstart`) exercises the
//! real daemon, NATS and engines, but runs in (scaled) real time, one policy at a time,
//! with timing noise. The lab runs the same engine model ([`engine_model::EngineCore`]:
//! KV cache, continuous batching, timing) and the same routing code (the real
//! `indexer::RadixTree` and `scheduler::Scheduler`, in-process) on a simulated clock
//! that jumps from event to event. A run of the 12,031-request Mooncake conversation
//! trace takes seconds, not an hour, and is a pure function of its inputs and seed.
//! What it leaves out is the transport: KV events reach the index after a fixed,
//! configurable lag (`--event-lag-ms`), and route decisions and lifecycle messages are
//! instantaneous. `docs/benchmarks.md` compares it with the online mode.
//!
//! What it costs: one engine core per rank and one index and scheduler per run, on
//! `--jobs` threads; time proportional to the engine steps simulated (see `sim`).
//!
//! Why a crate of its own: the lab is the only part of the mock tooling that needs the
//! router's `indexer` and `scheduler` and the `plotters` charts. Apart, `kv-mocker`'s
//! engines, replay and quickstart build without them, and the lab links no NATS, etcd
//! or HTTP: it drives the pure `engine_model` on a simulated clock. `kv-mocker lab`
//! dispatches here.
//!
//! # Layout
//! - `cli`: the `kv-mocker lab` flags ([`LabArgs`], [`LabCommand`]) and the sweep.
//! - `error`: [`LabError`].
//! - `config`: sweep points ([`Setting`], [`Speedup`]), shared knobs ([`SimConfig`]),
//!   policies under test ([`LabPolicy`]).
//! - `fleet`: engines that differ from the router's assumption (engine preset,
//!   shape factors, per-worker speed).
//! - `serving`: the engines' roles (aggregated, or split into prefill and decode
//!   engines); `disagg`: `kv-mocker lab disagg`,
//!   aggregated against disaggregated against conditional serving.
//! - `hybrid`: `kv-mocker lab hybrid`, a hybrid-attention fleet routed by a
//!   group-aware and a group-blind index, against a dense fleet.
//! - `robustness`: `kv-mocker lab robustness`, the policies across engine shapes.
//! - `calibration`: `kv-mocker lab swing`, how calibration follows a changing load.
//! - `sim`: the discrete-event simulator of one run (its `pair` module: the two halves
//!   of a disaggregated request); `prepared`: the trace mapped onto engine blocks;
//!   `sessions`: the sessions derived from a trace's prefix chains.
//! - `router`: index plus scheduler as the lab drives them; `replicas`: several
//!   schedulers in one queue group, syncing their bookings a lag late;
//!   `replica_study`: `kv-mocker lab replicas`, hit rate and TTFT against one replica.
//! - `log`: [`simulate_logged`], a run's route lookups and KV events, for replaying
//!   the same traffic into other indexes.
//! - `oracle`: the infinite-cache hit-rate bound.
//! - `regret`: each sampled decision's TTFT against the best rank in hindsight;
//!   `regret_report`: its table and `regret.csv`.
//! - `metrics`: per-request records and their aggregate.
//! - `sweep`: all runs on several threads with a progress bar.
//! - `report`: the JSON report; `table`: its terminal rendering; `charts`: PNGs.

mod blind;
mod calibration;
mod calibration_point;
mod charts;
mod cli;
mod config;
mod disagg;
mod error;
mod fleet;
mod hybrid;
mod log;
mod log_entry;
mod metrics;
mod oracle;
mod prepared;
mod regret;
mod regret_report;
mod replica_study;
mod replicas;
mod report;
mod robustness;
mod robustness_report;
mod router;
mod serving;
mod sessions;
mod sim;
mod study_args;
mod sweep;
mod table;

#[cfg(test)]
mod regret_tests;
#[cfg(test)]
mod test_cli;
#[cfg(test)]
mod tests;

pub use calibration::{SwingArgs, SwingReport};
pub use calibration_point::CalibrationPoint;
pub use charts::{CHART_FILES, DISAGG_CHART_FILES, write_charts, write_disagg_charts};
pub use cli::{LabArgs, LabCommand, run, run_lab, run_lab_with};
pub use config::{
    DEFAULT_SYNC_LAG_MS, LabPolicy, RouterGroups, RouterReplicas, Setting, SimConfig, Speedup,
};
pub use disagg::{DisaggArgs, DisaggReport, run_disagg};
pub use error::LabError;
pub use fleet::{EnginePreset, Factor, FleetPreset, SimulatedFleetArgs, TierPricing, WorkerSpeeds};
pub use hybrid::{HybridArgs, HybridReport, HybridRow, HybridShape, run_hybrid};
pub use log::simulate_logged;
pub use log_entry::LogEntry;
pub use metrics::{Prediction, RequestRecord, RunMetrics};
pub use oracle::{OracleBound, oracle_bound};
pub use regret::{RegretBucket, RegretFigures, RegretStats};
pub use replica_study::{ReplicaArgs, ReplicaReport, run_replicas};
pub use report::{ConfigInfo, LabReport, RunReport, TimingInfo, TraceInfo};
pub use robustness::{RobustnessArgs, run_robustness};
pub use robustness_report::{CellRun, RobustnessReport};
pub use serving::{ALWAYS_REMOTE, Serving, SplitFleet, SplitMode};
pub use sim::{PreparedTrace, RunResult, simulate};
pub use study_args::StudyArgs;
pub use sweep::{Sweep, run_sweep};
