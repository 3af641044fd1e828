//! `find_matches` latency: 128-block queries over 256 workers holding 10M entries,
//! idle and under a concurrent flood of 1M stored blocks per second.

use crate::{Scale, percentiles};
use bench_workload::{EngineHashes, Workload, WorkloadShape, build, flood_batches};
use indexer::{Indexer, IndexerApi, IndexerConfig, RadixTree};
use kv_events::{KvEventBatch, LocalBlockHash};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub(crate) const QUERIES: usize = 20_000;
pub(crate) const QUERY_BLOCKS: usize = 128;
/// Flood: one 16-block batch per 16 µs, sent in bursts every millisecond.
const FLOOD_BLOCKS_PER_SEC: u64 = 1_000_000;

/// The first [`QUERIES`] conversations of `w` long enough, cut to [`QUERY_BLOCKS`]
/// blocks: the queries of this bench and of the hybrid one.
pub(crate) fn queries(w: &Workload) -> Vec<Arc<[LocalBlockHash]>> {
    let queries: Vec<Arc<[LocalBlockHash]>> = w
        .paths
        .iter()
        .filter(|(_, p)| p.len() >= QUERY_BLOCKS)
        .map(|(_, p)| Arc::from(&p[..QUERY_BLOCKS]))
        .take(QUERIES)
        .collect();
    assert!(!queries.is_empty(), "no 128-block conversations");
    queries
}

/// The workload of the query benchmarks (also `hybrid.rs`).
pub(crate) fn shape(scale: Scale) -> WorkloadShape {
    WorkloadShape {
        workers: 256,
        entries: scale.of(10_000_000),
        prefixes: 64,
        prefix_len: 32,
        event_blocks: 16,
        conversation_events: 6, // 32 + 6 × 16 = 128-block conversations
        hashes: EngineHashes::Salted,
    }
}

fn row(name: &str, idle: Vec<Duration>, flooded: Option<(Vec<Duration>, f64)>) {
    let (p50, p99, max) = percentiles(idle);
    match flooded {
        Some((samples, rate)) => {
            let (f50, f99, fmax) = percentiles(samples);
            println!(
                "| {name} | {p50:.1} | {p99:.1} | {max:.0} | {f50:.1} | {f99:.1} | {fmax:.0} | {:.2} | {:.2}M |",
                f99 / p99,
                rate / 1e6
            );
        }
        None => println!("| {name} | {p50:.1} | {p99:.1} | {max:.0} | – | – | – | – | – |"),
    }
}

pub fn run(scale: Scale) {
    let w = build(shape(scale), 2024);
    let queries = queries(&w);
    println!(
        "\n## find_matches latency ({QUERY_BLOCKS}-block queries, 256 workers, {} entries; µs)\n",
        w.blocks
    );
    println!(
        "| design | idle p50 | idle p99 | idle max | flooded p50 | flooded p99 | flooded max | p99 ratio | flood blocks/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");

    // Baseline: the bare tree, one thread, no concurrency.
    let mut tree = RadixTree::new();
    for batch in &w.batches {
        for event in &batch.events {
            let _ = tree.apply_event(batch.worker_id, event);
        }
    }
    let mut idle = Vec::with_capacity(QUERIES);
    for q in queries.iter().cycle().take(QUERIES) {
        let start = Instant::now();
        std::hint::black_box(tree.find_matches(q));
        idle.push(start.elapsed());
    }
    row("bare tree (1 thread)", idle, None);
    drop(tree);

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let flood = flood_batches(2 * (FLOOD_BLOCKS_PER_SEC as usize / 16) * 4);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let (idle, flooded) = rt.block_on(measure(cores, &w.batches, &queries, flood));
    row(&format!("inline, {cores} shards"), idle, Some(flooded));
}

async fn measure(
    shards: usize,
    batches: &[KvEventBatch],
    queries: &[Arc<[LocalBlockHash]>],
    flood: Vec<KvEventBatch>,
) -> (Vec<Duration>, (Vec<Duration>, f64)) {
    let config = IndexerConfig {
        num_shards: shards,
        ..IndexerConfig::default()
    };
    let indexer = Indexer::spawn(config, CancellationToken::new()).expect("config");
    for batch in batches {
        indexer.apply(batch.clone()).await.expect("running");
    }
    indexer.stats().await.expect("running");
    let query_all = |indexer: Indexer| {
        let queries: Vec<Arc<[LocalBlockHash]>> = queries.to_vec();
        async move {
            let mut samples = Vec::with_capacity(QUERIES);
            for q in queries.iter().cycle().take(QUERIES) {
                let start = Instant::now();
                std::hint::black_box(indexer.find_matches(q.clone()).await.expect("running"));
                samples.push(start.elapsed());
            }
            samples
        }
    };
    let idle = query_all(indexer.clone()).await;

    // Flood from another task, paced at FLOOD_BLOCKS_PER_SEC in 1 ms bursts.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (indexer, stop, sent) = (indexer.clone(), stop.clone(), sent.clone());
        tokio::spawn(async move {
            let per_ms = (FLOOD_BLOCKS_PER_SEC / 1000 / 16) as usize;
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let started = Instant::now();
            let mut batches = flood.into_iter();
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                for _ in 0..per_ms {
                    let Some(batch) = batches.next() else {
                        return started.elapsed();
                    };
                    indexer.apply(batch).await.expect("running");
                    sent.fetch_add(16, Ordering::Relaxed);
                }
            }
            started.elapsed()
        })
    };
    let flooded = tokio::spawn(query_all(indexer.clone()))
        .await
        .expect("queries");
    stop.store(true, Ordering::Relaxed);
    let elapsed = flooder.await.expect("flooder");
    let rate = sent.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64();
    indexer.shutdown();
    (idle, (flooded, rate))
}
