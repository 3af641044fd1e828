//! Routing throughput, latency and daemon CPU of the real release daemon, for
//! `docs/benchmarks.md`: routes against a bare NATS echo, single route queries at
//! growing load, and batches, through real NATS.
//!
//! ```sh
//! cargo build --release -p kv-router
//! cargo run --release -p integration-tests --example route_bench -- [OPTIONS]
//! ```
//!
//! It starts nats-server and etcd on free loopback ports, spawns
//! `target/release/kv-router serve` (override with `KV_ROUTER_BIN`) at its default
//! policy and an echo responder (this binary, [`echo`]), registers `--workers`
//! workers and indexes `--chains-per-worker` cached prefixes of `--chain-blocks`
//! blocks on each. Frontend tasks send prompts of `--prompt-blocks` block hashes (a
//! random cached prefix plus new blocks) for `--seconds` per measurement, and free
//! each request as soon as it is routed, so the booked load stays at about (tasks ×
//! requests per round trip); their `freed`s go through one publisher task that
//! batches them as the gateway does (`--lifecycle`, [`freed`]). Sections (`--sections`):
//! - **echo**: `--concurrency` tasks send the encoded `RouteRequest` to the echo
//!   responder, then as `RouteRequest`s to the daemon, alternating `--rounds`
//!   times; idle, then while the daemon ingests `--ingest-blocks-per-s` blocks of
//!   KV events per second ([`ingest`]). Printed: the route round trip p50/p99 as a
//!   ratio of the echo's.
//! - **curve**: single `RouteRequest`s at each of `--curve` tasks in flight.
//! - **batch**: `--batch` requests per `RouteBatchRequest` on
//!   `{ns}.router.route_batch`, with `--concurrency / --batch` tasks (as many
//!   requests in flight as the single mode) and with `--concurrency` tasks.
//!
//! Printed per measurement: round trips/s, round-trip latency p50/p99 (a batch's
//! round trip covers all its routes) and the CPU time per round trip or route of
//! the process answering (`/proc/PID/stat`). The load generator shares the
//! machine's cores with the daemon and NATS; compare within one run.
//!
//! With `--replicas N` the daemon runs as N replicas in the route queue group, each
//! indexing every event and applying its peers' bookings; the daemon CPU per route
//! is then summed over the replicas (what the fleet pays for one route).

mod echo;
mod freed;
mod frontend;

use frontend::{Mode, Tally, frontend};
mod ingest;
mod load;
mod warm;

use anyhow::Context;
use bench_workload::{latencies, quantile_ms};
use clap::{Parser, ValueEnum};
use integration_tests::child_daemon::{ChildDaemon, register_workers};
use kv_events::routing::{LifecycleMessage, Prompt};
use kv_events::{
    ExternalBlockHash, KvCacheEventData, LocalBlockHash, Namespace, StoredBlock, Subjects, WorkerId,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use testbed::{EtcdServer, NatsServer};
use tokio::sync::mpsc;

const BLOCK_SIZE: u32 = 16;
const NAMESPACE: &str = "bench";
/// KV blocks each registered worker declares.
const TOTAL_KV_BLOCKS: u64 = 1_000_000;

/// A part of the bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Section {
    /// Route round trips as a ratio of a bare NATS echo, idle and under ingest.
    Echo,
    /// Single routes at each `--curve` number of tasks.
    Curve,
    /// Batches of `--batch` requests.
    Batch,
}

