//! End to end: KV event ordering and recovery with real nats-server and etcd.
//!
//! The test plays a publisher with a real `EventJournal` (numbering, ring buffer,
//! held blocks) that serves `{ns}.kv.recovery.{worker_id}`; "losing" an event in
//! transit means recording it in the journal without publishing it (the journal is
//! the publisher's truth, the wire is what the router sees). The router must end up
//! holding exactly the publisher's blocks, and the publisher must have been asked.

mod journal_worker;

use indexer::IndexerApi as _;
use integration_tests::{TestCluster, eventually};
use journal_worker::{JournalWorker, chain_from_root, held_paths, router_paths};
use kv_events::routing::RouteReply;
use kv_events::{DpRank, KvCacheEventData, WorkerId};
use std::sync::atomic::Ordering;
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn a_range_dropped_in_transit_is_recovered_exactly() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    // Worker 1 keeps a long ring (the lost range comes back as events); worker 2 a
    // ring of 4 (the lost range has left it: it answers with a dump).
    let w1 = JournalWorker::start(&mut cluster, 1, 1, 4096).await?;
    let w2 = JournalWorker::start(&mut cluster, 2, 1, 4).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    for w in [&w1, &w2] {
        for i in 0..30u64 {
            let data = chain_from_root(w.id(), i, 3);
            if (10..20).contains(&i) {
                w.record(DpRank(0), data); // lost in transit
            } else {
                w.record_and_publish(DpRank(0), data).await?;
            }
        }
        // And an eviction after the hole.
        let evict = KvCacheEventData::Removed {
            group: None,
            block_hashes: vec![journal_worker::engine_hash(w.id(), 25, 2)],
            tier: kv_events::StorageTier::Gpu,
        };
        w.record_and_publish(DpRank(0), evict).await?;
    }
    for w in [&w1, &w2] {
        eventually(
            "the router to hold exactly the publisher's blocks",
            WAIT,
            || async {
                let ours = router_paths(&daemon, w.id()).await;
                (ours == held_paths(&w.dump(DpRank(0)))).then_some(())
            },
        )
        .await?;
    }
    // Worker 1 still had the lost range in its ring; worker 2 answered with a dump
    // (besides the one each gave at start-up).
    assert_eq!((w1.ranges_served(), w1.dumps_served()), (1, 1));
    assert_eq!((w2.ranges_served(), w2.dumps_served()), (0, 2));
    let counters = daemon.state().indexer.counters().snapshot();
    assert_eq!(counters.gaps, 2);
    assert_eq!(counters.events_lost, 0);
    // Routing sees the recovered blocks: chain 15 (lost in transit) of worker 1.
    let tokens = journal_worker::chain_tokens(w1.id(), 15, 3, BLOCK);
    match cluster
        .route_tokens("after-recovery", integration_tests::continued(&tokens))
        .await?
    {
        RouteReply::Routed(d) => assert_eq!((d.worker_id, d.overlap_blocks), (w1.id(), 3)),
        other => panic!("not routed: {other:?}"),
    }
    daemon.shutdown().await
}

#[tokio::test]
async fn a_daemon_started_late_resyncs_every_worker_before_it_is_ready() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let w1 = JournalWorker::start(&mut cluster, 1, 2, 64).await?;
    // Published before any router runs: nobody receives these.
    for i in 0..40u64 {
        let dp = DpRank((i % 2) as u32);
        w1.record_and_publish(dp, chain_from_root(w1.id(), i, 2))
            .await?;
    }
    let daemon = cluster.start_daemon(|_| {}).await?;
    // Ready means resynced: no waiting needed.
    for dp in [DpRank(0), DpRank(1)] {
        let ours = router_paths_of_rank(&daemon, w1.id(), dp).await;
        assert_eq!(ours, held_paths(&w1.dump(dp)), "rank {dp}");
    }
    assert_eq!(w1.recovery_requests(), 2, "one dump per rank");
    // Events after start-up continue from the dump's position.
    w1.record_and_publish(DpRank(0), chain_from_root(w1.id(), 99, 2))
        .await?;
    eventually("the next event to be applied", WAIT, || async {
        let ours = router_paths_of_rank(&daemon, w1.id(), DpRank(0)).await;
        (ours == held_paths(&w1.dump(DpRank(0)))).then_some(())
    })
    .await?;
    assert_eq!(w1.recovery_requests(), 2, "no gap after the resync");
    daemon.shutdown().await
}

