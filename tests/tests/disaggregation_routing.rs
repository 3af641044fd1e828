//! Prefill/decode disaggregation in the router, end to end: real nats-server and
//! etcd, the daemon in-process, prefill and decode workers registered in etcd with
//! their role and transfer protocol and played by the test over the real wire
//! protocol. A long prompt held by one prefill worker is paired with it and a decode
//! worker; a short one stays on the decode worker; requests without
//! `allow_disaggregation` never reach a prefill worker; the lifecycle returns both
//! bookings to zero; two replicas see both halves of each other's bookings (live
//! sync and the start-up snapshot); approximate mode indexes both workers.

use indexer::IndexerApi as _;
use integration_tests::{FakeWorker, TestCluster, booked_requests, eventually, register_worker};
use kv_events::disaggregation::{DisaggregationReason, KvTransfer, TransferProtocol, WorkerRole};
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{
    LifecycleEvent, Prompt, RouteDecision, RouteErrorCode, RouteReply, RouteRequest,
};
use kv_events::{DpRank, RouterId, WorkerId, WorkerRank};
use router_daemon::{Daemon, DaemonConfig, Origin, Starting};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);
/// Tokens of the prefix prefill worker 12 holds: 500 blocks.
const PREFIX: u32 = 2000;

fn rank(id: u64) -> WorkerRank {
    WorkerRank::new(WorkerId(id), DpRank(0))
}

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed * 100_000 + i).collect()
}

fn registration(id: u64, role: WorkerRole) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 10_000,
        url: None,
        epoch: 0,
        max_model_len: None,
        role,
        kv_transfer: Some(KvTransfer {
            protocol: TransferProtocol::Vllm,
            bootstrap_port: None,
        }),
    }
}

/// Decode workers 1 and 2, prefill workers 11 and 12 (vLLM); returns worker 12's
/// event publisher.
async fn register_fleet(cluster: &mut TestCluster) -> anyhow::Result<FakeWorker> {
    for (id, role) in [
        (1, WorkerRole::Decode),
        (2, WorkerRole::Decode),
        (11, WorkerRole::Prefill),
    ] {
        register_worker(
            &mut cluster.etcd,
            &cluster.subjects,
            &registration(id, role),
            30,
        )
        .await?;
    }
    let reg = registration(12, WorkerRole::Prefill);
    let lease = register_worker(&mut cluster.etcd, &cluster.subjects, &reg, 30).await?;
    Ok(FakeWorker::publisher(WorkerId(12), lease))
}

fn pair_request(id: &str, token_ids: Vec<u32>) -> RouteRequest {
    let mut r = RouteRequest::new(id, Prompt::Tokens { token_ids });
    r.allow_disaggregation = true;
    r
}

fn routed(reply: RouteReply) -> RouteDecision {
    match reply {
        RouteReply::Routed(d) => d,
        RouteReply::Error(e) => panic!("route failed: {e:?}"),
    }
}

/// The value of `name{labels}` on a `/metrics` page (labels in exposition order).
fn metric(page: &str, name: &str, labels: &str) -> Option<f64> {
    let series = format!("{name}{{{labels}}} ");
    page.lines()
        .find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
}

async fn scrape(http: SocketAddr) -> anyhow::Result<String> {
    let (status, page) = kv_cluster::http::get_once(http, "/metrics", WAIT).await?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    Ok(page)
}

/// The load gauges of worker `id` (rank 0): prefill tokens, decode blocks, requests.
fn rank_gauges(page: &str, id: u64) -> [f64; 3] {
    let labels = format!("dp_rank=\"0\",worker_id=\"{id}\"");
    [
        "kv_router_worker_active_prefill_tokens",
        "kv_router_worker_active_decode_blocks",
        "kv_router_worker_active_requests",
    ]
    .map(|name| metric(page, name, &labels).unwrap_or(f64::NAN))
}

/// Waits until the scraped gauges of every worker in `expected` match.
async fn wait_for_gauges(
    http: SocketAddr,
    what: &str,
    expected: &[(u64, [f64; 3])],
) -> anyhow::Result<()> {
    eventually(what, WAIT, || async {
        let page = scrape(http).await.ok()?;
        expected
            .iter()
            .all(|(id, want)| rank_gauges(&page, *id) == *want)
            .then_some(())
    })
    .await
}

fn decisions(page: &str, reason: DisaggregationReason) -> Option<f64> {
    let labels = format!("reason=\"{}\"", reason.as_str());
    metric(page, "kv_router_disaggregation_decisions_total", &labels)
}

