//! End to end through real NATS and etcd: batch routing on `{ns}.router.route_batch`.
//! One round trip places several requests, each seeing the bookings of those placed
//! before it; a bad entry fails alone; a bad batch fails whole and books nothing; a
//! batch never waits in the queue, nor overtakes requests that do.

use integration_tests::{FakeWorker, TestCluster, eventually, wait_for_overlap};
use kv_events::routing::{
    BatchOrder, LifecycleEvent, Prompt, RouteBatchReply, RouteBatchRequest, RouteDecision,
    RouteError, RouteErrorCode, RouteReply, RouteRequest,
};
use kv_events::{DpRank, RequestId, WorkerId, WorkerRank, decode, encode};
use router_daemon::Daemon;
use router_daemon::counters::{MessageKind, Outcome};
use std::collections::BTreeSet;
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);
const PREFIX_BLOCKS: u32 = 4;

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 10_000 + i).collect()
}

/// The cached prefix plus one block of its own.
fn with_prefix(seed: u32) -> Vec<u32> {
    let mut p = prompt(1, PREFIX_BLOCKS);
    p.extend((0..BLOCK).map(|t| 500_000 + seed * 10 + t));
    p
}

fn tokens(id: &str, token_ids: Vec<u32>) -> RouteRequest {
    RouteRequest::new(id, Prompt::Tokens { token_ids })
}

fn batch(order: BatchOrder, requests: Vec<RouteRequest>) -> RouteBatchRequest {
    RouteBatchRequest { requests, order }
}

fn answered(reply: RouteBatchReply) -> Vec<RouteReply> {
    match reply {
        RouteBatchReply::Answered { replies } => replies,
        RouteBatchReply::Error(e) => panic!("batch refused: {e:?}"),
    }
}

fn routed(reply: &RouteReply) -> &RouteDecision {
    match reply {
        RouteReply::Routed(d) => d,
        RouteReply::Error(e) => panic!("entry failed: {e:?}"),
    }
}

fn failed(reply: &RouteReply) -> &RouteError {
    match reply {
        RouteReply::Error(e) => e,
        RouteReply::Routed(d) => panic!("entry routed: {d:?}"),
    }
}

async fn wait_for_workers(daemon: &Daemon, ranks: usize) -> anyhow::Result<()> {
    eventually("the workers to be registered", WAIT, || async {
        (daemon.state().scheduler().ranks().len() == ranks).then_some(())
    })
    .await
}

async fn active(daemon: &Daemon) -> usize {
    daemon.state().scheduler().active_requests()
}

#[tokio::test]
async fn a_batch_is_placed_in_one_round_trip_and_bad_entries_fail_alone() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut holder = FakeWorker::register(&mut cluster, 1, 60).await?;
    FakeWorker::register(&mut cluster, 2, 60).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    holder
        .store_prompt(&cluster, &prompt(1, PREFIX_BLOCKS))
        .await?;
    let hashes = FakeWorker::hashes(&prompt(1, PREFIX_BLOCKS), BLOCK);
    let rank1 = WorkerRank::new(WorkerId(1), DpRank(0));
    wait_for_overlap(&daemon, &hashes, rank1, PREFIX_BLOCKS).await?;
    wait_for_workers(&daemon, 2).await?;

    let replies = answered(
        cluster
            .route_batch(&batch(
                BatchOrder::AsGiven,
                vec![
                    tokens("a", with_prefix(1)),
                    tokens("empty", vec![]),
                    tokens("c", with_prefix(3)),
                    tokens("a", with_prefix(4)),
                    tokens("d", prompt(9, 3)),
                ],
            ))
            .await?,
    );
    assert_eq!(replies.len(), 5, "one reply per request: {replies:?}");
    // Input order; the entries sharing the cached prefix land where it is cached.
    for (i, id) in [(0, "a"), (2, "c")] {
        let d = routed(&replies[i]);
        assert_eq!(d.request_id, RequestId::from(id));
        assert_eq!(d.worker_id, WorkerId(1), "{id} follows the prefix");
        assert_eq!(d.overlap_blocks, PREFIX_BLOCKS);
        assert_eq!(d.request_blocks, PREFIX_BLOCKS + 1);
    }
    assert_eq!(failed(&replies[1]).code, RouteErrorCode::BadRequest);
    let duplicate = failed(&replies[3]);
    assert_eq!(duplicate.code, RouteErrorCode::BadRequest);
    assert!(duplicate.message.contains('a'), "{}", duplicate.message);
    assert_eq!(routed(&replies[4]).request_id, RequestId::from("d"));
    assert_eq!(
        active(&daemon).await,
        3,
        "exactly the routed entries are booked"
    );

    let counters = &daemon.state().counters;
    assert_eq!(counters.messages(MessageKind::RouteBatch, Outcome::Ok), 1);
    assert_eq!(counters.messages(MessageKind::Route, Outcome::Ok), 3);
    assert_eq!(counters.messages(MessageKind::Route, Outcome::Rejected), 2);

    // Batch entries have the ordinary lifecycle.
    cluster.lifecycle("a", LifecycleEvent::Freed).await?;
    eventually("a's booking to be released", WAIT, || async {
        (active(&daemon).await == 2).then_some(())
    })
    .await?;
    daemon.shutdown().await
}

