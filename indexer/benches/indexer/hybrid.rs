//! `find_matches` on a fleet serving a hybrid-attention model against the same fleet
//! serving a dense one: what the grouped walk (`tree/groups.rs`) costs.
//!
//! The hybrid fleet publishes every store of the query benchmark's workload as vLLM's
//! hybrid KV cache manager does for a Gemma-3-like model: once in a full-attention
//! group, and in each of 3 sliding-window groups (window 4 blocks) only the last 4
//! blocks, below the full group's block before them (vLLM's sparse retention). Same
//! queries (128 blocks, the conversations' paths) on both.

use crate::query::{QUERIES, QUERY_BLOCKS};
use crate::{Scale, percentiles};
use bench_workload::build;
use indexer::{Indexer, IndexerApi, IndexerConfig, RadixTree};
use kv_events::{
    KvCacheEvent, KvCacheEventData, KvCacheGroup, KvEventBatch, LocalBlockHash, WorkerRank,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Blocks of each sliding-window group's window (vLLM: window 128 tokens, block 32).
const WINDOW: usize = 4;

/// `batches` as a hybrid model publishes them (see the module docs), with event ids
/// renumbered per rank.
fn hybrid(batches: &[KvEventBatch]) -> Vec<KvEventBatch> {
    let mut next: HashMap<WorkerRank, u64> = HashMap::new();
    batches
        .iter()
        .map(|batch| {
            let mut events = Vec::new();
            for event in &batch.events {
                let rank = WorkerRank::new(batch.worker_id, event.dp_rank);
                let mut push = |data: KvCacheEventData| {
                    let id = next.entry(rank).or_insert(0);
                    events.push(KvCacheEvent {
                        event_id: *id,
                        dp_rank: event.dp_rank,
                        data,
                    });
                    *id += 1;
                };
                let KvCacheEventData::Stored {
                    parent_hash,
                    blocks,
                    tier,
                    ..
                } = &event.data
                else {
                    push(event.data.clone());
                    continue;
                };
                push(KvCacheEventData::Stored {
                    parent_hash: *parent_hash,
                    blocks: blocks.clone(),
                    tier: *tier,
                    group: Some(KvCacheGroup::full(3)),
                });
                let cut = blocks.len().saturating_sub(WINDOW);
                let parent = cut.checked_sub(1).map(|i| blocks[i].block_hash);
                for g in 0..3 {
                    push(KvCacheEventData::Stored {
                        parent_hash: parent.or(*parent_hash),
                        blocks: blocks[cut..].to_vec(),
                        tier: *tier,
                        group: KvCacheGroup::windowed(g, WINDOW as u32),
                    });
                }
            }
            KvEventBatch { events, ..*batch }
        })
        .collect()
}

/// The bare tree's query latencies and mean score.
fn bare_tree(
    batches: &[KvEventBatch],
    queries: &[Arc<[LocalBlockHash]>],
) -> (Vec<Duration>, f64, f64, usize) {
    let mut tree = RadixTree::new();
    let start = Instant::now();
    let mut blocks = 0;
    for batch in batches {
        for event in &batch.events {
            blocks += event.data.block_count();
            let _ = tree.apply_event(batch.worker_id, event);
        }
    }
    let apply = blocks as f64 / start.elapsed().as_secs_f64();
    let mut samples = Vec::with_capacity(QUERIES);
    let mut best = 0u64;
    for q in queries.iter().cycle().take(QUERIES) {
        let start = Instant::now();
        let scores = std::hint::black_box(tree.find_matches(q));
        samples.push(start.elapsed());
        best += u64::from(scores.max());
    }
    (
        samples,
        apply,
        best as f64 / QUERIES as f64,
        tree.num_ranks(),
    )
}

/// The running front's idle query latencies.
fn front(batches: &[KvEventBatch], queries: &[Arc<[LocalBlockHash]>]) -> Vec<Duration> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let config = IndexerConfig {
            num_shards: cores,
            ..IndexerConfig::default()
        };
        let indexer = Indexer::spawn(config, CancellationToken::new()).expect("config");
        for batch in batches {
            indexer.apply(batch.clone()).await.expect("running");
        }
        let mut samples = Vec::with_capacity(QUERIES);
        for q in queries.iter().cycle().take(QUERIES) {
            let start = Instant::now();
            std::hint::black_box(indexer.find_matches(q.clone()).await.expect("running"));
            samples.push(start.elapsed());
        }
        indexer.shutdown();
        samples
    })
}

pub fn run(scale: Scale) {
    let w = build(crate::query::shape(scale), 2024);
    let queries = crate::query::queries(&w);
    println!(
        "\n## hybrid fleet vs dense ({QUERY_BLOCKS}-block queries, 256 workers, {} blocks stored, each also 1 in 4 per windowed group; µs)\n",
        w.blocks
    );
    println!(
        "| fleet | holders | bare-tree apply blocks/s | mean best overlap | bare p50 | bare p99 | front p50 | front p99 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let hybrid = hybrid(&w.batches);
    let fleets = [
        ("dense (1 group)", &w.batches),
        ("hybrid (3 windowed + 1 full)", &hybrid),
    ];
    for (name, batches) in fleets {
        let (bare, apply, mean, holders) = bare_tree(batches, &queries);
        let (b50, b99, _) = percentiles(bare);
        let (f50, f99, _) = percentiles(front(batches, &queries));
        println!(
            "| {name} | {holders} | {:.2}M | {mean:.1} | {b50:.1} | {b99:.1} | {f50:.1} | {f99:.1} |",
            apply / 1e6
        );
    }
}
