//! A test cluster with one worker and a router, a gateway parity monitor asking that
//! router, and its outcome counts: shared by `router_removals` and `router_overlap`.

use integration_tests::{FakeWorker, TestCluster};
use kv_events::routing::{RouteDecision, RouteReply};
use kv_events::{DpRank, Subjects, WorkerId, WorkerRank};
use kv_gateway::parity::{ParityMonitor, RouterAsker};
use prometheus::{Encoder as _, Registry, TextEncoder};
use router_daemon::Daemon;

/// Answers of worker 1 counted with `outcome` on `registry`.
pub fn outcome(registry: &Registry, outcome: &str) -> f64 {
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut out)
        .expect("encodes");
    let line = format!(r#"kv_gateway_cache_parity_total{{outcome="{outcome}",worker="1"}}"#);
    String::from_utf8(out)
        .expect("utf-8")
        .lines()
        .find_map(|l| l.strip_prefix(&line)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A parity monitor asking `subjects`' router, with worker 1 registered at
/// `block_size` tokens a block.
pub fn monitor(
    cluster: &TestCluster,
    subjects: &Subjects,
    block_size: u32,
) -> anyhow::Result<(ParityMonitor, Registry)> {
    let registry = Registry::new();
    let metrics =
        kv_gateway::metrics::GatewayMetrics::new(&kv_cluster::metrics::Registrar::new(&registry))?;
    let workers = kv_gateway::workers::WorkerUrls::default();
    workers.insert(&FakeWorker::registration(WorkerId(1), block_size));
    let asker = RouterAsker::new(cluster.nats.clone(), subjects);
    Ok((
        ParityMonitor::asking(metrics, workers, Some(asker)),
        registry,
    ))
}

/// A fresh cluster of `block_size` tokens a block, worker 1 registered (nothing stored)
/// and a router daemon; the worker's rank 0.
pub async fn one_worker(
    block_size: u32,
) -> anyhow::Result<(TestCluster, FakeWorker, Daemon, WorkerRank)> {
    one_worker_with(block_size, |_| {}).await
}

/// [`one_worker`] with the daemon's flags changed by `adjust`.
pub async fn one_worker_with(
    block_size: u32,
    adjust: impl FnOnce(&mut router_daemon::config::ServeArgs),
) -> anyhow::Result<(TestCluster, FakeWorker, Daemon, WorkerRank)> {
    let mut cluster = TestCluster::start(block_size).await?;
    let worker = FakeWorker::register(&mut cluster, 1, 60).await?;
    let daemon = cluster.start_daemon(adjust).await?;
    let rank = WorkerRank::new(worker.id, DpRank(0));
    Ok((cluster, worker, daemon, rank))
}

/// The decision of a route reply; panics on an error reply.
pub fn routed(reply: RouteReply) -> RouteDecision {
    match reply {
        RouteReply::Routed(d) => d,
        RouteReply::Error(e) => panic!("route failed: {e:?}"),
    }
}
