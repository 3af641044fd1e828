//! Issue 14, findings 2, 3 and 4, end to end: who may publish KV events, at which
//! epoch, and what a forged event id does. Real nats-server and etcd, the daemon
//! in-process, publishers with real event journals answering recovery.

mod journal_worker;

use indexer::IndexerApi as _;
use integration_tests::{FakeWorker, TestCluster, eventually, register_worker};
use journal_worker::{JournalWorker, chain_from_root, held_paths, router_paths};
use kv_events::discovery::WorkerRegistration;
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    StoredBlock, WorkerId, encode,
};
use router_daemon::DaemonConfig;
use router_daemon::Starting;
use router_daemon::counters::{MessageKind, Outcome};
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

/// Publishes `batch` on its worker's subject, as anyone on the bus could.
async fn publish(cluster: &TestCluster, batch: &KvEventBatch) -> anyhow::Result<()> {
    let subject = cluster.subjects.kv_events(batch.worker_id);
    cluster.nats.publish(subject, encode(batch)?.into()).await?;
    cluster.nats.flush().await?;
    Ok(())
}

fn one_event(worker: WorkerId, epoch: u64, event_id: u64, data: KvCacheEventData) -> KvEventBatch {
    KvEventBatch {
        worker_id: worker,
        epoch,
        events: vec![KvCacheEvent {
            event_id,
            dp_rank: DpRank(0),
            data,
        }],
    }
}

fn one_block(h: u64) -> KvCacheEventData {
    KvCacheEventData::Stored {
        group: None,
        parent_hash: None,
        blocks: vec![StoredBlock {
            block_hash: ExternalBlockHash(h),
            tokens_hash: LocalBlockHash(h),
        }],
        tier: kv_events::StorageTier::Gpu,
    }
}

/// Waits until the router holds exactly what `worker`'s journal holds on rank 0.
async fn converged(daemon: &router_daemon::Daemon, worker: &JournalWorker) -> anyhow::Result<()> {
    let want = held_paths(&worker.dump(DpRank(0)));
    eventually("the router to hold the journal's blocks", WAIT, || async {
        (router_paths(daemon, worker.id()).await == want).then_some(())
    })
    .await
}

/// Finding 3: a batch on worker 1's subject with a newer epoch (here `u64::MAX`) used
/// to wipe worker 1's index, and its real later events were dropped as stale until it
/// re-registered. Now the forged epoch is held, then dropped; worker 1 keeps its
/// blocks and its events keep applying. A real new epoch comes with a registration.
#[tokio::test]
async fn a_forged_epoch_is_dropped_and_only_a_registration_moves_the_epoch() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let w1 = JournalWorker::start(&mut cluster, 1, 1, 64).await?;
    let daemon = cluster
        .start_daemon(|args| args.index.event_hold_ms = 200)
        .await?;
    for i in 0..3 {
        w1.record_and_send(DpRank(0), chain_from_root(w1.id(), i, 4))
            .await?;
    }
    converged(&daemon, &w1).await?;

    let forged = one_event(w1.id(), u64::MAX, 0, KvCacheEventData::Cleared);
    publish(&cluster, &forged).await?;
    let counters = &daemon.state().counters;
    eventually("the forged epoch to be dropped", WAIT, || async {
        (counters.messages(MessageKind::Events, Outcome::FutureEpoch) == 1).then_some(())
    })
    .await?;
    w1.record_and_send(DpRank(0), chain_from_root(w1.id(), 3, 4))
        .await?;
    // All four chains (16 block paths) survived the forged epoch.
    converged(&daemon, &w1).await?;
    assert_eq!(router_paths(&daemon, w1.id()).await.len(), 16);

    // A real restart: the new epoch's first batch arrives before its registration
    // (NATS beat etcd); it waits, then applies once the registration shows the epoch.
    let epoch = u64::MAX - 1;
    publish(&cluster, &one_event(w1.id(), epoch, 0, one_block(77))).await?;
    let reg = WorkerRegistration {
        worker_id: w1.id(),
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 1024,
        url: None,
        epoch,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    register_worker(&mut cluster.etcd, &cluster.subjects, &reg, 30).await?;
    let rank = kv_events::WorkerRank::new(w1.id(), DpRank(0));
    eventually("the registered epoch to reset the rank", WAIT, || async {
        let paths = router_paths(&daemon, w1.id()).await;
        let cursor = daemon.state().indexer.report().await.ok()?;
        let reset = cursor.blocks_per_rank == vec![(rank, 1)];
        (reset && paths.len() == 1).then_some(())
    })
    .await?;
    assert_eq!(
        counters.messages(MessageKind::Events, Outcome::FutureEpoch),
        1
    );
    daemon.shutdown().await
}

