//! End to end with zero engine changes: mock engines in vLLM mode
//! (`kv-mocker engines --kv-events vllm`) publish KV events over ZMQ exactly as vLLM
//! 0.33 does, and `kv-router relay` alone carries them to the router — the engines
//! touch neither NATS nor etcd. Real nats-server, etcd, router daemon, relay and mock
//! HTTP; requests are OpenAI completions with token-id prompts.

// Test helpers unwrap: a broken socket or server must fail the test loudly.
#![allow(clippy::unwrap_used)]

use engine_model::{CpuTierConfig, EngineModelConfig};
use indexer::IndexerApi as _;
use integration_tests::{TestCluster, eventually};
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::RouteReply;
use kv_events::{DpRank, LocalBlockHash, WorkerId, WorkerRank, compute_block_hashes};
use kv_relay::{Relay, RelayArgs, RelayConfig};
use mocker::engine::{EngineHttpArgs, EnginesHandle, FleetArgs, KvEventsArgs, RankEndpoints};
use mocker::replay::{ReplayTarget, cold};
use router_daemon::Daemon;
use serde_json::json;
use std::time::Duration;

const BLOCK: u32 = 16;
const WAIT: Duration = Duration::from_secs(15);
const WORKER: WorkerId = WorkerId(1);

/// The index's overlap scores of a prompt of `hashes`.
async fn scores(daemon: &Daemon, hashes: &[LocalBlockHash]) -> indexer::OverlapScores {
    daemon
        .state()
        .indexer
        .find_matches(hashes.to_vec())
        .await
        .unwrap()
}

async fn overlap(daemon: &Daemon, hashes: &[LocalBlockHash], rank: u32) -> u32 {
    scores(daemon, hashes)
        .await
        .get(WorkerRank::new(WORKER, DpRank(rank)))
}

async fn wait_overlap(daemon: &Daemon, what: &str, tokens: &[u32], rank: u32, blocks: u32) {
    let hashes = compute_block_hashes(tokens, BLOCK);
    eventually(what, WAIT, || async {
        (overlap(daemon, &hashes, rank).await == blocks).then_some(())
    })
    .await
    .unwrap();
}

