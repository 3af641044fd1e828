//! `kv-mocker lab replicas`: the same trace routed by 1, 2, 4, 8 … router replicas
//! whose queries are spread at random (`crate::replicas`), against one replica.
//!
//! Issue 29's replica target is hit rate within 1 point and mean TTFT within 3% of
//! one replica at 8. The live study (`kv-mocker quickstart --router-replicas`) meets
//! it with one gateway and replica affinity; this one measures the case affinity
//! cannot cover, a burst spread over several gateways, on the whole trace and free of
//! the host's noise. Each row is one replica count; `vs 1` compares its mean and p99
//! TTFT with the one-replica row of the same setting, `Δ hit` its hit rate.
//!
//! Cost: settings × replica counts runs of the whole trace over `--jobs` threads;
//! a run with `N` replicas books every request `N` times.

use crate::config::{LabPolicy, RouterReplicas, Setting, SimConfig, Speedup};
use crate::error::LabError;
use crate::report::{LabReport, RunReport, publish};
use crate::sim::PreparedTrace;
use crate::study_args::StudyArgs;
use crate::sweep::{LabelledRun, jobs_or_cores, run_labelled};
use crate::table::{engines_heading, ms, percent, tables_per_setting};
use engine_model::trace::BlockMapping;
use kv_events::routing::PolicyKind;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

/// `kv-mocker lab replicas` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicaArgs {
    /// Trace and simulation flags shared by every study.
    #[command(flatten)]
    pub study: StudyArgs,
    /// Engine counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub engines: Vec<u32>,
    /// Arrival speed-ups (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub speedup: Vec<Speedup>,
    /// Router replica counts, one row each (comma-separated); 1 is the reference row
    /// and is always run.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub replicas: Vec<usize>,
    /// From a replica's booking or lifecycle step to its peers applying it, in model ms.
    #[arg(long, default_value_t = crate::config::DEFAULT_SYNC_LAG_MS)]
    pub sync_lag_ms: f64,
    /// The router's policy in every row, with online calibration on (the daemon's
    /// default) unless `--uncalibrated`.
    #[arg(long, default_value = "predicted-ttft")]
    pub policy: PolicyKind,
    /// Online calibration off.
    #[arg(long)]
    pub uncalibrated: bool,
    /// Threads to run simulations on; default: the machine's cores.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Directory for `replicas.json`.
    #[arg(long, default_value = "target/lab-replicas")]
    pub out: PathBuf,
}

/// Everything `kv-mocker lab replicas` measured (`replicas.json`): the lab report, one
/// run per (setting, replica count) labelled `N replica(s)`, the sync lag, the policy
/// and the wall time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaReport {
    /// Trace, engine model, oracle bound and runs.
    #[serde(flatten)]
    pub lab: LabReport,
    /// The sync lag of every row, in model ms.
    pub sync_lag_ms: f64,
    /// The router's policy in every run.
    pub routing_policy: String,
    /// Wall time of the whole study, in s.
    pub wall_s: f64,
}

impl ReplicaArgs {
    /// The replica counts in report order: 1 first, then the others ascending, once
    /// each.
    fn counts(&self) -> Vec<usize> {
        let mut counts = self.replicas.clone();
        counts.push(1);
        counts.sort_unstable();
        counts.dedup();
        counts
    }

    /// Every (setting, replica count) run with its validated configuration.
    ///
    /// # Errors
    /// [`LabError::NoWorkers`] for no setting or a zero engine count;
    /// [`LabError::Replicas`] for a count of 0; configuration errors.
    fn plan(&self, base: &SimConfig) -> Result<Vec<LabelledRun>, LabError> {
        if self.engines.is_empty() || self.speedup.is_empty() || self.engines.contains(&0) {
            return Err(LabError::NoWorkers);
        }
        let mut items = Vec::new();
        for &workers in &self.engines {
            for &speedup in &self.speedup {
                for count in self.counts() {
                    let config = SimConfig {
                        replicas: RouterReplicas {
                            count,
                            sync_lag_ms: self.sync_lag_ms,
                        },
                        ..base.clone()
                    };
                    config.validate()?;
                    items.push(LabelledRun {
                        setting: Setting { workers, speedup },
                        label: label(count),
                        config,
                    });
                }
            }
        }
        Ok(items)
    }
}

