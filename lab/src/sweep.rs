//! Running every (setting, policy) pair, on several threads, with a progress bar.
//!
//! Runs are independent (each has its own engines, index, scheduler and seeded RNG),
//! so they are spread over `jobs` OS threads that take the next run from a shared
//! counter; results land in their run's slot, so the report's order and contents do
//! not depend on thread timing. Memory is one run's state per thread plus the shared
//! prepared trace.

use crate::config::{LabPolicy, Setting, SimConfig};
use crate::error::LabError;
use crate::report::RunReport;
use crate::sim::{PreparedTrace, simulate};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// What to run: every setting × every policy, with shared knobs.
#[derive(Debug, Clone)]
pub struct Sweep {
    /// Settings, in report order.
    pub settings: Vec<Setting>,
    /// Policies, in report order within each setting.
    pub policies: Vec<LabPolicy>,
    /// Engine model, timing, lag, seed.
    pub config: SimConfig,
    /// Threads to use (at least 1).
    pub jobs: usize,
}

impl Sweep {
    /// The (setting, policy) pairs in report order.
    pub fn runs(&self) -> Vec<(Setting, LabPolicy)> {
        self.settings
            .iter()
            .flat_map(|&s| self.policies.iter().map(move |&p| (s, p)))
            .collect()
    }
}

/// Runs the sweep over `trace`, ticking `progress` once per finished run.
///
/// # Errors
/// The first run's [`LabError`], in report order (a bad configuration fails every run
/// the same way).
pub fn run_sweep(
    trace: &PreparedTrace,
    sweep: &Sweep,
    progress: &ProgressBar,
) -> Result<Vec<RunReport>, LabError> {
    sweep.config.validate()?;
    let runs = sweep.runs();
    run_parallel(&runs, sweep.jobs, progress, |&(setting, policy)| {
        progress.set_message(format!(
            "{} workers, {}, {}",
            setting.workers,
            setting.speedup,
            policy.name()
        ));
        timed_run(trace, setting, policy, &sweep.config)
    })
}

/// One simulation, as a report entry with its wall time.
///
/// # Errors
/// The run's [`LabError`].
pub(super) fn timed_run(
    trace: &PreparedTrace,
    setting: Setting,
    policy: LabPolicy,
    config: &SimConfig,
) -> Result<RunReport, LabError> {
    let started = Instant::now();
    simulate(trace, setting, policy, config).map(|run| RunReport {
        setting,
        policy: policy.name(),
        metrics: run.metrics(setting.workers as usize),
        steps: run.steps,
        wall_ms: started.elapsed().as_secs_f64() * 1_000.0,
        calibration: run.final_calibration(),
        regret: run.regret,
    })
}

/// Runs `job` on every item, on `jobs` threads (at least 1) that take the next item
/// from a shared counter, ticking `progress` once per finished item; results come
/// back in item order whatever the thread timing.
///
/// # Errors
/// The first item's error, in item order; [`LabError::Incomplete`] for an item whose
/// job panicked.
pub(super) fn run_parallel<I, O, F>(
    items: &[I],
    jobs: usize,
    progress: &ProgressBar,
    job: F,
) -> Result<Vec<O>, LabError>
where
    I: Sync,
    O: Send,
    F: Fn(&I) -> Result<O, LabError> + Sync,
{
    let slots: Vec<Mutex<Option<Result<O, LabError>>>> =
        items.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let jobs = jobs.clamp(1, items.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else {
                        break;
                    };
                    let result = job(item);
                    progress.inc(1);
                    // A poisoned slot can only come from a panic in this very block;
                    // keep the value either way.
                    *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .unwrap_or(Err(LabError::Incomplete))
        })
        .collect()
}

/// `--jobs`, or the machine's cores when unset.
pub(crate) fn jobs_or_cores(jobs: Option<usize>) -> usize {
    jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// One run of a study whose rows are not policies: its setting, the row's label (its
/// report's `policy`) and its simulation.
#[derive(Debug, Clone)]
pub(crate) struct LabelledRun {
    pub setting: Setting,
    pub label: String,
    pub config: SimConfig,
}

/// Runs every item under `policy` over `trace` on `jobs` threads, with a progress
/// bar on stderr; the reports come back in item order, each labelled with its row.
///
/// # Errors
/// The first item's [`LabError`], in item order.
pub(crate) fn run_labelled(
    trace: &PreparedTrace,
    items: &[LabelledRun],
    policy: LabPolicy,
    jobs: usize,
) -> Result<Vec<RunReport>, LabError> {
    let progress = progress_bar(items.len());
    let runs = run_parallel(items, jobs, &progress, |item| {
        progress.set_message(format!(
            "{} engines, {}, {}",
            item.setting.workers, item.setting.speedup, item.label
        ));
        let mut run = timed_run(trace, item.setting, policy, &item.config)?;
        run.policy.clone_from(&item.label);
        Ok(run)
    })?;
    progress.finish_and_clear();
    Ok(runs)
}

/// The progress bar of a study of `len` runs, on stderr.
pub(crate) fn progress_bar(len: usize) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    // The template is a literal known to be valid; fall back to the default otherwise.
    if let Ok(style) = ProgressStyle::with_template(
        "lab [{bar:40}] {pos}/{len} runs, {elapsed} ({eta} left) {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
