//! The regret part of a [`LabReport`]: a terminal table (one row per run: the
//! figures over every sampled decision and, per dimension, the bucket holding the
//! largest share of the regret) and `regret.csv` (one row per run and bucket).
//! `O(runs × buckets)` formatting.

use crate::regret::{RegretFigures, RegretStats};
use crate::report::{LabReport, RunReport};
use crate::table::{percent, tables_per_setting};
use std::fmt::Write as _;

const HEADER: [&str; 8] = [
    "policy",
    "decisions",
    "regret mean",
    "p99",
    "best rank",
    "worst prompt bucket",
    "worst overlap bucket",
    "worst load bucket",
];

/// The CSV header of `regret.csv`.
const CSV_HEADER: &str =
    "workers,speedup,policy,dimension,bucket,decisions,mean_ms,p99_ms,best_share,regret_share";

impl LabReport {
    /// The regret table, `None` when no run sampled decisions.
    pub fn render_regret_table(&self) -> Option<String> {
        self.runs.iter().any(|r| r.regret.is_some()).then(|| {
            let mut out = String::from("\nRegret against the best rank in hindsight");
            tables_per_setting(
                &mut out,
                self,
                |s| format!("{} workers, {} arrivals", s.workers, s.speedup),
                &HEADER,
                row,
                "regret = counterfactual TTFT on the chosen rank − the best rank's, model ms; best rank = share of decisions with regret 0; worst bucket = the bucket with the largest share of the run's regret (its share, its mean)",
            );
            out
        })
    }

    /// `regret.csv`: the header, then per run with regret one `all` row and one row
    /// per non-empty bucket; `None` when no run sampled decisions.
    pub fn regret_csv(&self) -> Option<String> {
        let mut out = String::new();
        for run in &self.runs {
            let Some(regret) = &run.regret else {
                continue;
            };
            let mut line = |dimension: &str, bucket: &str, f: &RegretFigures| {
                let _ = writeln!(
                    out,
                    "{},{},{},{dimension},{bucket},{},{:.3},{:.3},{:.4},{:.4}",
                    run.setting.workers,
                    run.setting.speedup,
                    csv_field(&run.policy),
                    f.decisions,
                    f.mean_ms,
                    f.p99_ms,
                    f.best_share,
                    f.regret_share,
                );
            };
            line("all", "all", &regret.all);
            for b in &regret.buckets {
                line(&b.dimension, &b.bucket, &b.figures);
            }
        }
        (!out.is_empty()).then(|| format!("{CSV_HEADER}\n{out}"))
    }
}

/// `value` quoted when it holds a comma or a quote (RFC 4180).
fn csv_field(value: &str) -> String {
    if value.contains([',', '"', '\n']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value.to_owned()
    }
}

fn row(r: &RunReport) -> Vec<String> {
    let Some(regret) = &r.regret else {
        let mut cells = vec!["-".to_owned(); HEADER.len()];
        cells[0].clone_from(&r.policy);
        return cells;
    };
    let mut cells = vec![
        r.policy.clone(),
        regret.all.decisions.to_string(),
        format!("{:.1}", regret.all.mean_ms),
        format!("{:.1}", regret.all.p99_ms),
        percent(Some(regret.all.best_share)),
    ];
    for dimension in ["prompt_tokens", "predicted_overlap", "load_per_rank"] {
        cells.push(worst_bucket(regret, dimension));
    }
    cells
}

/// `bucket (share, mean ms)` of the bucket of `dimension` with the largest share of
/// the regret, `-` without any regret.
fn worst_bucket(regret: &RegretStats, dimension: &str) -> String {
    regret
        .buckets
        .iter()
        .filter(|b| b.dimension == dimension && b.figures.regret_share > 0.0)
        .max_by(|a, b| a.figures.regret_share.total_cmp(&b.figures.regret_share))
        .map_or_else(
            || "-".to_owned(),
            |b| {
                format!(
                    "{} ({:.0}%, {:.1})",
                    b.bucket,
                    b.figures.regret_share * 100.0,
                    b.figures.mean_ms
                )
            },
        )
}