/// Routing throughput and latency of the release daemon against a bare NATS echo,
/// single queries at growing load, and batches.
#[derive(Parser, Debug, Clone)]
struct Args {
    /// Registered workers (dp_size 1 each).
    #[arg(long, default_value_t = 64)]
    workers: u64,
    /// Cached prefixes indexed on each worker.
    #[arg(long, default_value_t = 64)]
    chains_per_worker: u64,
    /// Blocks per cached prefix.
    #[arg(long, default_value_t = 32)]
    chain_blocks: u64,
    /// Blocks per routed prompt: a cached prefix, then new blocks.
    #[arg(long, default_value_t = 64)]
    prompt_blocks: u64,
    /// Concurrent frontend tasks in the echo and batch sections.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Requests per batch in the batch section.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Duration of each measurement, in seconds.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Echo / route alternations per condition in the echo section.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// KV event blocks per second the daemon ingests in the loaded echo comparison
    /// (`Stored` and `Removed` blocks both count).
    #[arg(long, default_value_t = 200_000)]
    ingest_blocks_per_s: u64,
    /// Tasks (single requests in flight) of the curve section.
    #[arg(long, value_delimiter = ',', default_values_t = [32, 64, 128, 256, 512])]
    curve: Vec<usize>,
    /// Sections to run, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Section::Echo, Section::Curve, Section::Batch])]
    sections: Vec<Section>,
    /// Warm the fleet up first: start the daemon with this many calibration warm-up
    /// samples and give every rank them ([`warm`]); 0 leaves the fleet cold.
    #[arg(long, default_value_t = 0)]
    warm_up_samples: u32,
    /// Every worker reports load each this many ms after the warm-up, and the
    /// daemon runs with busy thresholds ([`load`]); unset: no reports, no thresholds.
    #[arg(long)]
    report_load_ms: Option<u64>,
    /// How the frontend publishes its `freed`s: `batch` as the gateway does (every
    /// message queued at a wake-up of its publisher in one NATS message), `single`
    /// one NATS message each (for daemons before the batch form).
    #[arg(long, value_enum, default_value_t = freed::LifecycleForm::Batch)]
    lifecycle: freed::LifecycleForm,
    /// Router replicas in the route queue group (sync on); the daemon CPU per route
    /// is their sum.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Serve as the echo responder on this NATS URL (how the bench runs its
    /// baseline process).
    #[arg(long, hide = true)]
    echo_responder: Option<String>,
}

/// Local hash of block `i` of cached prefix `chain`.
fn block(chain: u64, i: u64) -> LocalBlockHash {
    LocalBlockHash(
        chain
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(i.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)),
    )
}

/// Indexes `chains_per_worker` prefixes on every worker; chain `c` lives on workers
/// `c % workers` and `(c + 1) % workers`, so prefixes have two holders. Returns the
/// (worker, block) entries indexed and each worker's next event id.
async fn index_prefixes(
    nats: &async_nats::Client,
    subjects: &Subjects,
    args: &Args,
) -> anyhow::Result<(u64, Vec<u64>)> {
    let chains = args.workers * args.chains_per_worker / 2;
    let mut next_event = vec![0u64; args.workers as usize];
    for c in 0..chains {
        for w in [c % args.workers, (c + 1) % args.workers] {
            let blocks = (0..args.chain_blocks)
                .map(|i| StoredBlock {
                    block_hash: ExternalBlockHash(block(c, i).0 ^ (w << 48)),
                    tokens_hash: block(c, i),
                })
                .collect();
            let data = KvCacheEventData::Stored {
                group: None,
                parent_hash: None,
                blocks,
                tier: kv_events::StorageTier::Gpu,
            };
            ingest::publish_event(nats, subjects, &mut next_event, WorkerId(w), data).await?;
        }
    }
    nats.flush().await?;
    Ok((chains * 2 * args.chain_blocks, next_event))
}

/// A prompt of `prompt_blocks` hashes: cached prefix `chain`, then fresh blocks.
fn prompt(args: &Args, chain: u64, fresh: u64) -> Prompt {
    let cached = args.chain_blocks.min(args.prompt_blocks);
    let mut hashes: Vec<LocalBlockHash> = (0..cached).map(|i| block(chain, i)).collect();
    hashes.extend((cached..args.prompt_blocks).map(|i| block(u64::MAX - fresh, i)));
    Prompt::Blocks {
        block_hashes: hashes,
        num_tokens: args.prompt_blocks * u64::from(BLOCK_SIZE),
    }
}

