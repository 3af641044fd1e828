//! The terminal rendering of a [`LabReport`]: one aligned block per setting (workers,
//! speed-up), one row per policy (`engine_model::render_table`, the replay's style
//! too), with the oracle bound in each block's title.
//! Rendering is `O(runs)` string formatting.

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
            "trace {}: {} requests over {:.0} s; block size {}, {} blocks per rank, event lag {} ms",
            self.trace.name,
            self.trace.requests,
            self.trace.span_ms as f64 / 1_000.0,
            self.config.block_size,
            self.config.num_gpu_blocks,
            self.config.event_lag_ms,
        );
        for setting in self.settings() {
            let _ = writeln!(
                out,
                "\n{} workers, {} arrivals (oracle hit rate {:.1}%)",
                setting.workers,
                setting.speedup,
                self.oracle.hit_rate * 100.0
            );
            let runs = self.runs.iter().filter(|r| r.setting == setting);
            out.push_str(&render_table(&HEADER, runs.map(row)));
            out.push('\n');
        }
        out.push_str(
            "\n(latencies in model ms; hit rate = cached / prompt tokens, cpu = the part loaded back from a CPU tier; tok/s = output tokens per simulated second)\n",
        );
        out
    }
}

fn row(r: &RunReport) -> Vec<String> {
    let m = &r.metrics;
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
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
