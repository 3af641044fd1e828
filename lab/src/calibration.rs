//! What online calibration learns in the lab, and `kv-mocker lab swing`: a load swing
//! that shows the estimates stay stable (issue 17).
//!
//! A run under a `+cal` policy records every rank's learned multipliers at the end
//! ([`crate::report::RunReport::calibration`]) and, when asked, at a fixed simulated
//! interval ([`crate::SimConfig::calibration_sample_ms`]). The swing study replays the
//! trace in phases of equal request counts, each at its own arrival speed-up (default
//! 1×, 4×, 1×), on one robustness cell's engines, and prints per phase and rank the
//! range the multipliers moved in over the phase's second half — settled estimates
//! move little however the load swings; an oscillating estimator would not.
//!
//! What it costs: one simulation of the trace, plus one point per rank and sample.

pub use crate::calibration_point::CalibrationPoint;
use crate::config::{LabPolicy, Setting, SimConfig, Speedup};
use crate::error::LabError;
use crate::report::publish;
use crate::robustness::default_cells;
use crate::sim::{PreparedTrace, simulate};
use crate::study_args::StudyArgs;
use engine_model::trace::{BlockMapping, TraceRequest};
use kv_events::routing::PolicyKind;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

/// `kv-mocker lab swing` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct SwingArgs {
    /// Trace and simulation flags shared by every study.
    #[command(flatten)]
    pub study: StudyArgs,
    /// Workers.
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// Arrival speed-up of each phase (comma-separated); the trace is cut into this
    /// many runs of equal request counts.
    #[arg(long, value_delimiter = ',', default_value = "1,4,1")]
    pub phases: Vec<Speedup>,
    /// The robustness cell whose engines to simulate (`kv-mocker lab robustness`
    /// names, e.g. `matched`, `step base x4`, `half-slow fleet`).
    #[arg(long, default_value = "half-slow fleet")]
    pub cell: String,
    /// Sample interval of the estimates, in simulated ms.
    #[arg(long, default_value_t = 10_000.0)]
    pub sample_ms: f64,
    /// Directory for `swing.json`.
    #[arg(long, default_value = "target/lab-swing")]
    pub out: PathBuf,
}

/// One phase of the swing: its speed-up and its span in simulated ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SwingPhase {
    /// Arrival speed-up.
    pub speedup: f64,
    /// First arrival of the phase, in simulated ms.
    pub start_ms: f64,
    /// First arrival of the next phase (or the end of the run), in simulated ms.
    pub end_ms: f64,
}

/// What `kv-mocker lab swing` measured (`swing.json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SwingReport {
    /// Trace name and requests simulated.
    pub trace: String,
    /// Requests simulated.
    pub requests: usize,
    /// The cell's name.
    pub cell: String,
    /// The phases.
    pub phases: Vec<SwingPhase>,
    /// Every rank's estimates at every sample time.
    pub points: Vec<CalibrationPoint>,
    /// TTFT mean and p99 over the run, in model ms.
    pub ttft_mean_ms: Option<f64>,
    /// See `ttft_mean_ms`.
    pub ttft_p99_ms: Option<f64>,
    /// Wall time, in s.
    pub wall_s: f64,
}

/// Retimes `requests` into `phases.len()` runs of equal request counts, run `k`'s
/// gaps divided by `phases[k]`; returns the retimed trace and each phase's first
/// arrival, in trace ms. Arrival order is kept.
pub fn retime(requests: &[TraceRequest], phases: &[Speedup]) -> (Vec<TraceRequest>, Vec<f64>) {
    let n = requests.len();
    let k = phases.len().max(1);
    let mut out = Vec::with_capacity(n);
    let mut starts = Vec::with_capacity(k);
    let mut now = 0.0_f64;
    let mut prev = requests.first().map_or(0, |r| r.timestamp_ms);
    for (i, r) in requests.iter().enumerate() {
        let phase = (i * k / n.max(1)).min(k - 1);
        let speedup = phases.get(phase).map_or(1.0, |s| s.get());
        now += (r.timestamp_ms - prev) as f64 / speedup;
        prev = r.timestamp_ms;
        if starts.len() == phase {
            starts.push(now);
        }
        out.push(TraceRequest {
            timestamp_ms: now.round() as u64,
            ..r.clone()
        });
    }
    (out, starts)
}