async fn router_paths_of_rank(
    daemon: &router_daemon::Daemon,
    worker: WorkerId,
    dp: DpRank,
) -> journal_worker::Paths {
    journal_worker::router_paths_of(daemon, worker, dp).await
}

#[tokio::test]
async fn a_publisher_that_cannot_recover_does_not_stall_the_index() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    // Worker 5 answers recovery requests with garbage; worker 6 serves none at all.
    let w5 = JournalWorker::start_garbage(&mut cluster, 5).await?;
    let w6 = JournalWorker::start_silent(&mut cluster, 6).await?;
    let daemon = cluster
        .start_daemon(|args| {
            args.index.recovery.recovery_timeout_ms = 300;
            args.index.recovery.recovery_attempts = 2;
        })
        .await?;
    for w in [&w5, &w6] {
        w.record(DpRank(0), chain_from_root(w.id(), 0, 2)); // lost
        w.record_and_publish(DpRank(0), chain_from_root(w.id(), 1, 2))
            .await?;
    }
    // Recovery fails for both; the buffered event is applied past the hole.
    let running = &daemon;
    for w in [&w5, &w6] {
        let tokens = journal_worker::chain_tokens(w.id(), 1, 2, BLOCK);
        let hashes = kv_events::compute_block_hashes(&tokens, BLOCK);
        let rank = kv_events::WorkerRank::new(w.id(), DpRank(0));
        eventually("the event after the hole to be applied", WAIT, || {
            let hashes = hashes.clone();
            async move {
                let scores = running.state().indexer.find_matches(hashes).await.ok()?;
                (scores.get(rank) == 2).then_some(())
            }
        })
        .await?;
    }
    // Given up: the two start-up resyncs and the two gaps.
    let counters = daemon.state().indexer.counters().snapshot();
    assert_eq!(counters.recoveries_abandoned, 4);
    assert_eq!(counters.events_lost, 2);
    assert!(
        w5.recovery_requests() >= 1,
        "the garbage publisher was asked"
    );
    let recovery = &daemon.state().counters.metrics.recovery;
    assert!(
        recovery.runs("range", "failed") >= 2,
        "failures are counted"
    );
    daemon.shutdown().await
}

#[tokio::test]
async fn a_daemon_restarted_while_events_flow_converges() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let w1 = JournalWorker::start(&mut cluster, 1, 1, 256).await?;
    let w2 = JournalWorker::start(&mut cluster, 2, 1, 256).await?;
    let flow1 = w1.flow(DpRank(0), Duration::from_millis(2));
    let flow2 = w2.flow(DpRank(0), Duration::from_millis(3));
    let first = cluster.start_daemon(|_| {}).await?;
    eventually("the first daemon to index the flow", WAIT, || async {
        let stats = first.state().indexer.stats().await.ok()?;
        (stats.entries > 20).then_some(())
    })
    .await?;
    first.shutdown().await?;
    // Events keep flowing while no router runs, and while the next one starts.
    let registry = prometheus::Registry::new();
    let config = router_daemon::DaemonConfig::from_args(&cluster.serve_args())?;
    let second = router_daemon::Daemon::start(config, &registry).await?;
    let applied_at_start = second.state().indexer.counters().snapshot().batches;
    eventually("the second daemon to apply live events", WAIT, || async {
        let now = second.state().indexer.counters().snapshot().batches;
        (now > applied_at_start + 20).then_some(())
    })
    .await?;
    let published = flow1.stop().await + flow2.stop().await;
    assert!(published > 40, "the flow ran: {published} batches");
    for w in [&w1, &w2] {
        eventually("the restarted daemon to converge", WAIT, || async {
            let ours = router_paths(&second, w.id()).await;
            (ours == held_paths(&w.dump(DpRank(0)))).then_some(())
        })
        .await?;
    }
    second.shutdown().await
}

