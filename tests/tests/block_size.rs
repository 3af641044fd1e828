//! The router's block size from the registrations (`router_daemon::block_size`): real
//! nats-server and etcd, the daemon in-process, workers registered by the test.
//!
//! Without `--block-size` the daemon adopts the first accepted registration's size,
//! rejects (and counts) other sizes, forgets the size when the last worker leaves, and
//! orders the registrations it loads at start-up by etcd creation revision; with
//! `--block-size` the size is pinned and never forgotten.

use integration_tests::{
    FakeWorker, TestCluster, eventually, register_worker, routed_worker, wait_for_overlap,
};
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{RouteErrorCode, RouteReply};
use kv_events::{DpRank, WorkerId, WorkerRank};
use router_daemon::BlockSizeSource;
use router_daemon::Daemon;
use router_daemon::counters::{MessageKind, Outcome};
use std::num::NonZeroU32;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

fn registration(id: u64, block_size: u32) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size: 1,
        block_size,
        total_kv_blocks: 1024,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    }
}

/// Registers worker `id` at `block_size` tokens per block under a 30 s lease.
async fn register(cluster: &mut TestCluster, id: u64, block_size: u32) -> anyhow::Result<i64> {
    register_worker(
        &mut cluster.etcd,
        &cluster.subjects,
        &registration(id, block_size),
        30,
    )
    .await
}

fn block_size(daemon: &Daemon) -> Option<u32> {
    daemon.state().block_size.get().map(NonZeroU32::get)
}

/// Waits until the daemon's scheduler holds exactly `ids`.
async fn wait_for_workers(daemon: &Daemon, ids: &[u64]) -> anyhow::Result<()> {
    let want: Vec<WorkerId> = ids.iter().copied().map(WorkerId).collect();
    eventually(&format!("workers {ids:?} registered"), WAIT, || async {
        let mut have: Vec<WorkerId> = daemon
            .state()
            .scheduler()
            .workers()
            .map(|w| w.worker_id)
            .collect();
        have.sort();
        (have == want).then_some(())
    })
    .await
}

async fn wait_for_rejections(daemon: &Daemon, count: u64) -> anyhow::Result<()> {
    let counters = &daemon.state().counters;
    eventually(&format!("{count} registrations rejected"), WAIT, || async {
        (counters.messages(MessageKind::Registration, Outcome::Rejected) == count).then_some(())
    })
    .await
}

fn assert_no_workers(reply: &RouteReply) {
    assert!(
        matches!(reply, RouteReply::Error(e) if e.code == RouteErrorCode::NoWorkers),
        "{reply:?}"
    );
}

