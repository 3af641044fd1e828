//! The lab's JSON report: what was simulated (trace, engine model, timing, lag, seed),
//! the oracle bound, and one entry per (workers, speed-up, policy) run.
//!
//! Shape (`report.json`):
//!
//! ```text
//! { "trace":  { "name", "requests", "span_ms" },
//!   "config": { "block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
//!               "timing": { "step_base_ms", "prefill_ms_per_token", "decode_ms_per_seq",
//!                           "kv_read_ms_per_token" },
//!               "worker_speeds", "event_lag_ms", "seed",
//!               "cpu_tier_blocks", "cpu_tier_load_ms_per_token", "tier_pricing",
//!               "transfer_ms_per_token" },
//!   "oracle": { "hit_rate", "cached_tokens", "prompt_tokens" },
//!   "runs": [ { "workers", "speedup", "policy",
//!               "requests", "completed", "rejected", "hit_rate", "cpu_tier_hit_rate",
//!               "ttft_ms": {mean,p50,p90,p99}, "itl_ms": {…}, "e2e_ms": {…},
//!               "throughput_tokens_per_s", "throughput_requests_per_s",
//!               "requests_per_worker": [...], "disaggregated", "transferred_blocks",
//!               "ttft_cdf_ms": [101 quantiles],
//!               "refused_events", "steps", "wall_ms",
//!               "regret": { "sample_every", "decisions", "mean_ms", "p99_ms",
//!                           "best_share", "regret_share", "buckets": [...] } } ] }
//! ```
//!
//! `regret` is present only with `--regret-every` (see `crate::regret`); the same
//! figures go to `regret.csv`, one row per run and bucket:
//!
//! ```text
//! workers,speedup,policy,dimension,bucket,decisions,mean_ms,p99_ms,best_share,regret_share
//! ```
//!
//! Everything but `wall_ms` (the simulator's own run time) is a deterministic function
//! of the inputs and the seed.

use crate::calibration_point::CalibrationPoint;
use crate::config::{Setting, SimConfig};
use crate::error::LabError;
use crate::fleet::TierPricing;
use crate::metrics::RunMetrics;
use crate::oracle::OracleBound;
use crate::regret::RegretStats;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The trace that was replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceInfo {
    /// File path or the bundled excerpt's name.
    pub name: String,
    /// Requests simulated.
    pub requests: u64,
    /// Arrival span, first to last, in trace ms (before speed-up).
    pub span_ms: u64,
}

impl TraceInfo {
    /// `trace NAME: N requests over S s`, the head of a study's table.
    pub fn summary(&self) -> String {
        format!(
            "trace {}: {} requests over {:.0} s",
            self.name,
            self.requests,
            self.span_ms as f64 / 1_000.0
        )
    }
}

/// The timing model's coefficients, in model ms (see `docs/engine-model.md`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TimingInfo {
    /// Fixed cost per step, in ms.
    pub step_base_ms: f64,
    /// Per prefilled token, in ms.
    pub prefill_ms_per_token: f64,
    /// Per decoding sequence, in ms.
    pub decode_ms_per_seq: f64,
    /// Per KV token read by decode, in ms.
    pub kv_read_ms_per_token: f64,
}

/// The simulated engine and router settings shared by every run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigInfo {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV cache capacity per rank, in blocks.
    pub num_gpu_blocks: u64,
    /// Running batch limit per rank, in requests.
    pub max_num_seqs: u32,
    /// Step token budget, in tokens.
    pub max_num_batched_tokens: u64,
    /// The engines' step-time model at speed 1 (the router keeps its defaults).
    pub timing: TimingInfo,
    /// Per-worker engine speeds: `uniform`, `half-slow`, `all <speed>` or one speed
    /// per worker, comma-separated.
    pub worker_speeds: String,
    /// KV event lag, in model ms.
    pub event_lag_ms: f64,
    /// RNG seed.
    pub seed: u64,
    /// CPU tier capacity per rank, in blocks (0 = none; absent in older reports).
    #[serde(default)]
    pub cpu_tier_blocks: u64,
    /// CPU tier load time, in ms per token (absent in older reports).
    #[serde(default)]
    pub cpu_tier_load_ms_per_token: f64,
    /// Whether the router priced CPU-tier blocks (`on`, the default, or `off`).
    #[serde(default)]
    pub tier_pricing: TierPricing,
    /// KV transfer time between a split fleet's engines, in ms per token (absent in
    /// older reports).
    #[serde(default)]
    pub transfer_ms_per_token: f64,
}

