//! A query does not wait for a whole event batch: the `Indexer` applies a large batch
//! in slices and lets waiting queries read the shard between two slices. Before
//! slicing, a query saw a batch all or nothing.

#![allow(clippy::unwrap_used)]

mod common;

use common::{Numbering, batch, stored};
use indexer::{Indexer, IndexerApi, IndexerConfig};
use tokio_util::sync::CancellationToken;

/// Events in the large batch, one block each: thousands of slices, long enough (tens
/// of ms even in an optimised build) for a query to arrive while it is applied.
const EVENTS: u64 = 200_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_reads_a_large_batch_partly_applied() {
    let config = IndexerConfig {
        num_shards: 1,
        ..IndexerConfig::default()
    };
    let index = Indexer::spawn(config, CancellationToken::new()).unwrap();
    // One chain of single-block `Stored` events, each continuing the previous one.
    let events = (0..EVENTS)
        .map(|i| stored(0, i.checked_sub(1), &[(i, i)]))
        .collect();
    let big = Numbering::default().number(batch(1, events));

    let writer = {
        let index = index.clone();
        // On a runtime worker: the test body polls from the runtime's main thread.
        tokio::spawn(async move { index.apply(big).await.unwrap() })
    };
    // Poll until the batch shows up: the first query that sees any of it must see only
    // part of it (it got the lock between two slices). A query that only ever saw
    // nothing and then everything means the batch held the lock throughout.
    let mut seen = Vec::new();
    while !writer.is_finished() {
        let entries = index.stats().await.unwrap().entries;
        if entries > 0 {
            seen.push(entries);
        }
    }
    writer.await.unwrap();
    assert_eq!(index.stats().await.unwrap().entries as u64, EVENTS);
    assert!(
        seen.iter().any(|&n| (n as u64) < EVENTS),
        "every query saw the batch all or nothing: {seen:?}"
    );
}
