//! Side-by-side bench: kv-router's indexer against NVIDIA Dynamo's
//! (`dynamo-kv-router` 1.6.1), on the same events and queries (issue 15, part 1).
//!
//! ```sh
//! cargo bench -p peer-dynamo --bench peer -- --quick            # smoke run, 10x smaller
//! cargo bench -p peer-dynamo --bench peer                       # 64/256 workers x 1M/10M
//! cargo bench -p peer-dynamo --bench peer -- --salted           # per-worker salted engine hashes
//! cargo bench -p peer-dynamo --bench peer -- --workers 64,256,1024,4096 --entries 1000000
//! cargo bench -p peer-dynamo --bench peer -- --trace PATH       # full Mooncake trace instead of the excerpt
//! cargo bench -p peer-dynamo --bench peer -- --flood short      # short floods only (short|long|both)
//! cargo bench -p peer-dynamo --bench peer -- --pace open         # flooded queries open-loop at 10k/s
//! cargo bench -p peer-dynamo --bench peer -- --bare-only        # bare-tree rows only (apply, query, bytes)
//! ```
//!
//! Every case is measured in `--rounds` rounds (5 by default), the libraries
//! alternated within each round (ours, Dynamo's, ours, ...); each cell gives the
//! median, minimum and maximum over rounds of the per-round ratio ours / Dynamo's, so a
//! 1.3× can be told from noise, and the median figures. The front's query p99 is
//! measured idle and under each flood of [`flood`] (16- and 4096-block batches, short
//! and/or long). The bare-tree rows also compare with Dynamo's single-threaded
//! `RadixTree`. Bytes per entry are measured once per library and front in a
//! fresh child process. Every query answer (bare tree, idle front, flooded front) is
//! checked against [`bench_workload::Reference`], and wrong answers are counted and
//! shown. The output is a Markdown table of ratios, ours / Dynamo's, for
//! `docs/benchmarks.md`.
//!
//! Cases: the synthetic workload of `bench_workload::synthetic` (16 shared 32-block
//! system prompts — fewer where they would exceed a quarter of a worker's entries — conversations of six chained 16-block `Stored` events below one of
//! them, 128-block queries = 32 shared + 96 private blocks), and a realistic one
//! ([`trace`]): the Mooncake conversation trace replayed through the mocker's lab with
//! the scheduler's `kv` policy, whose KV events and prompts both libraries get.

mod dynamo;
mod flood;
mod lib_api;
mod ours;
mod run;
mod table;
mod trace;

use bench_workload::{EngineHashes, WorkloadShape, build, rss_bytes};
use dynamo::{Dynamo, DynamoSingle};
use flood::{Lengths, Pace};
use lib_api::{Front, Library};
use ours::Ours;
use run::{Case, Figures, Wrong, bare, expected, round};
use std::path::PathBuf;
use std::sync::Arc;

/// Command-line options.
#[derive(Debug, Clone)]
struct Options {
    /// 10 for `--quick`: entries and queries divided by it.
    scale: u64,
    workers: Vec<u64>,
    entries: Vec<u64>,
    hashes: EngineHashes,
    rounds: usize,
    /// The floods the front is measured under (`--flood`).
    lengths: Lengths,
    /// How queries are asked under a flood (`--pace`).
    pace: Pace,
    trace: Option<PathBuf>,
    no_trace: bool,
    /// Memory children: the case is the trace.
    trace_case: bool,
    /// Only the bare-tree figures (apply, query p50, bytes per entry): no front.
    bare_only: bool,
}

