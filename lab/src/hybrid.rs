//! `kv-mocker lab hybrid`: a hybrid-attention fleet (sliding-window KV cache groups
//! beside the full-attention group, `engine_model::hybrid`) routed by a group-aware
//! index and by a group-blind one, with a dense fleet of the same KV memory for
//! reference.
//!
//! Each setting (engines × arrival speed-up) runs the trace three times with the same
//! routing policy:
//! - `group-aware`: hybrid engines; the router indexes every group's KV events, so
//!   its overlap is the engine's own hybrid hit (kv-router's indexer);
//! - `group-blind`: the same engines; the router indexes only the full-attention
//!   group's events, once per block, and drops the sliding-window groups' (what a
//!   router that knows neither groups nor copies sees, Dynamo and llm-d; the `blind`
//!   module): it claims the full group's prefix even when the engine lacks the
//!   window before it and recomputes, and forgets a block at its first copy's
//!   eviction;
//! - `dense`: the same model without a hybrid KV cache manager (vLLM's
//!   `--disable-hybrid-kv-cache-manager`), every layer cached as full attention.
//!
//! Equal memory: vLLM's hybrid manager puts the same number of layers in each group,
//! so a physical block of a hybrid rank holds `1 / (N + 1)` of a dense block's layers;
//! the hybrid rows' pool is `(N + 1) × --num-gpu-blocks` blocks (the dense rank's
//! capacity). A row's hit rate is the engines' own (`cached_tokens` / prompt tokens);
//! `predicted` is what the router's index claimed on the chosen rank, and
//! `over-claimed` the tokens it claimed beyond the engine's hit, the error that makes
//! a group-blind router misplace requests.
//!
//! Cost: settings × 3 runs of the whole trace, over `--jobs` threads as in the main
//! sweep.

use crate::config::{LabPolicy, RouterGroups, Setting, SimConfig, Speedup};
use crate::error::LabError;
use crate::metrics::ratio;
use crate::report::{LabReport, RunReport, publish};
use crate::sim::PreparedTrace;
use crate::study_args::StudyArgs;
use crate::sweep::{LabelledRun, jobs_or_cores, run_labelled};
use crate::table::{engines_heading, ms, percent, tables_per_setting};
use engine_model::trace::BlockMapping;
use engine_model::{HybridConfig, WindowRetention};
use kv_events::routing::PolicyKind;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

/// `kv-mocker lab hybrid` flags.
#[derive(Debug, Clone, clap::Args)]
#[command(mut_arg("sliding_window_groups", |a| a.default_value("3")))]
pub struct HybridArgs {
    /// Trace and simulation flags shared by every study (`--num-gpu-blocks` is the
    /// dense engine's capacity; the hybrid engines get `N + 1` times as many blocks
    /// of one group each, the same memory).
    #[command(flatten)]
    pub study: StudyArgs,
    /// Engine counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub engines: Vec<u32>,
    /// Arrival speed-ups (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub speedup: Vec<Speedup>,
    /// The hybrid engines' shape, the mock engines' own flags (here 3 sliding-window
    /// groups by default).
    #[command(flatten)]
    pub hybrid: HybridConfig,
    /// The router's policy in every row.
    #[arg(long, default_value = "predicted-ttft")]
    pub policy: PolicyKind,
    /// Threads to run simulations on; default: the machine's cores.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Directory for `hybrid.json`.
    #[arg(long, default_value = "target/lab-hybrid")]
    pub out: PathBuf,
}

/// One row of a setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HybridRow {
    /// Hybrid engines, every group indexed.
    GroupAware,
    /// Hybrid engines, only the full-attention group indexed.
    GroupBlind,
    /// Dense engines of the same memory.
    Dense,
}

impl HybridRow {
    /// Every row, in report order.
    pub const ALL: [HybridRow; 3] = [Self::GroupAware, Self::GroupBlind, Self::Dense];

    /// The row's label (its runs' `policy` in the report).
    pub fn label(self) -> &'static str {
        match self {
            Self::GroupAware => "group-aware",
            Self::GroupBlind => "group-blind",
            Self::Dense => "dense",
        }
    }

    /// The simulation of this row: `base` (a dense engine) made hybrid with
    /// `hybrid` at equal memory, its router indexing the row's groups.
    pub fn config(self, base: &SimConfig, hybrid: HybridConfig) -> SimConfig {
        let router_groups = match self {
            Self::Dense => return base.clone(),
            Self::GroupAware => RouterGroups::All,
            Self::GroupBlind => RouterGroups::FullAttentionOnly,
        };
        let mut engine = base.engine;
        engine.num_gpu_blocks *= u64::from(hybrid.sliding_window_groups) + 1;
        SimConfig {
            engine,
            hybrid,
            router_groups,
            ..base.clone()
        }
    }
}

/// The hybrid engines' shape as reported.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HybridShape {
    /// Sliding-window groups beside the full-attention group.
    pub sliding_window_groups: u32,
    /// Their window, in tokens.
    pub sliding_window: u32,
    /// Blocks a hit needs of each before the hit point.
    pub window_blocks: u32,
    /// Which blocks they keep.
    pub retention: WindowRetention,
    /// The hybrid engines' pool, in blocks of one group (`(N + 1) ×` the dense
    /// engines' `num_gpu_blocks`).
    pub num_gpu_blocks: u64,
}

