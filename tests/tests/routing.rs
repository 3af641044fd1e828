//! End to end: real nats-server and etcd, the daemon in-process, workers and a
//! frontend played by the test over the real wire protocol.

use anyhow::Context;
use indexer::IndexerApi as _;
use integration_tests::{FakeWorker, TestCluster, eventually, routed_worker};
use kv_events::routing::{RouteErrorCode, RouteReply};
use kv_events::{WorkerId, WorkerRank, encode};
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 10_000 + i).collect()
}

async fn wait_for_overlap(
    daemon: &router_daemon::Daemon,
    tokens: &[u32],
    worker: WorkerId,
    blocks: u32,
) -> anyhow::Result<()> {
    let hashes = FakeWorker::hashes(tokens, BLOCK);
    let rank = WorkerRank::new(worker, kv_events::DpRank(0));
    integration_tests::wait_for_overlap(daemon, &hashes, rank, blocks).await
}

#[tokio::test]
async fn routes_to_the_worker_holding_the_prefix_and_drops_revoked_workers() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    let mut w2 = FakeWorker::register(&mut cluster, 2, 30).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    assert_eq!(
        daemon.state().scheduler().workers().count(),
        2,
        "start-up loads existing registrations"
    );

    let a = prompt(1, 6);
    let b = prompt(2, 6);
    w1.store_prompt(&cluster, &a).await?;
    w2.store_prompt(&cluster, &b).await?;
    wait_for_overlap(&daemon, &a, w1.id, 6).await?;
    wait_for_overlap(&daemon, &b, w2.id, 6).await?;

    // B first (round robin would pick worker 1 here), then a prompt extending A by a
    // partial block, which must go to worker 1 with 6 overlap blocks.
    assert_eq!(
        routed_worker(&cluster.route_tokens("b-1", b.clone()).await?),
        w2.id
    );
    let mut a_longer = a.clone();
    a_longer.extend([9, 9]);
    let reply = cluster.route_tokens("a-1", a_longer).await?;
    assert_eq!(routed_worker(&reply), w1.id);
    let RouteReply::Routed(decision) = &reply else {
        unreachable!()
    };
    assert_eq!(decision.overlap_blocks, 6);
    assert_eq!(decision.request_blocks, 7);

    // Revoking worker 1's lease deletes its key; the daemon drops it everywhere.
    cluster.etcd.lease_revoke(w1.lease).await?;
    eventually("worker 1 to be removed", WAIT, || async {
        (daemon.state().scheduler().workers().count() == 1).then_some(())
    })
    .await?;
    let scores = daemon
        .state()
        .indexer
        .find_matches(FakeWorker::hashes(&a, BLOCK))
        .await?;
    assert_eq!(
        scores.get(WorkerRank::new(w1.id, kv_events::DpRank(0))),
        0,
        "blocks dropped"
    );
    for i in 0..5 {
        let reply = cluster
            .route_tokens(&format!("a-after-{i}"), a.clone())
            .await?;
        assert_eq!(
            routed_worker(&reply),
            w2.id,
            "a revoked worker is never chosen"
        );
    }

    // A worker registered after start-up is picked up by the watch.
    let _w3 = FakeWorker::register(&mut cluster, 3, 30).await?;
    eventually("worker 3 to be discovered", WAIT, || async {
        daemon
            .state()
            .scheduler()
            .workers()
            .any(|w| w.worker_id == WorkerId(3))
            .then_some(())
    })
    .await?;
    daemon.shutdown().await
}