#[tokio::test]
async fn with_jetstream_a_restarted_daemon_restores_its_snapshot_and_replays_the_stream()
-> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    // No recovery responder: the stream and the snapshot alone must suffice.
    let w1 = JournalWorker::start_silent(&mut cluster, 1).await?;
    let jetstream = |args: &mut router_daemon::ServeArgs| {
        args.index.jetstream = true;
        args.index.jetstream_snapshot_every = 10;
    };
    let first = cluster.start_daemon(jetstream).await?;
    for i in 0..45u64 {
        w1.record_and_publish(DpRank(0), chain_from_root(w1.id(), i, 3))
            .await?;
    }
    eventually("the first daemon to consume the stream", WAIT, || async {
        let ours = router_paths(&first, w1.id()).await;
        (ours == held_paths(&w1.dump(DpRank(0)))).then_some(())
    })
    .await?;
    first.shutdown().await?;
    // Published while no router runs: only the stream has them.
    for i in 45..60u64 {
        w1.record_and_publish(DpRank(0), chain_from_root(w1.id(), i, 3))
            .await?;
    }
    w1.record_and_publish(
        DpRank(0),
        KvCacheEventData::Removed {
            group: None,
            block_hashes: vec![journal_worker::engine_hash(w1.id(), 3, 0)],
            tier: kv_events::StorageTier::Gpu,
        },
    )
    .await?;
    let registry = prometheus::Registry::new();
    let mut args = cluster.serve_args();
    jetstream(&mut args);
    let second =
        router_daemon::Daemon::start(router_daemon::DaemonConfig::from_args(&args)?, &registry)
            .await?;
    // Ready means caught up with the stream.
    assert_eq!(
        router_paths(&second, w1.id()).await,
        held_paths(&w1.dump(DpRank(0)))
    );
    let counters = second.state().indexer.counters().snapshot();
    assert_eq!(counters.recovery_requests, 0, "no publisher was needed");
    assert_eq!(
        counters.batches, 16,
        "the first daemon snapshotted at shutdown: only the batches published while \
         no router ran were replayed"
    );
    second.shutdown().await
}