/// A whole (non-streamed) completion of `prompt` on `rank`; returns the cached
/// prompt tokens the engine reports.
async fn complete(http: &reqwest::Client, url: &str, prompt: &[u32], rank: u32) -> u64 {
    let response = http
        .post(format!("{url}/v1/completions"))
        .header("x-data-parallel-rank", rank.to_string())
        .json(&json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    let body: serde_json::Value = response.json().await.unwrap();
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// Worker `WORKER` as vLLM-mode mock engines on free ports: `dp_size` ranks of
/// `num_gpu_blocks` blocks each, with `cpu_tier` and a context of `max_model_len`
/// tokens (default: one rank's cache), 100× faster than real time.
async fn vllm_engines(
    cluster: &TestCluster,
    num_gpu_blocks: u64,
    dp_size: u32,
    cpu_tier: CpuTierConfig,
    max_model_len: Option<u64>,
) -> EnginesHandle {
    let http = EngineHttpArgs {
        max_model_len,
        ..EngineHttpArgs::default()
    };
    vllm_engines_with(cluster, num_gpu_blocks, dp_size, cpu_tier, http).await
}

/// [`vllm_engines`] with the given HTTP flags.
async fn vllm_engines_with(
    cluster: &TestCluster,
    num_gpu_blocks: u64,
    dp_size: u32,
    cpu_tier: CpuTierConfig,
    http: EngineHttpArgs,
) -> EnginesHandle {
    let model = EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks,
        ..EngineModelConfig::default()
    };
    let mut args = cluster.engine_args(1, model, 100.0, http);
    args.fleet = FleetArgs {
        workers: 1,
        first_worker_id: WORKER.0,
        dp_size,
    };
    args.kv_events = KvEventsArgs::vllm_on_free_ports();
    args.cpu_tier = cpu_tier;
    mocker::engine::spawn_engines(args, Default::default())
        .await
        .unwrap()
}

fn relay_config(cluster: &TestCluster, sockets: &[RankEndpoints], url: &str) -> RelayConfig {
    let join = |f: fn(&RankEndpoints) -> &str| sockets.iter().map(f).collect::<Vec<_>>().join(",");
    let (publish, replay) = (join(|s| &s.publish), join(|s| &s.replay));
    let args = [
        "--engine-endpoint",
        publish.as_str(),
        "--replay-endpoint",
        replay.as_str(),
        "--worker-id",
        "1",
        "--worker-name",
        "vllm-mock-1",
        // The block size and KV capacity come from the engine's /metrics page.
        "--engine-url",
        url,
    ];
    RelayConfig::from_args(&cluster.flags::<RelayArgs>(&args)).unwrap()
}

/// A relay (with its own metrics registry) for the first worker of `engines`; also
/// returns that worker's HTTP URL.
async fn start_relay(cluster: &TestCluster, engines: &EnginesHandle) -> (Relay, String) {
    let url = engines.http_urls()[0].clone();
    let sockets = engines.zmq_endpoints()[0].clone();
    let registry = prometheus::Registry::new();
    let relay = Relay::start(relay_config(cluster, &sockets, &url), &registry)
        .await
        .unwrap();
    (relay, url)
}

/// Stops `relay`, then `engines`.
async fn stop(relay: Relay, engines: EnginesHandle) {
    relay.shutdown().await.unwrap();
    engines.shutdown();
    engines.wait().await.unwrap();
}

/// A request served before any relay runs reaches the router through the replay
/// socket once a relay connects; a request served afterwards arrives live; the
/// repeated prompt routes to the worker with full overlap; the worker is registered
/// by the relay (with its URL and the engine's context length), not by the engines.
#[tokio::test]
async fn vllm_mode_engines_reach_the_router_through_the_relay_alone() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let engines = vllm_engines(&cluster, 64, 2, CpuTierConfig::default(), Some(1000)).await;
    let url = engines.http_urls()[0].clone();
    let sockets = engines.zmq_endpoints()[0].clone();
    assert_eq!(sockets.len(), 2, "one PUB and one replay socket per rank");
    let http = kv_cluster::http::client().expect("http client");

    // Before any relay: rank 0 caches prompt A (3 full blocks). Nobody is
    // subscribed, so the batch lives only in rank 0's replay buffer.
    let a: Vec<u32> = (1000..1050).collect();
    assert_eq!(complete(&http, &url, &a, 0).await, 0);
    assert!(
        daemon.state().scheduler().workers().next().is_none(),
        "vllm-mode engines register nothing"
    );

    let registry = prometheus::Registry::new();
    let relay = Relay::start(relay_config(&cluster, &sockets, &url), &registry)
        .await
        .unwrap();
    wait_overlap(&daemon, "prompt A replayed at connect", &a, 0, 3).await;
    eventually("both sockets read at connect", WAIT, || async {
        let c = relay.counters();
        (c.connect_replays("complete") + c.connect_replays("empty") == 2).then_some(())
    })
    .await
    .unwrap();
    let registered = daemon
        .state()
        .scheduler()
        .workers()
        .find(|w| w.worker_id == WORKER)
        .map(|w| (w.dp_size, w.url.clone(), w.block_size, w.total_kv_blocks));
    // The block size and capacity are the engine's, read from its /metrics page.
    assert_eq!(registered, Some((2, Some(url.clone()), BLOCK, 64)));
    // Its context length too, from its /v1/models, in the record in etcd (for the
    // gateway's prompt bound).
    let key = cluster.subjects.etcd_worker_key(WORKER);
    eventually(
        "the registration in etcd to carry max_model_len",
        WAIT,
        || async {
            let mut etcd = cluster.etcd.clone();
            let got = etcd.get(key.as_str(), None).await.ok()?;
            let record: WorkerRegistration =
                serde_json::from_slice(got.kvs().first()?.value()).ok()?;
            (record.max_model_len == Some(1000)).then_some(())
        },
    )
    .await
    .unwrap();

    // Live: rank 1 caches prompt B; its data_parallel_rank puts it on rank 1.
    let b: Vec<u32> = (5000..5064).collect();
    assert_eq!(complete(&http, &url, &b, 1).await, 0);
    wait_overlap(&daemon, "prompt B live on rank 1", &b, 1, 4).await;
    assert_eq!(
        overlap(&daemon, &compute_block_hashes(&b, BLOCK), 0).await,
        0
    );

    // The prompt continued routes with its full overlap, and the engine serves it from
    // its prefix cache.
    let b = integration_tests::continued(&b);
    let reply = cluster.route_tokens("repeat-b", b.clone()).await.unwrap();
    let RouteReply::Routed(routed) = reply else {
        panic!("not routed: {reply:?}")
    };
    assert_eq!(routed.worker_id, WORKER);
    assert_eq!(
        routed.dp_rank,
        DpRank(1),
        "prompt B is cached on rank 1 only"
    );
    assert_eq!(routed.overlap_blocks, 4, "full overlap");
    assert_eq!(complete(&http, &url, &b, 1).await, 4 * u64::from(BLOCK));

    stop(relay, engines).await;
    daemon.shutdown().await.unwrap();
}