/// Finding 2: one batch with the worker's epoch and `event_id` 2^64−1 set off about
/// 4,000 recovery requests per second to the real engine, without end. Now the event
/// is dropped and one dump is asked for; afterwards the worker's traffic causes no
/// further recovery.
#[tokio::test]
async fn a_forged_event_id_costs_one_dump_not_a_recovery_loop() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let w1 = JournalWorker::start(&mut cluster, 1, 1, 64).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    w1.record_and_send(DpRank(0), chain_from_root(w1.id(), 0, 4))
        .await?;
    converged(&daemon, &w1).await?;
    let before = w1.recovery_requests();

    let epoch = w1.dump(DpRank(0)).epoch;
    publish(&cluster, &one_event(w1.id(), epoch, u64::MAX, one_block(5))).await?;
    eventually("the dump to be served", WAIT, || async {
        (w1.dumps_served() >= 1).then_some(())
    })
    .await?;
    for i in 1..6 {
        w1.record_and_send(DpRank(0), chain_from_root(w1.id(), i, 4))
            .await?;
    }
    converged(&daemon, &w1).await?;
    let stats = daemon.state().indexer.counters().snapshot();
    assert_eq!(stats.far_ahead_events, 1);
    assert_eq!(
        w1.recovery_requests() - before,
        1,
        "one dump request for the forged id, nothing after"
    );
    daemon.shutdown().await
}

/// Finding 4: events from 1,000 worker ids no etcd key named were indexed (64,000
/// entries) and never removed, and added 1,000 metric series. Now they wait for a
/// registration, in a bounded hold, then are dropped and counted; the index and the
/// metrics know only registered workers. A worker that registers within the grace
/// has its early events applied.
#[tokio::test]
async fn events_of_unregistered_workers_wait_briefly_then_are_dropped() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    let mut args = cluster.serve_args();
    args.index.event_hold_ms = 300;
    args.index.event_hold_batches = 100;
    let mut starting = Starting::new(DaemonConfig::from_args(&args)?, &cluster.registry)?;
    let http = starting.serve_http("127.0.0.1:0".parse()?).await?;
    let daemon = starting.start().await?;
    for id in 1000..2000 {
        publish(&cluster, &one_event(WorkerId(id), 0, 0, one_block(id))).await?;
    }
    // Worker 5 publishes first and registers right after.
    let mut w5 = FakeWorker::publisher(WorkerId(5), 0);
    let tokens: Vec<u32> = (0..3 * BLOCK).collect();
    w5.store_prompt(&cluster, &tokens).await?;
    let w5_reg = WorkerRegistration {
        worker_id: WorkerId(5),
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 1024,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    register_worker(&mut cluster.etcd, &cluster.subjects, &w5_reg, 30).await?;
    let hashes = FakeWorker::hashes(&tokens, BLOCK);
    let rank5 = kv_events::WorkerRank::new(WorkerId(5), DpRank(0));
    integration_tests::wait_for_overlap(&daemon, &hashes, rank5, 3).await?;

    let counters = &daemon.state().counters;
    eventually("the 1,000 batches to be dropped", WAIT, || async {
        (counters.messages(MessageKind::Events, Outcome::Unregistered) == 1000).then_some(())
    })
    .await?;
    w1.store_prompt(&cluster, &tokens).await?;
    let rank1 = kv_events::WorkerRank::new(w1.id, DpRank(0));
    integration_tests::wait_for_overlap(&daemon, &hashes, rank1, 3).await?;
    let report = daemon.state().indexer.report().await?;
    let ranks: Vec<WorkerId> = report
        .blocks_per_rank
        .iter()
        .map(|(r, _)| r.worker_id)
        .collect();
    assert_eq!(
        ranks,
        vec![WorkerId(1), WorkerId(5)],
        "only registered workers are indexed"
    );
    let (status, page) = kv_cluster::http::get_once(http, "/metrics", WAIT).await?;
    assert_eq!(status, 200);
    let mut series_workers: Vec<&str> = page
        .lines()
        .filter_map(|line| line.split("worker_id=\"").nth(1)?.split('"').next())
        .collect();
    series_workers.sort_unstable();
    series_workers.dedup();
    assert_eq!(
        series_workers,
        vec!["1", "5"],
        "metric series only for registered workers"
    );
    daemon.shutdown().await
}
