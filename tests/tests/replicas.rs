//! Router replicas end to end: two daemons on one NATS share the route queue group
//! and sync their bookings, so each sees the whole cluster's load and the queries NATS
//! spreads between them land as a single replica would place them; without sync,
//! each replica sees only its own half. A replica that starts late learns the
//! bookings its peers already hold from the start-up snapshot. A session's turns stay
//! on one worker whichever replica routes them.

use indexer::IndexerApi as _;
use integration_tests::{FakeWorker, TestCluster, eventually};
use kv_events::replicas::{BookedSequence, SequenceSync, SequenceUpdate};
use kv_events::routing::{LifecycleEvent, LifecycleMessage, PolicyKind, RouteReply};
use kv_events::{DpRank, RouterId, WorkerId, WorkerRank, encode};
use router_daemon::Origin;
use router_daemon::counters::{MessageKind, Outcome};
use router_daemon::{Daemon, DaemonConfig, ServeArgs};
use std::collections::BTreeMap;
use std::time::Duration;

#[path = "replicas/affinity.rs"]
mod affinity;
#[path = "replicas/agreement.rs"]
mod agreement;
#[path = "replicas/batch.rs"]
mod batch;
#[path = "replicas/grouping.rs"]
mod grouping;
#[path = "replicas/sessions.rs"]
mod sessions;
#[path = "replicas/snapshot.rs"]
mod snapshot;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);
/// Shared prompt prefix, cached on worker 1 only.
const PREFIX_BLOCKS: u32 = 8;
const REQUESTS: usize = 24;
const WORKERS: u64 = 4;

fn prefix() -> Vec<u32> {
    (0..PREFIX_BLOCKS * BLOCK).collect()
}

/// The shared prefix plus one block of its own.
fn request_prompt(i: usize) -> Vec<u32> {
    let mut p = prefix();
    p.extend((0..BLOCK).map(|t| 100_000 + i as u32 * 10 + t));
    p
}

/// Flags of the replica with router id `id` in the cluster's namespace (kv policy),
/// changed by `adjust`.
fn replica_args(cluster: &TestCluster, id: u64, adjust: impl Fn(&mut ServeArgs)) -> ServeArgs {
    let mut args = cluster.serve_args();
    args.scheduling.router_id = Some(id);
    // The kv cost spreads these small requests as decode blocks pile up, which
    // makes "lands as a single replica would place them" observable.
    args.scheduling.scheduler.policy.policy = PolicyKind::Kv;
    adjust(&mut args);
    args
}

/// Starts the replica with router id `id`, with its own metrics registry.
async fn start_replica(
    cluster: &TestCluster,
    id: u64,
    adjust: impl Fn(&mut ServeArgs),
) -> anyhow::Result<Daemon> {
    let config = DaemonConfig::from_args(&replica_args(cluster, id, adjust))?;
    Daemon::start(config, &prometheus::Registry::new()).await
}

/// Starts `n` daemons with router ids 100, 101, … in the cluster's namespace.
async fn start_replicas(
    cluster: &TestCluster,
    n: u64,
    adjust: impl Fn(&mut ServeArgs),
) -> anyhow::Result<Vec<Daemon>> {
    let mut daemons = Vec::new();
    for i in 0..n {
        daemons.push(start_replica(cluster, 100 + i, &adjust).await?);
    }
    Ok(daemons)
}

/// A cluster of 4 workers, worker 1 caching the prefix, and `replicas` daemons that
/// have indexed it.
async fn setup(replicas: u64, sync: bool) -> anyhow::Result<(TestCluster, Vec<Daemon>)> {
    setup_with(replicas, move |args| args.scheduling.replica_sync = sync).await
}