/// One measurement: its answers, round trips and the answering process's CPU.
struct Measured {
    routes: u64,
    failed: u64,
    round_trips_us: Vec<u64>,
    elapsed: f64,
    /// CPU seconds of the processes that answered (the daemon's replicas, or the
    /// echo responder).
    cpu: f64,
}

impl Measured {
    fn quantile_ms(&self, q: f64) -> f64 {
        let samples = self
            .round_trips_us
            .iter()
            .map(|&us| Duration::from_micros(us));
        quantile_ms(&latencies(samples), q)
    }
    fn p50(&self) -> f64 {
        self.quantile_ms(0.5)
    }
    fn p99(&self) -> f64 {
        self.quantile_ms(0.99)
    }
    fn per_s(&self) -> f64 {
        self.routes as f64 / self.elapsed
    }
    /// CPU per route (or per echo), in µs.
    fn cpu_us(&self) -> f64 {
        self.cpu / self.routes.max(1) as f64 * 1e6
    }
}

/// The running processes and connection the measurements use.
struct Bench {
    args: Arc<Args>,
    subjects: Arc<Subjects>,
    nats: async_nats::Client,
    /// The frontend's lifecycle publisher ([`freed`]).
    freer: mpsc::UnboundedSender<LifecycleMessage>,
    /// The daemon's replicas (one unless `--replicas`).
    daemons: Vec<ChildDaemon>,
    echo: echo::Responder,
    nats_url: String,
}

impl Bench {
    async fn measure(&self, mode: Mode, tasks: usize) -> anyhow::Result<Measured> {
        let cpu_seconds = || match mode {
            Mode::Echo => self.echo.cpu_seconds(),
            Mode::Single | Mode::Batch => self
                .daemons
                .iter()
                .map(ChildDaemon::cpu_seconds)
                .sum::<anyhow::Result<f64>>(),
        };
        let cpu_before = cpu_seconds()?;
        let started = Instant::now();
        let until = started + Duration::from_secs(self.args.seconds);
        let handles: Vec<_> = (0..tasks)
            .map(|task| {
                tokio::spawn(frontend(
                    self.nats.clone(),
                    self.freer.clone(),
                    self.subjects.clone(),
                    self.args.clone(),
                    mode,
                    task,
                    until,
                ))
            })
            .collect();
        let mut total = Tally::default();
        for handle in handles {
            let t = handle.await??;
            total.routes += t.routes;
            total.failed += t.failed;
            total.round_trips_us.extend(t.round_trips_us);
        }
        let elapsed = started.elapsed().as_secs_f64();
        let cpu = cpu_seconds()? - cpu_before;
        Ok(Measured {
            routes: total.routes,
            failed: total.failed,
            round_trips_us: total.round_trips_us,
            elapsed,
            cpu,
        })
    }
}

async fn curve_section(bench: &Bench) -> anyhow::Result<()> {
    println!("| in flight | routes/s | round trip p50 | p99 | daemon CPU per route | failed |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for &tasks in &bench.args.curve {
        let m = bench.measure(Mode::Single, tasks).await?;
        println!(
            "| {tasks} | {:.0} | {:.2} ms | {:.2} ms | {:.1} µs | {} |",
            m.per_s(),
            m.p50(),
            m.p99(),
            m.cpu_us(),
            m.failed
        );
    }
    Ok(())
}

