//! PNG charts of a [`LabReport`], drawn with plotters on its bitmap backend:
//!
//! - `ttft_cdf.png`: the TTFT CDF of every policy, one panel per setting (rows:
//!   workers, columns: speed-up), log-scale TTFT;
//! - `hit_rate_vs_speedup.png`: hit rate against speed-up, one panel per worker count,
//!   with the oracle bound dashed;
//! - `p99_ttft_vs_speedup.png`: p99 TTFT against speed-up (log scale), one panel per
//!   worker count;
//! - for `kv-mocker lab disagg` ([`write_disagg_charts`]), the TTFT CDF and p99 TTFT
//!   per serving, and `p99_itl_vs_speedup.png`: p99 ITL against speed-up (log scale).
//!
//! Text is rendered with a bundled font (DejaVu Sans Mono, `mocker/assets/`) through
//! plotters' pure-Rust `ab_glyph` path, so drawing needs no system font library.
//! Drawing costs a few ms per panel; encoding the PNGs dominates.

use crate::config::Setting;
use crate::error::LabError;
use crate::report::LabReport;
use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The bundled font: DejaVu Sans Mono (Bitstream Vera licence, see
/// `mocker/assets/LICENSE-DejaVu`).
const FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");
const FAMILY: &str = "sans-serif";

/// File names of the charts, in the order [`write_charts`] returns them.
pub const CHART_FILES: [&str; 3] = [
    "ttft_cdf.png",
    "hit_rate_vs_speedup.png",
    "p99_ttft_vs_speedup.png",
];

/// File names of `kv-mocker lab disagg`'s charts, in the order
/// [`write_disagg_charts`] returns them.
pub const DISAGG_CHART_FILES: [&str; 3] = [
    "ttft_cdf.png",
    "p99_ttft_vs_speedup.png",
    "p99_itl_vs_speedup.png",
];

/// Line colours, one per policy in report order (cycled beyond twelve).
const PALETTE: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
    RGBColor(188, 189, 34),
    RGBColor(127, 127, 127),
    RGBColor(0, 0, 128),
    RGBColor(0, 100, 0),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// A model-time axis label: `250 ms`, `1.5 s`, `2000 s`.
fn format_ms(ms: f64) -> String {
    if ms >= 1_000.0 {
        let s = ms / 1_000.0;
        if s >= 10.0 {
            format!("{s:.0} s")
        } else {
            format!("{s:.1} s")
        }
    } else {
        format!("{ms:.0} ms")
    }
}

fn chart_error(err: impl std::fmt::Display) -> LabError {
    LabError::Chart(err.to_string())
}

/// Registers the bundled font once per process.
fn ensure_font() -> Result<(), LabError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(LabError::Chart(
            "bundled font is not a valid TrueType font".to_owned(),
        ))
    }
}

/// Writes the three charts into `dir` (created if missing); returns their paths.
///
/// # Errors
/// [`LabError::Write`] if `dir` cannot be created, [`LabError::Chart`] if drawing or
/// encoding fails.
pub fn write_charts(report: &LabReport, dir: &Path) -> Result<Vec<PathBuf>, LabError> {
    let charts = [
        Chart::TtftCdf("TTFT CDF per policy"),
        Chart::VersusSpeedup(Metric::HitRate),
        Chart::VersusSpeedup(Metric::P99Ttft),
    ];
    write_set(report, dir, &CHART_FILES, charts)
}

/// Writes `kv-mocker lab disagg`'s charts into `dir` (created if missing): the TTFT
/// CDF, p99 TTFT and p99 ITL per serving (the report's `policy`); returns their paths.
///
/// # Errors
/// As [`write_charts`].
pub fn write_disagg_charts(report: &LabReport, dir: &Path) -> Result<Vec<PathBuf>, LabError> {
    let charts = [
        Chart::TtftCdf("TTFT CDF per serving"),
        Chart::VersusSpeedup(Metric::P99Ttft),
        Chart::VersusSpeedup(Metric::P99Itl),
    ];
    write_set(report, dir, &DISAGG_CHART_FILES, charts)
}

