//! End to end through real NATS and etcd: the full request lifecycle in the router
//! (route → prefill done → keep-alive → free, and expiry of a request nobody frees),
//! data-parallel ranks with pinning, per-request policy and overrides, and the wait
//! queue when every worker is busy.

use integration_tests::{TestCluster, eventually};
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{
    BatchOrder, CostOverrides, LifecycleEvent, PolicyKind, Prompt, RouteBatchReply,
    RouteBatchRequest, RouteDecision, RouteError, RouteErrorCode, RouteReply, RouteRequest,
};
use kv_events::{DpRank, RequestId, WorkerId, WorkerRank, encode};
use router_daemon::Daemon;
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 10_000 + i).collect()
}

/// Registers worker `id` with `dp_size` ranks of `total_kv_blocks` under a lease.
async fn register(cluster: &mut TestCluster, id: u64, dp_size: u32) -> anyhow::Result<()> {
    let reg = WorkerRegistration {
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
    integration_tests::register_worker(&mut cluster.etcd, &cluster.subjects, &reg, 60).await?;
    Ok(())
}

fn routed(reply: RouteReply) -> RouteDecision {
    match reply {
        RouteReply::Routed(d) => d,
        RouteReply::Error(e) => panic!("route failed: {e:?}"),
    }
}

fn refused(reply: RouteReply) -> RouteError {
    match reply {
        RouteReply::Error(e) => e,
        RouteReply::Routed(d) => panic!("routed although it should not be: {d:?}"),
    }
}

fn tokens(id: &str, token_ids: Vec<u32>) -> RouteRequest {
    RouteRequest::new(id, Prompt::Tokens { token_ids })
}

async fn active(daemon: &Daemon) -> usize {
    daemon.state().scheduler().active_requests()
}

#[tokio::test]
async fn route_prefill_done_keep_alive_free_and_expiry() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    register(&mut cluster, 1, 1).await?;
    let daemon = cluster
        .start_daemon(|a| a.scheduling.scheduler.request_ttl_ms = 2000)
        .await?;
    let rank = WorkerRank::new(WorkerId(1), DpRank(0));

    // Route: 3 blocks, nothing cached → 12 prefill tokens and 3 decode blocks booked.
    let d = routed(cluster.route_tokens("r1", prompt(1, 3)).await?);
    assert_eq!((d.worker_id, d.dp_rank), (WorkerId(1), DpRank(0)));
    let load = daemon.state().scheduler().rank_load(rank);
    assert_eq!(
        (load.active_prefill_tokens, load.active_decode_blocks),
        (12, 3)
    );

    cluster.lifecycle("r1", LifecycleEvent::PrefillDone).await?;
    eventually("prefill done to be applied", WAIT, || async {
        (daemon
            .state()
            .scheduler()
            .rank_load(rank)
            .active_prefill_tokens
            == 0)
            .then_some(())
    })
    .await?;
    assert_eq!(
        daemon
            .state()
            .scheduler()
            .rank_load(rank)
            .active_decode_blocks,
        3
    );

    // Keep-alives push the deadline out, so a request that lives longer than the TTL
    // is not expired while its frontend reports it.
    let id = RequestId::from("r1");
    let deadline = |d: &Daemon| {
        d.state()
            .scheduler()
            .sequences()
            .get(&id)
            .map(|r| r.deadline)
    };
    for _ in 0..3 {
        let before = deadline(&daemon).expect("r1 is active");
        cluster.lifecycle("r1", LifecycleEvent::KeepAlive).await?;
        eventually("keep-alive to refresh the deadline", WAIT, || async {
            (deadline(&daemon)? > before).then_some(())
        })
        .await?;
    }

    cluster.lifecycle("r1", LifecycleEvent::Freed).await?;
    eventually("free to release the load", WAIT, || async {
        (active(&daemon).await == 0).then_some(())
    })
    .await?;
    let load = daemon.state().scheduler().rank_load(rank);
    assert_eq!(
        (
            load.active_requests,
            load.active_decode_blocks,
            load.active_prefill_tokens
        ),
        (0, 0, 0)
    );

    // A request whose frontend never reports back expires after the TTL.
    routed(cluster.route_tokens("abandoned", prompt(2, 2)).await?);
    assert_eq!(active(&daemon).await, 1);
    eventually("the abandoned request to expire", WAIT, || async {
        (active(&daemon).await == 0).then_some(())
    })
    .await?;
    assert_eq!(daemon.state().admission.expired.get(), 1);
    // Its late lifecycle messages are counted as rejected and change nothing.
    let counters = &daemon.state().counters;
    use router_daemon::counters::{MessageKind, Outcome};
    let rejected = counters.messages(MessageKind::Lifecycle, Outcome::Rejected);
    cluster
        .lifecycle("abandoned", LifecycleEvent::Freed)
        .await?;
    eventually("the late free to be counted", WAIT, || async {
        (counters.messages(MessageKind::Lifecycle, Outcome::Rejected) == rejected + 1).then_some(())
    })
    .await?;
    let exported = cluster
        .registry
        .gather()
        .iter()
        .any(|f| f.name() == "kv_router_requests_expired_total");
    assert!(exported, "expiry counter is exported");
    daemon.shutdown().await
}