/// The `recovery` field of worker `id`'s rank 0 in `/debug/workers`.
async fn recovery_view(daemon: &router_daemon::Daemon, id: u64) -> serde_json::Value {
    let view = router_daemon::workers_view(daemon.state()).await;
    let json = serde_json::to_value(&view).expect("the view serializes");
    json["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["worker_id"] == id))
        .map(|w| w["ranks"][0]["recovery"].clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_publisher_whose_replies_never_close_the_gap_is_paced_then_degraded() -> anyhow::Result<()>
{
    const BUDGET: u64 = 5;
    const BACKOFF_MIN_MS: u64 = 50;
    let mut cluster = TestCluster::start(BLOCK).await?;
    // Worker 1 answers every recovery request with an empty range: a gap in its
    // events is never closed. Worker 2 is healthy.
    let stuck = JournalWorker::start_stuck(&mut cluster, 1).await?;
    let healthy = JournalWorker::start(&mut cluster, 2, 1, 4096).await?;
    let daemon = cluster
        .start_daemon(|args| {
            let r = &mut args.index.recovery;
            r.recovery_backoff_min_ms = BACKOFF_MIN_MS;
            r.recovery_backoff_max_ms = 400;
            r.recovery_budget = BUDGET as u32;
        })
        .await?;
    // The start-up resync got its (empty) answer and left no hole.
    assert_eq!(stuck.recovery_requests(), 1);
    let rank = kv_events::WorkerRank::new(stuck.id(), DpRank(0));

    stuck
        .record_and_publish(DpRank(0), chain_from_root(stuck.id(), 0, 2))
        .await?;
    for i in 1..4 {
        stuck.record(DpRank(0), chain_from_root(stuck.id(), i, 2)); // lost
    }
    let asked_from = std::time::Instant::now();
    stuck
        .record_and_publish(DpRank(0), chain_from_root(stuck.id(), 4, 2))
        .await?;
    eventually("the stuck rank to be degraded", WAIT, || async {
        (recovery_view(&daemon, 1).await["state"] == "degraded").then_some(())
    })
    .await?;
    let paced_for = asked_from.elapsed();
    // One request per recovery, each after the previous one's backoff: BUDGET
    // requests spread over at least the un-jittered delays 50 + 100 + 200 + 400 ms
    // (unpaced, the same hole drew thousands of requests per second).
    assert_eq!(stuck.recovery_requests(), 1 + BUDGET);
    let min_spacing: u64 = (0..BUDGET - 1)
        .map(|k| (BACKOFF_MIN_MS << k).min(400))
        .sum();
    assert!(
        paced_for >= Duration::from_millis(min_spacing),
        "{BUDGET} recoveries in {paced_for:?}"
    );
    let view = recovery_view(&daemon, 1).await;
    assert_eq!(view["reason"], "hole_not_closed", "{view}");
    assert_eq!(view["failures"], BUDGET, "{view}");
    let recovery = &daemon.state().counters.metrics.recovery;
    assert_eq!(recovery.degraded_ranks(), 1);
    // Degraded: the buffered event went in past the hole (3 events lost) ...
    let hashes = |i| {
        kv_events::compute_block_hashes(
            &journal_worker::chain_tokens(stuck.id(), i, 2, BLOCK),
            BLOCK,
        )
    };
    let indexed = |i| {
        let hashes = hashes(i);
        let daemon = &daemon;
        async move {
            let scores = daemon.state().indexer.find_matches(hashes).await.ok()?;
            (scores.get(rank) == 2).then_some(())
        }
    };
    eventually("the event after the hole to be applied", WAIT, || {
        indexed(4)
    })
    .await?;
    assert_eq!(daemon.state().indexer.counters().snapshot().events_lost, 3);
    // ... and a further gap is skipped without asking the publisher.
    stuck.record(DpRank(0), chain_from_root(stuck.id(), 5, 2)); // lost
    stuck
        .record_and_publish(DpRank(0), chain_from_root(stuck.id(), 6, 2))
        .await?;
    eventually(
        "the event after the second hole to be applied",
        WAIT,
        || indexed(6),
    )
    .await?;
    assert_eq!(
        stuck.recovery_requests(),
        1 + BUDGET,
        "not asked while degraded"
    );
    assert!(recovery.skipped("degraded") >= 2);

    // The other worker's events and every route are unaffected.
    for i in 0..3 {
        healthy
            .record_and_publish(DpRank(0), chain_from_root(healthy.id(), i, 3))
            .await?;
    }
    let attempt = std::sync::atomic::AtomicU64::new(0);
    for (w, i, blocks) in [(healthy.id(), 2, 3), (stuck.id(), 6, 2)] {
        let tokens = journal_worker::chain_tokens(w, i, blocks, BLOCK);
        let routed = eventually("a route to the cached rank", WAIT, || {
            let tokens = tokens.clone();
            let (cluster, n) = (&cluster, attempt.fetch_add(1, Ordering::Relaxed));
            async move {
                let tokens = integration_tests::continued(&tokens);
                match cluster.route_tokens(&format!("r-{n}"), tokens).await.ok()? {
                    RouteReply::Routed(d) if d.overlap_blocks == blocks as u32 => Some(d),
                    _ => None,
                }
            }
        })
        .await?;
        assert_eq!(routed.worker_id, w);
    }
    assert_eq!(recovery_view(&daemon, 2).await, serde_json::Value::Null);
    daemon.shutdown().await
}

#[tokio::test]
async fn a_reply_past_the_chunk_limit_is_refused_counted_and_not_asked_again_at_once()
-> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    // Chunks of at most 8 blocks: a dump of 12 blocks takes 2 chunks.
    let w1 = JournalWorker::start(&mut cluster, 1, 1, 64).await?;
    for i in 0..4 {
        w1.record(DpRank(0), chain_from_root(w1.id(), i, 3));
    }
    let daemon = cluster
        .start_daemon(|args| args.index.recovery.recovery_max_reply_chunks = 1)
        .await?;
    // The start-up dump was refused at its second chunk, once (no retry of an
    // oversized reply), and the rank was given up rather than left waiting.
    assert_eq!(w1.recovery_requests(), 1);
    let recovery = &daemon.state().counters.metrics.recovery;
    assert_eq!(recovery.refused("too_many_chunks"), 1);
    assert_eq!(recovery.runs("dump", "failed"), 1);
    let counters = daemon.state().indexer.counters().snapshot();
    assert_eq!(counters.recoveries_abandoned, 1);
    daemon.shutdown().await
}
