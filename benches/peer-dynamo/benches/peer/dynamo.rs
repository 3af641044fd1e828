//! NVIDIA Dynamo's indexer (`dynamo-kv-router` 1.6.1): the bare
//! `ConcurrentRadixTreeCompressed` and its production front,
//! `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with 2 threads; and, for the
//! bare-tree rows only, its single-threaded `RadixTree` ([`DynamoSingle`]), which
//! applies events by `&mut self` as ours does.
//!
//! Its tree applies events only through its worker loop (`SyncIndexer::worker`, the
//! loop each pool thread runs); the bare figures run that loop on the calling thread
//! over a channel filled before timing starts. Queries call the tree directly, as the
//! pool's `find_matches` does on the caller's thread.

use crate::lib_api::{Front, Library, Scores, Timer, Took};
use bench_workload::rss_bytes;
use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer, ThreadPoolIndexer, WorkerTask};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use kv_events::{KvEventBatch, WorkerId};
use std::sync::Arc;

/// Dynamo's.
pub struct Dynamo;

/// Block size given to the pool (used only for token-level queries, which the bench
/// does not make).
const BLOCK_SIZE: u32 = 16;

/// Converts one of our events into Dynamo's.
fn event(worker: WorkerId, e: &kv_events::KvCacheEvent) -> RouterEvent {
    let ext = |h: kv_events::ExternalBlockHash| ExternalSequenceBlockHash(h.0);
    let data = match &e.data {
        kv_events::KvCacheEventData::Stored {
            parent_hash,
            blocks,
            ..
        } => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent_hash.map(ext),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ext(b.block_hash),
                    tokens_hash: LocalBlockHash(b.tokens_hash.0),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        kv_events::KvCacheEventData::Removed { block_hashes, .. } => {
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: block_hashes.iter().copied().map(ext).collect(),
            })
        }
        kv_events::KvCacheEventData::Cleared => KvCacheEventData::Cleared,
    };
    RouterEvent::new(
        worker.0,
        KvCacheEvent {
            event_id: e.event_id,
            data,
            dp_rank: e.dp_rank.0,
        },
    )
}

/// The production front, shareable between tasks.
#[derive(Clone)]
pub struct Pool(Arc<ThreadPoolIndexer<ConcurrentRadixTreeCompressed>>);

impl Library for Dynamo {
    const NAME: &'static str = "Dynamo";
    type Event = RouterEvent;
    type Query = Vec<LocalBlockHash>;
    type Tree = ConcurrentRadixTreeCompressed;
    type Answer = OverlapScores;
    type Front = Pool;

    fn events(batches: &[KvEventBatch]) -> Vec<RouterEvent> {
        batches
            .iter()
            .flat_map(|b| b.events.iter().map(|e| event(b.worker_id, e)))
            .collect()
    }

    fn worker(event: &RouterEvent) -> u64 {
        event.worker_id
    }

    fn query(hashes: &Arc<[kv_events::LocalBlockHash]>) -> Self::Query {
        hashes.iter().map(|h| LocalBlockHash(h.0)).collect()
    }

    fn build(events: Vec<RouterEvent>) -> (ConcurrentRadixTreeCompressed, Took) {
        let tree = ConcurrentRadixTreeCompressed::new();
        let (tx, rx) = flume::unbounded();
        for e in events {
            tx.send(WorkerTask::Event(e))
                .expect("the receiver is alive");
        }
        drop(tx); // the loop ends once the channel is drained
        let timer = Timer::start();
        tree.worker(rx, None).expect("the worker loop ends cleanly");
        (tree, timer.stop())
    }

    fn find(tree: &ConcurrentRadixTreeCompressed, query: &Self::Query) -> OverlapScores {
        SyncIndexer::find_matches(tree, query, false)
    }

    fn scores(answer: OverlapScores) -> Scores {
        answer
            .scores
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(w, n)| (WorkerId(w.worker_id), n))
            .collect()
    }

    fn front() -> Pool {
        Pool(Arc::new(ThreadPoolIndexer::new(
            ConcurrentRadixTreeCompressed::new(),
            2,
            BLOCK_SIZE,
        )))
    }

    fn bare_rss(events: Vec<RouterEvent>) -> u64 {
        let before = rss_bytes();
        let tree = ConcurrentRadixTreeCompressed::new();
        // A small bounded queue, so queued events do not count as tree memory.
        let (tx, rx) = flume::bounded(256);
        std::thread::scope(|s| {
            let looper = s.spawn(|| tree.worker(rx, None));
            // Copies, as in `DynamoSingle::bare_rss`: the events stay allocated.
            for e in &events {
                tx.send(WorkerTask::Event(e.clone()))
                    .expect("the loop is running");
            }
            drop(tx);
            looper
                .join()
                .expect("the loop does not panic")
                .expect("the loop ends cleanly");
        });
        let grown = rss_bytes().saturating_sub(before);
        std::hint::black_box((&tree, &events));
        grown
    }
}

impl Front for Pool {
    type Event = RouterEvent;
    type Query = Vec<LocalBlockHash>;
    type Answer = OverlapScores;

    async fn apply(&self, event: RouterEvent) {
        self.0.enqueue_event(event).expect("the pool is running");
    }

    async fn settle(&self) {
        self.0.flush_and_wait().await.expect("the pool is running");
    }

    async fn find(&self, query: &Self::Query) -> OverlapScores {
        // Dynamo's API takes the sequence by value; the copy is part of its cost.
        self.0
            .find_matches(query.clone())
            .await
            .expect("the pool is running")
    }

    fn stop(self) {
        self.0.shutdown();
    }
}

/// Dynamo's single-threaded `RadixTree` (bare-tree rows; its front is [`Dynamo`]'s).
pub struct DynamoSingle;

impl Library for DynamoSingle {
    const NAME: &'static str = "Dynamo RadixTree";
    type Event = RouterEvent;
    type Query = Vec<LocalBlockHash>;
    type Tree = RadixTree;
    type Answer = OverlapScores;
    type Front = Pool;

    fn events(batches: &[KvEventBatch]) -> Vec<RouterEvent> {
        Dynamo::events(batches)
    }

    fn worker(event: &RouterEvent) -> u64 {
        event.worker_id
    }

    fn query(hashes: &Arc<[kv_events::LocalBlockHash]>) -> Self::Query {
        Dynamo::query(hashes)
    }

    fn build(events: Vec<RouterEvent>) -> (RadixTree, Took) {
        let mut tree = RadixTree::new();
        let timer = Timer::start();
        for e in events {
            let _ = tree.apply_event(e); // refusals show as wrong answers
        }
        (tree, timer.stop())
    }

    fn find(tree: &RadixTree, query: &Self::Query) -> OverlapScores {
        // By value, as its API takes it; the copy is part of its cost.
        tree.find_matches(query.clone(), false)
    }

    fn scores(answer: OverlapScores) -> Scores {
        Dynamo::scores(answer)
    }

    fn front() -> Pool {
        Dynamo::front()
    }

    fn bare_rss(events: Vec<RouterEvent>) -> u64 {
        let before = rss_bytes();
        let mut tree = RadixTree::new();
        // A copy of each event, freed right after: the events themselves stay
        // allocated (as ours do), so the tree cannot grow into their freed memory.
        for e in &events {
            let _ = tree.apply_event(e.clone());
        }
        let grown = rss_bytes().saturating_sub(before);
        std::hint::black_box((&tree, &events));
        grown
    }
}