#[tokio::test]
async fn malformed_input_is_counted_skipped_and_loses_nothing() -> anyhow::Result<()> {
    use router_daemon::counters::{MessageKind, Outcome};
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    let subjects = cluster.subjects.clone();
    let nats = cluster.nats.clone();

    // Garbage on every subject the daemon consumes, including a valid batch published
    // on another worker's subject and a truncated valid batch.
    let garbage: &[u8] = &[0xc1, 0xff, 0x00, 0x13];
    nats.publish(subjects.kv_events(WorkerId(1)), garbage.to_vec().into())
        .await?;
    let valid = kv_events::KvEventBatch::new(WorkerId(2), vec![]);
    nats.publish(subjects.kv_events(WorkerId(1)), encode(&valid)?.into())
        .await?;
    let truncated = encode(&kv_events::KvEventBatch::new(
        WorkerId(1),
        vec![kv_events::KvCacheEvent {
            event_id: 99,
            dp_rank: kv_events::DpRank(0),
            data: kv_events::KvCacheEventData::Cleared,
        }],
    ))?;
    nats.publish(
        subjects.kv_events(WorkerId(1)),
        truncated[..truncated.len() - 3].to_vec().into(),
    )
    .await?;
    nats.publish(subjects.load_metrics(WorkerId(1)), garbage.to_vec().into())
        .await?;
    nats.publish(subjects.lifecycle(), garbage.to_vec().into())
        .await?;
    let bad_route = nats
        .request(subjects.route(), garbage.to_vec().into())
        .await?;
    match kv_events::decode::<RouteReply>(&bad_route.payload)? {
        RouteReply::Error(e) => assert_eq!(e.code, RouteErrorCode::BadRequest),
        other => panic!("garbage was routed: {other:?}"),
    }
    // A packed list that is not whole integers: bad_request, naming the field. (Two
    // hashes packed in a 16-byte bin, `c4 10`, cut to 12 bytes.)
    let whole = encode(&kv_events::routing::RouteRequest::new(
        "partial",
        kv_events::routing::Prompt::Blocks {
            block_hashes: vec![kv_events::LocalBlockHash(7); 2],
            num_tokens: 32,
        },
    ))?;
    let at = whole
        .windows(2)
        .position(|w| w == [0xc4, 0x10])
        .context("the hashes packed in one bin")?;
    let mut partial = whole.clone();
    partial[at + 1] = 12;
    partial.drain(at + 2..at + 6);
    let reply = nats.request(subjects.route(), partial.into()).await?;
    match kv_events::decode::<RouteReply>(&reply.payload)? {
        RouteReply::Error(e) => {
            assert_eq!(e.code, RouteErrorCode::BadRequest);
            assert!(e.message.contains("block hashes"), "{}", e.message);
        }
        other => panic!("a partial packed list was routed: {other:?}"),
    }
    let empty = cluster
        .route_tokens("empty", vec![])
        .await
        .context("empty prompt")?;
    assert!(matches!(empty, RouteReply::Error(e) if e.code == RouteErrorCode::BadRequest));

    // A registration with the wrong block size is rejected, not half-applied.
    let bad_reg = kv_events::discovery::WorkerRegistration {
        worker_id: WorkerId(8),
        dp_size: 1,
        block_size: BLOCK + 1,
        total_kv_blocks: 10,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    cluster
        .etcd
        .put(
            subjects.etcd_worker_key(WorkerId(8)),
            serde_json::to_vec(&bad_reg)?,
            None,
        )
        .await?;
    cluster
        .etcd
        .put(
            subjects.etcd_worker_key(WorkerId(9)),
            b"{not json".to_vec(),
            None,
        )
        .await?;

    // Valid traffic after all of that still works.
    let a = prompt(3, 4);
    w1.store_prompt(&cluster, &a).await?;
    wait_for_overlap(&daemon, &a, w1.id, 4).await?;
    let ok = cluster
        .route_tokens("ok", a)
        .await
        .context("valid request after garbage")?;
    assert_eq!(routed_worker(&ok), w1.id);

    let counters = &daemon.state().counters;
    eventually("malformed messages to be counted", WAIT, || async {
        let c = counters;
        (c.messages(MessageKind::Events, Outcome::Malformed) == 2
            && c.messages(MessageKind::Events, Outcome::Rejected) == 1
            && c.messages(MessageKind::Metrics, Outcome::Malformed) == 1
            && c.messages(MessageKind::Lifecycle, Outcome::Malformed) == 1
            && c.messages(MessageKind::Route, Outcome::Malformed) == 2
            && c.messages(MessageKind::Registration, Outcome::Malformed) == 1
            && c.messages(MessageKind::Registration, Outcome::Rejected) == 1)
            .then_some(())
    })
    .await?;
    assert_eq!(
        daemon.state().scheduler().workers().count(),
        1,
        "bad registrations were not added"
    );
    daemon.shutdown().await
}

#[tokio::test]
async fn shutdown_stops_answering_and_returns() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let _w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    assert_eq!(
        routed_worker(&cluster.route_tokens("before", prompt(1, 2)).await?),
        WorkerId(1)
    );
    daemon.shutdown().await?;
    let after = cluster.route_tokens("after", prompt(1, 2)).await;
    assert!(after.is_err(), "no replica is left to answer: {after:?}");
    Ok(())
}