#[tokio::test]
async fn pairs_long_prompts_with_the_prefill_worker_holding_them_and_frees_both_halves()
-> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut w12 = register_fleet(&mut cluster).await?;
    let mut starting = Starting::new(
        DaemonConfig::from_args(&cluster.serve_args())?,
        &cluster.registry,
    )?;
    let http = starting.serve_http("127.0.0.1:0".parse()?).await?;
    let daemon = starting.start().await?;
    let page = scrape(http).await?;
    for reason in DisaggregationReason::ALL {
        assert_eq!(
            decisions(&page, reason),
            Some(0.0),
            "{reason:?} pre-registered"
        );
    }

    // Worker 12 holds a 500-block prefix; the prompt adds 100 blocks of its own.
    let prefix = tokens(1, PREFIX);
    w12.store_prompt(&cluster, &prefix).await?;
    let hashes = FakeWorker::hashes(&prefix, BLOCK);
    integration_tests::wait_for_overlap(&daemon, &hashes, rank(12), 500).await?;
    let mut prompt = prefix.clone();
    prompt.extend(tokens(2, 400));
    let d = routed(cluster.route(&pair_request("long", prompt)).await?);
    assert!([WorkerId(1), WorkerId(2)].contains(&d.worker_id), "{d:?}");
    let decode = d.worker_id.0;
    let disaggregation = d.disaggregation.expect("a decision");
    assert_eq!(disaggregation.reason, DisaggregationReason::LongUncached);
    let prefill = disaggregation.prefill.expect("prefilled remotely");
    assert_eq!(
        (prefill.worker_id, prefill.dp_rank, prefill.overlap_blocks),
        (WorkerId(12), DpRank(0), 500)
    );
    // The decode half: 600 blocks, nothing to prefill; the prefill half: its 400
    // uncached tokens and the 600 blocks it holds for the transfer.
    wait_for_gauges(
        http,
        "both halves booked",
        &[(decode, [0.0, 600.0, 1.0]), (12, [400.0, 600.0, 1.0])],
    )
    .await?;
    assert_eq!(
        decisions(&scrape(http).await?, DisaggregationReason::LongUncached),
        Some(1.0)
    );

    cluster
        .lifecycle("long", LifecycleEvent::RemotePrefillDone)
        .await?;
    wait_for_gauges(
        http,
        "the prefill half's tokens released",
        &[(decode, [0.0, 600.0, 1.0]), (12, [0.0, 600.0, 1.0])],
    )
    .await?;
    cluster
        .lifecycle("long", LifecycleEvent::PrefillDone)
        .await?;
    wait_for_gauges(
        http,
        "the prefill half freed at the first token",
        &[(decode, [0.0, 600.0, 1.0]), (12, [0.0, 0.0, 0.0])],
    )
    .await?;
    cluster.lifecycle("long", LifecycleEvent::Freed).await?;
    let zero = [0.0; 3];
    wait_for_gauges(
        http,
        "everything freed",
        &[(1, zero), (2, zero), (11, zero), (12, zero)],
    )
    .await?;

    // A short prompt stays on its decode worker, which prefills it.
    let d = routed(
        cluster
            .route(&pair_request("short", tokens(3, 100)))
            .await?,
    );
    let disaggregation = d.disaggregation.expect("a decision");
    assert_eq!(disaggregation.reason, DisaggregationReason::ShortUncached);
    assert_eq!(disaggregation.prefill, None);
    wait_for_gauges(
        http,
        "the short prompt booked locally",
        &[(d.worker_id.0, [100.0, 25.0, 1.0]), (11, zero), (12, zero)],
    )
    .await?;
    cluster.lifecycle("short", LifecycleEvent::Freed).await?;

    // Without the flag, no decision and never a prefill worker, even for the prompt
    // worker 12 holds.
    for i in 0..8 {
        let mut prompt = prefix.clone();
        prompt.extend(tokens(10 + i, 40));
        let request = RouteRequest::new(format!("whole-{i}"), Prompt::Tokens { token_ids: prompt });
        let d = routed(cluster.route(&request).await?);
        assert!([WorkerId(1), WorkerId(2)].contains(&d.worker_id), "{d:?}");
        assert_eq!(d.disaggregation, None);
    }
    let page = scrape(http).await?;
    assert_eq!(
        decisions(&page, DisaggregationReason::LongUncached),
        Some(1.0)
    );
    assert_eq!(
        decisions(&page, DisaggregationReason::ShortUncached),
        Some(1.0)
    );

    // A frontend's id may not end with the prefill half's suffix.
    match cluster
        .route(&pair_request("x#prefill", tokens(4, 8)))
        .await?
    {
        RouteReply::Error(e) => {
            assert_eq!(e.code, RouteErrorCode::BadRequest);
            assert!(e.message.contains("#prefill"), "{}", e.message);
        }
        other => panic!("a reserved id was routed: {other:?}"),
    }
    daemon.shutdown().await
}

async fn start_replica(cluster: &TestCluster, id: u64, snapshot_ms: u64) -> anyhow::Result<Daemon> {
    let mut args = cluster.serve_args();
    args.scheduling.router_id = Some(id);
    args.scheduling.replica_snapshot_timeout_ms = snapshot_ms;
    Daemon::start(
        DaemonConfig::from_args(&args)?,
        &prometheus::Registry::new(),
    )
    .await
}

