//! The terminal rendering of a [`ReplayReport`]: an aligned table with one row per
//! policy (`engine_model::render_table`, the lab's style too), route-error breakdowns,
//! and a `kv` vs `round-robin` comparison line.
//!
//! Kept apart from the aggregation so the numbers and their presentation evolve
//! separately. Rendering is `O(policies)` string formatting.

use super::report::{PolicyReport, ReplayReport};
use engine_model::render_table;
use kv_events::routing::PolicyKind;
use std::fmt::Write as _;

impl ReplayReport {
    /// An aligned terminal table (one row per policy; latencies in model ms), followed
    /// by route-error breakdowns and, when both were run, a line comparing `kv` with
    /// `round-robin`.
    pub fn render_table(&self) -> String {
        let header = [
            "policy",
            "requests",
            "completed",
            "failed",
            "hit rate",
            "TTFT mean",
            "p50",
            "p90",
            "p99",
            "e2e mean",
            "p99",
        ];
        let mut out = render_table(&header, self.policies.iter().map(table_row));
        out.push('\n');
        out.push_str("(latencies in model ms; hit rate = cached / prompt tokens)\n");
        for report in &self.policies {
            if report.route_errors.is_empty() {
                continue;
            }
            let parts: Vec<String> = report
                .route_errors
                .iter()
                .map(|(failure, n)| format!("{} {n}", failure.as_str()))
                .collect();
            let _ = writeln!(
                out,
                "{}: {} route errors ({})",
                report.policy,
                report.route_error_count(),
                parts.join(", ")
            );
        }
        for kv_aware in [PolicyKind::PredictedTtft, PolicyKind::Kv] {
            if let Some(line) = self.comparison(kv_aware, PolicyKind::RoundRobin) {
                out.push_str(&line);
                out.push('\n');
            }
        }
        out
    }

    /// "a vs b: hit rate +x pp, mean TTFT -y%, p99 TTFT -z%", for the parts both have.
    fn comparison(&self, a: PolicyKind, b: PolicyKind) -> Option<String> {
        let (ra, rb) = (self.policy(a)?, self.policy(b)?);
        let mut parts = Vec::new();
        if let (Some(ha), Some(hb)) = (ra.hit_rate, rb.hit_rate) {
            parts.push(format!("hit rate {} pp", signed((ha - hb) * 100.0)));
        }
        if let (Some(ta), Some(tb)) = (ra.ttft_ms, rb.ttft_ms) {
            if tb.mean > 0.0 {
                parts.push(format!(
                    "mean TTFT {:+.1}%",
                    (ta.mean / tb.mean - 1.0) * 100.0
                ));
            }
            if tb.p99 > 0.0 {
                parts.push(format!(
                    "p99 TTFT {}%",
                    signed((ta.p99 / tb.p99 - 1.0) * 100.0)
                ));
            }
        }
        (!parts.is_empty()).then(|| format!("{a} vs {b}: {}", parts.join(", ")))
    }
}

/// `value` with one decimal and an explicit sign; values that round to zero print as
/// `+0.0` (never `-0.0`).
fn signed(value: f64) -> String {
    let rounded = (value * 10.0).round() / 10.0;
    // Adding +0.0 turns -0.0 into +0.0.
    format!("{:+.1}", rounded + 0.0)
}

fn table_row(report: &PolicyReport) -> Vec<String> {
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    let ttft = report.ttft_ms;
    let e2e = report.e2e_ms;
    vec![
        report.policy.to_string(),
        report.requests.to_string(),
        report.completed.to_string(),
        report.failed.to_string(),
        report
            .hit_rate
            .map_or_else(|| "-".to_owned(), |h| format!("{:.1}%", h * 100.0)),
        ms(ttft.map(|s| s.mean)),
        ms(ttft.map(|s| s.p50)),
        ms(ttft.map(|s| s.p90)),
        ms(ttft.map(|s| s.p99)),
        ms(e2e.map(|s| s.mean)),
        ms(e2e.map(|s| s.p99)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::report::tests::sample_report;

    #[test]
    fn table_is_aligned_and_compares_kv_with_round_robin() {
        let table = sample_report().render_table();
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("policy"));
        assert!(lines[1].starts_with("------"));
        assert!(lines[2].starts_with("kv "));
        assert!(lines[3].starts_with("round-robin"));
        // Right-aligned columns end at the same offset.
        assert_eq!(lines[0].len(), lines[2].len());
        assert_eq!(lines[2].len(), lines[3].len());
        assert!(lines[2].contains("50.0%"), "{table}");
        assert!(lines[3].contains("10.0%"), "{table}");
        assert!(
            table.contains("round-robin: 1 route errors (overloaded 1)"),
            "{table}"
        );
        // hit rate 50% vs 10%; mean TTFT 150 vs 300 ms.
        assert!(
            table.contains("kv vs round-robin: hit rate +40.0 pp, mean TTFT -50.0%"),
            "{table}"
        );
    }

    #[test]
    fn signs_are_explicit_and_zero_is_positive() {
        assert_eq!(signed(12.34), "+12.3");
        assert_eq!(signed(-45.66), "-45.7");
        assert_eq!(signed(-0.01), "+0.0");
        assert_eq!(signed(0.0), "+0.0");
    }

    #[test]
    fn table_without_round_robin_has_no_comparison() {
        let mut report = sample_report();
        report.policies.truncate(1);
        assert!(!report.render_table().contains(" vs "));
    }
}
