//! Shutdown with NATS and etcd gone, end to end: `kv-router serve`, `kv-router relay`,
//! `kv-router gateway` and the mock engines each stop within their shutdown budget
//! (`--shutdown-timeout-ms`, the gateway's fixed flush timeout) instead of waiting
//! forever on a NATS client that reconnects forever, and report the steps they
//! skipped. And with the servers up, the daemon's shutdown still completes every step.
//!
//! The exits are behaviour, not performance: budgets of 1 s, asserted within 20 s
//! more.

// Test helpers unwrap: a broken server or socket must fail the test loudly.
#![allow(clippy::unwrap_used)]

use engine_model::EngineModelConfig;
use integration_tests::{TestCluster, eventually};
use kv_cluster::shutdown::ShutdownIncomplete;
use kv_relay::{Relay, RelayArgs, RelayConfig};
use mocker::engine::{FleetArgs, KvEventsArgs};
use router_daemon::{DaemonConfig, ServeArgs};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

const BLOCK: u32 = 16;
/// The budget every participant gets here, in ms.
const BUDGET_MS: &str = "1000";
/// What a shutdown may take beyond its budget before the test calls it hung.
const MARGIN: Duration = Duration::from_secs(20);
const WAIT: Duration = Duration::from_secs(15);

/// Stops nats-server and etcd (SIGTERM, as an operator would), dropping the test's
/// own clients first.
async fn stop_servers(cluster: TestCluster) {
    let TestCluster {
        nats_server,
        etcd_server,
        ..
    } = cluster;
    nats_server.stop().await.unwrap();
    etcd_server.stop().await.unwrap();
}

/// Runs `shutdown`, failing the test if it has not finished within `budget` +
/// [`MARGIN`].
async fn finishes<T>(what: &str, budget: Duration, shutdown: impl Future<Output = T>) -> T {
    tokio::time::timeout(budget + MARGIN, shutdown)
        .await
        .unwrap_or_else(|_| panic!("{what} still shutting down {:?} after its budget", MARGIN))
}

/// The steps an incomplete shutdown names, checking there is one.
fn abandoned(incomplete: &ShutdownIncomplete) -> Vec<&'static str> {
    assert!(!incomplete.abandoned.is_empty(), "{incomplete}");
    incomplete.abandoned.clone()
}

/// `kv-router serve` as the binary runs it (`router_daemon::run`, HTTP first): ready,
/// then its servers go away; the shutdown signal ends it within its budget, with an
/// error naming what it skipped. Before the budget, the NATS drain and round trip
/// of its shutdown waited forever.
#[tokio::test]
async fn serve_exits_within_its_budget_when_nats_and_etcd_are_gone() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let port = testbed::free_port().unwrap();
    let listen = format!("127.0.0.1:{port}");
    let args: ServeArgs = cluster.flags(&[
        "--shards",
        "2",
        "--http-listen",
        &listen,
        "--shutdown-timeout-ms",
        BUDGET_MS,
    ]);
    let config = DaemonConfig::from_args(&args).unwrap();
    assert_eq!(config.shutdown_timeout, Duration::from_secs(1));
    let registry = prometheus::Registry::new();
    let (signal, signalled) = tokio::sync::oneshot::channel::<()>();
    let daemon = tokio::spawn(async move {
        router_daemon::run(config, &registry, async {
            let _ = signalled.await;
        })
        .await
    });
    eventually("the daemon to be ready", WAIT, || async {
        let r = kv_cluster::http::get_once(&listen, "/health/readyz", Duration::from_secs(2)).await;
        (r.ok()?.0 == 200).then_some(())
    })
    .await
    .unwrap();

    stop_servers(cluster).await;
    signal.send(()).unwrap();
    let stopped = finishes("kv-router serve", Duration::from_secs(1), daemon).await;
    let err = stopped
        .unwrap()
        .expect_err("the shutdown could not complete");
    let incomplete = err
        .downcast_ref::<ShutdownIncomplete>()
        .unwrap_or_else(|| panic!("not a shutdown past its budget: {err:#}"));
    let skipped = abandoned(incomplete);
    assert!(
        skipped.contains(&"draining the NATS connections"),
        "{skipped:?}"
    );
    eventually("the HTTP endpoint to close", WAIT, || async {
        let r = kv_cluster::http::get_once(&listen, "/health/livez", Duration::from_secs(2)).await;
        r.is_err().then_some(())
    })
    .await
    .unwrap();
}

/// With the servers up, the same entry point completes every step of its shutdown
/// well within the budget: no step is skipped, and the route subject has no
/// responders at once.
#[tokio::test]
async fn serve_completes_its_orderly_shutdown_when_the_servers_are_up() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let mut args = cluster.serve_args();
    args.shutdown.shutdown_timeout_ms = 10_000;
    let config = DaemonConfig::from_args(&args).unwrap();
    let daemon = router_daemon::Daemon::start(config, &cluster.registry)
        .await
        .unwrap();
    let reply = cluster.route_tokens("before", vec![1; 32]).await;
    assert!(reply.is_ok(), "{reply:?}");
    finishes(
        "kv-router serve",
        Duration::from_secs(10),
        daemon.shutdown(),
    )
    .await
    .unwrap();
    let after = cluster
        .nats
        .request(cluster.subjects.route(), "{}".into())
        .await
        .expect_err("nobody answers once the daemon stopped");
    assert_eq!(
        after.kind(),
        async_nats::client::RequestErrorKind::NoResponders,
        "{after}"
    );
}

