//! The scheduler's share of a route, in process: what `kv-router serve` spends on one
//! decision and its booking (`Scheduler::schedule`) and on the request's `freed`
//! (`Scheduler::free`), without NATS, the index walk or the wire codec.
//!
//! ```sh
//! cargo bench -p scheduler --features clap --bench decision                # 64 and 4,096 ranks
//! cargo bench -p scheduler --features clap --bench decision -- --ranks 64 --rounds 9
//! ```
//!
//! Why it exists: `route_bench` measures the daemon's CPU per route through
//! nats-server on the same 2 cores, where a 5% change in the scheduler is inside
//! the run-to-run noise. Here the same traffic — the route bench's shape: prompts of
//! 64 blocks whose first 32 are a prefix cached on 2 of the workers, a fixed number
//! of requests in flight, each freed once it is the oldest — runs on one thread, so
//! two builds can be compared to a few percent.
//!
//! The scheduler is configured by its own flags (`scheduler::args`, the daemon's
//! defaults: `predicted-ttft` with calibration and the delay cap). Figures are
//! nanoseconds per routed request, the median of `--rounds` rounds, with the
//! spread.

use bench_workload::Rng;
use clap::Parser;
use indexer::OverlapScores;
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, LocalBlockHash, WorkerId, WorkerRank};
use scheduler::args::SchedulerArgs;
use scheduler::{ScheduleRequest, Scheduler};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

#[derive(Debug, Parser)]
struct Cli {
    /// Registered workers (dp_size 1 each), one measurement per value.
    #[arg(long, value_delimiter = ',', default_value = "64,4096")]
    ranks: Vec<u64>,
    /// Requests in flight: each route frees the oldest one beyond this many.
    #[arg(long, default_value_t = 32)]
    in_flight: usize,
    /// Blocks per prompt: a cached prefix, then new blocks.
    #[arg(long, default_value_t = 64)]
    prompt_blocks: u64,
    /// Blocks of the cached prefix.
    #[arg(long, default_value_t = 32)]
    cached_blocks: u32,
    /// Cached prefixes, each held by `--holders` workers.
    #[arg(long, default_value_t = 64)]
    prefixes: u64,
    /// Workers holding each cached prefix.
    #[arg(long, default_value_t = 2)]
    holders: u64,
    /// Routed requests per round.
    #[arg(long, default_value_t = 200_000)]
    routes: u64,
    /// Rounds; the figures are their median and spread.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Ignored (cargo bench passes it).
    #[arg(long, hide = true)]
    bench: bool,
    #[command(flatten)]
    scheduler: SchedulerArgs,
}

const BLOCK_SIZE: u32 = 16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let config = cli.scheduler.to_config()?;
    println!(
        "# scheduler decision bench: {} in flight, prompts of {} blocks ({} cached on {} workers), {} routes x {} rounds",
        cli.in_flight, cli.prompt_blocks, cli.cached_blocks, cli.holders, cli.routes, cli.rounds
    );
    println!("| ranks | schedule ns | free ns | per route ns (spread) |");
    println!("|---:|---:|---:|---:|");
    for &ranks in &cli.ranks {
        let mut rounds = Vec::with_capacity(cli.rounds);
        for round in 0..cli.rounds {
            let mut scheduler = Scheduler::new(config.clone(), Some(round as u64))?;
            for w in 0..ranks {
                scheduler.add_worker(registration(w))?;
            }
            rounds.push(run(&cli, &mut scheduler, ranks)?);
        }
        rounds.sort_by(|a, b| a.total().total_cmp(&b.total()));
        let median = rounds[rounds.len() / 2];
        let (low, high) = (rounds[0].total(), rounds[rounds.len() - 1].total());
        println!(
            "| {ranks} | {:.0} | {:.0} | **{:.0}** ({low:.0}–{high:.0}) |",
            median.schedule,
            median.free,
            median.total()
        );
    }
    Ok(())
}

/// Mean nanoseconds per routed request of one round.
#[derive(Debug, Clone, Copy)]
struct Round {
    schedule: f64,
    free: f64,
}

impl Round {
    fn total(&self) -> f64 {
        self.schedule + self.free
    }
}

fn registration(w: u64) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(w),
        dp_size: 1,
        block_size: BLOCK_SIZE,
        total_kv_blocks: 1_000_000,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    }
}

/// One round: `cli.in_flight` requests routed to warm up, then `cli.routes` timed
/// routes, each followed by the `freed` of the oldest request in flight.
fn run(
    cli: &Cli,
    scheduler: &mut Scheduler,
    ranks: u64,
) -> Result<Round, Box<dyn std::error::Error>> {
    let mut rng = Rng::new(ranks);
    let prefixes: Vec<Vec<LocalBlockHash>> = (0..cli.prefixes)
        .map(|_| rng.block_hashes(cli.cached_blocks.into()))
        .collect();
    let mut in_flight = VecDeque::with_capacity(cli.in_flight + 1);
    let (mut schedule, mut free) = (Duration::ZERO, Duration::ZERO);
    let warm_up = cli.in_flight as u64;
    for n in 0..warm_up + cli.routes {
        let family = rng.next_u64() % cli.prefixes;
        let mut hashes = prefixes[family as usize].clone();
        hashes.extend(rng.block_hashes(cli.prompt_blocks.saturating_sub(cli.cached_blocks.into())));
        let overlaps = OverlapScores::from_unique(
            (0..cli.holders)
                .map(|h| (rank((family * cli.holders + h) % ranks), cli.cached_blocks))
                .collect(),
        );
        let request = ScheduleRequest::new(
            format!("r{n}"),
            hashes,
            cli.prompt_blocks * u64::from(BLOCK_SIZE),
            BLOCK_SIZE,
        );
        let id = request.request_id.clone();
        let start = Instant::now();
        scheduler.schedule(&request, &overlaps, start)?;
        let routed = Instant::now();
        in_flight.push_back(id);
        if in_flight.len() > cli.in_flight
            && let Some(oldest) = in_flight.pop_front()
        {
            scheduler.free(&oldest, routed)?;
        }
        let freed = Instant::now();
        if n >= warm_up {
            schedule += routed - start;
            free += freed - routed;
        }
    }
    let per = |d: Duration| d.as_nanos() as f64 / cli.routes as f64;
    Ok(Round {
        schedule: per(schedule),
        free: per(free),
    })
}

fn rank(worker: u64) -> WorkerRank {
    WorkerRank::new(WorkerId(worker), DpRank(0))
}
