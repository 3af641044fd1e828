//! End to end with the real mock engines: they number their KV events in a journal,
//! stamp their epoch, and answer recovery requests, so a router started after they
//! cached prompts resyncs from them and routes to the engine holding a prefix.

mod journal_worker;

use futures::StreamExt;
use indexer::IndexerApi as _;
use integration_tests::TestCluster;
use journal_worker::{held_paths, router_paths_of};
use kv_cluster::args::{EtcdArgs, NatsArgs};
use kv_events::recovery::{ChunkAssembler, RecoveryChunk, RecoveryRequest};
use kv_events::routing::RouteReply;
use kv_events::{DpRank, LocalBlockHash, RequestId, WorkerId};
use mocker::engine::{
    ConnectionArgs, EngineArgs, EngineModelConfig, FleetArgs, RuntimeArgs, spawn_engines,
};
use mocker::protocol::{GenerateRequest, GenerateResponse, OP_GENERATE};
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(20);

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 10_000 + i).collect()
}

/// Serves one prompt on `worker` and waits for it to finish.
async fn generate(
    cluster: &TestCluster,
    worker: WorkerId,
    id: &str,
    tokens: &[u32],
) -> anyhow::Result<()> {
    let hashes: Vec<LocalBlockHash> = kv_events::compute_block_hashes(tokens, BLOCK);
    let request = GenerateRequest {
        request_id: RequestId::from(id),
        dp_rank: DpRank(0),
        block_hashes: hashes,
        num_tokens: tokens.len() as u64,
        max_tokens: 2,
    };
    let inbox = cluster.nats.new_inbox();
    let mut replies = cluster.nats.subscribe(inbox.clone()).await?;
    cluster
        .nats
        .publish_with_reply(
            cluster.subjects.engine(worker, OP_GENERATE),
            inbox,
            kv_events::encode(&request)?.into(),
        )
        .await?;
    loop {
        let msg = tokio::time::timeout(WAIT, replies.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("reply inbox closed"))?;
        match kv_events::decode::<GenerateResponse>(&msg.payload)? {
            GenerateResponse::Finished { .. } => return Ok(()),
            GenerateResponse::Error { message } => anyhow::bail!("engine error: {message}"),
            GenerateResponse::FirstToken { .. } => {}
        }
    }
}

/// Asks `worker` for a dump over NATS, as the router does.
async fn engine_dump(
    cluster: &TestCluster,
    worker: WorkerId,
) -> anyhow::Result<kv_events::recovery::RecoveryReply> {
    let request = RecoveryRequest {
        dp_rank: DpRank(0),
        epoch: 0,
        start_event_id: 0,
        dump: true,
    };
    let inbox = cluster.nats.new_inbox();
    let mut replies = cluster.nats.subscribe(inbox.clone()).await?;
    cluster
        .nats
        .publish_with_reply(
            cluster.subjects.kv_recovery(worker),
            inbox,
            kv_events::encode(&request)?.into(),
        )
        .await?;
    let mut asm = ChunkAssembler::new();
    loop {
        let msg = tokio::time::timeout(WAIT, replies.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("reply inbox closed"))?;
        let chunk: RecoveryChunk = kv_events::decode(&msg.payload)?;
        if let Some(reply) = asm.push(chunk)? {
            return Ok(reply);
        }
    }
}

#[tokio::test]
async fn a_router_started_after_the_engines_resyncs_from_them() -> anyhow::Result<()> {
    let cluster = TestCluster::start(BLOCK).await?;
    let args = EngineArgs {
        connection: ConnectionArgs {
            nats: NatsArgs {
                nats_url: vec![cluster.nats_server.url()],
                ..NatsArgs::default()
            },
            etcd: EtcdArgs {
                etcd_endpoints: vec![cluster.etcd_server.endpoint()],
                ..EtcdArgs::default()
            },
            namespace: cluster.subjects.namespace().clone(),
        },
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
        kv_events: Default::default(),
    };
    // The engines stop on their own handle's shutdown (a default, unshared token).
    let engines = spawn_engines(args, Default::default()).await?;
    // Before any router exists, each engine caches a different prompt.
    let (a, b) = (prompt(1, 6), prompt(2, 6));
    generate(&cluster, WorkerId(1), "warm-a", &a).await?;
    generate(&cluster, WorkerId(2), "warm-b", &b).await?;

    let daemon = cluster.start_daemon(|_| {}).await?;
    // Ready means resynced: the router holds exactly what each engine reports.
    for worker in [WorkerId(1), WorkerId(2)] {
        let dump = engine_dump(&cluster, worker).await?;
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
