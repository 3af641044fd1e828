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
//! `--jobs` threads; time proportional to the engine steps simulated (see [`sim`]).
//!
//! # Layout
//! - [`config`]: sweep points ([`Setting`], [`Speedup`]), shared knobs ([`SimConfig`]),
//!   policies under test ([`LabPolicy`]).
//! - [`fleet`]: engines that differ from the router's assumption (engine preset,
//!   shape factors, per-worker speed).
//! - [`robustness`]: `kv-mocker lab robustness`, the policies across engine shapes.
//! - [`sim`]: the discrete-event simulator of one run.
//! - `router`: index plus scheduler as the lab drives them.
//! - [`log`]: [`simulate_logged`], a run's route lookups and KV events, for replaying
//!   the same traffic into other indexes.
//! - [`oracle`]: the infinite-cache hit-rate bound.
//! - [`metrics`]: per-request records and their aggregate.
//! - [`sweep`]: all runs on several threads with a progress bar.
//! - [`report`]: the JSON report; `table`: its terminal rendering; [`charts`]: PNGs.

pub mod calibration;
mod calibration_point;
pub mod charts;
pub mod config;
pub mod fleet;
pub mod log;
mod log_entry;
pub mod metrics;
pub mod oracle;
pub mod report;
pub mod robustness;
mod router;
pub mod sessions;
pub mod sim;
mod study_args;
pub mod sweep;
mod table;

#[cfg(test)]
mod tests;

pub use config::{LabPolicy, Setting, SimConfig, Speedup};
pub use fleet::{EnginePreset, Factor, FleetArgs, FleetPreset, TierPricing, WorkerSpeeds};
pub use log::{LogEntry, simulate_logged};
pub use oracle::{OracleBound, oracle_bound};
pub use report::{LabReport, RunReport};
pub use robustness::{RobustnessArgs, RobustnessReport, run_robustness};
pub use sim::{PreparedTrace, RunResult, simulate};
pub use study_args::StudyArgs;
pub use sweep::{Sweep, run_sweep};

use engine_model::ModelConfigError;
use engine_model::trace::{BlockMapping, BlockSizeMismatch, TraceError};
use indicatif::{ProgressBar, ProgressStyle};
use kv_events::WorkerRank;
use kv_events::routing::PolicyKind;
use scheduler::SessionConfig;
use std::path::PathBuf;

/// Why the lab could not run or report.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The trace could not be loaded.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The engine block size cannot split the trace's blocks.
    #[error(transparent)]
    BlockSize(#[from] BlockSizeMismatch),
    /// The trace was prepared for another block size than the engine model's.
    #[error("trace prepared for {trace}-token blocks but the engine uses {engine}")]
    BlockSizeMismatch {
        /// Block size the trace was mapped to, in tokens.
        trace: u32,
        /// The engine model's block size, in tokens.
        engine: u32,
    },
    /// An engine model knob is unusable.
    #[error("engine model: {0}")]
    Engine(#[from] ModelConfigError),
    /// The event lag is negative or not finite.
    #[error("event lag must be finite and >= 0 ms, got {0}")]
    EventLag(f64),
    /// `kv-mocker lab swing --cell` names no robustness cell.
    #[error("unknown cell {0:?} (see `kv-mocker lab robustness` for the names)")]
    UnknownCell(String),
    /// The calibration sample interval is below 1 ms or not finite.
    #[error("calibration sample interval must be finite and >= 1 ms, got {0}")]
    SampleInterval(f64),
    /// A speed-up is not a finite number greater than 0.
    #[error("speed-up must be a finite number greater than 0, got {0}")]
    Speedup(f64),
    /// A worker speed or timing factor is not a finite number greater than 0.
    #[error("factor must be a finite number greater than 0, got {0}")]
    Factor(f64),
    /// A timing coefficient of the engines is negative or not finite.
    #[error("engine timing coefficients must be finite and >= 0 ms, got {0}")]
    Timing(f64),
    /// `--worker-speed` lists another number of speeds than a setting has workers.
    #[error(
        "--worker-speed gives {given} speeds but a setting has {workers} workers (give one speed for all, or one per worker)"
    )]
    WorkerSpeedCount {
        /// Speeds given.
        given: usize,
        /// Workers in the setting.
        workers: u32,
    },
    /// A setting has no workers, or no setting or policy was given.
    #[error("nothing to simulate: need at least one worker, setting and policy")]
    NoWorkers,
    /// The scheduler refused its configuration, a registration or a request.
    #[error("scheduler: {0}")]
    Scheduler(#[from] scheduler::SchedulerError),
    /// The scheduler chose a rank the lab does not simulate.
    #[error("scheduler chose unknown rank {0}")]
    NoRank(WorkerRank),
    /// A run did not produce a result (its thread panicked).
    #[error("a simulation run did not complete")]
    Incomplete,
    /// A report or chart file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A chart could not be drawn or encoded.
    #[error("chart: {0}")]
    Chart(String),
}

