//! Routing throughput and latency of the real release daemon, for
//! `docs/benchmarks.md`: single route queries against batches, through real NATS.
//!
//! ```sh
//! cargo build --release -p router-daemon
//! cargo run --release -p integration-tests --example route_bench -- [OPTIONS]
//! ```
//!
//! It starts nats-server and etcd on free loopback ports, spawns
//! `target/release/kv-router serve` (override with `KV_ROUTER_BIN`) at its default
//! policy, registers `--workers` workers and indexes `--chains-per-worker` cached
//! prefixes of `--chain-blocks` blocks on each. Then, for each mode, frontend tasks
//! send prompts of `--prompt-blocks` block hashes (a random cached prefix plus new
//! blocks) for `--seconds`, and free each request as soon as it is routed, so the
//! booked load stays at about (tasks × requests per round trip):
//! - **single**: `--concurrency` tasks, one `RouteRequest` per round trip on
//!   `{ns}.router.route`;
//! - **batch, same load**: `--concurrency / --batch` tasks, `--batch` requests per
//!   `RouteBatchRequest` on `{ns}.router.route_batch` — as many requests in flight as
//!   the single mode;
//! - **batch, same tasks**: `--concurrency` tasks of batches — `--batch` times the
//!   requests in flight, which makes every decision scan more booked load.
//!
//! Printed per mode: routes/s, round trips/s, round-trip latency p50/p99 (a batch's
//! round trip covers all its routes) and the daemon's CPU time per route
//! (`/proc/PID/stat`). The load generator shares the machine's cores with the daemon
//! and NATS; compare the modes within one run.

use anyhow::Context;
use clap::Parser;
use integration_tests::child_daemon::{ChildDaemon, register_workers};
use kv_events::routing::{
    LifecycleEvent, LifecycleMessage, Prompt, RouteBatchReply, RouteBatchRequest, RouteReply,
    RouteRequest,
};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    Namespace, StoredBlock, Subjects, WorkerId, decode, encode,
};
use mocker::cluster::{EtcdServer, NatsServer};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK_SIZE: u32 = 16;
const NAMESPACE: &str = "bench";

/// Routing throughput and latency of the release daemon, single queries vs batches.
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
    /// Concurrent frontend tasks.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Requests per batch in the batch mode.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Duration of each mode, in seconds.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
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
/// `c % workers` and `(c + 1) % workers`, so prefixes have two holders.
async fn index_prefixes(
    nats: &async_nats::Client,
    subjects: &Subjects,
    args: &Args,
) -> anyhow::Result<u64> {
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
            let id = &mut next_event[w as usize];
            let batch = KvEventBatch::new(
                WorkerId(w),
                vec![KvCacheEvent {
                    event_id: *id,
                    dp_rank: DpRank(0),
                    data: KvCacheEventData::Stored {
                        parent_hash: None,
                        blocks,
                    },
                }],
            );
            *id += 1;
            nats.publish(subjects.kv_events(WorkerId(w)), encode(&batch)?.into())
                .await?;
        }
    }
    nats.flush().await?;
    Ok(chains * 2 * args.chain_blocks)
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Single,
    Batch,
}

/// One measured configuration: the mode and its number of frontend tasks.
#[derive(Debug, Clone, Copy)]
struct Run {
    mode: Mode,
    tasks: usize,
}

/// What one frontend task measured.
#[derive(Default)]
struct Tally {
    routes: u64,
    failed: u64,
    round_trips_us: Vec<u64>,
}

