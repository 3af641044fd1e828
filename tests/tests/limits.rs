//! Issue 14, findings 1 and 5, end to end: a registration or a message that is valid
//! but sized far beyond any engine is refused, counted and skipped, and the daemon
//! goes on routing. Real nats-server and etcd, the daemon in-process, workers, peers
//! and frontends played by the test over the real wire protocol.

use indexer::IndexerApi as _;
use integration_tests::{FakeWorker, TestCluster, eventually, register_worker, routed_worker};
use kv_events::discovery::WorkerRegistration;
use kv_events::replicas::{BookedSequence, RouterId, SequenceSync, SequenceUpdate};
use kv_events::routing::{Prompt, RouteErrorCode, RouteReply, RouteRequest};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEventData, LocalBlockHash, RequestId, StoredBlock, WorkerId,
    encode,
};
use router_daemon::counters::{MessageKind, Outcome};
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 10_000 + i).collect()
}

/// Finding 1: a registration with `dp_size` 4,294,967,295 made every replica that
/// loaded it allocate ~64 GiB and abort; one with 1,000,000 ranks took 1.1 GiB and won
/// routes. Both are now rejected at the directory, before anything is sized by them,
/// whether present at start-up or written while the daemon runs.
#[tokio::test]
async fn a_registration_with_an_absurd_dp_size_is_rejected_and_routing_goes_on()
-> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut real = FakeWorker::register(&mut cluster, 1, 30).await?;
    let absurd = |id, dp_size| WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size,
        block_size: BLOCK,
        total_kv_blocks: 1024,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    register_worker(
        &mut cluster.etcd,
        &cluster.subjects,
        &absurd(2, u32::MAX),
        30,
    )
    .await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    // Written while the daemon runs: 1M ranks, and a capacity no engine has.
    register_worker(
        &mut cluster.etcd,
        &cluster.subjects,
        &absurd(3, 1_000_000),
        30,
    )
    .await?;
    let huge_capacity = WorkerRegistration {
        total_kv_blocks: u64::MAX,
        ..absurd(4, 1)
    };
    register_worker(&mut cluster.etcd, &cluster.subjects, &huge_capacity, 30).await?;

    let counters = &daemon.state().counters;
    eventually("the three registrations to be rejected", WAIT, || async {
        (counters.messages(MessageKind::Registration, Outcome::Rejected) == 3).then_some(())
    })
    .await?;
    let workers: Vec<WorkerId> = daemon
        .state()
        .scheduler()
        .workers()
        .map(|r| r.worker_id)
        .collect();
    assert_eq!(workers, vec![real.id], "only the real worker is registered");
    let tokens = prompt(1, 4);
    real.store_prompt(&cluster, &tokens).await?;
    for i in 0..20 {
        let reply = cluster
            .route_tokens(&format!("r{i}"), prompt(100 + i, 3))
            .await?;
        assert_eq!(routed_worker(&reply), real.id);
    }
    daemon.shutdown().await
}

