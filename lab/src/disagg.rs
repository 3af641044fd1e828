//! `kv-mocker lab disagg`: aggregated against disaggregated against conditional
//! serving at an equal number of engines, on one trace.
//!
//! Each setting (engines × arrival speed-up) runs the trace once per *serving*: every
//! engine in role `both` (`aggregated`), and for each `--prefill-engines` count `P`,
//! `P` prefill engines and the rest decode engines, with the router forcing every
//! prompt to a prefill engine (`disaggregated`) or deciding per request with its
//! conditional-disaggregation thresholds (`conditional`). The routing policy, the
//! engines and the trace are the same in every row, so a row's TTFT, ITL and
//! throughput against `aggregated` is what the split buys or costs; the
//! simulator's `pair` module describes the model of the two halves and the transfer.
//!
//! Cost: settings × servings runs of the whole trace, over `--jobs` threads as in the
//! main sweep (the defaults: 8 engines at 1×, 2× and 4×, 1 + 3 × 2 servings, 21 runs).

use crate::charts;
use crate::config::{LabPolicy, Setting, SimConfig, Speedup};
use crate::error::LabError;
use crate::metrics::RunMetrics;
use crate::report::{LabReport, RunReport, publish};
use crate::serving::{Serving, SplitFleet, SplitMode};
use crate::sim::PreparedTrace;
use crate::study_args::StudyArgs;
use crate::sweep::{LabelledRun, jobs_or_cores, run_labelled};
use crate::table::{engines_heading, ms, percent, tables_per_setting};
use engine_model::KvTransferConfig;
use engine_model::trace::BlockMapping;
use kv_events::routing::PolicyKind;
use scheduler::DisaggregationConfig;
use scheduler::args::DisaggregationArgs;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

/// `kv-mocker lab disagg` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DisaggArgs {
    /// Trace and simulation flags shared by every study.
    #[command(flatten)]
    pub study: StudyArgs,
    /// Engine counts (comma-separated); every serving of a setting uses this many.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub engines: Vec<u32>,
    /// Arrival speed-ups (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub speedup: Vec<Speedup>,
    /// Prefill engine counts to compare (comma-separated); each must leave at least
    /// one decode engine.
    #[arg(long, value_delimiter = ',', default_value = "2,4,6")]
    pub prefill_engines: Vec<u32>,
    /// Split modes to compare (comma-separated).
    #[arg(
        long = "mode",
        value_enum,
        value_delimiter = ',',
        default_value = "disaggregated,conditional"
    )]
    pub modes: Vec<SplitMode>,
    /// The router's policy in every row (for a split fleet, the prefill engine's
    /// choice; the decode engine is chosen by decode load and free KV).
    #[arg(long, default_value = "predicted-ttft")]
    pub policy: PolicyKind,
    /// The KV transfer to a decode engine, the mock engines' own flag
    /// (`--transfer-ms-per-token`).
    #[command(flatten)]
    pub transfer: KvTransferConfig,
    /// The conditional rows' thresholds, the router's own flags (`scheduler::args`).
    #[command(flatten)]
    pub conditional: DisaggregationArgs,
    /// Threads to run simulations on; default: the machine's cores.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Directory for `disagg.json` and the PNG charts.
    #[arg(long, default_value = "target/lab-disagg")]
    pub out: PathBuf,
    /// Skip the PNG charts.
    #[arg(long)]
    pub no_charts: bool,
}

/// Everything `kv-mocker lab disagg` measured (`disagg.json`): the lab report, one
/// run per (setting, serving) with the serving's label as its `policy`, plus the
/// router's policy and the wall time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DisaggReport {
    /// Trace, engines, transfer bandwidth, oracle bound and runs.
    #[serde(flatten)]
    pub lab: LabReport,
    /// The router's policy in every run.
    pub routing_policy: String,
    /// The conditional rows' thresholds (the disaggregated rows force every prompt
    /// that is not wholly cached on its decode engine to a prefill engine).
    pub conditional: DisaggregationConfig,
    /// Wall time of the whole study, in s.
    pub wall_s: f64,
}

impl DisaggArgs {
    /// The servings of a setting of `engines` engines, in report order:
    /// `aggregated`, then each prefill count in each mode.
    fn servings(&self) -> Vec<Serving> {
        let mut servings = vec![Serving::Aggregated];
        for &prefill_engines in &self.prefill_engines {
            for &mode in &self.modes {
                servings.push(Serving::Split(SplitFleet {
                    prefill_engines,
                    mode,
                }));
            }
        }
        servings
    }