/// A row's label.
fn label(count: usize) -> String {
    if count == 1 {
        "1 replica".to_owned()
    } else {
        format!("{count} replicas")
    }
}

/// Runs `kv-mocker lab replicas`: every setting × replica count, prints the table and
/// writes `replicas.json` into `--out`.
///
/// # Errors
/// Trace, configuration, simulation and file errors ([`LabError`]).
pub fn run_replicas(args: ReplicaArgs) -> Result<ReplicaReport, LabError> {
    let started = Instant::now();
    let (requests, name) = args.study.load_trace()?;
    let prepared = PreparedTrace::new(&requests, BlockMapping::new(args.study.engine.block_size)?);
    let base = args.study.sim_config();
    let items = args.plan(&base)?;
    let jobs = jobs_or_cores(args.jobs);
    let policy = if args.uncalibrated {
        LabPolicy::Scheduler(args.policy)
    } else {
        LabPolicy::Calibrated(args.policy)
    };
    eprintln!(
        "lab replicas: {} requests of {name}, {} runs on {jobs} threads; policy {}, sync lag {} ms",
        prepared.len(),
        items.len(),
        policy.name(),
        args.sync_lag_ms,
    );
    let runs = run_labelled(&prepared, &items, policy, jobs)?;
    let report = ReplicaReport {
        lab: LabReport::of(&prepared, name, &base, runs),
        sync_lag_ms: args.sync_lag_ms,
        routing_policy: policy.name(),
        wall_s: started.elapsed().as_secs_f64(),
    };
    publish(
        &render(&report),
        &report,
        &args.out.join("replicas.json"),
        report.wall_s,
    )?;
    Ok(report)
}

const HEADER: [&str; 9] = [
    "row",
    "hit rate",
    "Δ hit vs 1",
    "TTFT mean",
    "vs 1",
    "p99",
    "vs 1",
    "completed",
    "rejected",
];

/// The report as aligned tables, one per setting, one row per replica count
/// (latencies in model ms).
pub fn render(report: &ReplicaReport) -> String {
    let lab = &report.lab;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}; policy {}; queries spread at random over the replicas, sync lag {} ms",
        lab.trace.summary(),
        report.routing_policy,
        report.sync_lag_ms,
    );
    let reference = |r: &RunReport| {
        lab.runs
            .iter()
            .find(|one| one.setting == r.setting && one.policy == label(1))
    };
    tables_per_setting(
        &mut out,
        lab,
        engines_heading,
        &HEADER,
        |r| row(r, reference(r)),
        NOTE,
    );
    out
}

const NOTE: &str = "latencies in model ms; hit rate = cached / prompt tokens as the engines report them; vs 1 = this row's figure / the one-replica row's; each query goes to a replica drawn at random, each replica learns its peers' bookings and lifecycle steps one sync lag late";

fn row(r: &RunReport, one: Option<&RunReport>) -> Vec<String> {
    let m = &r.metrics;
    let vs = |f: fn(&RunReport) -> Option<f64>| {
        one.and_then(|o| ratio_of(f(r), f(o)))
            .map_or_else(|| "-".to_owned(), |x| format!("{x:.3}"))
    };
    let delta_hit = one
        .and_then(|o| Some((m.hit_rate? - o.metrics.hit_rate?) * 100.0))
        .map_or_else(|| "-".to_owned(), |d| format!("{d:+.1} pp"));
    vec![
        r.policy.clone(),
        percent(m.hit_rate),
        delta_hit,
        ms(m.ttft_ms.map(|t| t.mean)),
        vs(|r| r.metrics.ttft_ms.map(|t| t.mean)),
        ms(m.ttft_ms.map(|t| t.p99)),
        vs(|r| r.metrics.ttft_ms.map(|t| t.p99)),
        m.completed.to_string(),
        m.rejected.to_string(),
    ]
}

/// `a / b`, `None` when either is missing or `b` is 0.
fn ratio_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    let (a, b) = (a?, b?);
    (b != 0.0).then(|| a / b)
}

#[cfg(test)]
#[path = "replica_study_tests.rs"]
mod tests;