/// One chart of a report.
#[derive(Debug, Clone, Copy)]
enum Chart {
    /// The TTFT CDF per run label (policy or serving), one panel per setting, under
    /// this title.
    TtftCdf(&'static str),
    /// A metric against speed-up, one panel per worker count.
    VersusSpeedup(Metric),
}

/// Draws `charts` into `dir` (created if missing) under the matching `files` names.
fn write_set<const N: usize>(
    report: &LabReport,
    dir: &Path,
    files: &[&str; N],
    charts: [Chart; N],
) -> Result<Vec<PathBuf>, LabError> {
    ensure_font()?;
    std::fs::create_dir_all(dir).map_err(|source| LabError::Write {
        path: dir.to_owned(),
        source,
    })?;
    files
        .iter()
        .zip(charts)
        .map(|(file, chart)| {
            let path = dir.join(file);
            match chart {
                Chart::TtftCdf(title) => ttft_cdf(report, &path, title)?,
                Chart::VersusSpeedup(metric) => versus_speedup(report, &path, metric)?,
            }
            Ok(path)
        })
        .collect()
}

/// Distinct values, in first-seen order.
fn distinct<T: PartialEq + Copy>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

fn ttft_cdf(report: &LabReport, path: &Path, title: &str) -> Result<(), LabError> {
    let settings = report.settings();
    let workers = distinct(settings.iter().map(|s| s.workers));
    let speedups = distinct(settings.iter().map(|s| s.speedup));
    let policies = report.policies();
    let (rows, cols) = (workers.len().max(1), speedups.len().max(1));
    let size = (560 * cols as u32, 420 * rows as u32 + 40);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let root = root.titled(title, (FAMILY, 26)).map_err(chart_error)?;
    let panels = root.split_evenly((rows, cols));
    // One x range for every panel, so panels compare at a glance.
    let all = report
        .runs
        .iter()
        .flat_map(|r| r.metrics.ttft_cdf_ms.iter().copied())
        .filter(|v| *v > 0.0);
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo * 0.8, hi * 1.25)
    } else {
        (1.0, 10.0)
    };
    for (index, panel) in panels.iter().enumerate() {
        let (Some(&w), Some(&s)) = (workers.get(index / cols), speedups.get(index % cols)) else {
            continue;
        };
        let setting = Setting {
            workers: w,
            speedup: s,
        };
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{w} workers, {s} arrivals"), (FAMILY, 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d((lo..hi).log_scale(), 0.0f64..1.0f64)
            .map_err(chart_error)?;
        chart
            .configure_mesh()
            .x_desc("TTFT (model time, log)")
            .y_desc("fraction of requests")
            .x_label_formatter(&|v| format_ms(*v))
            .label_style((FAMILY, 12))
            .draw()
            .map_err(chart_error)?;
        for (i, policy) in policies.iter().enumerate() {
            let Some(run) = report.run(setting, policy) else {
                continue;
            };
            let cdf = &run.metrics.ttft_cdf_ms;
            let n = cdf.len().saturating_sub(1).max(1) as f64;
            let points = cdf
                .iter()
                .enumerate()
                .map(|(k, &v)| (v.max(lo), k as f64 / n));
            let c = color(i);
            chart
                .draw_series(LineSeries::new(points, c.stroke_width(2)))
                .map_err(chart_error)?
                .label(policy.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FAMILY, 12))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(chart_error)?;
    }
    root.present().map_err(chart_error)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    HitRate,
    P99Ttft,
    P99Itl,
}

impl Metric {
    fn title(self) -> &'static str {
        match self {
            Metric::HitRate => "Prefix-cache hit rate vs arrival speed-up",
            Metric::P99Ttft => "p99 TTFT vs arrival speed-up",
            Metric::P99Itl => "p99 inter-token latency vs arrival speed-up",
        }
    }

    fn y_desc(self) -> &'static str {
        match self {
            Metric::HitRate => "hit rate (%)",
            Metric::P99Ttft => "p99 TTFT (model time, log)",
            Metric::P99Itl => "p99 ITL (model time, log)",
        }
    }

    fn value(self, report: &LabReport, setting: Setting, policy: &str) -> Option<f64> {
        let m = &report.run(setting, policy)?.metrics;
        match self {
            Metric::HitRate => m.hit_rate.map(|h| h * 100.0),
            Metric::P99Ttft => m.ttft_ms.map(|t| t.p99).filter(|v| *v > 0.0),
            Metric::P99Itl => m.itl_ms.map(|t| t.p99).filter(|v| *v > 0.0),
        }
    }
}