async fn frontend(
    nats: async_nats::Client,
    subjects: Arc<Subjects>,
    args: Arc<Args>,
    mode: Mode,
    task: usize,
    until: Instant,
) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    let chains = args.workers * args.chains_per_worker / 2;
    let mut n: u64 = 0;
    while Instant::now() < until {
        let count = match mode {
            Mode::Single => 1,
            Mode::Batch => args.batch,
        };
        let requests: Vec<RouteRequest> = (0..count)
            .map(|_| {
                n += 1;
                let id = format!("t{task}-{n}");
                let chain = (n * 7919 + task as u64 * 104_729) % chains.max(1);
                RouteRequest::new(id, prompt(&args, chain, n * 1_000 + task as u64))
            })
            .collect();
        let started = Instant::now();
        let replies = match mode {
            Mode::Single => {
                let reply = nats
                    .request(subjects.route(), encode(&requests[0])?.into())
                    .await?;
                vec![decode::<RouteReply>(&reply.payload)?]
            }
            Mode::Batch => {
                let batch = RouteBatchRequest {
                    requests: requests.clone(),
                    order: Default::default(),
                };
                let reply = nats
                    .request(subjects.route_batch(), encode(&batch)?.into())
                    .await?;
                match decode::<RouteBatchReply>(&reply.payload)? {
                    RouteBatchReply::Answered { replies } => replies,
                    RouteBatchReply::Error(e) => anyhow::bail!("batch refused: {e:?}"),
                }
            }
        };
        tally
            .round_trips_us
            .push(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
        for (request, reply) in requests.iter().zip(&replies) {
            match reply {
                RouteReply::Routed(_) => {
                    tally.routes += 1;
                    let freed = LifecycleMessage {
                        request_id: request.request_id.clone(),
                        event: LifecycleEvent::Freed,
                    };
                    nats.publish(subjects.lifecycle(), encode(&freed)?.into())
                        .await?;
                }
                RouteReply::Error(_) => tally.failed += 1,
            }
        }
    }
    Ok(tally)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1000.0
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    let nats_server = NatsServer::start().await?;
    let etcd_server = EtcdServer::start().await?;
    let daemon = ChildDaemon::start(
        &nats_server.url(),
        &etcd_server.endpoint(),
        NAMESPACE,
        BLOCK_SIZE,
        &[],
    )
    .await?;
    let subjects = Arc::new(Subjects::new(Namespace::new(NAMESPACE)?));
    let mut etcd = etcd_client::Client::connect([etcd_server.endpoint()], None).await?;
    register_workers(&mut etcd, &subjects, 0..args.workers, BLOCK_SIZE, 1_000_000).await?;
    daemon
        .wait_for_sum(&["kv_router_workers"], args.workers as f64)
        .await?;
    let nats = async_nats::connect(nats_server.url()).await?;
    let indexed = index_prefixes(&nats, &subjects, &args).await?;
    daemon
        .wait_for_sum(&["kv_router_indexer_blocks"], indexed as f64)
        .await
        .context("indexing the cached prefixes")?;

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "machine: {cores} cores; daemon: {} (default policy); {} workers, {indexed} indexed (worker, block) entries; prompts of {} blocks ({} cached); {} frontend tasks, {} s per mode",
        daemon.bin,
        args.workers,
        args.prompt_blocks,
        args.chain_blocks.min(args.prompt_blocks),
        args.concurrency,
        args.seconds
    );
    println!();
    println!(
        "| mode | tasks | in flight | routes | routes/s | round trips/s | round trip p50 | p99 | daemon CPU per route | failed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let runs = [
        Run {
            mode: Mode::Single,
            tasks: args.concurrency,
        },
        Run {
            mode: Mode::Batch,
            tasks: (args.concurrency / args.batch.max(1)).max(1),
        },
        Run {
            mode: Mode::Batch,
            tasks: args.concurrency,
        },
    ];
    for Run { mode, tasks } in runs {
        let cpu_before = daemon.cpu_seconds()?;
        let started = Instant::now();
        let until = started + Duration::from_secs(args.seconds);
        let handles: Vec<_> = (0..tasks)
            .map(|task| {
                tokio::spawn(frontend(
                    nats.clone(),
                    subjects.clone(),
                    args.clone(),
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
        let cpu = daemon.cpu_seconds()? - cpu_before;
        total.round_trips_us.sort_unstable();
        let (label, per_trip) = match mode {
            Mode::Single => ("single".to_owned(), 1),
            Mode::Batch => (format!("batch of {}", args.batch), args.batch),
        };
        println!(
            "| {label} | {tasks} | {} | {} | {:.0} | {:.0} | {:.2} ms | {:.2} ms | {:.1} µs | {} |",
            tasks * per_trip,
            total.routes,
            total.routes as f64 / elapsed,
            total.round_trips_us.len() as f64 / elapsed,
            percentile(&total.round_trips_us, 0.5),
            percentile(&total.round_trips_us, 0.99),
            cpu / total.routes.max(1) as f64 * 1e6,
            total.failed
        );
    }
    daemon.stop().await
}