/// With a CPU tier, the blocks an engine offloads reach the router through the relay
/// as CPU-tier holders (`medium: "CPU"`, with their tokens), and the blocks it loads
/// back come back as GPU holders.
#[tokio::test]
async fn vllm_mode_cpu_tier_blocks_reach_the_router_as_a_lower_tier() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let cpu_tier = CpuTierConfig {
        cpu_tier_blocks: 32,
        ..CpuTierConfig::default()
    };
    let engines = vllm_engines(&cluster, 8, 1, cpu_tier, None).await;
    let (relay, url) = start_relay(&cluster, &engines).await;
    let http = kv_cluster::http::client().expect("http client");

    let a: Vec<u32> = (1000..1050).collect();
    let a_hashes = compute_block_hashes(&a, BLOCK);
    assert_eq!(complete(&http, &url, &a, 0).await, 0);
    wait_overlap(&daemon, "prompt A on the GPU", &a, 0, 3).await;
    // B's footprint (ceil((112 + 2) / 16) = 8 blocks) is the whole GPU: A's three
    // blocks are offloaded to the CPU tier.
    let b: Vec<u32> = (5000..5112).collect();
    assert_eq!(complete(&http, &url, &b, 0).await, 0);
    let rank = WorkerRank::new(WORKER, DpRank(0));
    eventually("prompt A held on the CPU tier only", WAIT, || async {
        let scores = scores(&daemon, &a_hashes).await;
        (scores.get(rank) == 0 && scores.get_any_tier(rank) == 3).then_some(())
    })
    .await
    .unwrap();
    // A again: loaded back from the CPU tier (reported as cached), GPU-held again.
    assert_eq!(complete(&http, &url, &a, 0).await, 3 * u64::from(BLOCK));
    wait_overlap(&daemon, "prompt A back on the GPU", &a, 0, 3).await;

    stop(relay, engines).await;
    daemon.shutdown().await.unwrap();
}

/// `kv-mocker replay`'s cold start clears a vLLM-mode engine over HTTP and returns only
/// once the router's picture of it is empty, on every rank: the engine, like vLLM,
/// publishes `AllBlocksCleared` only with its next step, so the cold start waits for
/// the event and makes the engine step. Without vLLM's dev mode the reset endpoint is
/// 404, and the cold start says how to turn it on.
#[tokio::test]
async fn the_cold_start_empties_the_routers_picture_of_a_vllm_engine() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let dev = EngineHttpArgs {
        vllm_dev_mode: true,
        ..EngineHttpArgs::default()
    };
    let engines = vllm_engines_with(&cluster, 64, 2, CpuTierConfig::default(), dev).await;
    let (relay, url) = start_relay(&cluster, &engines).await;
    let http = kv_cluster::http::client().expect("http client");
    let (a, b): (Vec<u32>, Vec<u32>) = ((1000..1050).collect(), (5000..5064).collect());
    complete(&http, &url, &a, 0).await;
    complete(&http, &url, &b, 1).await;
    wait_overlap(&daemon, "prompt A on rank 0", &a, 0, 3).await;
    wait_overlap(&daemon, "prompt B on rank 1", &b, 1, 4).await;

    let target = ReplayTarget {
        nats: cluster.nats.clone(),
        etcd: cluster.etcd.clone(),
        subjects: cluster.subjects.clone(),
    };
    let cleared = cold::clear_all(&target).await.unwrap();
    assert_eq!(cleared.len(), 1);
    // The cold start returns once every rank's `Cleared` is on the events subject; the
    // router reads that subject on its own subscription, so it applies them moments
    // later, not necessarily before clear_all returns. No request runs before these
    // waits, so only the cold start's own wait and nudge can make them pass.
    wait_overlap(&daemon, "rank 0 cleared", &a, 0, 0).await;
    wait_overlap(&daemon, "rank 1 cleared", &b, 1, 0).await;
    assert_eq!(
        complete(&http, &url, &a, 0).await,
        0,
        "the engine dropped it"
    );

    stop(relay, engines).await;

    // The same engine without dev mode: the reset is 404, and the error says why.
    let engines = vllm_engines(&cluster, 64, 1, CpuTierConfig::default(), None).await;
    let (relay, url) = start_relay(&cluster, &engines).await;
    eventually("the worker registered again", WAIT, || async {
        cold::list_workers(&target)
            .await
            .ok()
            .filter(|w| w.iter().any(|r| r.url.as_deref() == Some(url.as_str())))
    })
    .await
    .unwrap();
    let err = cold::clear_all(&target).await.unwrap_err().to_string();
    assert!(err.contains("VLLM_SERVER_DEV_MODE=1"), "{err}");
    stop(relay, engines).await;
    daemon.shutdown().await.unwrap();
}