async fn batch_section(bench: &Bench) -> anyhow::Result<()> {
    let batch = bench.args.batch.max(1);
    println!(
        "| mode | tasks | in flight | routes/s | round trips/s | round trip p50 | p99 | daemon CPU per route | failed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for tasks in [
        (bench.args.concurrency / batch).max(1),
        bench.args.concurrency,
    ] {
        let m = bench.measure(Mode::Batch, tasks).await?;
        println!(
            "| batch of {batch} | {tasks} | {} | {:.0} | {:.0} | {:.2} ms | {:.2} ms | {:.1} µs | {} |",
            tasks * batch,
            m.per_s(),
            m.round_trips_us.len() as f64 / m.elapsed,
            m.p50(),
            m.p99(),
            m.cpu_us(),
            m.failed
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Runtime::new()?;
    match args.echo_responder.clone() {
        Some(url) => runtime.block_on(echo::respond(&url)),
        None => runtime.block_on(run(args)),
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let args = Arc::new(args);
    let nats_server = NatsServer::start().await?;
    let etcd_server = EtcdServer::start().await?;
    let samples = args.warm_up_samples.to_string();
    let mut flags: Vec<String> = Vec::new();
    if args.warm_up_samples > 0 {
        flags.extend(["--calibration-warmup-samples".into(), samples]);
    }
    flags.extend(
        args.report_load_ms
            .map_or_else(Vec::new, load::daemon_flags),
    );
    let warm_flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut daemons = Vec::new();
    for _ in 0..args.replicas.max(1) {
        let daemon = ChildDaemon::start(
            &nats_server.url(),
            &etcd_server.endpoint(),
            NAMESPACE,
            BLOCK_SIZE,
            &warm_flags,
        )
        .await?;
        daemons.push(daemon);
    }
    let echo = echo::Responder::start(&nats_server.url()).await?;
    let subjects = Arc::new(Subjects::new(Namespace::new(NAMESPACE)?));
    let mut etcd = etcd_client::Client::connect([etcd_server.endpoint()], None).await?;
    register_workers(
        &mut etcd,
        &subjects,
        0..args.workers,
        BLOCK_SIZE,
        TOTAL_KV_BLOCKS,
    )
    .await?;
    for daemon in &daemons {
        daemon
            .wait_for_sum(&["kv_router_workers"], args.workers as f64)
            .await?;
    }
    let nats = async_nats::connect(nats_server.url()).await?;
    let (indexed, mut next_event) = index_prefixes(&nats, &subjects, &args).await?;
    for daemon in &daemons {
        daemon
            .wait_for_sum(&["kv_router_indexer_blocks"], indexed as f64)
            .await
            .context("indexing the cached prefixes")?;
        if daemons.len() > 1 {
            daemon
                .wait_for_sum(
                    &["kv_router_replica_peers_heard"],
                    (daemons.len() - 1) as f64,
                )
                .await
                .context("the replicas hearing each other")?;
        }
    }

    if args.warm_up_samples > 0 {
        let routed = warm::warm_up(&nats, &subjects, &args, args.warm_up_samples).await?;
        println!("warm-up: {routed} routes with a first token each");
    }
    let reporter = match args.report_load_ms {
        Some(ms) => {
            let task = load::start(&nats, &subjects, &args, ms, TOTAL_KV_BLOCKS).await?;
            println!("load reports: every worker every {ms} ms, busy thresholds set");
            Some(task)
        }
        None => None,
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pids: Vec<String> = daemons.iter().map(|d| d.pid().to_string()).collect();
    println!(
        "machine: {cores} cores; daemon: {} ({} replica(s), pid {}, default policy); {} workers, {indexed} indexed (worker, block) entries; prompts of {} blocks ({} cached); {} s per measurement",
        daemons[0].bin,
        daemons.len(),
        pids.join(", "),
        args.workers,
        args.prompt_blocks,
        args.chain_blocks.min(args.prompt_blocks),
        args.seconds
    );
    let sent = Arc::new(freed::Sent::default());
    let freer = freed::spawn(
        nats.clone(),
        subjects.lifecycle(),
        args.lifecycle,
        sent.clone(),
    );
    let bench = Bench {
        args: args.clone(),
        subjects,
        nats,
        freer,
        daemons,
        echo,
        nats_url: nats_server.url(),
    };
    for section in &args.sections {
        println!();
        match section {
            Section::Echo => echo::section(&bench, &mut next_event).await?,
            Section::Curve => curve_section(&bench).await?,
            Section::Batch => batch_section(&bench).await?,
        }
    }
    sent.report(args.lifecycle);
    if let Some(task) = reporter {
        task.abort();
    }
    let Bench { daemons, echo, .. } = bench;
    echo.stop().await?;
    for daemon in daemons {
        daemon.stop().await?;
    }
    Ok(())
}
