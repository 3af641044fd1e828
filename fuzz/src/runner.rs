//! The run loop: deterministic inputs per (seed, target, index), each handled on fresh
//! state under the allocation meter and `catch_unwind`, on a thread with the stack of
//! a tokio worker (2 MiB), so a stack overflow the daemon would hit is hit here too.

use crate::meter::{Meter, NotInstalled};
use crate::targets::{Target, Verdict};
use arbitrary::Unstructured;
use rand::{RngCore, SeedableRng, rngs::StdRng};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Stack size of the thread that handles inputs: tokio's worker default.
pub const WORKER_STACK_BYTES: usize = 2 << 20;

/// Random bytes behind each generated input's choices.
const ENTROPY_BYTES: usize = 4096;

/// Inputs at least this long count toward [`TargetReport::max_ratio`]: below it the
/// fixed part of what an input holds dominates.
const RATIO_MIN_BYTES: usize = 4096;

/// The allocation bound: handling an input of `n` bytes may hold at most
/// `per_byte × n + constant` heap bytes at once (decoded value and state changes
/// included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// Heap bytes allowed per input byte.
    pub per_byte: usize,
    /// Heap bytes allowed whatever the input, in bytes.
    pub constant: usize,
}

impl Bound {
    /// 128 bytes per input byte plus 256 KiB. What decoding holds is linear in the
    /// input once the codec has checked every announced length, but the factor is
    /// not small: serde reserves room for all announced elements before decoding the
    /// first, so 10,001 one-byte elements of a 96-byte `SnapshotEntry` reserve 96
    /// bytes per input byte; internally tagged enums are buffered as 32-byte generic
    /// values per msgpack value; and a `serde_json::Value` tree holds up to ~100
    /// bytes per JSON byte. The largest factors of the 10M-input run are in
    /// `docs/benchmarks.md`. Trusting a length prefix costs far more (1 MiB per
    /// announced container, whatever the input's length).
    pub const DEFAULT: Bound = Bound {
        per_byte: 128,
        constant: 256 << 10,
    };

    /// Heap bytes allowed for an input of `len` bytes.
    pub fn allowed(&self, len: usize) -> usize {
        self.per_byte
            .saturating_mul(len)
            .saturating_add(self.constant)
    }
}

/// What is run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Seed of every input's random choices.
    pub seed: u64,
    /// First input index (to resume a run, or replay one input).
    pub start: u64,
    /// Inputs per target.
    pub inputs: u64,
    /// The targets, in order.
    pub targets: Vec<&'static Target>,
    /// The allocation bound.
    pub bound: Bound,
}

/// What went wrong with one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The target panicked: the panic message and location.
    Panic(String),
    /// Handling it held more heap than the bound allows, in bytes.
    OverAllocated {
        /// Peak of live heap bytes while handling the input.
        peak: usize,
        /// What [`Bound::allowed`] gives for its length.
        allowed: usize,
    },
    /// It was refused with an empty error message.
    EmptyError,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::Panic(message) => write!(f, "panicked: {message}"),
            Problem::OverAllocated { peak, allowed } => {
                write!(f, "held {peak} heap bytes at peak, {allowed} allowed")
            }
            Problem::EmptyError => f.write_str("refused with an empty error message"),
        }
    }
}

/// A failing input, with what reproduces it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The target's name.
    pub target: &'static str,
    /// The run's seed and the input's index.
    pub seed: u64,
    /// Index of the input in the target's sequence.
    pub index: u64,
    /// What went wrong.
    pub problem: Problem,
    /// The input.
    pub input: Vec<u8>,
}

impl Failure {
    /// A test that reproduces this failure, for `fuzz/tests/regressions.rs`.
    pub fn test_snippet(&self) -> String {
        format!(
            "#[test]\nfn {target}_seed_{seed}_input_{index}() {{\n    \
             // {problem}\n    \
             let input = kv_fuzz::unhex(\"{hex}\").expect(\"hex\");\n    \
             kv_fuzz::assert_handles(\"{target}\", &input);\n}}\n",
            target = self.target,
            seed = self.seed,
            index = self.index,
            problem = self.problem,
            hex = crate::hex(&self.input),
        )
    }
}

/// The result of one target's inputs.
#[derive(Debug, Clone, Default)]
pub struct TargetReport {
    /// The target's name.
    pub name: &'static str,
    /// Inputs handled.
    pub inputs: u64,
    /// Inputs decoded (and applied).
    pub accepted: u64,
    /// Inputs refused with an error.
    pub refused: u64,
    /// Failing inputs (the first [`MAX_FAILURES_KEPT`] of them).
    pub failures: Vec<Failure>,
    /// Failing inputs in all.
    pub failed: u64,
    /// Largest input, in bytes.
    pub max_len: usize,
    /// Largest peak heap of one input, in bytes, and that input's length.
    pub max_peak: (usize, usize),
    /// Largest peak heap per input byte over inputs of at least 4 KiB.
    pub max_ratio: f64,
    /// Wall-clock time.
    pub elapsed: Duration,
}