#[tokio::test]
async fn without_the_flag_the_first_size_is_adopted_and_forgotten_when_the_last_worker_leaves()
-> anyhow::Result<()> {
    // Worker 1 registers 16-token blocks (the cluster's size for `FakeWorker`).
    let mut cluster = TestCluster::start(16).await?;
    let daemon = cluster.start_daemon(|a| a.block_size = None).await?;
    assert_eq!(block_size(&daemon), None);
    assert_eq!(daemon.state().block_size.source(), BlockSizeSource::Adopted);
    // No size yet: the same reply as a router without workers.
    assert_no_workers(&cluster.route_tokens("early", (0..40).collect()).await?);

    let mut w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    wait_for_workers(&daemon, &[1]).await?;
    assert_eq!(block_size(&daemon), Some(16));

    // A prompt the worker stored is hashed at the adopted size: 4 blocks overlap.
    let tokens: Vec<u32> = (0..4 * 16).map(|i| 7_000 + i).collect();
    w1.store_prompt(&cluster, &tokens).await?;
    let rank = WorkerRank::new(w1.id, DpRank(0));
    wait_for_overlap(&daemon, &FakeWorker::hashes(&tokens, 16), rank, 4).await?;
    let mut longer = tokens.clone();
    longer.extend([1, 2, 3]);
    let reply = cluster.route_tokens("stored", longer).await?;
    assert_eq!(routed_worker(&reply), w1.id);
    let RouteReply::Routed(decision) = &reply else {
        unreachable!("routed_worker panics on errors")
    };
    assert_eq!(decision.overlap_blocks, 4);
    assert_eq!(decision.request_blocks, 5);

    // Another size is rejected and counted; worker 1 stays.
    let w2 = register(&mut cluster, 2, 32).await?;
    wait_for_rejections(&daemon, 1).await?;
    wait_for_workers(&daemon, &[1]).await?;
    assert_eq!(block_size(&daemon), Some(16));

    // Worker 1 leaves: the size is forgotten, and worker 2, still registered, is
    // reconsidered and accepted at its size.
    cluster.etcd.lease_revoke(w1.lease).await?;
    wait_for_workers(&daemon, &[2]).await?;
    assert_eq!(block_size(&daemon), Some(32));
    let wide: Vec<u32> = (0..64).collect();
    let RouteReply::Routed(d) = cluster.route_tokens("wide", wide).await? else {
        anyhow::bail!("a prompt was not routed to worker 2");
    };
    assert_eq!(d.request_blocks, 2, "64 tokens at 32 per block");

    // Every worker gone: no size, and a worker with yet another size is accepted.
    cluster.etcd.lease_revoke(w2).await?;
    wait_for_workers(&daemon, &[]).await?;
    assert_eq!(block_size(&daemon), None);
    assert_no_workers(&cluster.route_tokens("none", (0..40).collect()).await?);
    register(&mut cluster, 3, 8).await?;
    wait_for_workers(&daemon, &[3]).await?;
    assert_eq!(block_size(&daemon), Some(8));
    assert_eq!(
        daemon
            .state()
            .counters
            .messages(MessageKind::Registration, Outcome::Rejected),
        1,
        "only worker 2's first registration was rejected"
    );
    daemon.shutdown().await
}

#[tokio::test]
async fn start_up_adopts_the_oldest_registration_not_the_lowest_worker_id() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(16).await?;
    // Worker 9 registers first at 16 tokens, then worker 2 at 32: etcd key order (and
    // worker id order) puts worker 2 first, registration order worker 9.
    register(&mut cluster, 9, 16).await?;
    register(&mut cluster, 2, 32).await?;
    let daemon = cluster.start_daemon(|a| a.block_size = None).await?;
    assert_eq!(
        block_size(&daemon),
        Some(16),
        "a replica that watched both arrive adopted worker 9's size"
    );
    wait_for_workers(&daemon, &[9]).await?;
    wait_for_rejections(&daemon, 1).await?;
    daemon.shutdown().await
}

#[tokio::test]
async fn a_pinned_size_rejects_other_sizes_even_with_no_worker() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(16).await?;
    // `serve_args` pins the cluster's size (`--block-size 16`).
    let daemon = cluster.start_daemon(|_| {}).await?;
    assert_eq!(daemon.state().block_size.source(), BlockSizeSource::Pinned);
    let w1 = FakeWorker::register(&mut cluster, 1, 30).await?;
    wait_for_workers(&daemon, &[1]).await?;
    register(&mut cluster, 2, 32).await?;
    wait_for_rejections(&daemon, 1).await?;

    // The last worker leaves: a pinned size is kept, so worker 2 stays rejected and a
    // new worker of another size is rejected too.
    cluster.etcd.lease_revoke(w1.lease).await?;
    wait_for_workers(&daemon, &[]).await?;
    register(&mut cluster, 3, 32).await?;
    wait_for_rejections(&daemon, 2).await?;
    assert_eq!(block_size(&daemon), Some(16));
    FakeWorker::register(&mut cluster, 4, 30).await?;
    wait_for_workers(&daemon, &[4]).await?;
    daemon.shutdown().await
}
