//! Behaviour specific to the sharded front: the biased shard loop's read-your-writes
//! guarantee (events drain before a dump or a query), backpressure, reordering across
//! senders, counters and shutdown.
//!
//! Tests run on Tokio's current-thread runtime: shard tasks only run when the test
//! task awaits something that is not ready. Events are queued inside
//! `tokio::task::unconstrained` (so the cooperative budget never forces a yield), which
//! leaves all of them and the following dump or query request queued together; a
//! non-biased shard loop would then serve the request before some of the events.

mod common;

use common::{Numbering, batch, chain, q, removed, stored, wr};
use indexer::{Backend, CountersSnapshot, IndexerApi, IndexerConfig, IndexerError, ShardedIndexer};
use kv_events::WorkerId;
use tokio_util::sync::CancellationToken;

fn spawn(num_shards: usize, event_queue_capacity: usize) -> (ShardedIndexer, CancellationToken) {
    let token = CancellationToken::new();
    let config = IndexerConfig {
        backend: Backend::Sharded,
        num_shards,
        event_queue_capacity,
        query_queue_capacity: 64,
        ..IndexerConfig::default()
    };
    (
        ShardedIndexer::spawn(config, token.clone()).expect("valid config"),
        token,
    )
}

/// Queues batches 0..n without letting the shards run.
async fn queue_batches(indexer: &ShardedIndexer, n: u64) {
    tokio::task::unconstrained(async {
        for i in 0..n {
            indexer.apply(nth_batch(i)).await.expect("indexer running");
        }
    })
    .await;
}

/// Batch `i` stores one block for worker `i % 7`, below that worker's previous one;
/// it is that worker's event number `i / 7`.
fn nth_batch(i: u64) -> kv_events::KvEventBatch {
    let parent = if i < 7 { None } else { Some(10_000 + i - 7) };
    let mut event = stored(0, parent, &[(10_000 + i, i / 7)]);
    event.event_id = i / 7;
    batch(i % 7, vec![event])
}

#[tokio::test]
async fn dump_contains_every_event_queued_before_it() {
    let (indexer, _token) = spawn(3, 1024);
    queue_batches(&indexer, 700).await;
    assert_eq!(
        indexer.queued_events(),
        700,
        "nothing applied yet on this runtime"
    );
    let dump = indexer.dump().await.unwrap();
    assert_eq!(indexer.queued_events(), 0);
    let blocks: usize = dump
        .iter()
        .flat_map(|b| &b.events)
        .map(|e| e.data.block_count())
        .sum();
    assert_eq!(blocks, 700);
    assert_eq!(indexer.counters().snapshot().unknown_parent_rejections, 0);
}

#[tokio::test]
async fn a_query_sees_the_callers_earlier_events() {
    let (indexer, _token) = spawn(2, 1024);
    queue_batches(&indexer, 700).await;
    assert_eq!(indexer.queued_events(), 700);
    let hashes: Vec<u64> = (0..100).collect();
    let scores = indexer.find_matches(q(&hashes)).await.unwrap();
    assert_eq!(scores.len(), 7);
    for worker in 0..7 {
        assert_eq!(scores.get(wr(worker, 0)), 100, "worker {worker}");
    }
    // Stats are served after events too. (Worker 3's next event is its 101st.)
    let mut event = removed(0, &[10_000 + 3 + 7 * 99]);
    event.event_id = 100;
    indexer.apply(batch(3, vec![event])).await.unwrap();
    assert_eq!(indexer.stats().await.unwrap().entries, 699);
}

#[tokio::test]
async fn a_full_queue_makes_senders_wait_and_reordered_events_are_put_back_in_order() {
    let (indexer, _token) = spawn(2, 2);
    let mut needs = indexer.take_recovery_needs().expect("first take");
    let mut senders = Vec::new();
    for part in 0..4u64 {
        let indexer = indexer.clone();
        senders.push(tokio::spawn(async move {
            for i in (part..700).step_by(4) {
                indexer.apply(nth_batch(i)).await.unwrap();
            }
        }));
    }
    for sender in senders {
        sender.await.unwrap();
    }
    // Batches of one worker from different senders race, so some arrive ahead of
    // their predecessor: those are buffered and a recovery is asked for. Nobody
    // serves it here; giving it up applies the buffer, which by now has no holes.
    indexer.stats().await.unwrap(); // every batch has been taken off the queues
    while let Ok(need) = needs.try_recv() {
        indexer
            .abandon_recovery(need.rank, need.token)
            .await
            .unwrap();
    }
    let stats = indexer.stats().await.unwrap();
    let snap = indexer.counters().snapshot();
    assert_eq!(snap.batches, 700);
    assert_eq!(snap.blocks_stored, 700);
    assert_eq!((snap.unknown_parent_rejections, snap.events_lost), (0, 0));
    assert_eq!(stats.entries, 700);
    let hashes: Vec<u64> = (0..100).collect();
    let scores = indexer.find_matches(q(&hashes)).await.unwrap();
    assert!((0..7).all(|w| scores.get(wr(w, 0)) == 100), "{scores:?}");
}

