//! kv-router's indexer: the bare `RadixTree` and the daemon's default front, the
//! inline backend with 2 shards.

use crate::lib_api::{Front, Library, Scores, Timer, Took};
use bench_workload::rss_bytes;
use indexer::{Indexer, IndexerApi, IndexerConfig, OverlapScores, RadixTree};
use kv_events::{KvEventBatch, LocalBlockHash};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Ours.
pub struct Ours;

impl Library for Ours {
    const NAME: &'static str = "kv-router";
    type Event = KvEventBatch;
    type Query = Arc<[LocalBlockHash]>;
    type Tree = RadixTree;
    type Answer = OverlapScores;
    type Front = Indexer;

    fn events(batches: &[KvEventBatch]) -> Vec<KvEventBatch> {
        batches.to_vec()
    }

    fn worker(event: &KvEventBatch) -> u64 {
        event.worker_id.0
    }

    fn query(hashes: &Arc<[LocalBlockHash]>) -> Self::Query {
        hashes.clone()
    }

    fn build(events: Vec<KvEventBatch>) -> (RadixTree, Took) {
        let mut tree = RadixTree::new();
        let timer = Timer::start();
        // Each batch is dropped once applied, as a front drops what it received and
        // as Dynamo's `apply_event` drops the event it takes by value: the tree's
        // allocations may reuse the freed events' memory on both sides.
        for batch in events {
            apply_batch(&mut tree, &batch);
        }
        (tree, timer.stop())
    }

    fn find(tree: &RadixTree, query: &Self::Query) -> OverlapScores {
        tree.find_matches(query)
    }

    fn scores(answer: OverlapScores) -> Scores {
        answer
            .sorted()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(rank, n)| (rank.worker_id, n))
            .collect()
    }

    fn front() -> Indexer {
        let config = IndexerConfig {
            num_shards: 2,
            ..IndexerConfig::default()
        };
        Indexer::spawn(config, CancellationToken::new()).expect("the config is valid")
    }

    fn bare_rss(events: Vec<KvEventBatch>) -> u64 {
        let before = rss_bytes();
        let mut tree = RadixTree::new();
        apply_all(&mut tree, &events);
        let grown = rss_bytes().saturating_sub(before);
        std::hint::black_box(&tree);
        grown
    }
}

/// Applies every event of `batches`; refusals are counted by the caller's checks.
fn apply_all(tree: &mut RadixTree, batches: &[KvEventBatch]) {
    for batch in batches {
        apply_batch(tree, batch);
    }
}

/// Applies every event of `batch`.
fn apply_batch(tree: &mut RadixTree, batch: &KvEventBatch) {
    for event in &batch.events {
        let _ = tree.apply_event(batch.worker_id, event);
    }
}

impl Front for Indexer {
    type Event = KvEventBatch;
    type Query = Arc<[LocalBlockHash]>;
    type Answer = OverlapScores;

    async fn apply(&self, event: KvEventBatch) {
        IndexerApi::apply(self, event).await.expect("running");
    }

    async fn settle(&self) {
        // The inline front applies before `apply` returns; `stats` reads every shard.
        self.stats().await.expect("running");
    }

    async fn find(&self, query: &Self::Query) -> OverlapScores {
        self.find_matches(query.clone()).await.expect("running")
    }

    fn stop(self) {
        self.shutdown();
    }
}
