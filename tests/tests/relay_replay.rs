//! Issue 25, finding 3: a relay (re)started beside a vLLM with a long history rebuilds
//! the whole picture although vLLM's replay socket drops part of its answer. vLLM
//! sends a replay from a ROUTER socket at the default send high-water mark, so a
//! reader that falls behind loses whole batches (a hole) and, at the end, the end
//! marker. The fake engine of `relay.rs` answers the relay's requests that way
//! ([`Lossy`]); real nats-server and etcd, the router daemon in-process.

// Test helpers unwrap: a broken fixture or socket must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "relay/engine.rs"]
#[allow(dead_code)]
mod engine;
#[path = "relay/helpers.rs"]
#[allow(dead_code)]
mod helpers;

use bytes::Bytes;
use engine::{FakeEngine, Lossy, ReplayFraming};
use helpers::*;
use integration_tests::{TestCluster, eventually};
use kv_events::{DpRank, ExternalBlockHash, StorageTier, compute_block_hashes};
use kv_relay::Relay;
use mocker::engine::vllm::{VllmEvent, encode_batch};

/// The engine's history: batch `i` stores block `i` of one long prompt, its parent
/// block `i - 1` (so a batch applied out of order, or after a missing one, is an
/// orphan the relay does not publish).
const HISTORY: u64 = 600;

/// The long prompt's tokens, `blocks` blocks of it.
fn prompt(blocks: u64) -> Vec<u32> {
    (0..blocks as u32 * BLOCK).map(|t| 10_000 + t).collect()
}

/// Engine batch `i` as vLLM 0.33 encodes it.
fn batch(i: u64) -> Bytes {
    let tokens = prompt(i + 1)[(i as usize) * BLOCK as usize..].to_vec();
    let event = VllmEvent::BlockStored {
        block_hashes: vec![ExternalBlockHash(i + 1)],
        parent_block_hash: (i > 0).then_some(ExternalBlockHash(i)),
        token_ids: tokens,
        block_size: BLOCK,
        tier: StorageTier::Gpu,
        group: None,
    };
    Bytes::from(encode_batch(1.0, &[event], DpRank(0)))
}

fn dropping(seqs: std::ops::Range<u64>, end_marker_dropped: bool) -> Lossy {
    Lossy {
        dropped: seqs,
        end_marker_dropped,
    }
}

/// At connect the relay reads a 600-batch buffer whose first answer has a hole
/// (200..300) and whose second loses its tail and end marker (450..600): it asks
/// again from the first missing batch each time, confirms the end, and the router
/// holds every block, in order, once. Later a live gap (600..650) is filled the same
/// way through a hole in the answer (620..630). The old relay kept only the run after
/// the hole (orphans all) and cleared the rank at the gap.
#[tokio::test]
async fn a_lossy_replay_is_asked_again_from_the_first_missing_batch() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    for i in 0..HISTORY {
        engine.buffer_only(i, &batch(i));
    }
    engine.drop_from_replies(vec![
        dropping(200..300, false),
        dropping(450..HISTORY, true),
    ]);
    let relay = Relay::start(
        relay_config(&cluster, &engine, &[]),
        &prometheus::Registry::new(),
    )
    .await
    .unwrap();
    engine.wait_subscribed().await;
    wait_connect_replay(&relay, "complete").await;
    // From 0; from the hole; from the lost tail; once more to confirm the end.
    assert_eq!(engine.replay_requests(), vec![0, 200, 450, HISTORY]);
    wait_registered(&daemon, WORKER, true).await;
    let before_hole = compute_block_hashes(&prompt(150), BLOCK);
    wait_overlap(&daemon, "blocks before the hole", &before_hole, 0, 150).await;
    let all = compute_block_hashes(&prompt(HISTORY), BLOCK);
    wait_overlap(&daemon, "the whole history", &all, 0, HISTORY as u32).await;
    let c = relay.counters();
    assert_eq!(
        (c.replay_requests("hole"), c.replay_requests("cut")),
        (1, 1)
    );

    // Live: 600..650 are lost in transit, 650 arrives; the answer to the gap's
    // request has a hole at 620..630.
    engine.drop_from_replies(vec![dropping(620..630, false)]);
    for i in HISTORY..HISTORY + 50 {
        engine.buffer_only(i, &batch(i));
    }
    engine.publish(HISTORY + 50, &batch(HISTORY + 50)).await;
    let all = compute_block_hashes(&prompt(HISTORY + 51), BLOCK);
    wait_overlap(&daemon, "the gap filled", &all, 0, HISTORY as u32 + 51).await;
    assert_eq!(
        engine.replay_requests()[4..],
        [HISTORY, HISTORY + 20],
        "the gap, then its first missing batch"
    );
    assert_eq!((c.gaps("filled"), c.gaps("cleared")), (1, 0));
    // Every batch applied once and in order: each stored its block, no orphan.
    let stored = HISTORY + 51;
    eventually("every batch published", WAIT, || async {
        (c.events("stored", "published") == stored).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(c.frames("ok"), stored);
    assert_eq!(c.events("stored", "orphan"), 0);
    assert_eq!(c.events("stored", "no_change"), 0);
    assert_eq!(c.resets("gap"), 0);

    relay.shutdown().await.unwrap();
    engine.stop();
    daemon.shutdown().await.unwrap();
}

/// A buffer the engine keeps dropping from ends the read at `--replay-max-requests`:
/// the relay goes live with what it read, counts the batches it saw but could not
/// get, and the next live batch fills the rest as a gap.
#[tokio::test]
async fn a_read_that_keeps_losing_goes_live_with_what_it_has() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    for i in 0..100 {
        engine.buffer_only(i, &batch(i));
    }
    engine.drop_from_replies(vec![dropping(40..50, false), dropping(60..70, false)]);
    let relay = Relay::start(
        relay_config(&cluster, &engine, &["--replay-max-requests", "2"]),
        &prometheus::Registry::new(),
    )
    .await
    .unwrap();
    engine.wait_subscribed().await;
    wait_connect_replay(&relay, "incomplete").await;
    assert_eq!(engine.replay_requests(), vec![0, 40]);
    // 60..69 were dropped twice over and 70 arrived after them: 11 batches known
    // to exist were not read.
    let c = relay.counters();
    assert_eq!(c.replay_missing_total(), 11);
    wait_registered(&daemon, WORKER, true).await;
    let read = compute_block_hashes(&prompt(100), BLOCK);
    wait_overlap(&daemon, "what was read", &read, 0, 60).await;
    // The next live batch: a gap from 60, filled whole.
    engine.publish(100, &batch(100)).await;
    let all = compute_block_hashes(&prompt(101), BLOCK);
    wait_overlap(&daemon, "the rest as a gap", &all, 0, 101).await;
    assert_eq!(engine.replay_requests(), vec![0, 40, 60]);
    assert_eq!(c.gaps("filled"), 1);

    relay.shutdown().await.unwrap();
    engine.stop();
    daemon.shutdown().await.unwrap();
}
