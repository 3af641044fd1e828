//! The soak's rows, as CSV and as a two-panel PNG (RSS and route latency against
//! time), drawn with plotters' bitmap backend and the font bundled with the mocker.

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};
use std::path::Path;

const FONT: &[u8] = include_bytes!("../../../lab/assets/DejaVuSansMono.ttf");
const FAMILY: &str = "sans-serif";

/// One sample of the soak.
pub struct SoakSample {
    /// Seconds since the start.
    pub t_s: f64,
    /// The daemon's resident set, in MiB.
    pub rss_mib: f64,
    /// The daemon's CPU use over the window, in cores.
    pub cpu_cores: f64,
    /// KV events published per second over the window.
    pub events_per_s: f64,
    /// Routes answered in the window.
    pub routes: u64,
    /// Routes that failed or got an error reply in the window.
    pub route_errors: u64,
    /// Route latency p50 of the window, ms (client side).
    pub route_p50_ms: f64,
    /// Route latency p99 of the window, ms (client side).
    pub route_p99_ms: f64,
    /// (worker, block) entries the daemon's index held.
    pub index_blocks: f64,
}

impl SoakSample {
    /// The row as a CSV line (no newline).
    pub fn csv(&self) -> String {
        format!(
            "{:.0},{:.1},{:.2},{:.0},{},{},{:.3},{:.3},{:.0}",
            self.t_s,
            self.rss_mib,
            self.cpu_cores,
            self.events_per_s,
            self.routes,
            self.route_errors,
            self.route_p50_ms,
            self.route_p99_ms,
            self.index_blocks
        )
    }
}

fn chart_error(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing the soak chart: {e}")
}

/// Draws RSS (top) and route p50/p99 (bottom) against minutes into `path`.
///
/// # Errors
/// When the font cannot be registered or the PNG cannot be drawn or written.
pub fn draw(rows: &[SoakSample], path: &Path) -> anyhow::Result<()> {
    register_font(FAMILY, FontStyle::Normal, FONT).map_err(|_| chart_error("bad bundled font"))?;
    let root = BitMapBackend::new(path, (900, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let panels = root.split_evenly((2, 1));
    let minutes = |r: &SoakSample| r.t_s / 60.0;
    let t_max = rows.last().map_or(1.0, minutes).max(1.0);
    let finite = |v: f64| if v.is_finite() { v } else { 0.0 };

    let rss_max = rows.iter().map(|r| finite(r.rss_mib)).fold(1.0, f64::max) * 1.2;
    let mut top = ChartBuilder::on(&panels[0])
        .caption("kv-router serve: resident memory", (FAMILY, 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t_max, 0.0..rss_max)
        .map_err(chart_error)?;
    top.configure_mesh()
        .x_desc("minutes")
        .y_desc("RSS (MiB)")
        .label_style((FAMILY, 14))
        .draw()
        .map_err(chart_error)?;
    top.draw_series(LineSeries::new(
        rows.iter().map(|r| (minutes(r), finite(r.rss_mib))),
        &BLUE,
    ))
    .map_err(chart_error)?;

    let lat_max = rows
        .iter()
        .map(|r| finite(r.route_p99_ms))
        .fold(0.1, f64::max)
        * 1.2;
    let mut bottom = ChartBuilder::on(&panels[1])
        .caption(
            "route latency (client side), per sample window",
            (FAMILY, 22),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t_max, 0.0..lat_max)
        .map_err(chart_error)?;
    bottom
        .configure_mesh()
        .x_desc("minutes")
        .y_desc("ms")
        .label_style((FAMILY, 14))
        .draw()
        .map_err(chart_error)?;
    for (label, color, pick) in [
        (
            "p99",
            RED,
            (|r: &SoakSample| r.route_p99_ms) as fn(&SoakSample) -> f64,
        ),
        ("p50", GREEN, |r: &SoakSample| r.route_p50_ms),
    ] {
        bottom
            .draw_series(LineSeries::new(
                rows.iter().map(|r| (minutes(r), finite(pick(r)))),
                &color,
            ))
            .map_err(chart_error)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    bottom
        .configure_series_labels()
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(chart_error)?;
    root.present().map_err(chart_error)?;
    Ok(())
}
