//! The overlap service: what it answers, and what it refuses.

use super::*;
use crate::state::RouterState;
use kv_events::routing::overlap::MAX_OVERLAP_HASHES;
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    StoredBlock, WorkerId, encode,
};

/// Worker 1 (registered by `test_state`) stores local hashes `hashes` as one chain.
async fn store(state: &RouterState, hashes: &[u64]) {
    let blocks = (hashes.iter())
        .map(|&h| StoredBlock {
            block_hash: ExternalBlockHash(h + 1_000),
            tokens_hash: LocalBlockHash(h),
        })
        .collect();
    let batch = KvEventBatch {
        worker_id: WorkerId(1),
        epoch: 0,
        events: vec![KvCacheEvent {
            event_id: 0,
            dp_rank: DpRank(0),
            data: KvCacheEventData::Stored {
                parent_hash: None,
                blocks,
                tier: Default::default(),
                group: None,
            },
        }],
    };
    state.removals.record(&batch);
    state.indexer.apply(batch).await.expect("running");
}

fn query(worker: u64, hashes: &[u64]) -> Vec<u8> {
    let query = OverlapQuery {
        worker_id: WorkerId(worker),
        dp_rank: DpRank(0),
        block_hashes: hashes.iter().copied().map(LocalBlockHash).collect(),
    };
    encode(&query).expect("encodes")
}

fn answered(reply: OverlapReply) -> OverlapAnswer {
    match reply {
        OverlapReply::Answered(a) => a,
        OverlapReply::Error(e) => panic!("refused: {e:?}"),
    }
}

/// The answer is the rank's prefix match now: the leading blocks it holds (not every
/// block it holds), 0 on another worker, with the rank's position.
#[tokio::test]
async fn the_answer_is_the_prefix_the_rank_holds_now() {
    let starting = crate::test_state::starting();
    let state = starting.state();
    let before = answered(handle(state, "s", &query(1, &[1, 2, 3])).await);
    assert_eq!(before.overlap_blocks, 0);
    store(state, &[1, 2]).await;
    let now = answered(handle(state, "s", &query(1, &[1, 2, 3])).await);
    assert_eq!(now.overlap_blocks, 2);
    assert!(!now.approximate);
    assert_eq!(now.kv_position.map(|p| p.event_id), Some(0));
    let gap = answered(handle(state, "s", &query(1, &[2, 3])).await);
    assert_eq!(gap.overlap_blocks, 0, "block 2 alone is no prefix");
    let other = answered(handle(state, "s", &query(2, &[1, 2])).await);
    assert_eq!(other.overlap_blocks, 0);
}

/// A query over the hash cap, or undecodable, is refused `bad_request` and counted;
/// one at the cap is answered.
#[tokio::test]
async fn over_long_or_malformed_queries_are_refused() {
    let starting = crate::test_state::starting();
    let state = starting.state();
    let long = query(1, &vec![1; MAX_OVERLAP_HASHES + 1]);
    for payload in [&long[..], b"\xc1"] {
        let reply = handle(state, "s", payload).await;
        assert!(
            matches!(&reply, OverlapReply::Error(e) if e.code == RouteErrorCode::BadRequest),
            "{reply:?}"
        );
    }
    let counters = &state.counters;
    assert_eq!(
        counters.messages(MessageKind::Overlap, Outcome::OverLimit),
        1
    );
    assert_eq!(
        counters.messages(MessageKind::Overlap, Outcome::Malformed),
        1
    );
    let ok = query(1, &vec![1; MAX_OVERLAP_HASHES]);
    answered(handle(state, "s", &ok).await);
    assert_eq!(counters.messages(MessageKind::Overlap, Outcome::Ok), 1);
}