/// The reply's `in_flight_blocks` names the prefix a request still booked on the rank
/// shares with the prompt, which the index cannot know yet (the cache-parity monitor
/// counts engine hits on it as `in_flight`, not as under-claims).
#[tokio::test]
async fn a_reply_names_the_prefix_booked_requests_share_before_it_is_indexed() -> anyhow::Result<()>
{
    let mut cluster = TestCluster::start(BLOCK).await?;
    register(&mut cluster, 1, 1).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    let first = routed(cluster.route_tokens("first", prompt(1, 3)).await?);
    assert_eq!((first.overlap_blocks, first.in_flight_blocks), (0, 0));
    // 4 blocks and one token: the first 3 blocks are the booked request's.
    let mut longer = prompt(1, 4);
    longer.push(7);
    let second = routed(cluster.route_tokens("second", longer.clone()).await?);
    assert_eq!((second.overlap_blocks, second.in_flight_blocks), (0, 3));
    for id in ["first", "second"] {
        cluster.lifecycle(id, LifecycleEvent::Freed).await?;
    }
    eventually("both frees to be applied", WAIT, || async {
        let third = routed(cluster.route_tokens("third", longer.clone()).await.ok()?);
        cluster
            .lifecycle("third", LifecycleEvent::Freed)
            .await
            .ok()?;
        (third.in_flight_blocks == 0).then_some(())
    })
    .await?;
    daemon.shutdown().await
}