/// `kv-mocker lab`: simulate a trace under every policy × workers × speed-up, or run
/// one of the lab's other studies (`kv-mocker lab robustness`).
#[derive(Debug, Clone, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct LabArgs {
    /// Another study instead of the sweep.
    #[command(subcommand)]
    pub command: Option<LabCommand>,
    /// Trace and simulation flags shared by every study.
    #[command(flatten)]
    pub study: StudyArgs,
    /// Worker counts to sweep (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    pub workers: Vec<u32>,
    /// Arrival speed-ups to sweep (comma-separated): arrivals happen at trace time /
    /// speed-up, so 2 doubles the offered load.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub speedup: Vec<Speedup>,
    /// Scheduler policies to compare (repeatable); default: all of them.
    #[arg(long = "policy", value_name = "POLICY")]
    pub policies: Vec<PolicyKind>,
    /// Also run these scheduler policies with online calibration on (repeatable),
    /// reported as `<policy>+cal`.
    #[arg(long = "calibrated", value_name = "POLICY")]
    pub calibrated: Vec<PolicyKind>,
    /// Also run these scheduler policies with session affinity (repeatable), each
    /// request carrying the session derived from the trace's prefix chains
    /// (`mocker::lab::sessions`), reported as `<policy>+sess`.
    #[arg(long = "sessions", value_name = "POLICY")]
    pub sessions: Vec<PolicyKind>,
    /// `+sess` rows of `predicted-ttft`: a session's last rank is left only for a rank
    /// predicted faster by more than this, in ms (the daemon's `--session-margin-ms`).
    #[arg(long, default_value_t = SessionConfig::default().margin_ms)]
    pub session_margin_ms: f64,
    /// `+sess` rows of `kv`: a session's last rank is left only for a rank cheaper by
    /// more than this share of its cost (the daemon's `--session-relative-margin`).
    #[arg(long, default_value_t = SessionConfig::default().relative_margin)]
    pub session_relative_margin: f64,
    /// The simulated engines' timing and speeds (the router keeps its defaults).
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Threads to run simulations on; default: the machine's cores.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Directory for `report.json` and the PNG charts.
    #[arg(long, default_value = "target/lab")]
    pub out: PathBuf,
    /// Skip the PNG charts.
    #[arg(long)]
    pub no_charts: bool,
}

/// The lab's studies besides the main sweep.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum LabCommand {
    /// Compare `kv` and `predicted-ttft` on engines whose step-time shape differs
    /// from the router's constants (issue 17's robustness table).
    Robustness(RobustnessArgs),
    /// Replay the trace in phases of different arrival speed-ups under calibrated
    /// `predicted-ttft` and show how its learned multipliers move (issue 17).
    Swing(calibration::SwingArgs),
}

/// Runs `kv-mocker lab`: the sweep ([`run_lab`]) or the study named by its subcommand.
///
/// # Errors
/// The study's [`LabError`].
pub fn run(mut args: LabArgs) -> Result<(), LabError> {
    match args.command.take() {
        Some(LabCommand::Robustness(study)) => run_robustness(study).map(drop),
        Some(LabCommand::Swing(study)) => calibration::run_swing(study).map(drop),
        None => run_lab(args).map(drop),
    }
}

