//! Restart time and NATS load of the two recovery paths at 1M indexed blocks, with
//! real nats-server and etcd: publisher dumps (the default) against a JetStream
//! snapshot. Ignored by default (it loads a million blocks); run with
//!
//! ```sh
//! cargo test --release -p integration-tests --test recovery_bench -- --ignored --nocapture
//! ```
//!
//! and see `docs/benchmarks.md` for the figures. `KV_BENCH_BLOCKS` overrides the
//! number of blocks (default 1,000,000).

mod journal_worker;

use indexer::IndexerApi as _;
use integration_tests::{TestCluster, eventually};
use journal_worker::JournalWorker;
use kv_events::{DpRank, ExternalBlockHash, KvCacheEventData, LocalBlockHash, StoredBlock};
use std::time::{Duration, Instant};

const BLOCK: u32 = 4;
const WORKERS: u64 = 64;
const EVENT_BLOCKS: u64 = 16;

/// Event `i` of worker `w`: 16 new blocks continuing the worker's previous event
/// (a new conversation from the root every 8 events).
fn event(w: u64, i: u64) -> KvCacheEventData {
    let ext = |n: u64| ExternalBlockHash(w << 40 | n);
    let parent = (!i.is_multiple_of(8)).then(|| ext(i * EVENT_BLOCKS - 1));
    let blocks = (0..EVENT_BLOCKS)
        .map(|b| {
            let n = i * EVENT_BLOCKS + b;
            StoredBlock {
                block_hash: ext(n),
                tokens_hash: LocalBlockHash((w << 40 | n).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            }
        })
        .collect();
    KvCacheEventData::Stored {
        group: None,
        parent_hash: parent,
        blocks,
        tier: kv_events::StorageTier::Gpu,
    }
}

async fn load(workers: &[JournalWorker], blocks: u64) -> anyhow::Result<()> {
    let events = blocks / WORKERS / EVENT_BLOCKS;
    for i in 0..events {
        for w in workers {
            w.record_and_send(DpRank(0), event(w.id().0, i)).await?;
        }
    }
    for w in workers {
        w.flush().await?;
    }
    Ok(())
}

#[tokio::test]
#[ignore = "loads 1M blocks; run on demand for docs/benchmarks.md"]
async fn restart_time_and_nats_load_at_1m_blocks() -> anyhow::Result<()> {
    let blocks: u64 = std::env::var("KV_BENCH_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut workers = Vec::new();
    for id in 0..WORKERS {
        workers.push(JournalWorker::start_bulk(&mut cluster, id).await?);
    }
    let wait = Duration::from_secs(600);
    let jetstream = |args: &mut router_daemon::ServeArgs| {
        args.index.jetstream = true;
        args.index.jetstream_snapshot_every = 10_000;
    };
    // A JetStream daemon follows the whole load (and snapshots at shutdown).
    let first = cluster.start_daemon(jetstream).await?;
    let started = Instant::now();
    load(&workers, blocks).await?;
    let expected = (blocks / WORKERS / EVENT_BLOCKS * WORKERS * EVENT_BLOCKS) as usize;
    eventually("the load to be indexed", wait, || async {
        let stats = first.state().indexer.stats().await.ok()?;
        (stats.entries == expected).then_some(())
    })
    .await?;
    let load_secs = started.elapsed().as_secs_f64();
    let stream = async_nats::jetstream::new(cluster.nats.clone())
        .get_stream(format!("{}-kv-events", cluster.subjects.namespace()))
        .await?
        .info()
        .await?
        .state
        .clone();
    let started = Instant::now();
    first.shutdown().await?;
    let shutdown_secs = started.elapsed().as_secs_f64();

    // Restart from publisher dumps.
    let registry = prometheus::Registry::new();
    let config = router_daemon::DaemonConfig::from_args(&cluster.serve_args())?;
    let started = Instant::now();
    let from_dumps = router_daemon::Daemon::start(config, &registry).await?;
    let dumps_secs = started.elapsed().as_secs_f64();
    let dumps_entries = from_dumps.state().indexer.stats().await?.entries;
    let dump_bytes: u64 = workers.iter().map(JournalWorker::bytes_served).sum();
    from_dumps.shutdown().await?;

    // Restart from the JetStream snapshot.
    let registry = prometheus::Registry::new();
    let mut args = cluster.serve_args();
    jetstream(&mut args);
    let config = router_daemon::DaemonConfig::from_args(&args)?;
    let started = Instant::now();
    let from_snapshot = router_daemon::Daemon::start(config, &registry).await?;
    let snapshot_secs = started.elapsed().as_secs_f64();
    let snapshot_entries = from_snapshot.state().indexer.stats().await?.entries;
    let requests: u64 = workers.iter().map(JournalWorker::recovery_requests).sum();
    from_snapshot.shutdown().await?;
    let bucket = async_nats::jetstream::new(cluster.nats.clone())
        .get_object_store(format!("{}-kv-index", cluster.subjects.namespace()))
        .await?;
    let snapshot_bytes = bucket.info("index-kv-router").await?.size;

    assert_eq!(dumps_entries, expected);
    assert_eq!(snapshot_entries, expected);
    println!("\n| {blocks} blocks, {WORKERS} workers | value |");
    println!("|---|---:|");
    println!("| load: published and indexed (JetStream intake) | {load_secs:.1} s |");
    println!(
        "| stream: messages / bytes stored | {} / {} |",
        stream.messages, stream.bytes
    );
    println!("| shutdown with final snapshot | {shutdown_secs:.2} s |");
    println!("| restart from publisher dumps: ready after | {dumps_secs:.2} s |");
    println!("| restart from publisher dumps: reply bytes over NATS | {dump_bytes} |");
    println!("| restart from the JetStream snapshot: ready after | {snapshot_secs:.2} s |");
    println!("| restart from the JetStream snapshot: snapshot bytes | {snapshot_bytes} |");
    println!("| recovery requests (dumps at the first restart) | {requests} |");
    Ok(())
}