/// Failing inputs kept per target (the rest are counted).
pub const MAX_FAILURES_KEPT: usize = 8;

static LAST_PANIC: Mutex<String> = Mutex::new(String::new());

/// The input of `target` at `index` for `seed`: the unmutated seeds first, then
/// generated inputs.
pub fn input(target: &Target, corpus: &crate::mutate::Corpus, seed: u64, index: u64) -> Vec<u8> {
    if let Some(seed_input) = usize::try_from(index)
        .ok()
        .and_then(|i| corpus.seeds().get(i))
    {
        return seed_input.clone();
    }
    let name_hash = fnv1a(target.name.as_bytes());
    let mut rng = StdRng::seed_from_u64(
        seed ^ name_hash.rotate_left(17) ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15),
    );
    let mut entropy = vec![0u8; ENTROPY_BYTES];
    rng.fill_bytes(&mut entropy);
    let mut u = Unstructured::new(&entropy);
    // An exhausted `Unstructured` yields zeros rather than failing.
    corpus.generate(&mut u).unwrap_or_default()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What one input did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handled {
    /// Accepted or refused.
    pub verdict: Verdict,
    /// Peak of live heap bytes while it was handled.
    pub peak: usize,
}

/// Handles one input of `target` on fresh state and judges it.
///
/// # Errors
/// The [`Problem`] with it.
pub fn check(
    target: &Target,
    meter: &Meter,
    bound: Bound,
    input: &[u8],
) -> Result<Handled, Problem> {
    let mut harness = target.fresh();
    let (result, peak) = meter.peak_of(|| catch_unwind(AssertUnwindSafe(|| harness.feed(input))));
    drop(harness);
    let verdict = result.map_err(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let location = std::mem::take(&mut *LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()));
        Problem::Panic(format!("{message} ({location})"))
    })?;
    let allowed = bound.allowed(input.len());
    if peak > allowed {
        return Err(Problem::OverAllocated { peak, allowed });
    }
    match verdict {
        Verdict::Refused(e) if e.trim().is_empty() => Err(Problem::EmptyError),
        verdict => Ok(Handled { verdict, peak }),
    }
}

/// Runs `plan` on a thread with [`WORKER_STACK_BYTES`] of stack; `progress` sees each
/// target's report every `every` inputs and when the target is done.
///
/// # Errors
/// [`NotInstalled`] when the binary does not use [`peak_alloc::PeakAlloc`].
pub fn run(
    plan: Plan,
    every: u64,
    progress: impl FnMut(&TargetReport, bool) + Send + 'static,
) -> Result<Vec<TargetReport>, NotInstalled> {
    let worker = std::thread::Builder::new()
        .name("fuzz".into())
        .stack_size(WORKER_STACK_BYTES)
        .spawn(move || run_here(&plan, every, progress));
    match worker.map(std::thread::JoinHandle::join) {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(e) => panic!("cannot start the fuzz thread: {e}"),
    }
}

fn run_here(
    plan: &Plan,
    every: u64,
    mut progress: impl FnMut(&TargetReport, bool),
) -> Result<Vec<TargetReport>, NotInstalled> {
    let meter = Meter::new()?;
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        let location = info.location().map(|l| l.to_string()).unwrap_or_default();
        *LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()) = location;
    }));
    let mut reports = Vec::new();
    for &target in &plan.targets {
        let corpus = target.corpus();
        let started = Instant::now();
        let mut report = TargetReport {
            name: target.name,
            ..TargetReport::default()
        };
        for index in plan.start..plan.start.saturating_add(plan.inputs) {
            let bytes = input(target, &corpus, plan.seed, index);
            report.inputs += 1;
            report.max_len = report.max_len.max(bytes.len());
            match check(target, &meter, plan.bound, &bytes) {
                Ok(Handled { verdict, peak }) => {
                    match verdict {
                        Verdict::Accepted => report.accepted += 1,
                        Verdict::Refused(_) => report.refused += 1,
                    }
                    let len = bytes.len();
                    if peak > report.max_peak.0 {
                        report.max_peak = (peak, len);
                    }
                    if len >= RATIO_MIN_BYTES {
                        report.max_ratio = report.max_ratio.max(peak as f64 / len as f64);
                    }
                }
                Err(problem) => {
                    report.failed += 1;
                    if report.failures.len() < MAX_FAILURES_KEPT {
                        report.failures.push(Failure {
                            target: target.name,
                            seed: plan.seed,
                            index,
                            problem,
                            input: bytes,
                        });
                    }
                }
            }
            if every > 0 && report.inputs.is_multiple_of(every) {
                report.elapsed = started.elapsed();
                progress(&report, false);
            }
        }
        report.elapsed = started.elapsed();
        progress(&report, true);
        reports.push(report);
    }
    std::panic::set_hook(previous_hook);
    Ok(reports)
}