#[tokio::test]
async fn a_bad_batch_is_refused_whole_and_books_nothing() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    FakeWorker::register(&mut cluster, 1, 60).await?;
    let daemon = cluster.start_daemon(|a| a.max_route_batch = 2).await?;
    wait_for_workers(&daemon, 1).await?;

    let refused = |reply: RouteBatchReply| match reply {
        RouteBatchReply::Error(e) => e,
        RouteBatchReply::Answered { replies } => panic!("batch answered: {replies:?}"),
    };
    let empty = refused(
        cluster
            .route_batch(&batch(BatchOrder::default(), vec![]))
            .await?,
    );
    assert_eq!(empty.code, RouteErrorCode::BadRequest);
    let too_many = refused(
        cluster
            .route_batch(&batch(
                BatchOrder::default(),
                (0..3)
                    .map(|i| tokens(&format!("r{i}"), prompt(i, 1)))
                    .collect(),
            ))
            .await?,
    );
    assert_eq!(too_many.code, RouteErrorCode::BadRequest);
    assert!(too_many.message.contains("1 to 2"), "{}", too_many.message);
    let reply = cluster
        .nats
        .request(
            cluster.subjects.route_batch(),
            b"\xc1 not msgpack".to_vec().into(),
        )
        .await?;
    let malformed = refused(decode(&reply.payload)?);
    assert_eq!(malformed.code, RouteErrorCode::BadRequest);

    let counters = &daemon.state().counters;
    assert_eq!(
        counters.messages(MessageKind::RouteBatch, Outcome::Malformed),
        1
    );
    assert_eq!(
        counters.messages(MessageKind::RouteBatch, Outcome::Rejected),
        2
    );
    assert_eq!(active(&daemon).await, 0);
    // The daemon still routes.
    let ok = answered(
        cluster
            .route_batch(&batch(
                BatchOrder::default(),
                vec![tokens("x", prompt(5, 1))],
            ))
            .await?,
    );
    assert_eq!(routed(&ok[0]).worker_id, WorkerId(1));
    daemon.shutdown().await
}

#[tokio::test]
async fn a_batch_never_waits_nor_overtakes_waiters() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    FakeWorker::register(&mut cluster, 1, 60).await?;
    FakeWorker::register(&mut cluster, 2, 60).await?;
    let daemon = cluster
        .start_daemon(|a| {
            // A rank holding 4 decode blocks is busy: one 4-block request each.
            a.scheduling.scheduler.busy_decode_blocks = Some("4".parse().expect("threshold"));
            a.scheduling.queue_capacity = 1;
            a.scheduling.queue_max_wait_ms = 5000;
        })
        .await?;
    wait_for_workers(&daemon, 2).await?;

    // Each booking makes its rank busy for the entries after it.
    let replies = answered(
        cluster
            .route_batch(&batch(
                BatchOrder::AsGiven,
                (1..=3)
                    .map(|i| tokens(&format!("b{i}"), prompt(i, 4)))
                    .collect(),
            ))
            .await?,
    );
    let workers: BTreeSet<WorkerId> = replies[..2].iter().map(|r| routed(r).worker_id).collect();
    assert_eq!(workers.len(), 2, "one entry per worker: {replies:?}");
    assert_eq!(failed(&replies[2]).code, RouteErrorCode::Overloaded);
    assert_eq!(
        daemon.state().admission.queue.lock().len(),
        0,
        "the refused entry did not queue"
    );

    // A single request waits for a free rank; a batch arriving now does not overtake it.
    let waiting = {
        let nats = cluster.nats.clone();
        let subject = cluster.subjects.route();
        let payload = encode(&tokens("waiter", prompt(7, 4)))?;
        tokio::spawn(async move { nats.request(subject, payload.into()).await })
    };
    let queue = &daemon.state().admission.queue;
    eventually("the single request to wait in the queue", WAIT, || async {
        (queue.lock().len() == 1).then_some(())
    })
    .await?;
    let replies = answered(
        cluster
            .route_batch(&batch(
                BatchOrder::default(),
                vec![tokens("late", prompt(8, 1))],
            ))
            .await?,
    );
    let late = failed(&replies[0]);
    assert_eq!(late.code, RouteErrorCode::Overloaded);
    assert!(
        late.message.contains("batch does not wait"),
        "{}",
        late.message
    );

    // Freeing a batch entry releases the waiter.
    cluster.lifecycle("b1", LifecycleEvent::Freed).await?;
    let reply: RouteReply = decode(&waiting.await??.payload)?;
    assert_eq!(routed(&reply).request_id, RequestId::from("waiter"));
    assert_eq!(active(&daemon).await, 2);
    daemon.shutdown().await
}
