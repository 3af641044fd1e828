//! Sizing measurements for `docs/operations.md`: memory per indexed block and CPU per
//! KV event, of the real release daemon under a synthetic event load.
//!
//! ```sh
//! cargo build --release -p kv-router
//! cargo run --release -p integration-tests --example sizing -- [ENTRIES] [RATES...]
//! ```
//!
//! It starts nats-server and etcd on free loopback ports, spawns
//! `target/release/kv-router serve` (override with `KV_ROUTER_BIN`), registers 16
//! workers, and then:
//! 1. **memory**: publishes `ENTRIES` (default 2,000,000) (worker rank, block) entries
//!    as 64-block chains, each chain held by two workers (so, when both land on the
//!    same shard, tree nodes are half the entries, as with shared prefixes), paced at
//!    200k blocks/s; once the daemon
//!    reports them all indexed, compares its resident set size (`/proc/PID/status`
//!    `VmRSS`) with the size before, and with the indexer's own estimate;
//! 2. **CPU**: for each rate in `RATES` (default 5000 20000 50000 events/s),
//!    publishes single-block store/remove event pairs for 5 s and reads the daemon's
//!    CPU time (`/proc/PID/stat` utime + stime) before and after.
//!
//! The load generator runs on the same machine and competes for its cores; the printed
//! table says how many cores the machine has.

use anyhow::Context;
use integration_tests::child_daemon::{ChildDaemon, register_workers};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    Namespace, StoredBlock, Subjects, WorkerId, encode,
};
use std::time::{Duration, Instant};
use testbed::{EtcdServer, NatsServer};

const WORKERS: u64 = 16;
const CHAIN: u64 = 64;
const BLOCK_SIZE: u32 = 16;

struct Publisher {
    nats: async_nats::Client,
    subjects: Subjects,
    next_event: Vec<u64>,
}

impl Publisher {
    async fn send(&mut self, worker: u64, data: KvCacheEventData) -> anyhow::Result<()> {
        let id = &mut self.next_event[worker as usize];
        let batch = KvEventBatch::new(
            WorkerId(worker),
            vec![KvCacheEvent {
                event_id: *id,
                dp_rank: DpRank(0),
                data,
            }],
        );
        *id += 1;
        self.nats
            .publish(
                self.subjects.kv_events(WorkerId(worker)),
                encode(&batch)?.into(),
            )
            .await?;
        Ok(())
    }
}

