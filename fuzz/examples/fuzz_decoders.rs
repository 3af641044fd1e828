//! The long fuzz run over every decoder of network input (see the `kv-fuzz` crate
//! docs for the targets and what is asserted).
//!
//! ```text
//! cargo run --release -p kv-fuzz --example fuzz_decoders -- --inputs 10000000
//! ```
//!
//! `--inputs` is the total, split evenly over the targets (rounded up). Input `i` of a target is
//! the same for the same `--seed`, so `--start` resumes a run and
//! `--replay TARGET:INDEX` prints one input as hex and handles it alone (in the
//! foreground: a crash shows its backtrace). Failing inputs are printed as hex with a
//! regression test to paste into `fuzz/tests/regressions.rs`; the exit code is 1 if
//! there is any.

use anyhow::{Context, bail};
use clap::Parser;
use kv_fuzz::runner::{self, Bound, Plan, TargetReport};
use kv_fuzz::targets::{ALL, Target, by_name};
use std::io::Write as _;
use std::time::Instant;

#[global_allocator]
static ALLOC: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

#[derive(Debug, Parser)]
#[command(about = "Fuzz every kv-router decoder of network input")]
struct Args {
    /// Inputs in total (at least), split evenly over the targets.
    #[arg(long, default_value_t = 1_000_000)]
    inputs: u64,
    /// Seed of the generated inputs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// First input index of every target (resume a run).
    #[arg(long, default_value_t = 0)]
    start: u64,
    /// Only these targets (comma-separated names); default all.
    #[arg(long, value_delimiter = ',')]
    targets: Vec<String>,
    /// List the targets (name, input, decoder and what runs after it) and exit.
    #[arg(long)]
    list: bool,
    /// Print input TARGET:INDEX as hex and handle it alone.
    #[arg(long)]
    replay: Option<String>,
    /// Print every input's target and index before handling it (to find one that
    /// aborts the process, e.g. by overflowing the stack).
    #[arg(long)]
    trace: bool,
    /// Heap bytes allowed per input byte.
    #[arg(long, default_value_t = Bound::DEFAULT.per_byte)]
    bound_per_byte: usize,
    /// Heap bytes allowed per input whatever its length.
    #[arg(long, default_value_t = Bound::DEFAULT.constant)]
    bound_constant: usize,
}

fn targets(names: &[String]) -> anyhow::Result<Vec<&'static Target>> {
    if names.is_empty() {
        return Ok(ALL.iter().collect());
    }
    names
        .iter()
        .map(|n| by_name(n).with_context(|| format!("no target called {n}")))
        .collect()
}

fn replay(spec: &str, seed: u64) -> anyhow::Result<()> {
    let (name, index) = spec
        .split_once(':')
        .context("--replay takes TARGET:INDEX")?;
    let target = by_name(name).with_context(|| format!("no target called {name}"))?;
    let index: u64 = index.parse().context("INDEX is a number")?;
    let input = runner::input(target, &target.corpus(), seed, index);
    println!(
        "{name}:{index} ({} bytes): {}",
        input.len(),
        kv_fuzz::hex(&input)
    );
    let verdict = kv_fuzz::assert_handles(name, &input);
    println!("{verdict:?}");
    Ok(())
}

fn line(r: &TargetReport) -> String {
    let rate = r.inputs as f64 / r.elapsed.as_secs_f64().max(1e-9);
    format!(
        "{:<19} {:>9} {:>9} {:>9} {:>6} {:>9} {:>10} ({:>7} B) {:>8.1} {:>8.1}s {:>8.0}/s",
        r.name,
        r.inputs,
        r.accepted,
        r.refused,
        r.failed,
        r.max_len,
        r.max_peak.0,
        r.max_peak.1,
        r.max_ratio,
        r.elapsed.as_secs_f64(),
        rate
    )
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.list {
        for target in ALL {
            println!("{:<19} {}", target.name, target.about);
        }
        return Ok(());
    }
    if let Some(spec) = &args.replay {
        return replay(spec, args.seed);
    }
    let targets = targets(&args.targets)?;
    let bound = Bound {
        per_byte: args.bound_per_byte,
        constant: args.bound_constant,
    };
    let per_target = args.inputs.div_ceil(targets.len() as u64);
    if per_target == 0 {
        bail!("--inputs must be at least 1");
    }
    if args.trace {
        let (seed, start) = (args.seed, args.start);
        let worker = std::thread::Builder::new()
            .stack_size(runner::WORKER_STACK_BYTES)
            .spawn(move || {
                for &target in &targets {
                    let corpus = target.corpus();
                    for index in start..start + per_target {
                        eprintln!("{}:{index}", target.name);
                        let input = runner::input(target, &corpus, seed, index);
                        let _ = kv_fuzz::assert_handles(target.name, &input);
                    }
                }
            })?;
        worker
            .join()
            .map_err(|_| anyhow::anyhow!("an input failed"))?;
        return Ok(());
    }
    println!(
        "seed {} start {} inputs {} ({} per target over {} targets), bound {} B/byte + {} B",
        args.seed,
        args.start,
        per_target * targets.len() as u64,
        per_target,
        targets.len(),
        bound.per_byte,
        bound.constant,
    );
    println!(
        "{:<19} {:>9} {:>9} {:>9} {:>6} {:>9} {:>10} {:>11} {:>8} {:>9} {:>10}",
        "target",
        "inputs",
        "accepted",
        "refused",
        "failed",
        "max len",
        "max peak",
        "(its len)",
        "peak/B",
        "elapsed",
        "rate"
    );
    let started = Instant::now();
    let plan = Plan {
        seed: args.seed,
        start: args.start,
        inputs: per_target,
        targets,
        bound,
    };
    let reports = runner::run(plan, 100_000, |report, done| {
        if done {
            println!("{}", line(report));
        } else {
            eprintln!("  … {}", line(report));
        }
        let _ = std::io::stdout().flush();
    })?;
    let elapsed = started.elapsed();
    let total: u64 = reports.iter().map(|r| r.inputs).sum();
    let failed: u64 = reports.iter().map(|r| r.failed).sum();
    println!(
        "total {total} inputs, {failed} failed, {:.1} s ({:.0} inputs/s)",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64().max(1e-9)
    );
    for failure in reports.iter().flat_map(|r| &r.failures) {
        println!(
            "\nFAILED {}:{} (seed {}): {}\ninput ({} bytes): {}\n{}",
            failure.target,
            failure.index,
            failure.seed,
            failure.problem,
            failure.input.len(),
            kv_fuzz::hex(&failure.input),
            failure.test_snippet()
        );
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
