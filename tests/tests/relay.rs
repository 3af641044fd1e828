//! End to end: `kv-router relay` beside a fake engine that replays real vLLM wire
//! captures over ZMQ, with real nats-server and etcd and the router daemon in-process.
//!
//! The fake engine is the engine's side of the wire, in Rust: a publisher socket
//! sending `[topic, seq, payload]` frames and a replay ROUTER socket serving its
//! buffer in either reply framing. The publisher is an XPUB socket (identical to PUB on
//! the wire) so the test can see the relay's subscription arrive instead of sleeping
//! past ZMQ's slow-joiner window. Frames come from `kv-events/tests/fixtures/engines/`.

// Test helpers unwrap: a broken fixture or socket must fail the test loudly.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use futures::StreamExt;
use integration_tests::{FakeWorker, TestCluster, eventually};
use kv_events::engines::{AdapterScope, HashScope};
use kv_events::recovery::{ChunkAssembler, RecoveryBody, RecoveryRequest};
use kv_events::routing::{Prompt, RouteReply, RouteRequest};
use kv_events::{
    DpRank, LocalBlockHash, StoredBlock, WorkerRank, compute_block_hashes, decode, encode,
};
use kv_relay::Relay;

#[path = "relay/engine.rs"]
#[allow(dead_code)]
mod engine;
#[path = "relay/helpers.rs"]
#[allow(dead_code)]
mod helpers;

use engine::{FakeEngine, ReplayFraming, payloads};
use helpers::*;

/// The engine hashes vLLM gave prompt A's blocks 0 and 1 and prompt B's block 2.
const A0: u64 = 7_322_446_309_363_477_352;
const A1: u64 = 17_027_874_615_116_373_601;
const B2: u64 = 8_646_635_060_491_323_254;

/// Asks the relay (as a router would) for a dump of `rank` and returns its blocks.
async fn recovery_dump(cluster: &TestCluster, rank: u32) -> Vec<StoredBlock> {
    let request = RecoveryRequest {
        dp_rank: DpRank(rank),
        epoch: 0,
        start_event_id: 0,
        dump: true,
    };
    let inbox = cluster.nats.new_inbox();
    let mut replies = cluster.nats.subscribe(inbox.clone()).await.unwrap();
    cluster
        .nats
        .publish_with_reply(
            cluster.subjects.kv_recovery(WORKER),
            inbox,
            encode(&request).unwrap().into(),
        )
        .await
        .unwrap();
    let mut chunks = ChunkAssembler::new();
    let reply = loop {
        let msg = tokio::time::timeout(WAIT, replies.next())
            .await
            .unwrap()
            .unwrap();
        if let Some(reply) = chunks.push(decode(&msg.payload).unwrap()).unwrap() {
            break reply;
        }
    };
    assert_eq!(reply.worker_id, WORKER);
    let RecoveryBody::Dump { chains, .. } = reply.body else {
        panic!("{:?}", reply.body)
    };
    chains.into_iter().flat_map(|c| c.blocks).collect()
}