fn chain(chain: u64, worker: u64) -> Vec<StoredBlock> {
    (0..CHAIN)
        .map(|i| {
            let local = chain
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(i.wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
            StoredBlock {
                block_hash: ExternalBlockHash(local ^ (worker << 56)),
                tokens_hash: LocalBlockHash(local),
            }
        })
        .collect()
}

/// Releases items at a fixed rate, in 10 ms ticks.
struct Pacer {
    per_tick: u64,
    tick: tokio::time::Interval,
}

impl Pacer {
    fn new(per_second: u64) -> Self {
        Self {
            per_tick: (per_second / 100).max(1),
            tick: tokio::time::interval(Duration::from_millis(10)),
        }
    }

    /// Waits for the next tick; returns how many items may go now.
    async fn next(&mut self) -> u64 {
        self.tick.tick().await;
        self.per_tick
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()
        .context("arguments are numbers: ENTRIES [RATES...]")?;
    let entries = args.first().copied().unwrap_or(2_000_000);
    let rates = if args.len() > 1 {
        args[1..].to_vec()
    } else {
        vec![5_000, 20_000, 50_000]
    };

    let nats_server = NatsServer::start().await?;
    let etcd_server = EtcdServer::start().await?;
    let daemon = ChildDaemon::start(
        &nats_server.url(),
        &etcd_server.endpoint(),
        "sizing",
        BLOCK_SIZE,
        &[],
    )
    .await?;
    let bin = daemon.bin.clone();
    let subjects = Subjects::new(Namespace::new("sizing")?);
    let mut etcd = etcd_client::Client::connect([etcd_server.endpoint()], None).await?;
    register_workers(&mut etcd, &subjects, 0..WORKERS, BLOCK_SIZE, entries).await?;
    daemon
        .wait_for_sum(&["kv_router_workers"], WORKERS as f64)
        .await?;
    let nats = async_nats::connect(nats_server.url()).await?;
    let mut publisher = Publisher {
        nats,
        subjects,
        next_event: vec![0; WORKERS as usize],
    };

    // 1. Memory per indexed block.
    let rss_before = daemon.rss_bytes()?;
    let chains = entries / (2 * CHAIN);
    let mut pacer = Pacer::new(200_000 / CHAIN);
    let (mut sent, started) = (0, Instant::now());
    while sent < chains * 2 {
        for _ in 0..pacer.next().await.min(chains * 2 - sent) {
            // The second copy goes to a worker of the same shard parity, so with the
            // default shard count of a 2-core machine both copies share tree nodes.
            let (c, copy) = (sent / 2, sent % 2);
            let worker = (c + 2 * copy) % WORKERS;
            let blocks = chain(c, worker);
            publisher
                .send(
                    worker,
                    KvCacheEventData::Stored {
                        group: None,
                        parent_hash: None,
                        blocks,
                        tier: kv_events::StorageTier::Gpu,
                    },
                )
                .await?;
            sent += 1;
        }
    }
    let indexed = (chains * 2 * CHAIN) as f64;
    daemon
        .wait_for_sum(&["kv_router_indexer_blocks"], indexed)
        .await?;
    let load_time = started.elapsed();
    let rss_after = daemon.rss_bytes()?;
    let estimate = daemon.metric("kv_router_indexer_memory_bytes").await?;
    let nodes = daemon.metric("kv_router_indexer_nodes").await?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("machine: {cores} cores; daemon: {bin}, {WORKERS} workers, block size {BLOCK_SIZE}");
    println!();
    println!(
        "| indexed entries | tree nodes | RSS before | RSS after | RSS / entry | indexer estimate / entry | load time |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {indexed:.0} | {nodes:.0} | {:.0} MiB | {:.0} MiB | {:.0} B | {:.0} B | {:.1} s |",
        rss_before as f64 / 1048576.0,
        rss_after as f64 / 1048576.0,
        (rss_after.saturating_sub(rss_before)) as f64 / indexed,
        estimate / indexed,
        load_time.as_secs_f64()
    );

    // 2. CPU per event at steady rates: each event stores one new block on a fresh
    // chain, the next removes it, so the index size stays constant.
    println!();
    println!("| offered rate (events/s) | applied | daemon CPU (cores) | CPU per event |");
    println!("|---|---|---|---|");
    let window = Duration::from_secs(5);
    let mut chain_id = u64::MAX / 2;
    for rate in rates {
        let applied_before = daemon
            .metric("kv_router_indexer_events_total{outcome=\"applied\",type=\"stored\"}")
            .await
            .unwrap_or(0.0)
            + daemon
                .metric("kv_router_indexer_events_total{outcome=\"applied\",type=\"removed\"}")
                .await
                .unwrap_or(0.0);
        let cpu_before = daemon.cpu_seconds()?;
        let started = Instant::now();
        let total = rate * window.as_secs();
        let mut pacer = Pacer::new(rate);
        let mut sent = 0;
        while sent < total {
            for _ in 0..pacer.next().await.min(total - sent) {
                let worker = (sent / 2) % WORKERS;
                let block = chain(chain_id, worker)[0];
                let data = if sent % 2 == 0 {
                    KvCacheEventData::Stored {
                        group: None,
                        parent_hash: None,
                        blocks: vec![block],
                        tier: kv_events::StorageTier::Gpu,
                    }
                } else {
                    chain_id += 1;
                    KvCacheEventData::Removed {
                        group: None,
                        block_hashes: vec![block.block_hash],
                        tier: kv_events::StorageTier::Gpu,
                    }
                };
                publisher.send(worker, data).await?;
                sent += 1;
            }
        }
        publisher.nats.flush().await?;
        let target = applied_before + total as f64;
        daemon
            .wait_for_sum(
                &[
                    "kv_router_indexer_events_total{outcome=\"applied\",type=\"stored\"}",
                    "kv_router_indexer_events_total{outcome=\"applied\",type=\"removed\"}",
                ],
                target,
            )
            .await?;
        let elapsed = started.elapsed().as_secs_f64();
        let cpu = daemon.cpu_seconds()? - cpu_before;
        println!(
            "| {rate} | {total} in {elapsed:.1} s | {:.2} | {:.1} µs |",
            cpu / elapsed,
            cpu / total as f64 * 1e6
        );
    }
    daemon.stop().await?;
    Ok(())
}