/// `kv-router relay` beside a vLLM-mode mock engine, registered in etcd: with NATS and
/// etcd gone, its shutdown (lease revoke, claim release, NATS flush) ends within
/// its budget and says what it skipped.
#[tokio::test]
async fn relay_exits_within_its_budget_when_nats_and_etcd_are_gone() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let model = EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks: 64,
        ..EngineModelConfig::default()
    };
    let mut engine = cluster.engine_args(1, model, 100.0, Default::default());
    engine.fleet = FleetArgs {
        workers: 1,
        first_worker_id: 1,
        dp_size: 1,
    };
    engine.kv_events = KvEventsArgs::vllm_on_free_ports();
    let engines = mocker::engine::spawn_engines(engine, Default::default())
        .await
        .unwrap();
    let url = engines.http_urls()[0].clone();
    let sockets = engines.zmq_endpoints()[0][0].clone();
    let flags = [
        "--engine-endpoint",
        &sockets.publish,
        "--replay-endpoint",
        &sockets.replay,
        "--worker-id",
        "1",
        "--worker-name",
        "shutdown-1",
        "--engine-url",
        &url,
        "--shutdown-timeout-ms",
        BUDGET_MS,
    ];
    let config = RelayConfig::from_args(&cluster.flags::<RelayArgs>(&flags)).unwrap();
    let relay = Relay::start(config, &prometheus::Registry::new())
        .await
        .unwrap();
    let key = cluster.subjects.etcd_worker_key(kv_events::WorkerId(1));
    let etcd = cluster.etcd.clone();
    eventually("the relay's registration", WAIT, || {
        let (mut etcd, key) = (etcd.clone(), key.clone());
        async move {
            let found = etcd.get(key, None).await.ok()?;
            (!found.kvs().is_empty()).then_some(())
        }
    })
    .await
    .unwrap();

    stop_servers(cluster).await;
    let stopped = finishes("kv-router relay", Duration::from_secs(1), relay.shutdown()).await;
    let Err(kv_relay::RelayError::ShutdownIncomplete(incomplete)) = stopped else {
        panic!("not a shutdown past its budget: {stopped:?}")
    };
    let skipped = abandoned(&incomplete);
    assert_eq!(skipped.last(), Some(&"flushing NATS"), "{skipped:?}");
    engines.shutdown();
    engines.wait().await.unwrap();
}

/// `kv-router gateway` with NATS and etcd gone: the lifecycle flush is abandoned
/// after its fixed timeout and the shutdown says so.
#[tokio::test]
async fn gateway_exits_when_nats_and_etcd_are_gone() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let args: kv_gateway::GatewayArgs = cluster.flags(&[
        "--listen",
        "127.0.0.1:0",
        "--served-model-name",
        "m",
        "--tokenize-via",
        "engine",
    ]);
    let gateway = kv_gateway::Gateway::start(
        args.to_config().unwrap(),
        Arc::new(prometheus::Registry::new()),
        Default::default(),
    )
    .await
    .unwrap();

    stop_servers(cluster).await;
    let budget = kv_gateway::SHUTDOWN_FLUSH_TIMEOUT;
    let stopped = finishes("kv-router gateway", budget, gateway.shutdown()).await;
    let incomplete = stopped.expect_err("the flush could not complete");
    assert_eq!(
        abandoned(&incomplete),
        vec!["flushing the lifecycle messages to NATS"]
    );
}

/// Mock engines registered in etcd and publishing to NATS: with both gone, their
/// shutdown (lease revokes, outbox flush) ends within the budget.
#[tokio::test]
async fn mock_engines_exit_within_their_budget_when_nats_and_etcd_are_gone() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let model = EngineModelConfig {
        block_size: BLOCK,
        ..EngineModelConfig::default()
    };
    let mut args = cluster.engine_args(2, model, 100.0, Default::default());
    args.runtime.shutdown.shutdown_timeout_ms = 1_000;
    let engines = mocker::engine::spawn_engines(args, Default::default())
        .await
        .unwrap();

    stop_servers(cluster).await;
    engines.shutdown();
    let stopped = finishes("the mock engines", Duration::from_secs(1), engines.wait()).await;
    let Err(mocker::engine::ServiceError::ShutdownIncomplete(incomplete)) = stopped else {
        panic!("not a shutdown past its budget: {stopped:?}")
    };
    let skipped = abandoned(&incomplete);
    assert_eq!(
        skipped.last(),
        Some(&"publishing the outbox to NATS"),
        "{skipped:?}"
    );
}
