//! Router replicas starting against a 3-node NATS cluster, as an operator runs them:
//! every replica given all three URLs, so its main and replica-sync connections land
//! on nodes the client picks at random, often two different ones.
//!
//! Before the fix, the start-up barrier between those two connections published once
//! to an inbox whose subscription had not yet crossed the routes to the publisher's
//! node; the message was dropped and start-up waited forever (7 of 144 starts in the
//! field), while `/health/livez` said 200 and nothing was logged. The cluster's routes
//! carry every byte [`ROUTE_LATENCY`] late, as between machines or zones, so a
//! subscription takes that long to cross and the two connections landing on different
//! nodes (two starts in three) is enough to meet the race.

use integration_tests::eventually;
use integration_tests::nats_cluster::NatsCluster;
use kv_cluster::barrier::{BarrierError, round_trip};
use kv_events::routing::{Prompt, RouteReply, RouteRequest};
use kv_events::{Namespace, Subjects};
use router_daemon::{Daemon, DaemonConfig, ServeArgs};
use std::time::Duration;
use testbed::{EtcdServer, NatsServer};

/// Router starts in all, two replicas at a time.
const STARTS: usize = 30;
/// Between any two NATS nodes, each way.
const ROUTE_LATENCY: Duration = Duration::from_millis(50);
/// Generous: a start takes well under a second here when it does not hang.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How long a ready replica's route subscription may take to reach every node.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

fn replica_args(nats_urls: &str, etcd: &str, router_id: usize) -> anyhow::Result<ServeArgs> {
    let router_id = router_id.to_string();
    Ok(kv_cluster::args::parse_flags([
        "kv-router",
        "--nats-url",
        nats_urls,
        "--etcd-endpoints",
        etcd,
        "--namespace",
        "nats-cluster",
        "--block-size",
        "16",
        "--shards",
        "1",
        "--router-id",
        &router_id,
    ])?)
}

/// Starts one replica and waits for it to be ready, within [`READY_WITHIN`].
async fn start_replica(args: ServeArgs) -> anyhow::Result<Daemon> {
    let config = DaemonConfig::from_args(&args)?;
    let registry = prometheus::Registry::new();
    match tokio::time::timeout(READY_WITHIN, Daemon::start(config, &registry)).await {
        Ok(daemon) => daemon,
        Err(_) => anyhow::bail!("a router replica was not ready within {READY_WITHIN:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_replica_starts_against_a_three_node_cluster_all_become_ready() -> anyhow::Result<()>
{
    let nats = NatsCluster::start_with_route_latency(3, ROUTE_LATENCY).await?;
    let etcd = EtcdServer::start().await?;
    let urls = nats.url_list();
    let subjects = Subjects::new(Namespace::new("nats-cluster")?);
    let mut started = 0;
    while started < STARTS {
        let (a, b) = tokio::join!(
            start_replica(replica_args(&urls, &etcd.endpoint(), started + 1)?),
            start_replica(replica_args(&urls, &etcd.endpoint(), started + 2)?),
        );
        let (a, b) = (a?, b?);
        started += 2;
        for daemon in [&a, &b] {
            let report = daemon.state().health.report();
            assert!(report.ready, "start {started}: {report:?}");
        }
        // Ready means in the route queue group; a query from any node is answered
        // (no workers yet), once the group's interest has crossed the routes.
        for i in 0..nats.len() {
            let client = async_nats::ConnectOptions::new()
                .retain_servers_order()
                .connect(nats.url(i))
                .await?;
            let reply = eventually(&format!("an answer via node {i}"), ANSWER_WITHIN, || {
                route_probe(&client, &subjects)
            })
            .await?;
            assert!(
                matches!(reply, RouteReply::Error(_)),
                "no workers registered: {reply:?}"
            );
        }
        a.shutdown().await?;
        b.shutdown().await?;
    }
    Ok(())
}

/// A node killed under two running replicas: queries through the surviving nodes are
/// still answered (each replica's connections move to a live node), and through the
/// node again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_answer_through_every_live_node_while_one_is_killed_and_restarted()
-> anyhow::Result<()> {
    let mut nats = NatsCluster::start(3).await?;
    let etcd = EtcdServer::start().await?;
    let urls = nats.url_list();
    let subjects = Subjects::new(Namespace::new("nats-cluster")?);
    let (a, b) = tokio::join!(
        start_replica(replica_args(&urls, &etcd.endpoint(), 1)?),
        start_replica(replica_args(&urls, &etcd.endpoint(), 2)?),
    );
    let (a, b) = (a?, b?);
    let node_urls = nats.urls();
    let answered = |i: usize| {
        let (url, subjects) = (node_urls[i].clone(), subjects.clone());
        async move {
            let client = async_nats::ConnectOptions::new()
                .retain_servers_order()
                .connect(url)
                .await?;
            eventually(&format!("an answer via node {i}"), READY_WITHIN, || {
                route_probe(&client, &subjects)
            })
            .await
        }
    };
    nats.kill(0);
    for i in [1, 2] {
        answered(i).await?;
    }
    nats.restart(0).await?;
    answered(0).await?;
    a.shutdown().await?;
    b.shutdown().await
}

/// One route query through `client`: the reply, or `None` while nobody answers on
/// that node yet.
async fn route_probe(client: &async_nats::Client, subjects: &Subjects) -> Option<RouteReply> {
    let request = RouteRequest::new(
        "probe",
        Prompt::Tokens {
            token_ids: vec![1; 16],
        },
    );
    let payload = kv_events::encode(&request).ok()?;
    let reply = client
        .request(subjects.route(), payload.into())
        .await
        .ok()?;
    kv_events::decode(&reply.payload).ok()
}

/// Two nats-servers that are not routed to each other never carry a message between
/// them, as a cluster with broken routes: the barrier between a connection to each
/// re-publishes, then gives up after its deadline naming both servers, instead of
/// waiting forever.
#[tokio::test]
async fn a_barrier_between_servers_that_carry_nothing_fails_after_its_deadline()
-> anyhow::Result<()> {
    let (a, b) = (NatsServer::start().await?, NatsServer::start().await?);
    let sender = async_nats::connect(a.url()).await?;
    let receiver = async_nats::connect(b.url()).await?;
    let deadline = Duration::from_millis(500);
    let result = tokio::time::timeout(READY_WITHIN, round_trip(&sender, &receiver, deadline))
        .await
        .map_err(|_| anyhow::anyhow!("the barrier did not give up within {READY_WITHIN:?}"))?;
    let error = match result {
        Ok(()) => anyhow::bail!("a message crossed between two unrouted servers"),
        Err(e) => e,
    };
    let message = error.to_string();
    match error {
        BarrierError::Timeout {
            waited, publishes, ..
        } => {
            assert!(waited >= deadline, "{message}");
            assert!(publishes > 1, "it published again: {message}");
        }
        other => anyhow::bail!("not a timeout: {other}"),
    }
    for server in [&sender, &receiver] {
        let name = server.server_info().server_name;
        assert!(message.contains(&name), "{name} named in: {message}");
    }
    Ok(())
}