fn list(s: &str) -> Vec<u64> {
    s.split(',')
        .map(|n| n.trim().parse().expect("a number"))
        .collect()
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        scale: 1,
        workers: vec![64, 256],
        entries: vec![1_000_000, 10_000_000],
        hashes: EngineHashes::Chained,
        rounds: 5,
        lengths: Lengths::Both,
        pace: Pace::Closed,
        trace: None,
        no_trace: false,
        trace_case: false,
        bare_only: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().expect("a value after the flag").clone();
        match a.as_str() {
            "--quick" => o.scale = 10,
            "--salted" => o.hashes = EngineHashes::Salted,
            "--workers" => o.workers = list(&value()),
            "--entries" => o.entries = list(&value()),
            "--rounds" => o.rounds = value().parse().expect("a number"),
            "--flood" => o.lengths = Lengths::parse(&value()),
            "--pace" => o.pace = Pace::parse(&value()),
            "--trace" => o.trace = Some(PathBuf::from(value())),
            "--no-trace" => o.no_trace = true,
            "--trace-case" => o.trace_case = true,
            "--bare-only" => o.bare_only = true,
            // `cargo bench` passes `--bench`; other unknown flags are ignored too.
            _ => {}
        }
    }
    o
}

/// The queries of the synthetic workload: 128-block conversation paths.
const QUERY_BLOCKS: usize = 128;

/// The synthetic case: `workers` workers, `entries / scale` entries.
fn synthetic(workers: u64, entries: u64, hashes: EngineHashes, scale: u64) -> Case {
    // Shared prefixes take at most a quarter of a worker's entries (fewer than 16
    // only in the smallest quick cases).
    let per_worker = entries / scale / workers;
    let shape = WorkloadShape {
        workers,
        entries: entries / scale,
        prefixes: (per_worker / (4 * 32)).clamp(1, 16),
        prefix_len: 32,
        event_blocks: 16,
        conversation_events: 6, // 32 + 6 x 16 = 128-block conversations
        hashes,
    };
    let w = build(shape, workers ^ entries);
    let queries: Vec<Arc<[_]>> = w
        .paths
        .iter()
        .filter(|(_, p)| p.len() >= QUERY_BLOCKS)
        .map(|(_, p)| Arc::from(&p[..QUERY_BLOCKS]))
        .take(10_000 / scale as usize)
        .collect();
    let answers = expected(&w.batches, &queries);
    Case {
        name: format!("{workers} × {}", short(entries / scale)),
        batches: w.batches,
        blocks: w.blocks,
        queries: queries.into_iter().zip(answers).collect(),
    }
}

fn short(n: u64) -> String {
    if n >= 1_000_000 {
        format!("{}M", n as f64 / 1e6)
    } else {
        format!("{}k", n as f64 / 1e3)
    }
}

/// Bytes per entry of library `lib` (`ours`/`dynamo`), `front` or bare, on the case
/// named by `spec`; run in a fresh child process (the fronts are skipped, NaN, when
/// `bare_only`).
fn memory(spec: &[String], blocks: u64, bare_only: bool) -> [f64; 5] {
    let exe = std::env::current_exe().expect("own path");
    let mut out = [0.0; 5];
    for (i, (lib, kind)) in [
        ("ours", "bare"),
        ("dynamo", "bare"),
        ("ours", "front"),
        ("dynamo", "front"),
        ("dynamo-single", "bare"),
    ]
    .into_iter()
    .enumerate()
    {
        if bare_only && kind == "front" {
            out[i] = f64::NAN;
            continue;
        }
        let child = std::process::Command::new(&exe)
            .args(["--memory-one", lib, kind])
            .args(spec)
            .output()
            .expect("the child runs");
        let bytes: f64 = String::from_utf8_lossy(&child.stdout)
            .trim()
            .parse()
            .unwrap_or(f64::NAN);
        out[i] = bytes / blocks as f64;
    }
    out
}

/// The child side of [`memory`]: prints the resident-set growth in bytes.
fn memory_one(lib: &str, kind: &str, o: &Options) {
    let case = case_of(o);
    let bytes = match (lib, kind) {
        ("ours", "bare") => Ours::bare_rss(Ours::events(&case.batches)),
        ("dynamo", "bare") => Dynamo::bare_rss(Dynamo::events(&case.batches)),
        ("dynamo-single", _) => DynamoSingle::bare_rss(DynamoSingle::events(&case.batches)),
        ("ours", "front") => front_rss::<Ours>(&case),
        _ => front_rss::<Dynamo>(&case),
    };
    println!("{bytes}");
}

