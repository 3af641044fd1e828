//! End to end: liveness from silence. An engine killed while its etcd lease lives on
//! stops getting routes once its load metrics fall silent, with real nats-server,
//! etcd, mock engines and the daemon.

use engine_model::EngineModelConfig;
use integration_tests::etcd_proxy::{EtcdProxy, etcd_addr};
use integration_tests::{FakeWorker, TestCluster, eventually};
use kv_events::routing::RouteReply;
use kv_events::{DpRank, WorkerId, WorkerRank};
use mocker::engine::EngineHttpArgs;
use std::time::{Duration, Instant};

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(20);
/// The mock engines of `TestCluster` publish load metrics every 50 ms.
const INTERVAL_MS: u64 = 50;

fn model() -> EngineModelConfig {
    EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks: 1024,
        ..EngineModelConfig::default()
    }
}

/// `live`, `quiet`, `silent` or `never_reported`.
fn liveness(daemon: &router_daemon::Daemon, worker: u64) -> &'static str {
    let rank = WorkerRank::new(WorkerId(worker), DpRank(0));
    daemon
        .state()
        .scheduler()
        .liveness(rank, Instant::now())
        .0
        .label()
}

/// Routes `n` distinct prompts; returns the workers chosen.
async fn route(cluster: &TestCluster, tag: &str, n: u32) -> anyhow::Result<Vec<u64>> {
    let mut chosen = Vec::new();
    for i in 0..n {
        let tokens = (0..2 * BLOCK).map(|t| i * 1000 + t).collect();
        match cluster.route_tokens(&format!("{tag}-{i}"), tokens).await? {
            RouteReply::Routed(d) => chosen.push(d.worker_id.0),
            other => anyhow::bail!("not routed: {other:?}"),
        }
    }
    Ok(chosen)
}

#[tokio::test]
async fn an_engine_killed_while_its_lease_lives_stops_getting_routes_once_silent()
-> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let daemon = cluster
        .start_daemon(|args| {
            let l = &mut args.scheduling.scheduler.liveness;
            l.metrics_interval_ms = INTERVAL_MS;
            l.metrics_quiet_intervals = 3;
            l.metrics_silent_intervals = 6;
        })
        .await?;
    let survivors = cluster
        .spawn_engines(2, model(), 1.0, EngineHttpArgs::default())
        .await?;
    // The victim reaches etcd through a path the test cuts before killing it, so its
    // revoke never arrives and its lease (10 min) outlives it, as when an engine dies
    // during an etcd outage.
    let mut path = EtcdProxy::new(etcd_addr(&cluster.etcd_server.endpoint()))?;
    path.restore().await?;
    let mut args = cluster.engine_args(1, model(), 1.0, EngineHttpArgs::default());
    args.fleet.first_worker_id = 3;
    args.connection.etcd.etcd_endpoints = vec![path.endpoint()];
    args.runtime.lease_ttl_secs = 600;
    let victim = mocker::engine::spawn_engines(args, Default::default()).await?;
    // A worker registered without ever publishing metrics (an integration without
    // them): its lease is its only signal.
    let quiet_integration = FakeWorker::register(&mut cluster, 9, 600).await?;

    eventually("every engine registered and reporting", WAIT, || async {
        let workers = daemon.state().scheduler().workers().count();
        let live = [1, 2, 3].iter().all(|&w| liveness(&daemon, w) == "live");
        (workers == 4 && live).then_some(())
    })
    .await?;
    let before = route(&cluster, "before", 40).await?;
    assert!(before.contains(&3), "the victim is in rotation: {before:?}");

    path.cut().await;
    victim.shutdown();
    let killed_at = Instant::now();
    eventually("the victim's metrics to fall silent", WAIT, || async {
        (liveness(&daemon, 3) == "silent").then_some(())
    })
    .await?;
    let silent_after = killed_at.elapsed();
    assert!(
        silent_after >= Duration::from_millis(6 * INTERVAL_MS) - Duration::from_millis(INTERVAL_MS),
        "silent after {silent_after:?}: not before its 6 intervals were missed"
    );
    // Its lease lives on: still registered, yet no longer routed to.
    assert!(
        daemon
            .state()
            .scheduler()
            .workers()
            .any(|w| w.worker_id == WorkerId(3))
    );
    let after = route(&cluster, "after", 40).await?;
    assert!(!after.contains(&3), "routed to a dead engine: {after:?}");
    assert!(
        after.contains(&quiet_integration.id.0),
        "a worker that never reported metrics keeps its share: {after:?}"
    );

    let view = router_daemon::workers_view(daemon.state()).await;
    let json = serde_json::to_value(&view)?;
    let rank_of = |id: u64| {
        json["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["worker_id"] == id))
            .map(|w| w["ranks"][0].clone())
            .unwrap_or_default()
    };
    assert_eq!(rank_of(3)["liveness"], "silent", "{json}");
    assert!(rank_of(3)["metrics_age_ms"].as_u64() >= Some(6 * INTERVAL_MS));
    assert_eq!(rank_of(1)["liveness"], "live", "{json}");
    assert_eq!(rank_of(9)["liveness"], "never_reported", "{json}");
    assert_eq!(rank_of(9)["metrics_age_ms"], serde_json::Value::Null);

    survivors.shutdown();
    survivors.wait().await?;
    daemon.shutdown().await
}
