//! Queries do not wait behind a whole batch (issue 29, item 4): the running
//! [`Indexer`] applies one 50,000-block `Stored` in steps, a query blocked on the
//! shard is let in between two steps and sees a prefix of the chain, and a snapshot
//! never sees part of the event.

mod common;

use common::{batch, wr};
use indexer::inline::STEP_BLOCKS;
use indexer::{Indexer, IndexerApi, IndexerConfig};
use kv_events::LocalBlockHash;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const BLOCKS: usize = 50_000;

/// Gives up after this long: the test must end even if the writer never yields.
const DEADLINE: Duration = Duration::from_secs(60);

fn one_shard() -> Indexer {
    let config = IndexerConfig {
        num_shards: 1,
        ..IndexerConfig::default()
    };
    Indexer::spawn(config, CancellationToken::new()).expect("valid config")
}

/// One `Stored` event of a `BLOCKS`-long chain from the root, local hashes 1..
fn long_chain() -> (kv_events::KvEventBatch, Vec<LocalBlockHash>) {
    let pairs: Vec<(u64, u64)> = (1..=BLOCKS as u64).map(|h| (h, h)).collect();
    let event = common::stored(0, None, &pairs);
    let query = pairs.iter().map(|(_, l)| LocalBlockHash(*l)).collect();
    (batch(1, vec![event]), query)
}

/// Applies `batch` to `indexer` while another thread calls `probe` in a loop, from
/// before the batch arrives until one call after it was applied; returns what each
/// call returned, in order.
async fn probe_during_apply<T: Send + 'static>(
    indexer: &Indexer,
    batch: kv_events::KvEventBatch,
    probe: impl Fn(&Indexer, &tokio::runtime::Handle) -> T + Send + 'static,
) -> Vec<T> {
    let applied = Arc::new(AtomicBool::new(false));
    let prober = {
        let (indexer, applied) = (indexer.clone(), applied.clone());
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let began = Instant::now();
            let mut seen = Vec::new();
            loop {
                let done = applied.load(Ordering::Acquire);
                seen.push(probe(&indexer, &handle));
                if done || began.elapsed() > DEADLINE {
                    return seen;
                }
            }
        })
    };
    // Let the prober start before the event arrives.
    tokio::time::sleep(Duration::from_millis(50)).await;
    indexer.apply(batch).await.expect("running");
    applied.store(true, Ordering::Release);
    prober.await.expect("prober")
}

/// Whether a query lands inside the event is up to the scheduler (an optimised build
/// applies the 50,000 blocks in about a millisecond, and the querying thread may be
/// off its core for all of it), so the event is applied again to a fresh indexer, up
/// to this many times, until one does; every attempt must pass the other checks.
const ATTEMPTS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_is_answered_between_two_steps_of_one_event() {
    let mut partial = Vec::new();
    for _ in 0..ATTEMPTS {
        let indexer = one_shard();
        let (batch, query) = long_chain();
        let query: Arc<[LocalBlockHash]> = query.into();
        let scores = probe_during_apply(&indexer, batch, move |indexer, handle| {
            let answer = handle.block_on(indexer.find_matches(query.clone()));
            answer.expect("running").get(wr(1, 0))
        })
        .await;
        indexer.shutdown();
        assert_eq!(scores.last().copied(), Some(BLOCKS as u32), "{scores:?}");
        assert!(
            scores.windows(2).all(|w| w[0] <= w[1]),
            "a query saw the chain shrink: {scores:?}"
        );
        partial = (scores.iter().copied())
            .filter(|s| *s > 0 && (*s as usize) < BLOCKS)
            .collect();
        if !partial.is_empty() {
            break;
        }
    }
    assert!(
        !partial.is_empty(),
        "no query was answered between two steps in {ATTEMPTS} attempts"
    );
    assert!(
        partial
            .iter()
            .all(|s| (*s as usize).is_multiple_of(STEP_BLOCKS)),
        "a query saw a part that is not a whole number of steps: {partial:?}"
    );
}

/// Snapshots are taken while another thread's queries make the writer stop and
/// hand the shard over (a snapshot blocked on the lock is woken with them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_never_sees_part_of_an_event() {
    let indexer = one_shard();
    let (batch, query) = long_chain();
    let stop = Arc::new(AtomicBool::new(false));
    let asker = {
        let (indexer, stop) = (indexer.clone(), stop.clone());
        let query: Arc<[LocalBlockHash]> = query.into();
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let began = Instant::now();
            while !stop.load(Ordering::Acquire) && began.elapsed() < DEADLINE {
                let answer = handle.block_on(indexer.find_matches(query.clone()));
                answer.expect("running");
            }
        })
    };
    let seen = probe_during_apply(&indexer, batch, |indexer, handle| {
        let snapshot = handle.block_on(indexer.snapshot()).expect("running");
        let blocks: usize = (snapshot.batches.iter())
            .flat_map(|b| &b.events)
            .map(|e| e.data.block_count())
            .sum();
        let next = snapshot.cursors.first().map_or(0, |c| c.next_event_id);
        (next, blocks)
    })
    .await;
    stop.store(true, Ordering::Release);
    asker.await.expect("asker");
    assert_eq!(seen.last().copied(), Some((1, BLOCKS)));
    for (next, blocks) in &seen {
        assert!(
            (*next, *blocks) == (0, 0) || (*next, *blocks) == (1, BLOCKS),
            "a snapshot paired cursor {next} with {blocks} blocks"
        );
    }
}