/// Runs `kv-mocker lab swing`: prints the per-phase stability table and writes
/// `swing.json` into `--out`.
///
/// # Errors
/// An unknown cell ([`LabError::UnknownCell`]), and trace, configuration, simulation
/// and file errors.
pub fn run_swing(args: SwingArgs) -> Result<SwingReport, LabError> {
    let started = Instant::now();
    let cell = default_cells()
        .into_iter()
        .find(|c| c.name == args.cell)
        .ok_or_else(|| LabError::UnknownCell(args.cell.clone()))?;
    let (requests, name) = args.study.load_trace()?;
    let (retimed, starts) = retime(&requests, &args.phases);
    let prepared = PreparedTrace::new(&retimed, BlockMapping::new(args.study.engine.block_size)?);
    let config = cell.config(&SimConfig {
        calibration_sample_ms: Some(args.sample_ms),
        ..args.study.sim_config()
    });
    let setting = Setting {
        workers: args.workers,
        speedup: Speedup::new(1.0)?,
    };
    eprintln!(
        "lab swing: {} requests of {name} on `{}`, phases {:?}",
        prepared.len(),
        cell.name,
        args.phases.iter().map(|s| s.get()).collect::<Vec<_>>()
    );
    let run = simulate(
        &prepared,
        setting,
        LabPolicy::Calibrated(PolicyKind::PredictedTtft),
        &config,
    )?;
    let metrics = run.metrics(args.workers as usize);
    let end_ms = run.calibration.last().map_or(0.0, |p| p.at_ms);
    let phases = args
        .phases
        .iter()
        .enumerate()
        .map(|(i, s)| SwingPhase {
            speedup: s.get(),
            start_ms: starts.get(i).copied().unwrap_or(end_ms),
            end_ms: starts.get(i + 1).copied().unwrap_or(end_ms),
        })
        .collect();
    let report = SwingReport {
        trace: name,
        requests: prepared.len(),
        cell: cell.name,
        phases,
        points: run.calibration,
        ttft_mean_ms: metrics.ttft_ms.as_ref().map(|s| s.mean),
        ttft_p99_ms: metrics.ttft_ms.as_ref().map(|s| s.p99),
        wall_s: started.elapsed().as_secs_f64(),
    };
    let path = args.out.join("swing.json");
    publish(&render_swing(&report), &report, &path, report.wall_s)?;
    Ok(report)
}

/// Mean, min and max of `values` (`None` when empty).
fn summary(values: impl Iterator<Item = f64>) -> Option<(f64, f64, f64)> {
    let (mut n, mut sum, mut lo, mut hi) = (0.0, 0.0, f64::INFINITY, f64::NEG_INFINITY);
    for v in values {
        n += 1.0;
        sum += v;
        lo = lo.min(v);
        hi = hi.max(v);
    }
    (n > 0.0).then(|| (sum / n, lo, hi))
}

/// The swing as Markdown: per phase and worker, the mean and range of both
/// multipliers over the second half of the phase, then a coarse time series of the
/// first and last worker.
pub fn render_swing(report: &SwingReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} requests of {} on `{}`; TTFT mean / p99 {:.0} / {:.0} ms\n",
        report.requests,
        report.trace,
        report.cell,
        report.ttft_mean_ms.unwrap_or(f64::NAN),
        report.ttft_p99_ms.unwrap_or(f64::NAN),
    );
    let _ = writeln!(
        out,
        "| phase | worker | samples | prefill: mean [min–max] | per step: mean [min–max] |\n|---|---|---|---|---|"
    );
    let mut workers: Vec<usize> = report.points.iter().map(|p| p.worker).collect();
    workers.sort_unstable();
    workers.dedup();
    for (i, phase) in report.phases.iter().enumerate() {
        let from = 0.5 * (phase.start_ms + phase.end_ms);
        for &w in &workers {
            let points = || {
                report
                    .points
                    .iter()
                    .filter(move |p| p.worker == w && p.at_ms >= from && p.at_ms <= phase.end_ms)
            };
            let samples = points().next_back().map_or(0, |p| p.samples);
            let cell = |s: Option<(f64, f64, f64)>| {
                s.map_or("n/a".into(), |(m, lo, hi)| {
                    format!("{m:.2} [{lo:.2}–{hi:.2}]")
                })
            };
            let _ = writeln!(
                out,
                "| {} ({}x, {:.0}–{:.0} s) | {w} | {samples} | {} | {} |",
                i + 1,
                phase.speedup,
                from / 1e3,
                phase.end_ms / 1e3,
                cell(summary(points().map(|p| p.prefill))),
                cell(summary(points().map(|p| p.per_step))),
            );
        }
    }
    let (Some(&first), Some(&last)) = (workers.first(), workers.last()) else {
        return out;
    };
    let _ = writeln!(
        out,
        "\n| t (s) | worker {first}: prefill / per step | worker {last}: prefill / per step |\n|---|---|---|"
    );
    let series: Vec<&CalibrationPoint> =
        report.points.iter().filter(|p| p.worker == first).collect();
    let stride = series.len().div_ceil(40).max(1);
    for p in series.iter().step_by(stride) {
        let other = report
            .points
            .iter()
            .find(|q| q.worker == last && q.at_ms == p.at_ms);
        let _ = writeln!(
            out,
            "| {:.0} | {:.2} / {:.2} | {} |",
            p.at_ms / 1e3,
            p.prefill,
            p.per_step,
            other.map_or("n/a".into(), |q| format!(
                "{:.2} / {:.2}",
                q.prefill, q.per_step
            )),
        );
    }
    out
}

#[cfg(test)]
#[path = "calibration_tests.rs"]
mod tests;
