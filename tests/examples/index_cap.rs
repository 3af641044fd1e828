//! The index memory cap under a flood, for `docs/benchmarks.md` (issue 14, finding 6).
//!
//! ```sh
//! cargo build --release -p kv-router
//! cargo run --release -p integration-tests --example index_cap -- [OPTIONS]
//! ```
//!
//! It starts nats-server and etcd on free loopback ports and the release
//! `kv-router serve` (override with `KV_ROUTER_BIN`) with `--index-max-blocks CAP` and
//! one shard (so the flood and the real prompt compete for the same bound),
//! registers two workers, and then:
//! 1. worker 1 stores a real 64-block prompt, which is routed once (so the router has
//!    matched it);
//! 2. worker 2 floods the index with blocks nobody asks for — 64-block chains at
//!    `--rate` blocks/s for `--seconds` — while every `--sample-s` the tool reads the
//!    daemon's RSS (`/proc/PID/status`), the indexer's entry count, and the overlap
//!    the router reports for the real prompt (a route request, freed at once);
//! 3. the flood stops and one more sample is taken after `--sample-s`.
//!
//! The load generator shares the machine's cores with the daemon, nats-server and etcd.

use anyhow::Context;
use clap::Parser;
use integration_tests::child_daemon::{ChildDaemon, register_workers};
use kv_events::routing::{LifecycleEvent, LifecycleMessage, Prompt, RouteReply, RouteRequest};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    Namespace, StoredBlock, Subjects, WorkerId, compute_block_hashes, decode, encode,
};
use std::time::{Duration, Instant};
use testbed::{EtcdServer, NatsServer};

const BLOCK_SIZE: u32 = 16;
const CHAIN: u64 = 64;

/// Index memory cap under a flood of never-matched blocks.
#[derive(Parser, Debug)]
struct Args {
    /// `--index-max-blocks` of the daemon.
    #[arg(long, default_value_t = 200_000)]
    cap: usize,
    /// Flood rate, in blocks per second (64-block `Stored` events).
    #[arg(long, default_value_t = 100_000)]
    rate: u64,
    /// Flood duration, in seconds.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 5)]
    sample_s: u64,
}

fn batch(worker: u64, event_id: u64, data: KvCacheEventData) -> KvEventBatch {
    KvEventBatch::new(
        WorkerId(worker),
        vec![KvCacheEvent {
            event_id,
            dp_rank: DpRank(0),
            data,
        }],
    )
}