    /// Every (setting, serving) run with its validated configuration, in report
    /// order.
    ///
    /// # Errors
    /// [`LabError::NoWorkers`] for no setting or a zero engine count,
    /// [`LabError::Split`] for a prefill count that leaves no decode engine, and
    /// configuration errors.
    fn plan(&self, base: &SimConfig) -> Result<Vec<LabelledRun>, LabError> {
        base.validate()?;
        if self.engines.is_empty() || self.speedup.is_empty() || self.engines.contains(&0) {
            return Err(LabError::NoWorkers);
        }
        let mut items = Vec::new();
        for &workers in &self.engines {
            for &speedup in &self.speedup {
                for serving in self.servings() {
                    serving.roles(workers)?;
                    items.push(LabelledRun {
                        setting: Setting { workers, speedup },
                        label: serving.label(workers),
                        config: SimConfig {
                            serving,
                            ..base.clone()
                        },
                    });
                }
            }
        }
        Ok(items)
    }
}

/// Runs `kv-mocker lab disagg`: every setting × serving, prints the table, writes
/// `disagg.json` and the charts into `--out`.
///
/// # Errors
/// Trace, configuration, simulation and file errors ([`LabError`]).
pub fn run_disagg(args: DisaggArgs) -> Result<DisaggReport, LabError> {
    let started = Instant::now();
    let (requests, name) = args.study.load_trace()?;
    let prepared = PreparedTrace::new(&requests, BlockMapping::new(args.study.engine.block_size)?);
    let base = SimConfig {
        transfer: args.transfer,
        conditional: args.conditional.to_config(),
        ..args.study.sim_config()
    };
    let items = args.plan(&base)?;
    let jobs = jobs_or_cores(args.jobs);
    let policy = LabPolicy::Scheduler(args.policy);
    eprintln!(
        "lab disagg: {} requests of {name}, {} runs on {jobs} threads; policy {}, KV transfer {} ms/token",
        prepared.len(),
        items.len(),
        policy.name(),
        args.transfer.transfer_ms_per_token,
    );
    let runs = run_labelled(&prepared, &items, policy, jobs)?;
    let report = DisaggReport {
        lab: LabReport::of(&prepared, name, &base, runs),
        routing_policy: policy.name(),
        conditional: base.conditional,
        wall_s: started.elapsed().as_secs_f64(),
    };
    publish(
        &render(&report),
        &report,
        &args.out.join("disagg.json"),
        report.wall_s,
    )?;
    if !args.no_charts {
        for path in charts::write_disagg_charts(&report.lab, &args.out)? {
            eprintln!("chart written to {}", path.display());
        }
    }
    Ok(report)
}

const HEADER: [&str; 13] = [
    "serving",
    "hit rate",
    "remote",
    "local short/held",
    "moved/req",
    "TTFT mean",
    "p50",
    "p99",
    "ITL mean",
    "p99",
    "tok/s",
    "completed",
    "rejected",
];

/// The report as aligned tables, one per setting, one row per serving (latencies
/// in model ms).
pub fn render(report: &DisaggReport) -> String {
    let lab = &report.lab;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}; policy {}; KV transfer {} ms/token; conditional: local up to {} uncached tokens or {}% held; block size {}, {} blocks per engine",
        lab.trace.summary(),
        report.routing_policy,
        lab.config.transfer_ms_per_token,
        report.conditional.max_local_prefill_tokens,
        report.conditional.min_decode_overlap * 100.0,
        lab.config.block_size,
        lab.config.num_gpu_blocks,
    );
    tables_per_setting(
        &mut out,
        lab,
        engines_heading,
        &HEADER,
        row,
        "latencies in model ms; hit rate = cached / prompt tokens where the prompt was prefilled; remote = share of completed requests prefilled on a prefill engine; local short/held = kept on the decode engine as short_uncached / decode_holds_prefix; moved/req = blocks transferred per remote prefill; ITL = per-request mean inter-token latency; tok/s = output tokens per simulated second",
    );
    out
}

fn row(r: &RunReport) -> Vec<String> {
    let m: &RunMetrics = &r.metrics;
    let ms1 = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    let share = |part: u64, whole: u64| {
        if whole == 0 {
            "-".to_owned()
        } else {
            format!("{:.0}%", part as f64 * 100.0 / whole as f64)
        }
    };
    let per_remote = if m.disaggregated == 0 {
        "-".to_owned()
    } else {
        format!(
            "{:.1}",
            m.transferred_blocks as f64 / m.disaggregated as f64
        )
    };
    vec![
        r.policy.clone(),
        percent(m.hit_rate),
        share(m.disaggregated, m.completed),
        format!(
            "{} / {}",
            share(m.decisions.short_uncached, m.completed),
            share(m.decisions.decode_holds_prefix, m.completed)
        ),
        per_remote,
        ms(m.ttft_ms.map(|t| t.mean)),
        ms(m.ttft_ms.map(|t| t.p50)),
        ms(m.ttft_ms.map(|t| t.p99)),
        ms1(m.itl_ms.map(|t| t.mean)),
        ms1(m.itl_ms.map(|t| t.p99)),
        format!("{:.0}", m.throughput_tokens_per_s),
        m.completed.to_string(),
        m.rejected.to_string(),
    ]
}

#[cfg(test)]
#[path = "disagg_tests.rs"]
mod tests;
