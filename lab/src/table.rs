//! The terminal rendering of a [`LabReport`]: one aligned block per setting (workers,
//! speed-up), one row per policy (`engine_model::render_table`, the replay's style
//! too), with the oracle bound in each block's title.
//! Rendering is `O(runs)` string formatting.

use crate::config::Setting;
use crate::report::{LabReport, RunReport};
use engine_model::render_table;
use std::fmt::Write as _;

const HEADER: [&str; 12] = [
    "policy",
    "hit rate",
    "TTFT mean",
    "p50",
    "p90",
    "p99",
    "ITL mean",
    "p99",
    "e2e mean",
    "tok/s",
    "completed",
    "rejected",
];

impl LabReport {
    /// The aligned terminal table (latencies in model ms).
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{}; block size {}, {} blocks per rank, event lag {} ms",
            self.trace.summary(),
            self.config.block_size,
            self.config.num_gpu_blocks,
            self.config.event_lag_ms,
        );
        let oracle = self.oracle.hit_rate * 100.0;
        tables_per_setting(
            &mut out,
            self,
            |s| {
                format!(
                    "{} workers, {} arrivals (oracle hit rate {oracle:.1}%)",
                    s.workers, s.speedup
                )
            },
            &HEADER,
            row,
            "latencies in model ms; hit rate = cached / prompt tokens, cpu = the part loaded back from a CPU tier; tok/s = output tokens per simulated second",
        );
        out
    }
}

/// Appends to `out` one aligned table per setting of `report`, in report order,
/// under its `heading`: `header` over one `row` per run of the setting; then `note`
/// in parentheses. The layout every lab table shares.
pub(crate) fn tables_per_setting(
    out: &mut String,
    report: &LabReport,
    heading: impl Fn(Setting) -> String,
    header: &[&str],
    row: impl Fn(&RunReport) -> Vec<String>,
    note: &str,
) {
    for setting in report.settings() {
        let _ = writeln!(out, "\n{}", heading(setting));
        let runs = report.runs.iter().filter(|r| r.setting == setting);
        out.push_str(&render_table(header, runs.map(&row)));
        out.push('\n');
    }
    let _ = writeln!(out, "\n({note})");
}

/// A study's heading of a setting whose engines are its subject:
/// `N engines, S arrivals`.
pub(crate) fn engines_heading(s: Setting) -> String {
    format!("{} engines, {} arrivals", s.workers, s.speedup)
}

/// A latency cell: whole ms, `-` when there is none.
pub(crate) fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
}

/// A fraction as a percentage cell with one decimal, `-` when there is none.
pub(crate) fn percent(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{:.1}%", v * 100.0))
}

fn row(r: &RunReport) -> Vec<String> {
    let m = &r.metrics;
    let ttft = m.ttft_ms;
    let itl = m.itl_ms;
    vec![
        r.policy.clone(),
        match (m.hit_rate, m.cpu_tier_hit_rate) {
            (None, _) => "-".to_owned(),
            (Some(h), Some(cpu)) if cpu > 0.0 => {
                format!("{:.1}% (cpu {:.1}%)", h * 100.0, cpu * 100.0)
            }
            (Some(h), _) => format!("{:.1}%", h * 100.0),
        },
        ms(ttft.map(|t| t.mean)),
        ms(ttft.map(|t| t.p50)),
        ms(ttft.map(|t| t.p90)),
        ms(ttft.map(|t| t.p99)),
        itl.map_or_else(|| "-".to_owned(), |t| format!("{:.1}", t.mean)),
        itl.map_or_else(|| "-".to_owned(), |t| format!("{:.1}", t.p99)),
        ms(m.e2e_ms.map(|t| t.mean)),
        format!("{:.0}", m.throughput_tokens_per_s),
        m.completed.to_string(),
        m.rejected.to_string(),
    ]
}