/// vLLM 0.33 frames (tagged maps, u64 and 32-byte hashes, LoRA, dp rank 3) with
/// seq 2 lost in transit and served back by the replay socket: everything reaches
/// the router, a request with prompt B routes to the relay's worker with its three
/// blocks cached, LoRA blocks (offloaded to CPU) only match LoRA-scoped queries and
/// only on any tier, the final
/// `AllBlocksCleared` empties rank 0, and a dead engine takes its registration away.
#[tokio::test]
async fn captured_vllm_frames_reach_the_router_with_a_gap_filled_from_replay() {
    let mut cluster = TestCluster::start(BLOCK).await.unwrap();
    let _idle = FakeWorker::register(&mut cluster, 1, 30).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    let registry = prometheus::Registry::new();
    let config = relay_config(
        &cluster,
        &engine,
        &[
            "--dp-size",
            "4",
            "--shared-endpoint",
            "--http-listen",
            "127.0.0.1:0",
        ],
    );
    let relay = Relay::start(config, &registry).await.unwrap();
    engine.wait_subscribed().await;
    wait_connect_replay(&relay, "empty").await;
    wait_registered(&daemon, WORKER, true).await;
    // The router asks a worker that joins for a dump of each rank. The relay's journal
    // dumps the GPU tier only, so a dump answered after the CPU-tier store below would
    // cover its event id without its block: let the four dumps be answered first.
    eventually("the join's dumps answered", WAIT, || async {
        (relay.counters().recovery_requests() >= 4).then_some(())
    })
    .await
    .unwrap();

    let frames = payloads("vllm_zmq_frames_topic_kv-events.json");
    engine.publish(0, &frames[0]).await;
    engine.publish(1, &frames[1]).await;
    engine.buffer_only(2, &frames[2]);
    engine.publish(3, &frames[3]).await;

    let a = compute_block_hashes(&prompt_a(), BLOCK);
    let b = compute_block_hashes(&prompt_b(), BLOCK);
    // Batch 2 (replayed) removed A's third block; B's third block hangs below A's second.
    wait_overlap(&daemon, "prompt B indexed on rank 0", &b, 0, 3).await;
    // B (batch 1) may be indexed before the replayed batch 2 is: wait for the removal.
    wait_overlap(&daemon, "A's third block removed", &a, 0, 2).await;
    let c = relay.counters();
    // Batch 3 is published after the replayed batch 2, possibly a moment after the
    // router applied batch 2.
    eventually("batch 3 published", WAIT, || async {
        (c.published_total() == 8).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(c.gaps("filled"), 1);
    assert_eq!(c.gaps("cleared"), 0);
    assert_eq!(c.frames("ok"), 4, "batches 0-3, one of them replayed");
    assert_eq!(c.frames("malformed"), 0);
    // 4 start `cleared`s + stored A, stored B, removed, stored (LoRA, rank 3).
    assert_eq!(c.published_total(), 8);
    let addr = relay.http_addr().unwrap().to_string();
    let (status, page) = kv_cluster::http::get_once(&addr, "/metrics", WAIT)
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(
        page.contains("kv_relay_gaps_total{result=\"filled\"} 1"),
        "{page}"
    );

    // The relay answers the router's recovery requests from its journal: a dump of
    // rank 0 holds exactly A's first two blocks and B's own block, with our hashes.
    let dump = recovery_dump(&cluster, 0).await;
    let mut held: Vec<(u64, LocalBlockHash)> = dump
        .iter()
        .map(|b| (b.block_hash.0, b.tokens_hash))
        .collect();
    held.sort();
    let mut expected = vec![(A0, a[0]), (A1, a[1]), (B2, b[2])];
    expected.sort();
    assert_eq!(held, expected);

    let reply = cluster.route_tokens("b-1", prompt_b()).await.unwrap();
    let RouteReply::Routed(decision) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!((decision.worker_id, decision.dp_rank), (WORKER, DpRank(0)));
    assert_eq!(decision.overlap_blocks, 3);

    // Batch 3 stored A's first block under LoRA "my-lora" on rank 3, with medium
    // "CPU": the index holds it on the CPU tier, so it is no GPU overlap, but it is
    // overlap on any tier; only a query in that adapter's scope matches it there.
    let lora = HashScope {
        adapter: Some(AdapterScope::Name("my-lora".into())),
        cache_salt: None,
    };
    let a_lora = lora.block_hashes(&prompt_a(), BLOCK);
    eventually("LoRA block on rank 3, CPU tier", WAIT, || async {
        (overlap_any_tier(&daemon, a_lora.clone(), 3).await == 1).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(
        overlap(&daemon, a_lora.clone(), 3).await,
        0,
        "a CPU-held block is no GPU overlap"
    );
    assert_eq!(
        overlap_any_tier(&daemon, a.clone(), 3).await,
        0,
        "base-model query never matches a LoRA block"
    );
    let reply = cluster
        .route(&RouteRequest::new(
            "lora-1",
            Prompt::Blocks {
                block_hashes: a_lora.clone(),
                num_tokens: 48,
            },
        ))
        .await
        .unwrap();
    let RouteReply::Routed(decision) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(decision.overlap_blocks, 0, "the route reply counts the GPU");

    // Batch 4: AllBlocksCleared on rank 0 only.
    engine.publish(4, &frames[4]).await;
    wait_overlap(&daemon, "rank 0 cleared", &b, 0, 0).await;
    assert_eq!(
        overlap_any_tier(&daemon, a_lora, 3).await,
        1,
        "rank 3 untouched"
    );

    // The engine goes away: the relay revokes the worker's lease.
    engine.stop();
    wait_registered(&daemon, WORKER, false).await;
    relay.shutdown().await.unwrap();
    daemon.shutdown().await.unwrap();
}

/// vLLM 0.23 positional-array payloads with the legacy replay framing, then an
/// engine restart (seq back to 0), an undecodable payload, and a gap the engine can
/// no longer replay: each is handled without losing what follows.
#[tokio::test]
async fn legacy_replay_restart_bad_payload_and_unfillable_gap() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let mut engine = FakeEngine::start("", ReplayFraming::Legacy).await;
    let registry = prometheus::Registry::new();
    let extra = ["--metrics-interval-ms", "50"];
    let relay = Relay::start(relay_config(&cluster, &engine, &extra), &registry)
        .await
        .unwrap();
    engine.wait_subscribed().await;
    wait_connect_replay(&relay, "empty").await;
    wait_registered(&daemon, WORKER, true).await;
    let p = payloads("vllm_0.23.0_payloads.json");
    let a = compute_block_hashes(&prompt_a(), BLOCK);
    let b = compute_block_hashes(&prompt_b(), BLOCK);

    // Stored A, (stored B lost, replayed in legacy framing), removed A2.
    engine.publish(0, &p[0]).await;
    engine.buffer_only(1, &p[1]);
    engine.publish(2, &p[2]).await;
    wait_overlap(&daemon, "B after the legacy replay", &b, 0, 3).await;
    assert_eq!(overlap(&daemon, a.clone(), 0).await, 2);
    assert_eq!(relay.counters().gaps("filled"), 1);

    // The engine restarts: seq 0 again, with an empty cache that stores A.
    engine.forget();
    engine.publish(0, &p[0]).await;
    wait_overlap(&daemon, "A after the restart", &a, 0, 3).await;
    assert_eq!(
        overlap(&daemon, b.clone(), 0).await,
        2,
        "B's own block is gone"
    );
    assert_eq!(relay.counters().resets("restart"), 1);

    // An undecodable payload is counted and skipped; the next batch still applies.
    engine
        .publish(1, &Bytes::from_static(b"\x93\xcb\x00"))
        .await;
    engine.publish(2, &p[2]).await;
    wait_overlap(&daemon, "removal after a bad payload", &a, 0, 2).await;
    assert_eq!(relay.counters().frames("malformed"), 1);

    // Seqs 3 and 4 are lost and the engine's buffer no longer has them: the rank is
    // cleared, and what follows (seq 5: stored B's chain from the root) applies.
    engine.forget();
    let b_from_root = payloads("vllm_0.11.0_payloads.json")[0].clone();
    engine.publish(5, &b_from_root).await;
    eventually("the unfillable gap", WAIT, || async {
        (relay.counters().gaps("cleared") == 1).then_some(())
    })
    .await
    .unwrap();
    wait_overlap(&daemon, "A rebuilt after the clear", &a, 0, 3).await;
    assert_eq!(relay.counters().resets("gap"), 1);

    // Load scraped from the engine's Prometheus page reaches the router.
    let load = eventually("scraped load metrics", WAIT, || async {
        let scheduler = daemon.state().scheduler();
        scheduler
            .load_metrics(WorkerRank::new(WORKER, DpRank(0)))
            .copied()
    })
    .await
    .unwrap();
    assert_eq!(
        (load.num_requests_running, load.num_requests_waiting),
        (3, 2)
    );
    assert_eq!((load.kv_used_blocks, load.kv_total_blocks), (250, 1000));
    assert!(relay.counters().scrapes("ok") >= 1);

    relay.shutdown().await.unwrap();
    wait_registered(&daemon, WORKER, false).await;
    engine.stop();
    daemon.shutdown().await.unwrap();
}

/// One engine format of the idle-engine catch-up test.
struct Idle {
    name: &'static str,
    file: &'static str,
    topic: &'static str,
    framing: ReplayFraming,
    /// Engine seqs of the fixture's first batches, as the replay buffer holds them.
    seqs: std::ops::Range<u64>,
    /// (prompt, rank 0 overlap, in blocks) once the buffer is applied.
    expected: Vec<(Vec<u32>, u32)>,
    /// `kv_relay_connect_replays_total`'s result.
    result: &'static str,
}

/// Finding 7: a relay started (or restarted) beside an idle engine reads the engine's
/// replay buffer as soon as its socket connects, so the router sees the engine's
/// cached blocks without any new engine batch; for vLLM 0.33, vLLM 0.11 (legacy
/// replay framing) and SGLang 0.5.23. The engine here never publishes.
#[tokio::test]
async fn an_idle_engines_replay_buffer_reaches_the_router_at_connect() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let cases = [
        Idle {
            name: "vLLM 0.33",
            file: "vllm_zmq_frames_topic_kv-events.json",
            topic: "kv-events",
            framing: ReplayFraming::WithTopic,
            seqs: 0..3,
            expected: vec![(prompt_b(), 3), (prompt_a(), 2)],
            result: "complete",
        },
        Idle {
            name: "vLLM 0.11",
            file: "vllm_0.11.0_payloads.json",
            topic: "",
            framing: ReplayFraming::Legacy,
            seqs: 0..3,
            expected: vec![(prompt_b(), 3), (prompt_a(), 2)],
            result: "complete",
        },
        Idle {
            name: "SGLang 0.5.23",
            file: "sglang_0.5.23_payloads.json",
            topic: "kv-events",
            framing: ReplayFraming::WithTopic,
            seqs: 0..1,
            expected: vec![(prompt_a(), 2), (prompt_b(), 2)],
            result: "complete",
        },
        // A buffer that no longer reaches back to seq 0: what it holds still applies.
        Idle {
            name: "vLLM 0.33, buffer from seq 5",
            file: "vllm_zmq_frames_topic_kv-events.json",
            topic: "kv-events",
            framing: ReplayFraming::WithTopic,
            seqs: 5..6,
            expected: vec![(prompt_a(), 3), (prompt_b(), 2)],
            result: "partial",
        },
    ];
    for case in cases {
        let engine = FakeEngine::start(case.topic, case.framing).await;
        let batches = payloads(case.file);
        for (i, seq) in case.seqs.clone().enumerate() {
            engine.buffer_only(seq, &batches[i]);
        }
        let hashes: Vec<(Vec<LocalBlockHash>, u32)> = case
            .expected
            .iter()
            .map(|(prompt, blocks)| (compute_block_hashes(prompt, BLOCK), *blocks))
            .collect();
        // The relay starts, and later restarts, while the engine stays idle.
        for run in ["start", "restart"] {
            let registry = prometheus::Registry::new();
            let relay = Relay::start(relay_config(&cluster, &engine, &[]), &registry)
                .await
                .unwrap();
            wait_connect_replay(&relay, case.result).await;
            wait_registered(&daemon, WORKER, true).await;
            for (hashes, blocks) in &hashes {
                let what = format!(
                    "{}: the engine's cached blocks after the relay's {run}",
                    case.name
                );
                wait_overlap(&daemon, &what, hashes, 0, *blocks).await;
            }
            relay.shutdown().await.unwrap();
            // The revoked lease drops the worker and its blocks from the router.
            wait_registered(&daemon, WORKER, false).await;
            for (hashes, _) in &hashes {
                assert_eq!(
                    overlap(&daemon, hashes.clone(), 0).await,
                    0,
                    "{}",
                    case.name
                );
            }
        }
        engine.stop();
    }
    daemon.shutdown().await.unwrap();
}
