//! The `kv-mocker lab` command line: its flags ([`LabArgs`], [`LabCommand`]) and the
//! sweep it runs by default ([`run_lab`]); the other studies have their own modules.

use crate::calibration;
use crate::charts;
use crate::config::{LabPolicy, Setting};
use crate::config::{SimConfig, Speedup};
use crate::disagg::{DisaggArgs, run_disagg};
use crate::error::LabError;
use crate::fleet::SimulatedFleetArgs;
use crate::hybrid::{HybridArgs, run_hybrid};
use crate::oracle::oracle_bound;
use crate::replica_study::{ReplicaArgs, run_replicas};
use crate::report::{self, LabReport};
use crate::robustness::{RobustnessArgs, run_robustness};
use crate::sim::PreparedTrace;
use crate::study_args::StudyArgs;
use crate::sweep::{Sweep, progress_bar, run_sweep};
use engine_model::trace::BlockMapping;
use indicatif::ProgressBar;
use kv_events::routing::PolicyKind;
use scheduler::args::SessionTuningArgs;
use std::num::NonZeroU64;
use std::path::PathBuf;

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
    /// (`kv_lab`'s `sessions`), reported as `<policy>+sess`.
    #[arg(long = "sessions", value_name = "POLICY")]
    pub sessions: Vec<PolicyKind>,
    /// Session affinity's bounds and margins for the `+sess` rows, the daemon's own
    /// flags (`scheduler::args`).
    #[command(flatten)]
    pub session_tuning: SessionTuningArgs,
    /// The simulated engines' timing and speeds (the router keeps its defaults).
    #[command(flatten)]
    pub fleet: SimulatedFleetArgs,
    /// Measure the regret of every N-th request's routing decision: its TTFT on the
    /// chosen rank against the best rank in hindsight (one engine copy per rank per
    /// sampled decision; see `docs/engine-model.md`). Adds a regret table,
    /// `regret` to each run of `report.json`, and `regret.csv`. Default: off.
    #[arg(long, value_name = "N")]
    pub regret_every: Option<NonZeroU64>,
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
    /// Compare aggregated, disaggregated and conditional serving at an equal number
    /// of engines: TTFT, inter-token latency and throughput (issue 27).
    Disagg(DisaggArgs),
    /// Route a hybrid-attention fleet (sliding-window KV cache groups) with a
    /// group-aware and a group-blind index, against a dense fleet of the same
    /// memory: hit rate, the router's over-claimed overlap and TTFT (issue 28).
    Hybrid(HybridArgs),
    /// Route with 1, 2, 4, 8 router replicas whose queries are spread at random, each
    /// learning its peers' bookings a sync lag late: hit rate and TTFT against one
    /// replica (issue 29).
    Replicas(ReplicaArgs),
}

/// Runs `kv-mocker lab`: the sweep ([`run_lab`]) or the study named by its subcommand.
///
/// # Errors
/// The study's [`LabError`].
pub fn run(mut args: LabArgs) -> Result<(), LabError> {
    match args.command.take() {
        Some(LabCommand::Robustness(study)) => run_robustness(study).map(drop),
        Some(LabCommand::Swing(study)) => calibration::run_swing(study).map(drop),
        Some(LabCommand::Disagg(study)) => run_disagg(study).map(drop),
        Some(LabCommand::Hybrid(study)) => run_hybrid(study).map(drop),
        Some(LabCommand::Replicas(study)) => run_replicas(study).map(drop),
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
        sessions: args.session_tuning.to_config(false),
        cpu_tier: args.fleet.cpu_tier,
        tier_pricing: args.fleet.tier_pricing,
        regret_every: args.regret_every,
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
    if let (Some(table), Some(csv)) = (report.render_regret_table(), report.regret_csv()) {
        println!("{table}");
        let path = args.out.join("regret.csv");
        std::fs::write(&path, csv).map_err(|source| LabError::Write {
            path: path.clone(),
            source,
        })?;
        eprintln!("regret written to {}", path.display());
    }
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