#[tokio::test]
async fn dp_ranks_pinning_policies_and_overrides() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    register(&mut cluster, 1, 2).await?;
    register(&mut cluster, 2, 1).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    assert_eq!(daemon.state().scheduler().ranks().len(), 3);

    // A pinned request lands on that dp_rank, on the only worker that has it.
    let pinned = RouteRequest {
        dp_rank: Some(DpRank(1)),
        ..tokens("pinned", prompt(1, 2))
    };
    let d = routed(cluster.route(&pinned).await?);
    assert_eq!((d.worker_id, d.dp_rank), (WorkerId(1), DpRank(1)));
    // No worker has dp_rank 3: a typed refusal, never another rank.
    let missing = RouteRequest {
        dp_rank: Some(DpRank(3)),
        ..tokens("missing", prompt(2, 2))
    };
    let e = refused(cluster.route(&missing).await?);
    assert_eq!(e.code, RouteErrorCode::RankUnavailable);
    assert_eq!(e.message, "no registered worker has dp_rank 3");

    // Per-request policy, and overrides of its knobs.
    let normalized = RouteRequest {
        policy: Some(PolicyKind::KvNormalized),
        overrides: CostOverrides {
            load_balance_weight: Some(2.0),
            ..CostOverrides::default()
        },
        ..tokens("normalized", prompt(3, 2))
    };
    assert_eq!(
        routed(cluster.route(&normalized).await?).policy,
        PolicyKind::KvNormalized
    );
    let least = RouteRequest {
        policy: Some(PolicyKind::LeastLoaded),
        ..tokens("least", prompt(4, 2))
    };
    // Ranks 1/0 and 2/0 are idle (1/1 holds "pinned", one of them "normalized"):
    // least-loaded picks an idle one.
    let d = routed(cluster.route(&least).await?);
    let rank = WorkerRank::new(d.worker_id, d.dp_rank);
    assert_ne!(rank, WorkerRank::new(WorkerId(1), DpRank(1)));
    let bad = RouteRequest {
        policy: Some(PolicyKind::RoundRobin),
        overrides: CostOverrides {
            temperature: Some(1.0),
            ..CostOverrides::default()
        },
        ..tokens("bad", prompt(5, 2))
    };
    let e = refused(cluster.route(&bad).await?);
    assert_eq!(e.code, RouteErrorCode::BadRequest);
    assert!(e.message.contains("temperature"), "{}", e.message);
    let negative = RouteRequest {
        overrides: CostOverrides {
            overlap_credit: Some(-1.0),
            ..CostOverrides::default()
        },
        ..tokens("negative", prompt(6, 2))
    };
    assert_eq!(
        refused(cluster.route(&negative).await?).code,
        RouteErrorCode::BadRequest
    );
    assert_eq!(active(&daemon).await, 3, "refused requests book nothing");
    daemon.shutdown().await
}

/// A daemon whose ranks are busy from 8 decode blocks on, with a wait queue of
/// `capacity` requests waiting at most `max_wait_ms` each.
async fn busy_at_8_blocks(
    cluster: &TestCluster,
    capacity: usize,
    max_wait_ms: u64,
) -> anyhow::Result<Daemon> {
    cluster
        .start_daemon(|a| {
            a.scheduling.scheduler.busy_decode_blocks = Some("8".parse().expect("threshold"));
            a.scheduling.queue_capacity = capacity;
            a.scheduling.queue_max_wait_ms = max_wait_ms;
        })
        .await
}

#[tokio::test]
async fn busy_workers_make_requests_wait_and_a_free_releases_them() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    register(&mut cluster, 1, 1).await?;
    let daemon = busy_at_8_blocks(&cluster, 1, 3000).await?;
    let queue = &daemon.state().admission.queue;

    // 8 decode blocks: the only worker is busy from now on.
    routed(cluster.route_tokens("hog", prompt(1, 8)).await?);
    let waiting = {
        let nats = cluster.nats.clone();
        let subject = cluster.subjects.route();
        let payload = encode(&tokens("waiter", prompt(2, 8)))?;
        tokio::spawn(async move { nats.request(subject, payload.into()).await })
    };
    eventually("the second request to wait in the queue", WAIT, || async {
        (queue.lock().len() == 1).then_some(())
    })
    .await?;
    // The queue holds one: the next is refused at once.
    let e = refused(cluster.route_tokens("third", prompt(3, 2)).await?);
    assert_eq!(e.code, RouteErrorCode::Overloaded);
    assert!(e.message.contains("queue is full"), "{}", e.message);

    // Freeing the hog releases the waiter, which is routed (and now holds the worker).
    cluster.lifecycle("hog", LifecycleEvent::Freed).await?;
    let reply: RouteReply = kv_events::decode(&waiting.await??.payload)?;
    let d = routed(reply);
    assert_eq!(d.request_id, RequestId::from("waiter"));
    assert_eq!(queue.outcomes().get("routed"), 1);
    assert_eq!(queue.outcomes().get("refused"), 1);

    // With nothing freed, a waiter is answered overloaded after the maximum wait.
    let e = refused(cluster.route_tokens("patient", prompt(4, 2)).await?);
    assert_eq!(e.code, RouteErrorCode::Overloaded);
    assert!(e.message.contains("stayed busy"), "{}", e.message);
    assert_eq!(queue.outcomes().get("timed_out"), 1);
    assert_eq!(active(&daemon).await, 1, "only the waiter is booked");

    // Queue depth and wait time are exported.
    let families = cluster.registry.gather();
    let family = |name: &str| families.iter().find(|f| f.name() == name);
    let depth = family("kv_router_queue_depth").expect("depth exported");
    assert_eq!(depth.get_metric()[0].get_gauge().value(), 0.0);
    let wait = family("kv_router_queue_wait_seconds").expect("wait exported");
    assert_eq!(wait.get_metric()[0].get_histogram().sample_count(), 1);
    daemon.shutdown().await
}