#[tokio::test]
async fn a_failover_route_skips_the_excluded_workers() -> anyhow::Result<()> {
    use kv_events::routing::{MAX_EXCLUDED_WORKERS, Prompt, RouteRequest};
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    let w2 = FakeWorker::register(&mut cluster, 2, 30).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    let a = prompt(4, 6);
    w1.store_prompt(&cluster, &a).await?;
    wait_for_overlap(&daemon, &a, w1.id, 6).await?;
    let excluding = |id: &str, workers: Vec<WorkerId>| RouteRequest {
        exclude_workers: workers,
        ..RouteRequest::new(
            id,
            Prompt::Tokens {
                token_ids: a.clone(),
            },
        )
    };

    // Worker 1 holds the prefix, but the retry already failed there.
    let retry = cluster.route(&excluding("retry", vec![w1.id])).await?;
    assert_eq!(routed_worker(&retry), w2.id);
    // No worker left to try: nothing is booked, and the code is one every client knows.
    match cluster
        .route(&excluding("none", vec![w1.id, w2.id]))
        .await?
    {
        RouteReply::Error(e) => {
            assert_eq!(e.code, RouteErrorCode::NoWorkers);
            assert!(e.message.contains("excluded"), "{}", e.message);
        }
        other => panic!("routed with every worker excluded: {other:?}"),
    }
    let too_many = (0..=MAX_EXCLUDED_WORKERS as u64).map(WorkerId).collect();
    match cluster.route(&excluding("many", too_many)).await? {
        RouteReply::Error(e) => assert_eq!(e.code, RouteErrorCode::BadRequest),
        other => panic!("an oversized exclusion list was routed: {other:?}"),
    }
    assert_eq!(
        daemon.state().scheduler().active_requests(),
        1,
        "only the retry"
    );
    daemon.shutdown().await
}

#[tokio::test]
async fn an_eligible_set_bounds_the_choice_and_fallbacks_rank_the_others() -> anyhow::Result<()> {
    use kv_events::routing::{
        MAX_ELIGIBLE_WORKERS, MAX_FALLBACKS, Prompt, RouteDecision, RouteRequest,
    };
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut workers = Vec::new();
    for id in 1..=120 {
        workers.push(FakeWorker::register(&mut cluster, id, 30).await?);
    }
    let daemon = cluster.start_daemon(|_| {}).await?;
    let a = prompt(5, 6);
    // Worker 110 holds the whole prompt, worker 40 its first 4 blocks, worker 70
    // its first 2.
    for (id, blocks) in [(110, 6), (40, 4), (70, 2)] {
        let held = &a[..(blocks * BLOCK) as usize];
        workers[id as usize - 1]
            .store_prompt(&cluster, held)
            .await?;
        wait_for_overlap(&daemon, held, WorkerId(id), blocks).await?;
    }
    let ask = |id: &str, eligible: Vec<WorkerId>, fallbacks: u8| RouteRequest {
        eligible_workers: eligible,
        fallbacks,
        ..RouteRequest::new(
            id,
            Prompt::Tokens {
                token_ids: a.clone(),
            },
        )
    };
    let decided = |reply: RouteReply| -> RouteDecision {
        match reply {
            RouteReply::Routed(d) => d,
            other => panic!("not routed: {other:?}"),
        }
    };
    let alternates =
        |d: &RouteDecision| -> Vec<u64> { d.fallbacks.iter().map(|f| f.worker_id.0).collect() };

    // Every worker eligible: the holder, then the next cheapest, one per worker.
    let all = decided(cluster.route(&ask("all", Vec::new(), 2)).await?);
    assert_eq!(all.worker_id, WorkerId(110));
    assert_eq!(alternates(&all), [40, 70]);
    assert_eq!(all.fallbacks[0].overlap_blocks, 4);
    // 100 of the 120 workers eligible: the choice and its fallbacks stay inside.
    let inside: Vec<WorkerId> = (1..=100).map(WorkerId).collect();
    let within = decided(cluster.route(&ask("within", inside, 3)).await?);
    assert_eq!(within.worker_id, WorkerId(40));
    let listed = alternates(&within);
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert_eq!(listed[0], 70, "{listed:?}");
    assert!(listed[1..].iter().all(|&w| w <= 100 && w != 40 && w != 70));
    // Nothing registered inside the set: no_workers, as when all are excluded.
    let outside = cluster
        .route(&ask("outside", vec![WorkerId(500)], 0))
        .await?;
    assert!(
        matches!(&outside, RouteReply::Error(e) if e.code == RouteErrorCode::NoWorkers),
        "{outside:?}"
    );
    // Over the bounds: bad_request, nothing booked.
    let wide = (0..=MAX_ELIGIBLE_WORKERS as u64).map(WorkerId).collect();
    for (id, request) in [
        ("wide", ask("wide", wide, 0)),
        ("greedy", ask("greedy", Vec::new(), MAX_FALLBACKS + 1)),
    ] {
        match cluster.route(&request).await? {
            RouteReply::Error(e) => assert_eq!(e.code, RouteErrorCode::BadRequest, "{id}"),
            other => panic!("{id} was routed: {other:?}"),
        }
    }
    assert_eq!(daemon.state().scheduler().active_requests(), 2);
    daemon.shutdown().await
}