/// [`setup`] with the replicas' flags changed by `adjust`.
async fn setup_with(
    replicas: u64,
    adjust: impl Fn(&mut ServeArgs),
) -> anyhow::Result<(TestCluster, Vec<Daemon>)> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    let mut workers = Vec::new();
    for id in 1..=WORKERS {
        workers.push(FakeWorker::register(&mut cluster, id, 60).await?);
    }
    let daemons = start_replicas(&cluster, replicas, adjust).await?;
    workers[0].store_prompt(&cluster, &prefix()).await?;
    let hashes = FakeWorker::hashes(&prefix(), BLOCK);
    let rank = WorkerRank::new(WorkerId(1), DpRank(0));
    for daemon in &daemons {
        eventually("the prefix to be indexed", WAIT, || {
            let hashes = hashes.clone();
            async move {
                let scores = daemon.state().indexer.find_matches(hashes).await.ok()?;
                (scores.get(rank) == PREFIX_BLOCKS).then_some(())
            }
        })
        .await?;
        eventually("every worker to be registered", WAIT, || async {
            (daemon.state().scheduler().ranks().len() == WORKERS as usize).then_some(())
        })
        .await?;
    }
    Ok((cluster, daemons))
}

/// Sends the requests one by one through the queue group. With `settle`, waits after
/// each until every replica has applied it, so no decision races a sync message.
/// Returns requests per worker.
async fn route_all(
    cluster: &TestCluster,
    daemons: &[Daemon],
    settle: bool,
) -> anyhow::Result<BTreeMap<u64, usize>> {
    let mut per_worker: BTreeMap<u64, usize> = (1..=WORKERS).map(|w| (w, 0)).collect();
    for i in 0..REQUESTS {
        match cluster
            .route_tokens(&format!("r{i}"), request_prompt(i))
            .await?
        {
            RouteReply::Routed(d) => *per_worker.entry(d.worker_id.0).or_default() += 1,
            RouteReply::Error(e) => anyhow::bail!("request {i} failed: {e:?}"),
        }
        if settle {
            for daemon in daemons {
                eventually("the booking to reach every replica", WAIT, || async {
                    (daemon.state().scheduler().active_requests() == i + 1).then_some(())
                })
                .await?;
            }
        }
    }
    Ok(per_worker)
}

/// Requests each replica booked itself (as opposed to learned from a peer).
fn own_bookings(daemon: &Daemon) -> usize {
    daemon
        .state()
        .scheduler()
        .sequences()
        .iter()
        .filter(|(_, r)| r.origin == Origin::Local)
        .count()
}

fn max(per_worker: &BTreeMap<u64, usize>) -> usize {
    per_worker.values().copied().max().unwrap_or(0)
}

/// The baseline: requests per worker when one replica, which sees every booking,
/// routes the requests one by one (its cluster stopped after).
async fn one_replica_one_by_one() -> anyhow::Result<BTreeMap<u64, usize>> {
    let (cluster, single) = setup(1, true).await?;
    let alone = route_all(&cluster, &single, false).await?;
    for daemon in single {
        daemon.shutdown().await?;
    }
    Ok(alone)
}

#[tokio::test]
async fn synced_replicas_spread_load_like_a_single_replica() -> anyhow::Result<()> {
    let alone = one_replica_one_by_one().await?;

    // Two replicas, sync on: NATS spreads the queries between them.
    let (cluster, pair) = setup(2, true).await?;
    let synced = route_all(&cluster, &pair, true).await?;
    let views: Vec<usize> = pair
        .iter()
        .map(|d| d.state().scheduler().active_requests())
        .collect();
    let own: Vec<usize> = pair.iter().map(own_bookings).collect();
    let loads: Vec<Vec<(WorkerRank, u64, usize)>> = pair
        .iter()
        .map(|d| {
            d.state()
                .scheduler()
                .rank_loads()
                .map(|(rank, l)| (rank, l.active_decode_blocks, l.active_requests))
                .collect()
        })
        .collect();

    // Two replicas, sync off: each sees only what it booked.
    let (cluster_off, unsynced_pair) = setup(2, false).await?;
    let unsynced = route_all(&cluster_off, &unsynced_pair, false).await?;
    let unsynced_views: Vec<usize> = unsynced_pair
        .iter()
        .map(|d| d.state().scheduler().active_requests())
        .collect();
    eprintln!(
        "requests per worker: single replica {alone:?}, two synced {synced:?}, two unsynced {unsynced:?}; \
         bookings per synced replica {own:?}, unsynced views {unsynced_views:?}"
    );

    assert!(
        own.iter().all(|&n| n > 0),
        "the queue group spread the queries over both replicas: {own:?}"
    );
    assert_eq!(own.iter().sum::<usize>(), REQUESTS);
    assert_eq!(
        views,
        vec![REQUESTS; 2],
        "each synced replica sees every booking"
    );
    assert_eq!(
        loads[0], loads[1],
        "both replicas see the same per-rank load"
    );
    assert!(
        max(&synced) <= max(&alone) + 2,
        "synced replicas pile no more onto one worker than a single replica: {synced:?} vs {alone:?}"
    );
    assert!(
        synced.values().filter(|&&n| n > 0).count() == WORKERS as usize,
        "load spread to every worker: {synced:?}"
    );
    assert_eq!(unsynced_views.iter().sum::<usize>(), REQUESTS);
    assert!(
        unsynced_views.iter().all(|&n| n < REQUESTS),
        "without sync each replica under-counts the cluster: {unsynced_views:?}"
    );
    for daemon in pair.into_iter().chain(unsynced_pair) {
        daemon.shutdown().await?;
    }
    Ok(())
}

