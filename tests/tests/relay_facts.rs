//! `kv-router relay` learns what the engine publishes (issue 16): the block size and
//! KV capacity from its metrics page or its first stored event, and (issue 24) its
//! context length from `/v1/models` without ever waiting on it, against real
//! nats-server and etcd and the router daemon in-process, beside the fake engine of
//! `relay.rs`.

// Test helpers unwrap: a broken fixture or socket must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "relay/engine.rs"]
#[allow(dead_code)]
mod engine;
#[path = "relay/helpers.rs"]
#[allow(dead_code)]
mod helpers;

use engine::{FakeEngine, ReplayFraming, payloads, serve_page};
use helpers::*;
use integration_tests::{TestCluster, eventually};
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, WorkerRank, compute_block_hashes};
use kv_relay::Relay;
use router_daemon::Daemon;
use router_daemon::counters::{MessageKind, Outcome};

/// A fake engine with its page, and a relay for it (reading the page every 100 ms,
/// and given the page server as `--engine-url` if `engine_url`), once the router has
/// its registration.
async fn registered_relay(
    cluster: &TestCluster,
    daemon: &Daemon,
    engine_url: bool,
) -> (FakeEngine, Relay, WorkerRegistration) {
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    let base = engine.metrics_url.trim_end_matches("/metrics").to_owned();
    let mut flags = vec!["--metrics-interval-ms", "100"];
    if engine_url {
        flags.extend(["--engine-url", base.as_str()]);
    }
    let relay = Relay::start(
        relay_config(cluster, &engine, &flags),
        &prometheus::Registry::new(),
    )
    .await
    .unwrap();
    engine.wait_subscribed().await;
    wait_registered(daemon, WORKER, true).await;
    (engine, relay, registration(daemon).unwrap())
}

/// Issue 16: no operator flag holds a number the engine publishes. The relay reads
/// the block size and the KV capacity from the engine's metrics page before it
/// registers; without a page it learns the block size from the first stored event
/// (and registers only then); a page stating another block size than the router's is
/// refused by the router, naming both values, and the engine's events of another size
/// than the page's are refused by the relay.
#[tokio::test]
async fn the_block_size_and_capacity_come_from_the_engine() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let frames = payloads("vllm_zmq_frames_topic_kv-events.json");
    let a = compute_block_hashes(&prompt_a(), BLOCK);

    // From the page, before any event.
    let (engine, relay, reg) = registered_relay(&cluster, &daemon, false).await;
    assert_eq!((reg.block_size, reg.total_kv_blocks), (BLOCK, 1000));
    assert_eq!(relay.facts().block_size, Some(BLOCK));
    relay.shutdown().await.unwrap();
    wait_registered(&daemon, WORKER, false).await;
    engine.stop();

    // Without a page: from the first stored event, and only then registered.
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    let flags = engine.relay_flags_without_page();
    let relay = Relay::start(
        config_from(&cluster, flags, &[]),
        &prometheus::Registry::new(),
    )
    .await
    .unwrap();
    engine.wait_subscribed().await;
    wait_connect_replay(&relay, "empty").await;
    assert_eq!(relay.facts().block_size, None);
    assert!(
        registration(&daemon).is_none(),
        "no block size, no registration"
    );
    engine.publish(0, &frames[0]).await;
    wait_registered(&daemon, WORKER, true).await;
    let reg = registration(&daemon).unwrap();
    assert_eq!((reg.block_size, reg.total_kv_blocks), (BLOCK, 0));
    wait_overlap(&daemon, "prompt A indexed", &a, 0, 3).await;
    relay.shutdown().await.unwrap();
    wait_registered(&daemon, WORKER, false).await;
    engine.stop();

    // A page saying 32 tokens: the router (16) refuses the registration, and the
    // relay refuses the engine's 16-token events.
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    let (url, page) = serve_page(
        "vllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"500\"} 1.0\n"
            .to_owned(),
    )
    .await;
    let flags = engine.relay_flags_without_page();
    let relay = Relay::start(
        config_from(&cluster, flags, &["--metrics-url", url.as_str()]),
        &prometheus::Registry::new(),
    )
    .await
    .unwrap();
    engine.wait_subscribed().await;
    let counters = &daemon.state().counters;
    eventually("the 32-token registration rejected", WAIT, || async {
        (counters.messages(MessageKind::Registration, Outcome::Rejected) == 1).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(relay.facts().block_size, Some(32));
    engine.publish(0, &frames[0]).await;
    eventually("the 16-token event refused", WAIT, || async {
        (relay.counters().events("stored", "bad_blocks") == 1).then_some(())
    })
    .await
    .unwrap();
    assert!(registration(&daemon).is_none());
    relay.shutdown().await.unwrap();
    page.abort();
    engine.stop();
    daemon.shutdown().await.unwrap();
}

/// The engine's context length is read from `/v1/models` at `--engine-url`, but an
/// engine whose answer there is unusable (here its Prometheus text, no model list) is
/// registered all the same, without one, and asked again every scrape period: the
/// read never holds the registration back.
#[tokio::test]
async fn an_unreadable_context_length_does_not_hold_the_registration_back() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    // The engine's page server answers its page on every path, /v1/models included.
    let (engine, relay, reg) = registered_relay(&cluster, &daemon, true).await;
    assert_eq!(
        (reg.block_size, reg.total_kv_blocks, reg.max_model_len),
        (BLOCK, 1000, None)
    );
    eventually("the read retried every period", WAIT, || async {
        (relay.counters().scrapes("models_failed") >= 3).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(relay.counters().scrapes("models_ok"), 0);
    assert_eq!(relay.facts().max_model_len, None);
    relay.shutdown().await.unwrap();
    engine.stop();
    daemon.shutdown().await.unwrap();
}

/// Issue 25, finding 6: a vLLM started with `--data-parallel-size 2` states its two
/// engine cores' total `num_gpu_blocks` (here 512) under both engine labels of
/// `vllm:cache_config_info`. The worker registers each rank's capacity (256), and
/// each rank's scraped KV usage is scaled by it.
#[tokio::test]
async fn a_data_parallel_vllm_registers_each_ranks_capacity() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    // The page of the real vLLM CPU server of the issue, 16-token blocks here.
    let dp_page = "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",\
                   gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"512\",num_gpu_blocks_override=\"None\"} 1.0\n\
                   vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"1\",\
                   gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"512\",num_gpu_blocks_override=\"None\"} 1.0\n\
                   vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
                   vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n";
    let (url, page) = serve_page(dp_page.to_owned()).await;
    let flags = engine.relay_flags_without_page();
    let extra = [
        "--metrics-url",
        url.as_str(),
        "--metrics-interval-ms",
        "100",
        "--dp-size",
        "2",
        "--shared-endpoint",
    ];
    let (relay, reg) = registered_with(&cluster, &daemon, &mut engine, flags, &extra).await;
    assert_eq!(
        (reg.dp_size, reg.block_size, reg.total_kv_blocks),
        (2, BLOCK, 256)
    );
    assert_eq!(relay.facts().kv_blocks, Some(256));
    for (rank, used) in [(0, 64), (1, 128)] {
        let load = eventually("rank's scraped load", WAIT, || async {
            let scheduler = daemon.state().scheduler();
            scheduler
                .load_metrics(WorkerRank::new(WORKER, DpRank(rank)))
                .copied()
        })
        .await
        .unwrap();
        assert_eq!((load.kv_used_blocks, load.kv_total_blocks), (used, 256));
    }
    relay.shutdown().await.unwrap();
    page.abort();
    engine.stop();
    daemon.shutdown().await.unwrap();
}
