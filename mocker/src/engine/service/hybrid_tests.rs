//! A hybrid-attention mock engine on NATS: its KV events name their groups in the
//! router's protocol, windowed stores are sparse runs below the full group's
//! blocks, a recomputed prefix is stored again (copies), and the engine reports the
//! hybrid hit as its cached tokens.

use super::tests::{WAIT, next_response, request, small_model, start_shaped};
use crate::engine::FleetArgs;
use crate::protocol::GenerateResponse;
use engine_model::{HybridConfig, chain_block_hashes};
use futures::StreamExt;
use kv_events::{
    ExternalBlockHash, KvCacheEventData, KvCacheGroup, KvEventBatch, LocalBlockHash, WorkerId,
};

/// `(group, parent, blocks)` of every `Stored` in a batch, in order.
fn stores(
    batch: &KvEventBatch,
) -> Vec<(
    KvCacheGroup,
    Option<ExternalBlockHash>,
    Vec<ExternalBlockHash>,
)> {
    batch
        .events
        .iter()
        .filter_map(|e| match &e.data {
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                group,
                ..
            } => Some((
                group.expect("a hybrid rank names its groups"),
                *parent_hash,
                blocks.iter().map(|b| b.block_hash).collect(),
            )),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_hybrid_engine_publishes_groups_on_nats_and_reports_the_hybrid_hit() {
    let fleet = FleetArgs {
        workers: 1,
        first_worker_id: 3,
        dp_size: 1,
    };
    let model = small_model();
    // Two sliding-window groups of 33 tokens: a hit needs the 2 blocks before it.
    let mut h = start_shaped(fleet, model, 50.0, HybridConfig::sliding(2, 33)).await;
    let worker = WorkerId(3);
    // The largest request that fits: 64 blocks less two windows' working sets of
    // one step (256 / 16 + 1) and the window (2): 26 blocks of 16 tokens.
    let regs = h.registered_workers().await;
    assert_eq!(regs[0].max_model_len, Some(26 * 16));
    let mut events = h
        .nats
        .subscribe(h.subjects.kv_events(worker))
        .await
        .expect("sub");
    kv_cluster::barrier::server_barrier(&h.nats)
        .await
        .expect("subscribed at the server");
    let chain = |hashes: &[u64]| {
        let locals: Vec<LocalBlockHash> = hashes.iter().map(|&h| LocalBlockHash(h)).collect();
        chain_block_hashes(&locals)
            .iter()
            .map(|b| b.block_hash)
            .collect::<Vec<_>>()
    };
    let (full, w0, w1) = (
        KvCacheGroup::full(2),
        KvCacheGroup::windowed(0, 2).expect("window"),
        KvCacheGroup::windowed(1, 2).expect("window"),
    );
    // (prompt, cached tokens, the batch's stores as (group, parent, positions)).
    let a = [1, 2, 3, 4, 5, 6];
    let b = [1, 2, 3, 4, 9, 10];
    let c = [1, 2, 3, 4, 11, 12];
    type Expected = Vec<(KvCacheGroup, Option<usize>, std::ops::Range<usize>)>;
    let cases: [(&str, [u64; 6], u64, Expected); 3] = [
        // 88 tokens: 5 full blocks; the windows keep the 2 before block 5.
        (
            "a",
            a,
            0,
            vec![(full, None, 0..5), (w0, Some(2), 3..5), (w1, Some(2), 3..5)],
        ),
        // Shares 4 blocks, but the windows lack block 2: a miss, the prefix is stored
        // again (copies) and the windows keep the junction's 2..4 and the tail.
        (
            "b",
            b,
            0,
            vec![(full, None, 0..5), (w0, Some(1), 2..5), (w1, Some(1), 2..5)],
        ),
        // Now the window before the shared 4 blocks is held: a hit of 4 blocks.
        (
            "c",
            c,
            64,
            vec![
                (full, Some(3), 4..5),
                (w0, Some(3), 4..5),
                (w1, Some(3), 4..5),
            ],
        ),
    ];
    for (id, prompt, cached, expected) in cases {
        let mut inbox = h.generate(worker, &request(id, 0, &prompt, 88, 1)).await;
        assert_eq!(
            next_response(&mut inbox).await,
            GenerateResponse::FirstToken {
                cached_tokens: cached,
                prompt_tokens: 88
            },
            "{id}"
        );
        let msg = tokio::time::timeout(WAIT, events.next())
            .await
            .expect("events in time")
            .expect("open");
        let batch: KvEventBatch = kv_events::decode(&msg.payload).expect("batch decodes");
        let hashes = chain(&prompt[..5]);
        let want: Vec<_> = expected
            .into_iter()
            .map(|(group, parent, range)| {
                (group, parent.map(|p| hashes[p]), hashes[range].to_vec())
            })
            .collect();
        assert_eq!(stores(&batch), want, "{id}");
    }
    h.stop().await;
}
