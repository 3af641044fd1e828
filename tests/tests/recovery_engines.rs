//! End to end with the real mock engines: they number their KV events in a journal,
//! stamp their epoch, and answer recovery requests, so a router started after they
//! cached prompts resyncs from them and routes to the engine holding a prefix.

mod journal_worker;
mod mock_engine;

use engine_model::EngineModelConfig;
use indexer::IndexerApi as _;
use integration_tests::TestCluster;
use journal_worker::{held_paths, router_paths_of};
use kv_events::routing::RouteReply;
use kv_events::{DpRank, WorkerId};
use mock_engine::{engine_dump, generate};
use mocker::engine::{ConnectionArgs, EngineArgs, FleetArgs, RuntimeArgs, spawn_engines};

const BLOCK: u32 = 4;

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 10_000 + i).collect()
}

#[tokio::test]
async fn a_router_started_after_the_engines_resyncs_from_them() -> anyhow::Result<()> {
    let cluster = TestCluster::start(BLOCK).await?;
    let args = EngineArgs {
        connection: ConnectionArgs::local(
            &cluster.nats_server.url(),
            &cluster.etcd_server.endpoint(),
            cluster.subjects.namespace(),
        ),
        fleet: FleetArgs {
            workers: 2,
            first_worker_id: 1,
            dp_size: 1,
        },
        model: EngineModelConfig {
            block_size: BLOCK,
            num_gpu_blocks: 256,
            ..EngineModelConfig::default()
        },
        runtime: RuntimeArgs {
            time_scale: 100.0,
            lease_ttl_secs: 10,
            metrics_interval_ms: 50,
            shutdown: Default::default(),
        },
        http: Default::default(),
        cpu_tier: Default::default(),
        hybrid: Default::default(),
        kv_events: Default::default(),
        disaggregation: Default::default(),
    };
    // The engines stop on their own handle's shutdown (a default, unshared token).
    let engines = spawn_engines(args, Default::default()).await?;
    // Before any router exists, each engine caches a different prompt.
    let (a, b) = (prompt(1, 6), prompt(2, 6));
    generate(
        &cluster.nats,
        &cluster.subjects,
        BLOCK,
        WorkerId(1),
        "warm-a",
        &a,
    )
    .await?;
    generate(
        &cluster.nats,
        &cluster.subjects,
        BLOCK,
        WorkerId(2),
        "warm-b",
        &b,
    )
    .await?;

    let daemon = cluster.start_daemon(|_| {}).await?;
    // Ready means resynced: the router holds exactly what each engine reports.
    for worker in [WorkerId(1), WorkerId(2)] {
        let dump = engine_dump(&cluster.nats, &cluster.subjects, worker).await?;
        assert!(
            !held_paths(&dump).is_empty(),
            "engine {worker} cached blocks"
        );
        assert_eq!(
            router_paths_of(&daemon, worker, DpRank(0)).await,
            held_paths(&dump),
            "engine {worker}"
        );
    }
    let mut longer = a.clone();
    longer.extend([7, 7]);
    match cluster.route_tokens("after-resync", longer).await? {
        RouteReply::Routed(d) => assert_eq!((d.worker_id, d.overlap_blocks), (WorkerId(1), 6)),
        other => panic!("not routed: {other:?}"),
    }
    let counters = daemon.state().indexer.counters().snapshot();
    assert_eq!(counters.recovered_dumps, 2, "one dump per engine rank");
    daemon.shutdown().await?;
    engines.shutdown();
    engines.wait().await?;
    Ok(())
}