#[tokio::test]
async fn counters_track_outcomes() {
    let (indexer, _token) = spawn(3, 64);
    let mut ids = Numbering::default();
    indexer
        .apply(ids.number(batch(1, vec![stored(0, None, &chain(100, 3))])))
        .await
        .unwrap();
    indexer
        .apply(ids.number(batch(1, vec![stored(0, None, &chain(100, 2))])))
        .await
        .unwrap();
    indexer
        .apply(ids.number(batch(2, vec![stored(0, Some(5), &chain(200, 2))])))
        .await
        .unwrap();
    indexer
        .apply(ids.number(batch(1, vec![removed(0, &[102, 77]), common::cleared(1)])))
        .await
        .unwrap();
    indexer.remove_worker(WorkerId(1)).await.unwrap();
    indexer.find_matches(q(&[0, 1])).await.unwrap();
    let expected = CountersSnapshot {
        batches: 4,
        stored_events: 2,
        removed_events: 1,
        cleared_events: 1,
        rejected_events: 1,
        blocks_stored: 3,
        duplicate_stores: 2,
        blocks_removed: 3, // 102 by the remove, 100 and 101 by the worker removal
        unknown_removes: 1,
        unknown_parent_rejections: 1,
        recovery_requests: 1, // worker 2's unknown parent asks for a dump
        workers_removed: 1,
        queries: 3, // one per shard
        ..CountersSnapshot::default()
    };
    assert_eq!(indexer.counters().snapshot(), expected);
}

#[tokio::test]
async fn workers_are_sticky_to_one_shard() {
    let (indexer, _token) = spawn(3, 64);
    assert_eq!(indexer.num_shards(), 3);
    for worker in 0..9 {
        assert_eq!(indexer.shard_of(WorkerId(worker)), (worker % 3) as usize);
    }
    // Worker 4's events land in one tree: a chain continued across batches works,
    // which it would not if the second batch reached a shard without the parent.
    let mut ids = Numbering::default();
    indexer
        .apply(ids.number(batch(4, vec![stored(0, None, &chain(40, 2))])))
        .await
        .unwrap();
    indexer
        .apply(ids.number(batch(4, vec![stored(0, Some(41), &[(42, 2)])])))
        .await
        .unwrap();
    assert_eq!(
        indexer
            .find_matches(q(&[0, 1, 2]))
            .await
            .unwrap()
            .get(wr(4, 0)),
        3
    );
}

#[tokio::test]
async fn cancelling_the_token_stops_shards_and_fails_later_calls() {
    let (indexer, token) = spawn(3, 64);
    indexer
        .apply(batch(1, vec![stored(0, None, &chain(100, 3))]))
        .await
        .unwrap();
    token.cancel();
    indexer.closed().await;
    let shutting_down = Err(IndexerError::ShuttingDown);
    assert_eq!(indexer.apply(batch(1, vec![])).await, shutting_down);
    assert_eq!(indexer.remove_worker(WorkerId(1)).await, shutting_down);
    assert_eq!(
        indexer.find_matches(q(&[0])).await,
        Err(IndexerError::ShuttingDown)
    );
    assert_eq!(indexer.dump().await, Err(IndexerError::ShuttingDown));
    assert_eq!(indexer.stats().await, Err(IndexerError::ShuttingDown));
}

#[tokio::test]
async fn shutdown_stops_only_this_indexer() {
    let (indexer, token) = spawn(2, 64);
    let clone = indexer.clone();
    clone.shutdown();
    indexer.closed().await;
    assert!(!token.is_cancelled(), "the caller's token is not cancelled");
    assert_eq!(
        indexer.find_matches(q(&[0])).await,
        Err(IndexerError::ShuttingDown)
    );
}

#[tokio::test]
async fn invalid_config_is_refused() {
    let config = IndexerConfig {
        num_shards: 0,
        ..IndexerConfig::default()
    };
    let err = ShardedIndexer::spawn(config, CancellationToken::new()).unwrap_err();
    assert_eq!(
        err,
        IndexerError::InvalidConfig {
            field: "num_shards",
            reason: "must be at least 1"
        }
    );
}