fn versus_speedup(report: &LabReport, path: &Path, metric: Metric) -> Result<(), LabError> {
    let settings = report.settings();
    let workers = distinct(settings.iter().map(|s| s.workers));
    let mut speedups: Vec<f64> = distinct(settings.iter().map(|s| s.speedup.get()));
    speedups.sort_by(f64::total_cmp);
    let policies = report.policies();
    let cols = workers.len().max(1);
    let root = BitMapBackend::new(path, (560 * cols as u32, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let root = root
        .titled(metric.title(), (FAMILY, 24))
        .map_err(chart_error)?;
    let panels = root.split_evenly((1, cols));
    let x_lo = speedups.first().copied().unwrap_or(1.0) / 1.25;
    let x_hi = speedups.last().copied().unwrap_or(1.0) * 1.25;
    let values: Vec<f64> = settings
        .iter()
        .flat_map(|&s| {
            policies
                .iter()
                .filter_map(move |p| metric.value(report, s, p))
        })
        .collect();
    for (panel, &w) in panels.iter().zip(&workers) {
        let series: Vec<(usize, Vec<(f64, f64)>)> = policies
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let pts = speedups
                    .iter()
                    .filter_map(|&x| {
                        let setting = settings
                            .iter()
                            .find(|s| s.workers == w && s.speedup.get() == x)?;
                        Some((x, metric.value(report, *setting, p)?))
                    })
                    .collect();
                (i, pts)
            })
            .collect();
        let caption = format!("{w} workers");
        match metric {
            Metric::HitRate => {
                // Head room above the oracle line for the legend.
                let top = (report.oracle.hit_rate * 100.0)
                    .max(values.iter().copied().fold(0.0, f64::max))
                    * 1.7;
                let mut chart = speedup_chart(panel, &caption, x_lo..x_hi, 0.0..top.max(1.0))?;
                draw_mesh(&mut chart, metric)?;
                let oracle = report.oracle.hit_rate * 100.0;
                chart
                    .draw_series(DashedLineSeries::new(
                        [(x_lo, oracle), (x_hi, oracle)],
                        8,
                        6,
                        BLACK.stroke_width(1),
                    ))
                    .map_err(chart_error)?
                    .label("oracle bound")
                    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
                draw_policies(&mut chart, &policies, &series)?;
            }
            Metric::P99Ttft | Metric::P99Itl => {
                let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = values.iter().copied().fold(0.0, f64::max);
                // Head room (a factor 30 on the log axis) for the legend.
                let (lo, hi) = if lo.is_finite() && hi > lo {
                    (lo / 1.5, hi * 30.0)
                } else {
                    (1.0, 10.0)
                };
                let mut chart = speedup_chart(panel, &caption, x_lo..x_hi, (lo..hi).log_scale())?;
                draw_mesh(&mut chart, metric)?;
                draw_policies(&mut chart, &policies, &series)?;
            }
        }
    }
    root.present().map_err(chart_error)
}

type Panel<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// A chart over one panel with a log-scale speed-up axis and a `Y` value axis.
type SpeedupChart<'b, 'a, Y> = ChartContext<'b, BitMapBackend<'a>, Cartesian2d<LogCoord<f64>, Y>>;

fn speedup_chart<'a, 'b, Y: plotters::coord::ranged1d::AsRangedCoord<Value = f64>>(
    panel: &'b Panel<'a>,
    caption: &str,
    x: std::ops::Range<f64>,
    y: Y,
) -> Result<SpeedupChart<'b, 'a, Y::CoordDescType>, LabError> {
    ChartBuilder::on(panel)
        .caption(caption, (FAMILY, 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(x.log_scale(), y)
        .map_err(chart_error)
}

fn draw_mesh<'a, 'b: 'a, Y>(
    chart: &mut ChartContext<'a, BitMapBackend<'b>, Cartesian2d<LogCoord<f64>, Y>>,
    metric: Metric,
) -> Result<(), LabError>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let mut mesh = chart.configure_mesh();
    mesh.x_desc("arrival speed-up, log")
        .y_desc(metric.y_desc())
        .x_label_formatter(&|x| format!("{x}x"))
        .label_style((FAMILY, 12));
    if metric != Metric::HitRate {
        mesh.y_label_formatter(&|v| format_ms(*v));
    }
    mesh.draw().map_err(chart_error)
}

fn draw_policies<'a, 'b: 'a, Y>(
    chart: &mut ChartContext<'a, BitMapBackend<'b>, Cartesian2d<LogCoord<f64>, Y>>,
    policies: &[String],
    series: &[(usize, Vec<(f64, f64)>)],
) -> Result<(), LabError>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    for (i, points) in series {
        let c = color(*i);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))
            .map_err(chart_error)?
            .label(policies[*i].as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(chart_error)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FAMILY, 12))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(chart_error)
}
