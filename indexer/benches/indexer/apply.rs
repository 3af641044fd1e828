//! Apply throughput (stored blocks per second) and bytes per entry.

use crate::{Scale, rss_bytes};
use bench_workload::{Workload, WorkloadShape, build};
use indexer::{Indexer, IndexerApi, IndexerConfig, OrderedIndex, RadixTree, ShardSettings};
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores())
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Blocks per second of one `OrderedIndex` (one shard, ordering included).
fn one_shard(w: &Workload) -> f64 {
    let mut index = OrderedIndex::new(ShardSettings::default(), Arc::default());
    let start = Instant::now();
    for batch in &w.batches {
        index.apply_batch(batch);
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(index.tree().num_entries() as u64, w.blocks);
    w.blocks as f64 / secs
}

/// Blocks per second of a bare `RadixTree` (no ordering checks).
fn raw_tree(w: &Workload) -> f64 {
    let mut tree = RadixTree::new();
    let start = Instant::now();
    for batch in &w.batches {
        for event in &batch.events {
            let _ = tree.apply_event(batch.worker_id, event);
        }
    }
    w.blocks as f64 / start.elapsed().as_secs_f64()
}

fn config() -> IndexerConfig {
    IndexerConfig {
        num_shards: cores(),
        ..IndexerConfig::default()
    }
}

/// Blocks per second of the running [`Indexer`] (one writer task per shard).
fn inline(rt: &tokio::runtime::Runtime, w: &Workload) -> f64 {
    let _guard = rt.enter();
    let indexer = Indexer::spawn(config(), CancellationToken::new()).expect("config");
    let mut parts = vec![Vec::new(); indexer.num_shards()];
    for batch in &w.batches {
        parts[indexer.shard_of(batch.worker_id)].push(batch.clone());
    }
    rt.block_on(async {
        let start = Instant::now();
        let writers: Vec<_> = parts
            .into_iter()
            .map(|part| {
                let indexer = indexer.clone();
                tokio::spawn(async move {
                    for batch in part {
                        indexer.apply(batch).await.expect("running");
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.await.expect("writer");
        }
        let secs = start.elapsed().as_secs_f64();
        let stats = indexer.stats().await.expect("running");
        assert_eq!(stats.entries as u64, w.blocks);
        indexer.shutdown();
        w.blocks as f64 / secs
    })
}

fn m(x: f64) -> String {
    format!("{:.2}M", x / 1e6)
}

pub fn run(scale: Scale) {
    let rt = runtime();
    let n = cores() as f64;
    println!("\n## apply throughput (stored blocks/s; 16-block Stored events)\n");
    println!(
        "| entries | workers | one shard (ordered) | bare tree | inline, all shards | per core |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for entries in [1_000_000u64, 10_000_000] {
        for workers in [64u64, 256, 1024] {
            let w = build(
                WorkloadShape::apply(workers, scale.of(entries)),
                workers ^ entries,
            );
            let one = one_shard(&w);
            let raw = raw_tree(&w);
            let il = inline(&rt, &w);
            println!(
                "| {} | {workers} | {} | {} | {} | {} |",
                w.blocks,
                m(one),
                m(raw),
                m(il),
                m(il / n)
            );
        }
    }
}

/// Bytes per (worker, block) entry at 10M entries, from the tree's own accounting
/// (capacity of every buffer) and from the resident set. Each size runs in a fresh
/// child process, so memory freed by earlier runs cannot hide the tree's growth.
pub fn memory(scale: Scale) {
    println!("\n## memory (bytes per (worker, block) entry)\n");
    println!("| entries | workers | nodes | accounted bytes/entry | RSS bytes/entry |");
    println!("|---:|---:|---:|---:|---:|");
    let exe = std::env::current_exe().expect("own path");
    for workers in [64u64, 256, 1024] {
        let out = std::process::Command::new(&exe)
            .args(["--memory-one", &workers.to_string(), &scale.0.to_string()])
            .output()
            .expect("child runs");
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
}

/// One row of [`memory`], in this (child) process.
pub fn memory_one(workers: u64, scale: Scale) {
    let w = build(
        WorkloadShape::apply(workers, scale.of(10_000_000)),
        7 + workers,
    );
    let before = rss_bytes();
    let mut tree = RadixTree::new();
    for batch in &w.batches {
        for event in &batch.events {
            let _ = tree.apply_event(batch.worker_id, event);
        }
    }
    let after = rss_bytes();
    let stats = tree.stats();
    println!(
        "| {} | {workers} | {} | {:.1} | {:.1} |",
        stats.entries,
        stats.nodes,
        stats.bytes_per_entry(),
        after.saturating_sub(before) as f64 / stats.entries as f64
    );
}
