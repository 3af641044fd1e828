//! The indexer benchmarks of `docs/benchmarks.md`, as one bench binary (no harness):
//!
//! ```sh
//! cargo bench -p indexer --bench indexer -- all          # everything (~5 min on 2 cores)
//! cargo bench -p indexer --bench indexer -- apply        # stored blocks/s
//! cargo bench -p indexer --bench indexer -- query        # find_matches p50/p99, idle and flooded
//! cargo bench -p indexer --bench indexer -- hybrid       # the same queries on a hybrid-model fleet
//! cargo bench -p indexer --bench indexer -- memory       # bytes per entry at 10M entries
//! cargo bench -p indexer --bench indexer -- recovery     # rebuild 1M blocks from dumps / a snapshot
//! cargo bench -p indexer --bench indexer -- steps        # 4,096-block events whole and in parts
//! cargo bench -p indexer --bench indexer -- all --quick  # 10x smaller, for a smoke run
//! ```
//!
//! Workloads are generated deterministically (splitmix64), built before timing
//! starts, and shaped like prefix-caching traffic: every worker holds a few shared
//! "system prompt" prefixes and many private conversations continuing them. Wall-clock
//! figures come from `std::time::Instant`; latency percentiles from an HDR histogram of
//! every sample (3 significant digits). The machine's core count is printed with the results: compare ratios
//! within one run.

mod apply;
mod hybrid;
mod query;
mod recovery;
mod steps;

/// Scale factor: 1 for the documented sizes, 10 for `--quick`.
#[derive(Debug, Clone, Copy)]
pub struct Scale(pub u64);

impl Scale {
    /// `n` scaled down.
    pub fn of(self, n: u64) -> u64 {
        (n / self.0).max(1)
    }
}

pub use bench_workload::{percentiles, rss_bytes};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, workers, scale] = args.as_slice()
        && flag == "--memory-one"
    {
        let parse = |s: &str| s.parse::<u64>().expect("a number");
        apply::memory_one(parse(workers), Scale(parse(scale)));
        return;
    }
    let scale = if args.iter().any(|a| a == "--quick") {
        Scale(10)
    } else {
        Scale(1)
    };
    let what: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let run = |name: &str| what.is_empty() || what.contains(&"all") || what.contains(&name);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("# indexer benchmarks ({cores} cores, scale 1/{})", scale.0);
    if run("apply") {
        apply::run(scale);
    }
    if run("query") {
        query::run(scale);
    }
    if run("hybrid") {
        hybrid::run(scale);
    }
    if run("memory") {
        apply::memory(scale);
    }
    if run("recovery") {
        recovery::run(scale);
    }
    if run("steps") {
        steps::run(scale);
    }
}