/// Finding 5: one message could allocate without bound — a `Stored` event of 5M
/// blocks held 500 MiB after it was applied, a route request of 50M tokens reached
/// 2.1 GiB, a peer's booking with a load of `u64::MAX` was accepted unclamped. Here
/// each kind is sent over a (lowered) limit: each is refused by reason, the requester
/// of a route gets `bad_request`, and the state is unchanged; the real worker's events
/// and routes still work afterwards.
#[tokio::test]
async fn messages_over_a_limit_are_refused_by_reason_and_nothing_else_is_lost() -> anyhow::Result<()>
{
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    let daemon = cluster
        .start_daemon(|args| {
            args.limits.max_message_bytes = 64 << 10;
            args.limits.max_route_tokens = 4096;
            args.limits.max_batch_blocks = 1000;
            args.scheduling.replica_sync = true;
        })
        .await?;
    let subjects = cluster.subjects.clone();
    let nats = cluster.nats.clone();

    // A Stored event of 5,000 blocks (~90 KiB): too large, not decoded.
    let blocks = |n: u64| KvCacheEventData::Stored {
        group: None,
        parent_hash: None,
        blocks: (0..n)
            .map(|i| StoredBlock {
                block_hash: ExternalBlockHash(u64::MAX - i),
                tokens_hash: LocalBlockHash(i),
            })
            .collect(),
        tier: kv_events::StorageTier::Gpu,
    };
    w1.publish(&cluster, blocks(5000)).await?;
    // 1,500 blocks (~27 KiB): within the bytes, over --max-batch-blocks.
    w1.publish(&cluster, blocks(1500)).await?;

    // A route request of 5,000 tokens: bad_request to the requester.
    let long = RouteRequest::new(
        "long",
        Prompt::Tokens {
            token_ids: (0..5000).collect(),
        },
    );
    match cluster.route(&long).await? {
        RouteReply::Error(e) => {
            assert_eq!(e.code, RouteErrorCode::BadRequest);
            assert!(e.message.contains("token_ids is 5000"), "{}", e.message);
        }
        other => panic!("an over-limit prompt was routed: {other:?}"),
    }
    // A peer replica's booking with an unclamped load.
    let booking = SequenceSync {
        router_id: RouterId(99),
        request_id: RequestId("peer-1".into()),
        update: SequenceUpdate::Booked(BookedSequence {
            worker_id: w1.id,
            dp_rank: DpRank(0),
            block_hashes: vec![LocalBlockHash(1)],
            request_blocks: 1,
            prefill_tokens: u64::MAX,
            expected_prefill_ms: None,
            session_id: None,
        }),
    };
    nats.publish(subjects.sequences(), encode(&booking)?.into())
        .await?;
    nats.flush().await?;

    let counters = &daemon.state().counters;
    eventually("every refusal to be counted by reason", WAIT, || async {
        (counters.messages(MessageKind::Events, Outcome::TooLarge) == 1
            && counters.messages(MessageKind::Events, Outcome::OverLimit) == 1
            && counters.messages(MessageKind::Route, Outcome::OverLimit) == 1
            && counters.messages(MessageKind::Sequences, Outcome::OverLimit) == 1)
            .then_some(())
    })
    .await?;
    assert_eq!(
        daemon.state().scheduler().active_requests(),
        0,
        "the booking was not applied"
    );

    // The worker's next events: the two refused ones left a gap of two event ids,
    // which recovery fills or abandons; its real prompt is indexed and wins routes.
    let tokens = prompt(7, 5);
    w1.store_prompt(&cluster, &tokens).await?;
    let hashes = FakeWorker::hashes(&tokens, BLOCK);
    let rank = kv_events::WorkerRank::new(w1.id, DpRank(0));
    integration_tests::wait_for_overlap(&daemon, &hashes, rank, 5).await?;
    let reply = cluster
        .route_tokens("after", integration_tests::continued(&tokens))
        .await?;
    match reply {
        RouteReply::Routed(d) => assert_eq!((d.worker_id, d.overlap_blocks), (w1.id, 5)),
        RouteReply::Error(e) => panic!("route failed: {e:?}"),
    }
    daemon.shutdown().await
}

/// Finding 6: with `--index-max-blocks` set, a flood of blocks nobody asks for pushed
/// a real, recently matched prompt out of the index while the junk stayed, and the
/// index went over its bound at each store. Here a worker floods 100 × 50 blocks into
/// an index capped at 2,000: the index stays under the cap and the real prompt keeps
/// its full overlap.
#[tokio::test]
async fn a_flood_at_the_index_cap_leaves_the_matched_prompt_in_place() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut real = FakeWorker::register(&mut cluster, 1, 30).await?;
    let mut flood = FakeWorker::register(&mut cluster, 2, 30).await?;
    let daemon = cluster
        .start_daemon(|args| {
            args.shards = Some(1); // one tree: the flood and the prompt share the bound
            args.index.index_max_blocks = Some(2000);
        })
        .await?;
    let tokens = prompt(1, 8);
    real.store_prompt(&cluster, &tokens).await?;
    let hashes = FakeWorker::hashes(&tokens, BLOCK);
    let rank = kv_events::WorkerRank::new(real.id, DpRank(0));
    integration_tests::wait_for_overlap(&daemon, &hashes, rank, 8).await?;
    let first = cluster.route_tokens("real-1", tokens.clone()).await?;
    assert_eq!(routed_worker(&first), real.id);
    cluster
        .lifecycle("real-1", kv_events::routing::LifecycleEvent::Freed)
        .await?;

    for chain in 0..100 {
        flood
            .store_prompt(&cluster, &prompt(1000 + chain, 50))
            .await?;
    }
    let indexer = &daemon.state().indexer;
    eventually("the flood to be applied", WAIT, || async {
        let stats = indexer.counters().snapshot();
        (stats.stored_events >= 101).then_some(())
    })
    .await?;
    let report = indexer.report().await?;
    assert!(
        report.stats.entries <= 2000,
        "{} entries over the cap",
        report.stats.entries
    );
    match cluster
        .route_tokens("real-2", integration_tests::continued(&tokens))
        .await?
    {
        RouteReply::Routed(d) => assert_eq!((d.worker_id, d.overlap_blocks), (real.id, 8)),
        RouteReply::Error(e) => panic!("route failed: {e:?}"),
    }
    daemon.shutdown().await
}
