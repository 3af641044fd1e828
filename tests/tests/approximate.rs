//! End to end: approximate mode, for engines that publish no KV events. The router
//! indexes its own routing decisions, so a repeated prefix goes back to the worker
//! it was routed to, with its overlap counted.

use indexer::IndexerApi as _;
use integration_tests::{FakeWorker, TestCluster};
use kv_events::WorkerId;
use kv_events::routing::RouteReply;

const BLOCK: u32 = 4;

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 10_000 + i).collect()
}

fn routed(reply: RouteReply) -> (WorkerId, u32) {
    match reply {
        RouteReply::Routed(d) => (d.worker_id, d.overlap_blocks),
        RouteReply::Error(e) => panic!("route failed: {e:?}"),
    }
}

#[tokio::test]
async fn routing_decisions_are_indexed_when_engines_publish_no_events() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let _w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    let _w2 = FakeWorker::register(&mut cluster, 2, 30).await?;
    let daemon = cluster
        .start_daemon(|args| {
            args.index.index_mode = router_daemon::config::index::IndexModeArg::Approximate;
            args.index.approximate_ttl_secs = 600;
        })
        .await?;
    let a = prompt(1, 5);
    let (first, overlap) = routed(cluster.route_tokens("a-1", a.clone()).await?);
    assert_eq!(overlap, 0, "nothing is known yet");
    // The same prompt extended: the router remembers where it sent the first one,
    // even though no engine published anything.
    let mut longer = a.clone();
    longer.extend(prompt(9, 2));
    let (again, overlap) = routed(cluster.route_tokens("a-2", longer).await?);
    assert_eq!((again, overlap), (first, 5));
    let report = daemon.state().indexer.report().await?;
    assert_eq!(report.approximate_blocks, 7, "5 blocks, then 2 more");
    assert_eq!(
        daemon
            .state()
            .indexer
            .counters()
            .snapshot()
            .recovery_requests,
        0
    );
    daemon.shutdown().await
}