/// Everything `kv-mocker lab hybrid` measured (`hybrid.json`): the lab report, one run
/// per (setting, row) with the row's label as its `policy`, the hybrid shape, the
/// router's policy and the wall time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HybridReport {
    /// Trace, the dense engines' model, oracle bound and runs.
    #[serde(flatten)]
    pub lab: LabReport,
    /// The hybrid rows' engines.
    pub hybrid: HybridShape,
    /// The router's policy in every run.
    pub routing_policy: String,
    /// Wall time of the whole study, in s.
    pub wall_s: f64,
}

impl HybridArgs {
    /// Every (setting, row) run with its validated configuration, in report order.
    ///
    /// # Errors
    /// [`LabError::NotHybrid`] without sliding-window groups, [`LabError::NoWorkers`]
    /// for no setting or a zero engine count, and configuration errors.
    fn plan(&self, base: &SimConfig) -> Result<Vec<LabelledRun>, LabError> {
        if !self.hybrid.is_hybrid() {
            return Err(LabError::NotHybrid);
        }
        if self.engines.is_empty() || self.speedup.is_empty() || self.engines.contains(&0) {
            return Err(LabError::NoWorkers);
        }
        let mut items = Vec::new();
        for &workers in &self.engines {
            for &speedup in &self.speedup {
                for row in HybridRow::ALL {
                    let config = row.config(base, self.hybrid);
                    config.validate()?;
                    items.push(LabelledRun {
                        setting: Setting { workers, speedup },
                        label: row.label().to_owned(),
                        config,
                    });
                }
            }
        }
        Ok(items)
    }
}

/// Runs `kv-mocker lab hybrid`: every setting × row, prints the table and writes
/// `hybrid.json` into `--out`.
///
/// # Errors
/// Trace, configuration, simulation and file errors ([`LabError`]).
pub fn run_hybrid(args: HybridArgs) -> Result<HybridReport, LabError> {
    let started = Instant::now();
    let (requests, name) = args.study.load_trace()?;
    let block_size = args.study.engine.block_size;
    let prepared = PreparedTrace::new(&requests, BlockMapping::new(block_size)?);
    let base = args.study.sim_config();
    let items = args.plan(&base)?;
    let jobs = jobs_or_cores(args.jobs);
    let policy = LabPolicy::Scheduler(args.policy);
    let shape = HybridShape {
        sliding_window_groups: args.hybrid.sliding_window_groups,
        sliding_window: args.hybrid.sliding_window,
        window_blocks: engine_model::hybrid::window_blocks(args.hybrid.sliding_window, block_size),
        retention: args.hybrid.sliding_window_retention,
        num_gpu_blocks: HybridRow::GroupAware
            .config(&base, args.hybrid)
            .engine
            .num_gpu_blocks,
    };
    eprintln!(
        "lab hybrid: {} requests of {name}, {} runs on {jobs} threads; policy {}, {} sliding-window groups of {} tokens",
        prepared.len(),
        items.len(),
        policy.name(),
        shape.sliding_window_groups,
        shape.sliding_window,
    );
    let runs = run_labelled(&prepared, &items, policy, jobs)?;
    let report = HybridReport {
        lab: LabReport::of(&prepared, name, &base, runs),
        hybrid: shape,
        routing_policy: policy.name(),
        wall_s: started.elapsed().as_secs_f64(),
    };
    publish(
        &render(&report),
        &report,
        &args.out.join("hybrid.json"),
        report.wall_s,
    )?;
    Ok(report)
}

const HEADER: [&str; 11] = [
    "row",
    "hit rate",
    "predicted",
    "over-claimed/req",
    "over-claimed reqs",
    "TTFT mean",
    "p50",
    "p99",
    "tok/s",
    "completed",
    "rejected",
];

/// The report as aligned tables, one per setting, one row per [`HybridRow`]
/// (latencies in model ms).
pub fn render(report: &HybridReport) -> String {
    let (lab, h) = (&report.lab, &report.hybrid);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}; policy {}; {} sliding-window groups of {} tokens ({} blocks before a hit), retention {:?}, + 1 full-attention group; block size {}; dense engines {} blocks, hybrid {} blocks of one group (equal memory)",
        lab.trace.summary(),
        report.routing_policy,
        h.sliding_window_groups,
        h.sliding_window,
        h.window_blocks,
        h.retention,
        lab.config.block_size,
        lab.config.num_gpu_blocks,
        h.num_gpu_blocks,
    );
    tables_per_setting(&mut out, lab, engines_heading, &HEADER, row, NOTE);
    out
}

const NOTE: &str = "latencies in model ms; hit rate = cached / prompt tokens as the engines report them; predicted = the router's overlap on the chosen engine / prompt tokens; over-claimed = predicted tokens beyond the engine's hit, per completed request and share of requests; group-aware indexes every KV cache group, group-blind only full attention, dense = the same model without a hybrid KV cache manager";

fn row(r: &RunReport) -> Vec<String> {
    let (m, p) = (&r.metrics, &r.metrics.prediction);
    vec![
        r.policy.clone(),
        percent(m.hit_rate),
        percent(p.predicted_rate()),
        ratio(p.overclaimed_tokens, m.completed)
            .map_or_else(|| "-".to_owned(), |t| format!("{t:.0}")),
        percent(ratio(p.overclaimed_requests, m.completed)),
        ms(m.ttft_ms.map(|t| t.mean)),
        ms(m.ttft_ms.map(|t| t.p50)),
        ms(m.ttft_ms.map(|t| t.p99)),
        format!("{:.0}", m.throughput_tokens_per_s),
        m.completed.to_string(),
        m.rejected.to_string(),
    ]
}

#[cfg(test)]
#[path = "hybrid_tests.rs"]
mod tests;