#[tokio::test]
async fn replicas_share_both_halves_by_snapshot_and_by_sync() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    register_fleet(&mut cluster).await?;
    let a = start_replica(&cluster, 100, 500).await?;
    let long = || {
        let mut p = tokens(1, PREFIX);
        p.extend(tokens(2, 400));
        p
    };
    let first = routed(cluster.route(&pair_request("r1", long())).await?);
    assert!(first.disaggregation.and_then(|d| d.prefill).is_some());
    let own = (Origin::Local, false);
    let expected = BTreeMap::from([("r1".to_owned(), own), ("r1#prefill".to_owned(), own)]);
    assert_eq!(booked_requests(&a), expected);

    // B starts late: the snapshot brings both halves, as A's bookings.
    let b = start_replica(&cluster, 101, 2000).await?;
    let peer = (Origin::Peer(RouterId(100)), false);
    let learned = BTreeMap::from([("r1".to_owned(), peer), ("r1#prefill".to_owned(), peer)]);
    assert_eq!(booked_requests(&b), learned);

    // Whichever replica books r2, the other applies both halves from its sync.
    let second = routed(cluster.route(&pair_request("r2", long())).await?);
    assert!(second.disaggregation.and_then(|d| d.prefill).is_some());
    let ids = ["r1", "r1#prefill", "r2", "r2#prefill"];
    for daemon in [&a, &b] {
        eventually("both replicas to hold both halves of r2", WAIT, || async {
            let held = booked_requests(daemon);
            ids.iter().all(|id| held.contains_key(*id)).then_some(())
        })
        .await?;
    }
    let (held_a, held_b) = (booked_requests(&a), booked_requests(&b));
    for id in ["r2", "r2#prefill"] {
        let origins = [held_a[id].0, held_b[id].0];
        assert_eq!(
            origins.iter().filter(|o| **o == Origin::Local).count(),
            1,
            "{id}: booked by exactly one replica, {origins:?}"
        );
    }
    let loads = |d: &Daemon| -> Vec<_> {
        d.state()
            .scheduler()
            .rank_loads()
            .map(|(r, l)| (r, l.active_prefill_tokens, l.active_decode_blocks))
            .collect()
    };
    assert_eq!(loads(&a), loads(&b), "both count the same load");

    // Lifecycle messages reach both replicas; the halves go on each.
    cluster
        .lifecycle("r1", LifecycleEvent::RemotePrefillDone)
        .await?;
    for daemon in [&a, &b] {
        eventually("r1's prefill half done everywhere", WAIT, || async {
            booked_requests(daemon)
                .get("r1#prefill")
                .is_some_and(|(_, done)| *done)
                .then_some(())
        })
        .await?;
    }
    cluster.lifecycle("r1", LifecycleEvent::PrefillDone).await?;
    cluster.lifecycle("r2", LifecycleEvent::Freed).await?;
    for daemon in [&a, &b] {
        eventually("only r1's decode half left", WAIT, || async {
            let held = booked_requests(daemon);
            (held.keys().map(String::as_str).collect::<Vec<_>>() == ["r1"]).then_some(())
        })
        .await?;
    }
    cluster.lifecycle("r1", LifecycleEvent::Freed).await?;
    for daemon in [&a, &b] {
        eventually("nothing booked", WAIT, || async {
            booked_requests(daemon).is_empty().then_some(())
        })
        .await?;
    }
    b.shutdown().await?;
    a.shutdown().await
}

#[tokio::test]
async fn approximate_mode_indexes_a_disaggregated_prompt_on_both_workers() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    register_fleet(&mut cluster).await?;
    let daemon = cluster
        .start_daemon(|args| {
            args.index.index_mode = router_daemon::config::index::IndexModeArg::Approximate;
            args.index.approximate_ttl_secs = 600;
        })
        .await?;
    let prompt = tokens(5, PREFIX);
    let d = routed(cluster.route(&pair_request("a", prompt.clone())).await?);
    let prefill = d.disaggregation.and_then(|d| d.prefill).expect("remote");
    let scores = daemon
        .state()
        .indexer
        .find_matches(FakeWorker::hashes(&prompt, BLOCK))
        .await?;
    let decode_rank = WorkerRank::new(d.worker_id, d.dp_rank);
    let prefill_rank = WorkerRank::new(prefill.worker_id, prefill.dp_rank);
    assert_eq!(
        scores.get(prefill_rank),
        500,
        "the prefill worker computed it"
    );
    assert_eq!(
        scores.get(decode_rank),
        500,
        "the decode worker stores the transfer"
    );
    // Once it is freed, its repeat goes to the decode worker that holds it all,
    // which prefills the nothing left itself but the last token (the prompt is
    // exactly 500 blocks, so 499 are reusable).
    cluster.lifecycle("a", LifecycleEvent::Freed).await?;
    eventually("a to be freed", WAIT, || async {
        (daemon.state().scheduler().active_requests() == 0).then_some(())
    })
    .await?;
    let again = routed(cluster.route(&pair_request("b", prompt)).await?);
    assert_eq!((again.worker_id, again.overlap_blocks), (d.worker_id, 499));
    assert_eq!(
        again.disaggregation.map(|d| (d.reason, d.prefill)),
        Some((DisaggregationReason::ShortUncached, None))
    );
    daemon.shutdown().await
}