impl From<&SimConfig> for ConfigInfo {
    fn from(c: &SimConfig) -> Self {
        Self {
            block_size: c.engine.block_size,
            num_gpu_blocks: c.engine.num_gpu_blocks,
            max_num_seqs: c.engine.max_num_seqs,
            max_num_batched_tokens: c.engine.max_num_batched_tokens,
            timing: TimingInfo {
                step_base_ms: c.timing.step_base_ms,
                prefill_ms_per_token: c.timing.prefill_ms_per_token,
                decode_ms_per_seq: c.timing.decode_ms_per_seq,
                kv_read_ms_per_token: c.timing.kv_read_ms_per_token,
            },
            worker_speeds: c.speeds.describe(),
            event_lag_ms: c.event_lag_ms,
            seed: c.seed,
            cpu_tier_blocks: c.cpu_tier.cpu_tier_blocks,
            cpu_tier_load_ms_per_token: c.cpu_tier.cpu_tier_load_ms_per_token,
            tier_pricing: c.tier_pricing,
            transfer_ms_per_token: c.transfer.transfer_ms_per_token,
        }
    }
}

/// One (setting, policy) run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// Workers and speed-up.
    #[serde(flatten)]
    pub setting: Setting,
    /// Policy name (`kv`, `round-robin`, …, or `proto:<name>`).
    pub policy: String,
    /// What was measured.
    #[serde(flatten)]
    pub metrics: RunMetrics,
    /// Engine steps simulated over all ranks.
    pub steps: u64,
    /// Wall-clock time the simulation took, in ms (the only non-deterministic field).
    pub wall_ms: f64,
    /// Each rank's calibration estimates at the end of the run (`+cal` policies only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calibration: Vec<CalibrationPoint>,
    /// The sampled decisions' regret against the best rank in hindsight (with
    /// `--regret-every`; aggregated fleets only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regret: Option<RegretStats>,
}

/// The whole lab report. See the module docs for the JSON shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LabReport {
    /// The trace.
    pub trace: TraceInfo,
    /// Engine model, timing, lag and seed.
    pub config: ConfigInfo,
    /// The infinite-cache hit-rate bound.
    pub oracle: OracleBound,
    /// Every run, grouped by setting (workers, then speed-up) in sweep order, policies
    /// in the order given.
    pub runs: Vec<RunReport>,
}

impl LabReport {
    /// The report of `runs` of `trace` (named `name`) under `config`, with the trace's
    /// oracle bound.
    pub(crate) fn of(
        trace: &crate::sim::PreparedTrace,
        name: String,
        config: &SimConfig,
        runs: Vec<RunReport>,
    ) -> Self {
        Self {
            trace: TraceInfo {
                name,
                requests: trace.len() as u64,
                span_ms: trace.span_ms(),
            },
            config: config.into(),
            oracle: crate::oracle::oracle_bound(trace),
            runs,
        }
    }

    /// The run of `policy` at `setting`, if any.
    pub fn run(&self, setting: Setting, policy: &str) -> Option<&RunReport> {
        self.runs
            .iter()
            .find(|r| r.setting == setting && r.policy == policy)
    }

    /// Distinct settings, in report order.
    pub fn settings(&self) -> Vec<Setting> {
        let mut out: Vec<Setting> = Vec::new();
        for run in &self.runs {
            if !out.contains(&run.setting) {
                out.push(run.setting);
            }
        }
        out
    }

    /// Distinct policy names, in report order.
    pub fn policies(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for run in &self.runs {
            if !out.contains(&run.policy) {
                out.push(run.policy.clone());
            }
        }
        out
    }

    /// Writes the report as pretty JSON to `path`, creating parent directories.
    ///
    /// # Errors
    /// [`LabError::Write`] if the file cannot be written.
    pub fn write_json(&self, path: &Path) -> Result<(), LabError> {
        write_json(self, path)
    }
}

/// A study's end: prints `table`, writes `value` to `path` and says where, with the
/// study's wall time `wall_s`.
///
/// # Errors
/// [`LabError::Write`] if the file cannot be written.
pub(super) fn publish<T: Serialize>(
    table: &str,
    value: &T,
    path: &Path,
    wall_s: f64,
) -> Result<(), LabError> {
    println!("{table}");
    write_json(value, path)?;
    eprintln!("report written to {}; {wall_s:.1} s", path.display());
    Ok(())
}

/// Writes `value` as pretty JSON to `path`, creating parent directories.
///
/// # Errors
/// [`LabError::Write`] if the file cannot be written.
pub(super) fn write_json<T: Serialize>(value: &T, path: &Path) -> Result<(), LabError> {
    let write_error = |source| LabError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(write_error)?;
    }
    let json = serde_json::to_string_pretty(value)
        .map_err(|err| write_error(std::io::Error::other(err)))?;
    std::fs::write(path, json + "\n").map_err(write_error)
}
