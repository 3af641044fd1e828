//! The robustness report: what `kv-mocker lab robustness` measured
//! ([`RobustnessReport`], written as `robustness.json`) and its Markdown rendering —
//! one table per setting, one line per cell, and the multipliers each calibrated run
//! learned. The study itself (cells, rows, runs) is `robustness`, which fills this.

use crate::config::{LabPolicy, Setting};
use crate::metrics::RunMetrics;
use crate::report::{RunReport, TimingInfo, TraceInfo};
use kv_events::routing::PolicyKind;
use serde::Serialize;
use std::fmt::Write as _;

/// Name of the reference cell, where the engines use the router's constants.
pub const MATCHED: &str = "matched";

/// One (cell, setting, row) run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellRun {
    /// The cell's name.
    pub cell: String,
    /// The row's label.
    pub row: String,
    /// Setting, metrics, steps and wall time.
    #[serde(flatten)]
    pub run: RunReport,
}

/// Everything `kv-mocker lab robustness` measured (`robustness.json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RobustnessReport {
    /// The trace.
    pub trace: TraceInfo,
    /// The router's constants, which every cell keeps.
    pub router_timing: TimingInfo,
    /// Every run, cell by cell, then setting, then row.
    pub runs: Vec<CellRun>,
    /// Wall time of the whole sweep, in s.
    pub wall_s: f64,
}

/// `(mean, p99)` TTFT of a run, in model ms.
fn ttft(metrics: &RunMetrics) -> Option<(f64, f64)> {
    metrics.ttft_ms.as_ref().map(|s| (s.mean, s.p99))
}

/// `new / base − 1` as a signed percentage.
fn change(new: f64, base: f64) -> String {
    if base > 0.0 {
        format!("{:+.0}%", (new / base - 1.0) * 100.0)
    } else {
        "n/a".into()
    }
}

/// The share of the yardstick's gain over the baseline that `ratio` keeps.
fn kept(ratio: f64, yardstick_ratio: Option<f64>) -> String {
    match yardstick_ratio {
        Some(m) if m < 1.0 => format!("{:.0}%", (1.0 - ratio) / (1.0 - m) * 100.0),
        _ => "n/a".into(),
    }
}

/// The report as Markdown tables, one per setting: one line per cell; per row mean /
/// p99 TTFT (model ms) and hit rate; per non-baseline row the change against the
/// baseline row and the share it keeps of the gain `predicted-ttft@engine` (the
/// engines' own constants) has over the baseline in the same cell — in the `matched`
/// cell where a cell has no such row (a mixed-speed fleet), and of the row's own
/// `matched` gain when no run has one (e.g. a `--cell` selection without it).
pub fn render(report: &RobustnessReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "trace {}: {} requests over {} s; router constants: step base {} ms, prefill {} ms/token",
        report.trace.name,
        report.trace.requests,
        report.trace.span_ms / 1_000,
        report.router_timing.step_base_ms,
        report.router_timing.prefill_ms_per_token,
    );
    let mut settings: Vec<Setting> = Vec::new();
    let mut cells: Vec<&str> = Vec::new();
    let mut labels: Vec<&str> = Vec::new();
    for r in &report.runs {
        if !settings.contains(&r.run.setting) {
            settings.push(r.run.setting);
        }
        if !cells.contains(&r.cell.as_str()) {
            cells.push(&r.cell);
        }
        if !labels.contains(&r.row.as_str()) {
            labels.push(&r.row);
        }
    }
    let Some((&baseline, others)) = labels.split_first() else {
        return out;
    };
    let yardstick = LabPolicy::Tuned(PolicyKind::PredictedTtft).name();
    let find = |cell: &str, setting: Setting, row: &str| {
        report
            .runs
            .iter()
            .find(|r| r.cell == cell && r.run.setting == setting && r.row == row)
    };
    for setting in settings {
        let _ = writeln!(
            out,
            "\n{} workers, {} arrivals (TTFT mean / p99 in model ms, hit rate)\n",
            setting.workers, setting.speedup
        );
        let mut header = String::from("| engines vs router |");
        let mut rule = String::from("|---|");
        for label in &labels {
            let _ = write!(header, " {label} |");
            rule.push_str("---|");
        }
        for label in others {
            let _ = write!(
                header,
                " {label} vs {baseline}: mean / p99 | gain kept: mean / p99 |"
            );
            rule.push_str("---|---|");
        }
        let _ = writeln!(out, "{header}\n{rule}");
        let ratios = |cell: &str, row: &str| {
            let base = find(cell, setting, baseline).and_then(|r| ttft(&r.run.metrics))?;
            let new = find(cell, setting, row).and_then(|r| ttft(&r.run.metrics))?;
            Some((new.0 / base.0, new.1 / base.1))
        };
        for &cell in &cells {
            let mut line = format!("| {cell} |");
            for label in &labels {
                let run = find(cell, setting, label);
                match run.and_then(|r| Some((ttft(&r.run.metrics)?, r.run.metrics.hit_rate))) {
                    Some(((mean, p99), hit)) => {
                        let hit = hit.map_or("n/a".into(), |h| format!("{:.1}%", h * 100.0));
                        let _ = write!(line, " {mean:.0} / {p99:.0} / {hit} |");
                    }
                    None => line.push_str(" n/a |"),
                }
            }
            for label in others {
                let base = find(cell, setting, baseline).and_then(|r| ttft(&r.run.metrics));
                let new = find(cell, setting, label).and_then(|r| ttft(&r.run.metrics));
                match (base, new, ratios(cell, label)) {
                    (Some(b), Some(n), Some((rm, rp))) => {
                        let matched = ratios(cell, &yardstick)
                            .or_else(|| ratios(MATCHED, &yardstick))
                            .or_else(|| ratios(MATCHED, label));
                        let _ = write!(
                            line,
                            " {} / {} | {} / {} |",
                            change(n.0, b.0),
                            change(n.1, b.1),
                            kept(rm, matched.map(|m| m.0)),
                            kept(rp, matched.map(|m| m.1)),
                        );
                    }
                    _ => line.push_str(" n/a | n/a |"),
                }
            }
            let _ = writeln!(out, "{line}");
        }
    }
    render_learned(report, &mut out);
    out
}

/// Per calibrated run, the range of the learned multipliers over the ranks at the
/// end of the run: `prefill lo–hi, per step lo–hi`.
fn render_learned(report: &RobustnessReport, out: &mut String) {
    let calibrated: Vec<&CellRun> = report
        .runs
        .iter()
        .filter(|r| !r.run.calibration.is_empty())
        .collect();
    if calibrated.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "
learned multipliers at the end of each calibrated run (min–max over ranks)

| cell | setting | row | prefill | per step |
|---|---|---|---|---|"
    );
    for r in calibrated {
        let range = |f: fn(&crate::calibration_point::CalibrationPoint) -> f64| {
            let (lo, hi) = r
                .run
                .calibration
                .iter()
                .map(f)
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                    (lo.min(v), hi.max(v))
                });
            format!("{lo:.2}–{hi:.2}")
        };
        let _ = writeln!(
            out,
            "| {} | {} workers, {} | {} | {} | {} |",
            r.cell,
            r.run.setting.workers,
            r.run.setting.speedup,
            r.row,
            range(|p| p.prefill),
            range(|p| p.per_step),
        );
    }
}