/// Runs `kv-mocker lab`: load and map the trace, run the sweep with a progress bar on
/// stderr, print the table, write `report.json` and the charts into `--out`.
///
/// # Errors
/// Trace, configuration, simulation and file errors ([`LabError`]).
pub fn run_lab(args: LabArgs) -> Result<LabReport, LabError> {
    let (trace, name) = args.study.load_trace()?;
    let config = SimConfig {
        timing: args.fleet.timing(),
        speeds: args.fleet.speeds(),
        sessions: SessionConfig {
            margin_ms: args.session_margin_ms,
            relative_margin: args.session_relative_margin,
            ..SessionConfig::default()
        },
        cpu_tier: args.fleet.cpu_tier,
        tier_pricing: args.fleet.tier_pricing,
        ..args.study.sim_config()
    };
    let mut policies: Vec<LabPolicy> = if args.policies.is_empty() {
        LabPolicy::all_scheduler()
    } else {
        args.policies
            .iter()
            .copied()
            .map(LabPolicy::Scheduler)
            .collect()
    };
    policies.extend(args.calibrated.iter().copied().map(LabPolicy::Calibrated));
    policies.extend(args.sessions.iter().copied().map(LabPolicy::Sessions));
    let sweep = Sweep {
        settings: args
            .workers
            .iter()
            .flat_map(|&workers| {
                args.speedup
                    .iter()
                    .map(move |&speedup| Setting { workers, speedup })
            })
            .collect(),
        policies,
        config,
        jobs: args
            .jobs
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    let mapping = BlockMapping::new(args.study.engine.block_size)?;
    let prepared = PreparedTrace::new(&trace, mapping);
    eprintln!(
        "lab: {} requests of {name}, {} runs ({} settings x {} policies) on {} threads; engines {}, worker speeds {}, cpu tier {} blocks (pricing {:?})",
        prepared.len(),
        sweep.settings.len() * sweep.policies.len(),
        sweep.settings.len(),
        sweep.policies.len(),
        sweep.jobs,
        args.fleet.engine_preset.name(),
        sweep.config.speeds.describe(),
        sweep.config.cpu_tier.cpu_tier_blocks,
        sweep.config.tier_pricing,
    );
    let report = run_lab_with(&prepared, &name, &sweep, &progress_bar(sweep.runs().len()))?;
    println!("{}", report.render_table());
    let json = args.out.join("report.json");
    report.write_json(&json)?;
    eprintln!("report written to {}", json.display());
    if !args.no_charts {
        for path in charts::write_charts(&report, &args.out)? {
            eprintln!("chart written to {}", path.display());
        }
    }
    Ok(report)
}

/// Runs `sweep` over a prepared trace named `name` and assembles the report (oracle
/// bound included); no printing, no files.
///
/// # Errors
/// [`LabError::NoWorkers`] for an empty sweep or a zero worker count, and any run's
/// [`LabError`].
pub fn run_lab_with(
    prepared: &PreparedTrace,
    name: &str,
    sweep: &Sweep,
    progress: &ProgressBar,
) -> Result<LabReport, LabError> {
    if sweep.settings.is_empty()
        || sweep.policies.is_empty()
        || sweep.settings.iter().any(|s| s.workers == 0)
    {
        return Err(LabError::NoWorkers);
    }
    for setting in &sweep.settings {
        sweep.config.speeds.for_workers(setting.workers)?;
    }
    let runs = run_sweep(prepared, sweep, progress)?;
    progress.finish_and_clear();
    Ok(LabReport {
        trace: report::TraceInfo {
            name: name.to_owned(),
            requests: prepared.len() as u64,
            span_ms: prepared.span_ms(),
        },
        config: (&sweep.config).into(),
        oracle: oracle_bound(prepared),
        runs,
    })
}

fn progress_bar(len: usize) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    // The template is a literal known to be valid; fall back to the default otherwise.
    if let Ok(style) = ProgressStyle::with_template(
        "lab [{bar:40}] {pos}/{len} runs, {elapsed} ({eta} left) {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