/// The overlap the router reports for `tokens` (the booking is freed at once).
async fn overlap(
    nats: &async_nats::Client,
    subjects: &Subjects,
    tokens: &[u32],
    n: u64,
) -> anyhow::Result<u32> {
    let id = format!("probe-{n}");
    let request = RouteRequest::new(
        id.as_str(),
        Prompt::Tokens {
            token_ids: tokens.to_vec(),
        },
    );
    let reply = nats
        .request(subjects.route(), encode(&request)?.into())
        .await?;
    let overlap = match decode::<RouteReply>(&reply.payload)? {
        RouteReply::Routed(d) if d.worker_id == WorkerId(1) => d.overlap_blocks,
        RouteReply::Routed(_) => 0, // worker 2 holds nothing of it
        RouteReply::Error(e) => anyhow::bail!("route failed: {e:?}"),
    };
    let freed = LifecycleMessage {
        request_id: id.into(),
        event: LifecycleEvent::Freed,
    };
    nats.publish(subjects.lifecycle(), encode(&freed)?.into())
        .await?;
    Ok(overlap)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let nats_server = NatsServer::start().await?;
    let etcd_server = EtcdServer::start().await?;
    let cap = args.cap.to_string();
    let daemon = ChildDaemon::start(
        &nats_server.url(),
        &etcd_server.endpoint(),
        "cap",
        BLOCK_SIZE,
        &[
            "--index-max-blocks",
            &cap,
            "--policy",
            "kv",
            "--shards",
            "1",
        ],
    )
    .await?;
    let subjects = Subjects::new(Namespace::new("cap")?);
    let mut etcd = etcd_client::Client::connect([etcd_server.endpoint()], None).await?;
    register_workers(&mut etcd, &subjects, 1..3, BLOCK_SIZE, 1 << 20).await?;
    daemon.wait_for_sum(&["kv_router_workers"], 2.0).await?;
    let nats = async_nats::connect(nats_server.url()).await?;

    // The real prompt: 64 blocks of worker 1, routed once.
    let tokens: Vec<u32> = (0..CHAIN as u32 * BLOCK_SIZE).collect();
    let hashes = compute_block_hashes(&tokens, BLOCK_SIZE);
    let blocks: Vec<StoredBlock> = hashes
        .iter()
        .map(|h| StoredBlock {
            block_hash: ExternalBlockHash(h.0),
            tokens_hash: *h,
        })
        .collect();
    let real = batch(
        1,
        0,
        KvCacheEventData::Stored {
            group: None,
            parent_hash: None,
            blocks,
            tier: kv_events::StorageTier::Gpu,
        },
    );
    nats.publish(subjects.kv_events(WorkerId(1)), encode(&real)?.into())
        .await?;
    daemon
        .wait_for_sum(&["kv_router_indexer_blocks"], CHAIN as f64)
        .await?;
    let mut probes = 0;
    let first = overlap(&nats, &subjects, &tokens, probes).await?;
    println!(
        "cap {} blocks, flood {} blocks/s for {} s, real prompt {} blocks (overlap {first})",
        args.cap, args.rate, args.seconds, CHAIN
    );
    println!(
        "{:>6} {:>10} {:>14} {:>14}",
        "t (s)", "RSS (MiB)", "index entries", "real overlap"
    );
    let row = |t: f64, entries: f64, overlap: u32, note: &str| -> anyhow::Result<()> {
        let rss = daemon.rss_bytes()? as f64 / f64::from(1u32 << 20);
        println!("{t:>6.0} {rss:>10.1} {entries:>14.0} {overlap:>14} {note}");
        Ok(())
    };

    let start = Instant::now();
    let mut next_sample = Duration::ZERO;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let chains_per_tick = (args.rate / CHAIN / 100).max(1);
    let mut event_id = 0u64;
    while start.elapsed() < Duration::from_secs(args.seconds) {
        tick.tick().await;
        for _ in 0..chains_per_tick {
            let base = event_id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let junk: Vec<StoredBlock> = (0..CHAIN)
                .map(|i| StoredBlock {
                    block_hash: ExternalBlockHash(base ^ i),
                    tokens_hash: LocalBlockHash(base.wrapping_add(i)),
                })
                .collect();
            let b = batch(
                2,
                event_id,
                KvCacheEventData::Stored {
                    group: None,
                    parent_hash: None,
                    blocks: junk,
                    tier: kv_events::StorageTier::Gpu,
                },
            );
            nats.publish(subjects.kv_events(WorkerId(2)), encode(&b)?.into())
                .await?;
            event_id += 1;
        }
        if start.elapsed() >= next_sample {
            next_sample += Duration::from_secs(args.sample_s);
            probes += 1;
            let o = overlap(&nats, &subjects, &tokens, probes).await?;
            let entries = daemon.metric("kv_router_indexer_blocks").await?;
            let held = daemon
                .metric("kv_router_indexer_rank_blocks{dp_rank=\"0\",worker_id=\"1\"}")
                .await
                .unwrap_or(-1.0);
            row(
                start.elapsed().as_secs_f64(),
                entries,
                o,
                &format!("worker 1 holds {held}"),
            )?;
        }
    }
    tokio::time::sleep(Duration::from_secs(args.sample_s)).await;
    probes += 1;
    let o = overlap(&nats, &subjects, &tokens, probes).await?;
    let entries = daemon.metric("kv_router_indexer_blocks").await?;
    row(start.elapsed().as_secs_f64(), entries, o, "(flood stopped)")?;
    println!(
        "flood: {} events, {} blocks published",
        event_id,
        event_id * CHAIN
    );
    daemon.stop().await.context("stopping the daemon")?;
    Ok(())
}