/// A frontend that gives up on a route query frees its id. A router that reads the
/// query only after that `freed` (a replica that stalled and resumed; alone or in a
/// batch), or holds it in its wait queue when the `freed` comes, refuses it and books
/// nothing.
#[tokio::test]
async fn a_query_freed_before_it_was_routed_books_nothing() -> anyhow::Result<()> {
    use router_daemon::counters::{MessageKind, Outcome};
    let mut cluster = TestCluster::start(BLOCK).await?;
    register(&mut cluster, 1, 1).await?;
    let daemon = busy_at_8_blocks(&cluster, 64, 10_000).await?;
    let counters = &daemon.state().counters;
    let stale = |reply: RouteReply| {
        let e = refused(reply);
        assert_eq!(e.code, RouteErrorCode::BadRequest);
        assert!(e.message.contains("freed by its frontend"), "{}", e.message);
    };

    // Freed first, asked after: refused.
    cluster.lifecycle("gave-up", LifecycleEvent::Freed).await?;
    eventually("the freed to be read", WAIT, || async {
        (counters.messages(MessageKind::Lifecycle, Outcome::Rejected) == 1).then_some(())
    })
    .await?;
    stale(cluster.route_tokens("gave-up", prompt(1, 2)).await?);
    assert_eq!(active(&daemon).await, 0);
    // In a batch, the entry alone.
    let batch = RouteBatchRequest {
        requests: vec![
            tokens("gave-up", prompt(1, 2)),
            tokens("beside", prompt(5, 2)),
        ],
        order: BatchOrder::AsGiven,
    };
    let RouteBatchReply::Answered { mut replies } = cluster.route_batch(&batch).await? else {
        panic!("batch refused whole");
    };
    routed(replies.pop().expect("two replies"));
    stale(replies.pop().expect("two replies"));
    assert_eq!(active(&daemon).await, 1, "only the entry beside it");
    cluster.lifecycle("beside", LifecycleEvent::Freed).await?;
    eventually("the entry beside it to be freed", WAIT, || async {
        (active(&daemon).await == 0).then_some(())
    })
    .await?;

    // Waiting in the queue behind a busy worker when its freed comes: refused when
    // the worker frees.
    routed(cluster.route_tokens("hog", prompt(2, 8)).await?);
    let waiting = {
        let nats = cluster.nats.clone();
        let subject = cluster.subjects.route();
        let payload = encode(&tokens("waiter", prompt(3, 2)))?;
        tokio::spawn(async move { nats.request(subject, payload.into()).await })
    };
    let queue = &daemon.state().admission.queue;
    eventually("the waiter to queue", WAIT, || async {
        (queue.lock().len() == 1).then_some(())
    })
    .await?;
    cluster.lifecycle("waiter", LifecycleEvent::Freed).await?;
    eventually("the waiter's freed to be read", WAIT, || async {
        (counters.messages(MessageKind::Lifecycle, Outcome::Rejected) == 2).then_some(())
    })
    .await?;
    cluster.lifecycle("hog", LifecycleEvent::Freed).await?;
    stale(kv_events::decode(&waiting.await??.payload)?);
    assert_eq!(active(&daemon).await, 0, "neither is booked");

    // A fresh id routes as ever.
    routed(cluster.route_tokens("fresh", prompt(4, 2)).await?);
    daemon.shutdown().await
}
