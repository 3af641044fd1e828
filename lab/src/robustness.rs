//! `kv-mocker lab robustness`: how the routing policies fare when the engines are not
//! what the router assumes.
//!
//! Each *cell* simulates engines of another shape than the router's constants
//! ([`crate::config::ROUTER_TIMING`], which the router keeps): the prefill cost per
//! token alone at 0.25×, 0.5×, 2× and 4×, the step base alone at the same factors, a
//! half-fast/half-slow fleet, and Dynamo's mocker timing ([`crate::fleet`]); plus the
//! `matched` cell, where engines and router agree, as the reference. Each *row* is a
//! router configuration ([`rows`]); `kv` comes first and is the baseline of the ratios,
//! and `predicted-ttft@engine` (the router given the cell's true constants) is the
//! yardstick of how much of the attainable gain a row keeps.
//! Every (cell, setting, row) is one full simulation of the trace.
//!
//! Why shapes and not a uniform scale: scaling every constant alike only changes the
//! load (see [`crate::fleet`]), which the main sweep's speed-ups already cover.
//!
//! What it costs: cells × settings × rows runs; with the defaults (11 cells, 8 workers
//! at 1× and 4×, 4 rows, `@engine` not in the mixed fleet) 86 runs, spread over
//! `--jobs` threads like the main sweep.

use crate::config::{LabPolicy, Setting, SimConfig, Speedup};
use crate::error::LabError;
use crate::fleet::{DYNAMO_POLYNOMIAL, Factor, ShapeFactors, WorkerSpeeds};
use crate::report::{TimingInfo, TraceInfo, publish};
use crate::robustness_report::{CellRun, MATCHED, RobustnessReport, render};
use crate::sim::PreparedTrace;
use crate::study_args::StudyArgs;
use crate::sweep::progress_bar;
use crate::sweep::{run_parallel, timed_run};
use engine_model::TimingModel;
use engine_model::trace::BlockMapping;
use kv_events::routing::PolicyKind;
use std::path::PathBuf;
use std::time::Instant;

/// The factors each single constant is scaled by, one cell per factor.
pub const SHAPE_FACTORS: [f64; 4] = [0.25, 0.5, 2.0, 4.0];

/// `kv-mocker lab robustness` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct RobustnessArgs {
    /// Trace and simulation flags shared by every study.
    #[command(flatten)]
    pub study: StudyArgs,
    /// Worker counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub workers: Vec<u32>,
    /// Arrival speed-ups (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub speedup: Vec<Speedup>,
    /// Leave out the `predicted-ttft+cal` row (a quicker grid).
    #[arg(long)]
    pub no_calibrated: bool,
    /// Run only these cells, by name (repeatable, e.g. `--cell "prefill x4"`);
    /// default: every cell.
    #[arg(long = "cell", value_name = "NAME")]
    pub cells: Vec<String>,
    /// Threads to run simulations on; default: the machine's cores.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Directory for `robustness.json`.
    #[arg(long, default_value = "target/lab-robustness")]
    pub out: PathBuf,
}

/// One engine variant: what the simulated engines run, the router unchanged.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    /// Display name, e.g. `prefill x0.25`.
    pub name: String,
    /// The engines' timing at speed 1.
    pub timing: TimingModel,
    /// Per-worker speeds.
    pub speeds: WorkerSpeeds,
}

impl Cell {
    fn new(name: impl Into<String>, timing: TimingModel, speeds: WorkerSpeeds) -> Self {
        Self {
            name: name.into(),
            timing,
            speeds,
        }
    }

    /// `base` with this cell's engines.
    pub fn config(&self, base: &SimConfig) -> SimConfig {
        SimConfig {
            timing: self.timing,
            speeds: self.speeds.clone(),
            ..base.clone()
        }
    }
}

/// The default cells: `matched`, the prefill and step-base factors of
/// [`SHAPE_FACTORS`], the half-slow fleet and the Dynamo preset.
pub fn default_cells() -> Vec<Cell> {
    let router = crate::config::ROUTER_TIMING;
    let mut cells = vec![Cell::new(MATCHED, router, WorkerSpeeds::Uniform)];
    let shaped = |prefill: f64, step_base: f64| {
        // The factors are positive literals; `Factor::new` cannot fail on them.
        let factor = |v| Factor::new(v).unwrap_or(Factor::ONE);
        ShapeFactors {
            prefill: factor(prefill),
            step_base: factor(step_base),
        }
        .apply(router)
    };
    for f in SHAPE_FACTORS {
        cells.push(Cell::new(
            format!("prefill x{f}"),
            shaped(f, 1.0),
            WorkerSpeeds::Uniform,
        ));
    }
    for f in SHAPE_FACTORS {
        cells.push(Cell::new(
            format!("step base x{f}"),
            shaped(1.0, f),
            WorkerSpeeds::Uniform,
        ));
    }
    cells.push(Cell::new("half-slow fleet", router, WorkerSpeeds::HalfSlow));
    cells.push(Cell::new(
        "dynamo-polynomial",
        DYNAMO_POLYNOMIAL,
        WorkerSpeeds::Uniform,
    ));
    cells
}

/// A router configuration compared in every cell.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Display name.
    pub label: String,
    /// The policy, with its defaults (the router's constants).
    pub policy: LabPolicy,
}