fn front_rss<L: Library>(case: &Case) -> u64 {
    let events = L::events(&case.batches);
    let rt = runtime();
    let before = rss_bytes();
    let front = rt.block_on(async {
        let front = L::front();
        for (i, e) in events.into_iter().enumerate() {
            front.apply(e).await;
            if i % 1024 == 1023 {
                front.settle().await; // keep queues short: they are not index memory
            }
        }
        front.settle().await;
        front
    });
    let grown = rss_bytes().saturating_sub(before);
    front.stop();
    grown
}

/// The one case `o` names (memory children: exactly one worker count and size).
fn case_of(o: &Options) -> Case {
    if o.trace_case {
        trace::case(o.trace.as_deref(), o.workers[0])
    } else {
        synthetic(o.workers[0], o.entries[0], o.hashes, o.scale)
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// One column of the table: every round's figures of each library.
pub struct Column {
    name: String,
    ours: Vec<Figures>,
    dynamo: Vec<Figures>,
    /// Dynamo's single-threaded `RadixTree`: bare-tree figures only.
    single: Vec<Figures>,
    /// Bytes per entry: ours bare, Dynamo's bare, ours front, Dynamo's front, Dynamo's
    /// `RadixTree` bare.
    memory: [f64; 5],
    wrong: [Wrong; 3],
}

fn measure(case: Case, spec: Vec<String>, o: &Options) -> Column {
    eprintln!(
        "{}: {} entries, {} queries",
        case.name,
        case.blocks,
        case.queries.len()
    );
    let rt = runtime();
    let floods = o.lengths.floods(o.pace);
    let (mut ours, mut dynamo, mut single) = (Vec::new(), Vec::new(), Vec::new());
    let mut wrong = [Wrong::default(), Wrong::default(), Wrong::default()];
    for r in 0..o.rounds {
        if o.bare_only {
            ours.push(bare::<Ours>(&case, &mut wrong[0]));
            dynamo.push(bare::<Dynamo>(&case, &mut wrong[1]));
        } else {
            ours.push(round::<Ours>(&case, &floods, &rt, &mut wrong[0]));
            dynamo.push(round::<Dynamo>(&case, &floods, &rt, &mut wrong[1]));
        }
        single.push(bare::<DynamoSingle>(&case, &mut wrong[2]));
        eprintln!("  round {} done", r + 1);
    }
    let memory = memory(&spec, case.blocks, o.bare_only);
    Column {
        name: case.name,
        ours,
        dynamo,
        single,
        memory,
        wrong,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = options(&args);
    if let [flag, lib, kind, ..] = args.as_slice()
        && flag == "--memory-one"
    {
        memory_one(lib, kind, &o);
        return;
    }
    let salted = if o.hashes == EngineHashes::Salted {
        " --salted"
    } else {
        ""
    };
    let mut columns = Vec::new();
    for &entries in &o.entries {
        for &workers in &o.workers {
            let case = synthetic(workers, entries, o.hashes, o.scale);
            let mut spec = vec![
                "--workers".into(),
                workers.to_string(),
                "--entries".into(),
                entries.to_string(),
            ];
            if o.scale > 1 {
                spec.push("--quick".into());
            }
            if o.hashes == EngineHashes::Salted {
                spec.push("--salted".into());
            }
            columns.push(measure(case, spec, &o));
        }
    }
    if !o.no_trace {
        let workers = trace::WORKERS;
        let mut spec = vec![
            "--trace-case".into(),
            "--workers".into(),
            workers.to_string(),
        ];
        if let Some(p) = &o.trace {
            spec.extend(["--trace".into(), p.display().to_string()]);
        }
        columns.push(measure(trace::case(o.trace.as_deref(), workers), spec, &o));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "\n## Indexer side by side ({cores} cores, engine hashes {}{salted}; ratio ours / Dynamo's per round: median (min–max) of {} rounds)\n",
        if salted.is_empty() {
            "chained"
        } else {
            "salted per worker"
        },
        o.rounds
    );
    let floods = if o.bare_only {
        Vec::new()
    } else {
        o.lengths.floods(o.pace)
    };
    table::print(&columns, &floods, o.bare_only);
}