/// A readiness probe (a route query with an empty prompt, in either form) gets the
/// reply any empty prompt gets and books nothing, but counts under its own outcome,
/// so frontends' health checks do not read as refused queries; a refused query with
/// tokens still counts as `bad_request`.
#[tokio::test]
async fn a_readiness_probe_counts_apart_from_refused_queries() -> anyhow::Result<()> {
    use kv_events::routing::{MAX_EXCLUDED_WORKERS, Prompt, RouteRequest};
    let mut cluster = TestCluster::start(BLOCK).await?;
    let _w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    let probes = [
        Prompt::Tokens { token_ids: vec![] },
        Prompt::Blocks {
            block_hashes: vec![],
            num_tokens: 0,
        },
    ];
    for (i, probe) in probes.into_iter().enumerate() {
        match cluster
            .route(&RouteRequest::new(format!("probe-{i}"), probe))
            .await?
        {
            RouteReply::Error(e) => {
                assert_eq!(e.code, RouteErrorCode::BadRequest);
                assert!(e.message.contains("empty prompt"), "{}", e.message);
            }
            other => panic!("a probe was routed: {other:?}"),
        }
    }
    let refused = RouteRequest {
        exclude_workers: (0..=MAX_EXCLUDED_WORKERS as u64).map(WorkerId).collect(),
        ..RouteRequest::new(
            "refused",
            Prompt::Tokens {
                token_ids: prompt(1, 2),
            },
        )
    };
    match cluster.route(&refused).await? {
        RouteReply::Error(e) => assert_eq!(e.code, RouteErrorCode::BadRequest),
        other => panic!("an oversized exclusion list was routed: {other:?}"),
    }
    let routed = cluster.route_tokens("routed", prompt(2, 2)).await?;
    assert!(matches!(routed, RouteReply::Routed(_)), "{routed:?}");

    let families = cluster.registry.gather();
    let family = |name: &str| {
        families
            .iter()
            .find(|f| f.name() == name)
            .unwrap_or_else(|| panic!("{name} is exported"))
    };
    let by_outcome = |name: &str| -> Vec<(String, u64)> {
        let mut samples: Vec<(String, u64)> = (family(name).get_metric().iter())
            .map(|m| {
                let outcome = m.get_label()[0].value().to_owned();
                // A counter's value, or a histogram's count (the other reads 0).
                let count =
                    (m.get_counter().value() as u64).max(m.get_histogram().get_sample_count());
                (outcome, count)
            })
            .collect();
        samples.sort();
        samples
    };
    let expected = [
        ("bad_request".to_owned(), 1),
        ("probe".to_owned(), 2),
        ("routed".to_owned(), 1),
    ];
    assert_eq!(by_outcome("kv_router_route_requests_total"), expected);
    assert_eq!(by_outcome("kv_router_route_duration_seconds"), expected);
    assert_eq!(
        daemon.state().scheduler().active_requests(),
        1,
        "only the routed query is booked"
    );
    daemon.shutdown().await
}