#[tokio::test]
async fn lifecycle_reaches_every_replica_and_bad_sync_input_is_skipped() -> anyhow::Result<()> {
    let (cluster, daemons) = setup(2, true).await?;
    // At least 4 requests, and more until the queue group has handed each replica one
    // (it picks a member at random), so each replica publishes sync messages.
    let mut routed = 0;
    while routed < 4 || daemons.iter().any(|d| own_bookings(d) == 0) {
        anyhow::ensure!(routed < 64, "the queue group never reached both replicas");
        cluster
            .route_tokens(&format!("r{routed}"), request_prompt(routed))
            .await?;
        routed += 1;
    }
    for daemon in &daemons {
        eventually("bookings to sync", WAIT, || async {
            (daemon.state().scheduler().active_requests() == routed).then_some(())
        })
        .await?;
    }

    // Garbage, a booking from an unknown replica for a rank nobody registered, and a
    // valid peer booking followed by its free.
    let subject = cluster.subjects.sequences();
    cluster
        .nats
        .publish(subject.clone(), vec![0xc1, 0x00, 0xff].into())
        .await?;
    let booking = |worker: u64, id: &str| SequenceSync {
        router_id: RouterId(7),
        request_id: id.into(),
        update: SequenceUpdate::Booked(BookedSequence {
            worker_id: WorkerId(worker),
            dp_rank: DpRank(0),
            block_hashes: vec![],
            request_blocks: 2,
            prefill_tokens: 8,
            expected_prefill_ms: None,
            session_id: None,
        }),
    };
    for msg in [booking(99, "ghost"), booking(2, "peer")] {
        cluster
            .nats
            .publish(subject.clone(), encode(&msg)?.into())
            .await?;
    }
    for daemon in &daemons {
        let c = &daemon.state().counters;
        eventually("bad sync input to be counted", WAIT, || async {
            (c.messages(MessageKind::Sequences, Outcome::Malformed) == 1
                && c.messages(MessageKind::Sequences, Outcome::Rejected) == 1
                && daemon.state().scheduler().active_requests() == routed + 1)
                .then_some(())
        })
        .await?;
    }
    let freed = SequenceSync {
        router_id: RouterId(7),
        request_id: "peer".into(),
        update: SequenceUpdate::Freed,
    };
    cluster
        .nats
        .publish(subject, encode(&freed)?.into())
        .await?;

    // The frontend frees its requests; every replica releases them.
    for i in 0..routed {
        let msg = LifecycleMessage {
            request_id: format!("r{i}").into(),
            event: LifecycleEvent::Freed,
        };
        cluster
            .nats
            .publish(cluster.subjects.lifecycle(), encode(&msg)?.into())
            .await?;
    }
    for daemon in &daemons {
        eventually("every request to be freed everywhere", WAIT, || async {
            (daemon.state().scheduler().active_requests() == 0).then_some(())
        })
        .await?;
        // The sync connection has no echo: a replica publishes its steps and never
        // reads them back (the peers applied them: the free above reached everyone).
        let sync = daemon.state().admission.replicas.metrics();
        assert_eq!(sync.get("in", "own"), 0, "no own message comes back");
        assert!(sync.get("out", "published") > 0);
    }
    // Routing still works after all of that.
    assert!(matches!(
        cluster.route_tokens("after", request_prompt(9)).await?,
        RouteReply::Routed(_)
    ));
    for daemon in daemons {
        daemon.shutdown().await?;
    }
    Ok(())
}