impl Row {
    /// The run's configuration for this row in a cell (the policy carries the
    /// router's own switches, such as calibration).
    pub fn config(&self, cell: &SimConfig) -> SimConfig {
        cell.clone()
    }
}

/// The rows, baseline first: `kv`, `predicted-ttft` with the router's default
/// constants, the same with online calibration (`predicted-ttft+cal`), and the same
/// with the engines' own constants (`predicted-ttft@engine`, the yardstick of the
/// gain kept; run only in cells whose workers all share one speed, since one set of
/// constants cannot be right for a mixed fleet).
pub fn rows() -> Vec<Row> {
    [
        LabPolicy::Scheduler(PolicyKind::Kv),
        LabPolicy::Scheduler(PolicyKind::PredictedTtft),
        LabPolicy::Calibrated(PolicyKind::PredictedTtft),
        LabPolicy::Tuned(PolicyKind::PredictedTtft),
    ]
    .into_iter()
    .map(|policy| Row {
        label: policy.name(),
        policy,
    })
    .collect()
}

impl RobustnessArgs {
    /// `rows`, without the calibrated row under `--no-calibrated`.
    pub fn rows(&self) -> Vec<Row> {
        let mut rows = rows();
        if self.no_calibrated {
            rows.retain(|r| !matches!(r.policy, LabPolicy::Calibrated(_)));
        }
        rows
    }

    /// The `--cell` cells in `default_cells` order, or every cell.
    ///
    /// # Errors
    /// [`LabError::UnknownCell`] for a name no cell has.
    pub fn selected_cells(&self) -> Result<Vec<Cell>, LabError> {
        let cells = default_cells();
        if let Some(unknown) = self
            .cells
            .iter()
            .find(|name| !cells.iter().any(|c| &c.name == *name))
        {
            return Err(LabError::UnknownCell(unknown.clone()));
        }
        Ok(cells
            .into_iter()
            .filter(|c| self.cells.is_empty() || self.cells.contains(&c.name))
            .collect())
    }
}

/// Runs `kv-mocker lab robustness`: every default cell × setting × row, prints the
/// table and writes `robustness.json` into `--out`.
///
/// # Errors
/// Trace, configuration, simulation and file errors ([`LabError`]).
pub fn run_robustness(args: RobustnessArgs) -> Result<RobustnessReport, LabError> {
    let started = Instant::now();
    let (requests, name) = args.study.load_trace()?;
    let prepared = PreparedTrace::new(&requests, BlockMapping::new(args.study.engine.block_size)?);
    let base = args.study.sim_config();
    let settings: Vec<Setting> = args
        .workers
        .iter()
        .flat_map(|&workers| {
            args.speedup
                .iter()
                .map(move |&speedup| Setting { workers, speedup })
        })
        .collect();
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let cells = args.selected_cells()?;
    let rows = args.rows();
    let items = plan(&cells, &settings, &rows, &base)?;
    eprintln!(
        "lab robustness: {} requests of {name}, {} runs ({} cells x {} settings x {} rows) on {jobs} threads",
        prepared.len(),
        items.len(),
        cells.len(),
        settings.len(),
        rows.len(),
    );
    let progress = progress_bar(items.len());
    let runs = run_parallel(&items, jobs, &progress, |item| {
        progress.set_message(format!("{}, {}", item.cell, item.row));
        timed_run(&prepared, item.setting, item.policy, &item.config).map(|run| CellRun {
            cell: item.cell.clone(),
            row: item.row.clone(),
            run,
        })
    })?;
    progress.finish_and_clear();
    let t = crate::config::ROUTER_TIMING;
    let report = RobustnessReport {
        trace: TraceInfo {
            name,
            requests: prepared.len() as u64,
            span_ms: prepared.span_ms(),
        },
        router_timing: TimingInfo {
            step_base_ms: t.step_base_ms,
            prefill_ms_per_token: t.prefill_ms_per_token,
            decode_ms_per_seq: t.decode_ms_per_seq,
            kv_read_ms_per_token: t.kv_read_ms_per_token,
        },
        runs,
        wall_s: started.elapsed().as_secs_f64(),
    };
    let path = args.out.join("robustness.json");
    publish(&render(&report), &report, &path, report.wall_s)?;
    Ok(report)
}

/// One planned run.
#[derive(Debug, Clone)]
struct Item {
    cell: String,
    row: String,
    setting: Setting,
    policy: LabPolicy,
    config: SimConfig,
}

/// Every (cell, setting, row) with its validated configuration, in report order.
fn plan(
    cells: &[Cell],
    settings: &[Setting],
    rows: &[Row],
    base: &SimConfig,
) -> Result<Vec<Item>, LabError> {
    if settings.is_empty() || settings.iter().any(|s| s.workers == 0) {
        return Err(LabError::NoWorkers);
    }
    let mut items = Vec::new();
    for cell in cells {
        let cell_config = cell.config(base);
        cell_config.validate()?;
        for &setting in settings {
            cell_config.speeds.for_workers(setting.workers)?;
            for row in rows {
                let tuned = matches!(row.policy, LabPolicy::Tuned(_));
                if tuned && cell_config.speeds != WorkerSpeeds::Uniform {
                    continue;
                }
                items.push(Item {
                    cell: cell.name.clone(),
                    row: row.label.clone(),
                    setting,
                    policy: row.policy,
                    config: row.config(&cell_config),
                });
            }
        }
    }
    Ok(items)
}

#[cfg(test)]
mod tests;
