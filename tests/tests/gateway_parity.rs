//! The gateway's cache-parity monitor end to end: real nats-server, etcd, router
//! daemon, mock engines (and a relay) and gateway. A healthy fleet agrees on every
//! answer the official `openai` client gets; each broken deployment the field
//! reports — a block size other than the engine's, a worker whose KV events never
//! reach the router, engine hashes that never match the router's, a tokenizer that
//! differs from the engine's — is flagged, with its likely cause, within 10 requests.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;

use engine_model::EngineModelConfig;
use fixture::{BLOCK, MODEL, Stack};
use integration_tests::{TestCluster, eventually};
use kv_cluster::http::exposition::samples;
use kv_relay::{Relay, RelayArgs, RelayConfig};
use mocker::engine::http::faults::FaultArgs;
use mocker::engine::{EngineHttpArgs, EnginesHandle, KvEventsArgs};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(15);

/// The sum of `name`'s samples whose labels include `label` (`k="v"`), over workers.
fn total(page: &str, name: &str, label: &str) -> f64 {
    samples(page)
        .filter(|s| s.name == name && s.labels.contains(label))
        .map(|s| s.value)
        .sum()
}

/// The causes `worker` is flagged with on the gateway's `/metrics` page.
fn flagged(page: &str, worker: u64) -> Vec<String> {
    samples(page)
        .filter(|s| s.name == "kv_gateway_cache_parity_mismatch" && s.value == 1.0)
        .filter(|s| s.label("worker") == Some(&worker.to_string()))
        .filter_map(|s| Some(s.label("cause")?.to_owned()))
        .collect()
}

/// The mock engines' model: [`BLOCK`]-token blocks, room for every test prompt.
fn model() -> EngineModelConfig {
    EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks: 1024,
        max_num_seqs: 16,
        max_num_batched_tokens: 2048,
    }
}

fn http_args(model_dir: &Path, faults: FaultArgs) -> EngineHttpArgs {
    EngineHttpArgs {
        model_dir: Some(model_dir.to_owned()),
        served_model_name: MODEL.into(),
        faults,
        ..EngineHttpArgs::default()
    }
}

/// One NATS-mode mock worker (id 1) with `http`, the daemon and a gateway with
/// `gateway_flags`, on a fresh cluster whose daemon pins `daemon_block` tokens a block.
async fn one_worker(daemon_block: u32, http: EngineHttpArgs, gateway_flags: &[&str]) -> Stack {
    let cluster = TestCluster::start(daemon_block).await.unwrap();
    let engines = cluster.spawn_engines(1, model(), 10.0, http).await.unwrap();
    Stack::assemble(cluster, engines, |_| {}, gateway_flags).await
}

/// Sends completions `body(i)` for i = 1..=10, one at a time, until worker 1 is
/// flagged; returns the request that flagged it and the causes.
async fn flagged_within_ten(stack: &Stack, body: impl Fn(usize) -> Value) -> (usize, Vec<String>) {
    for i in 1..=10 {
        let response = stack.post("/v1/completions", body(i).to_string()).await;
        assert_eq!(response.status(), 200, "request {i}");
        let page = stack.metrics().await;
        let causes = flagged(&page, 1);
        if !causes.is_empty() {
            return (i, causes);
        }
    }
    panic!("not flagged after 10 requests:\n{}", stack.metrics().await);
}

/// Three full blocks and 5 tokens: a repeat finds 48 tokens cached.
fn prompt() -> Vec<u32> {
    (500..500 + 3 * BLOCK + 5).collect()
}

fn token_body(_: usize) -> Value {
    json!({"model": MODEL, "prompt": prompt(), "max_tokens": 2})
}

#[tokio::test]
async fn a_healthy_fleet_agrees_on_every_answer_the_openai_client_gets() {
    let stack = Stack::start(2, 1.0, |_| {}, &[]).await;
    let (python, script) = fixture::openai_python("parity_client.py").await;
    let block = BLOCK.to_string();
    let seen =
        integration_tests::python::run_json(&python, &script, &[&stack.base, MODEL, &block]).await;
    let cached: Vec<u64> = (seen["cached"].as_array().unwrap().iter())
        .map(|c| c.as_u64().unwrap())
        .collect();
    // Repeats, shared prefixes and chats sharing a system prompt hit the cache.
    assert!(cached.iter().filter(|&&c| c > 0).count() >= 8, "{seen}");
    assert_eq!(seen["usage_unasked"], 0, "{seen}");

    let page = stack.metrics().await;
    let count = |outcome: &str| {
        total(
            &page,
            "kv_gateway_cache_parity_total",
            &format!(r#"outcome="{outcome}""#),
        )
    };
    let requests = seen["requests"].as_f64().unwrap();
    assert_eq!(
        count("agree"),
        requests,
        "every answer judged and agreed:\n{page}"
    );
    assert_eq!(
        count("over_claim") + count("under_claim") + count("unreported"),
        0.0
    );
    let diffs = total(
        &page,
        "kv_gateway_cache_parity_diff_tokens_count",
        "worker=",
    );
    assert_eq!(diffs, requests);
    assert!(
        !page.contains("kv_gateway_cache_parity_mismatch{"),
        "{page}"
    );
    stack.stop().await;
}

/// The worker registers 32 tokens a block (the router pins 32) while its engine
/// caches 16-token blocks: the router's hashes never match, and the engine's hits
/// are not whole registered blocks.
#[tokio::test]
async fn a_block_size_other_than_the_engines_is_flagged() {
    let faults = FaultArgs {
        registered_block_size: Some(32),
        ..FaultArgs::default()
    };
    let stack = one_worker(32, http_args(&fixture::model_dir(), faults), &[]).await;
    let (at, causes) = flagged_within_ten(&stack, token_body).await;
    assert_eq!(causes, ["block_size_mismatch"], "at request {at}");
    stack.stop().await;
}

/// The engine hashes its blocks with another seed: its events reach the router and
/// never match.
#[tokio::test]
async fn engine_hashes_that_never_match_the_routers_are_flagged() {
    let faults = FaultArgs {
        block_hash_salt: Some(0x5eed),
        ..FaultArgs::default()
    };
    let stack = one_worker(BLOCK, http_args(&fixture::model_dir(), faults), &[]).await;
    let (at, causes) = flagged_within_ten(&stack, token_body).await;
    assert_eq!(causes, ["no_matching_events"], "at request {at}");
    // Both sides kept answering: the engine's cache works, the router's picture not.
    let page = stack.metrics().await;
    let under = r#"outcome="under_claim""#;
    assert!(
        total(&page, "kv_gateway_cache_parity_total", under) >= 5.0,
        "{page}"
    );
    stack.stop().await;
}

/// The engine's tokenizer adds no BOS where the gateway's does (a tokenizer.json
/// without its post-processor), and the gateway forwards text: the engine caches
/// other token ids than the ones the router was asked about.
#[tokio::test]
async fn a_tokenizer_that_differs_from_the_engines_is_flagged() {
    let dir = tempfile::tempdir().unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture::model_dir().join(file), dir.path().join(file)).unwrap();
    }
    let path = dir.path().join("tokenizer.json");
    let mut tokenizer: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    tokenizer["post_processor"] = Value::Null;
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let http = http_args(dir.path(), FaultArgs::default());
    let stack = one_worker(BLOCK, http, &["--forward", "text"]).await;
    let text = (0..40)
        .map(|i| format!("word{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let body = |_| json!({"model": MODEL, "prompt": text, "max_tokens": 2});
    let (at, causes) = flagged_within_ten(&stack, body).await;
    assert_eq!(causes, ["tokenizer_mismatch"], "at request {at}");
    stack.stop().await;
}

/// A vLLM-mode engine behind a relay subscribed to another topic than the engine
/// publishes on: the worker is registered (the relay's sockets are connected) and
/// its KV events never reach the router.
#[tokio::test]
async fn a_registered_worker_whose_events_never_arrive_is_flagged() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let mut args = cluster.engine_args(
        1,
        model(),
        10.0,
        http_args(&fixture::model_dir(), FaultArgs::default()),
    );
    args.kv_events = KvEventsArgs::vllm_on_free_ports();
    let engines = mocker::engine::spawn_engines(args, Default::default())
        .await
        .unwrap();
    let relay = relay(&cluster, &engines).await;
    let stack = Stack::assemble(cluster, engines, |_| {}, &[]).await;
    let (at, causes) = flagged_within_ten(&stack, token_body).await;
    assert_eq!(causes, ["no_matching_events"], "at request {at}");
    relay.shutdown().await.unwrap();
    stack.stop().await;
}

/// A relay for worker 1 of `engines`, subscribed to topic `kv-events` while the engine
/// publishes with an empty topic; returns once the worker is registered.
async fn relay(cluster: &TestCluster, engines: &EnginesHandle) -> Relay {
    let url = engines.http_urls()[0].clone();
    let sockets = &engines.zmq_endpoints()[0];
    let flags = [
        "--engine-endpoint",
        &sockets[0].publish,
        "--replay-endpoint",
        &sockets[0].replay,
        "--topic",
        "kv-events",
        "--worker-id",
        "1",
        "--worker-name",
        "silent-1",
        "--engine-url",
        &url,
    ];
    let config = RelayConfig::from_args(&cluster.flags::<RelayArgs>(&flags)).unwrap();
    let relay = Relay::start(config, &prometheus::Registry::new())
        .await
        .unwrap();
    let key = cluster.subjects.etcd_worker_key(kv_events::WorkerId(1));
    eventually("the relay to register the worker", WAIT, || async {
        let mut etcd = cluster.etcd.clone();
        let got = etcd.get(key.as_str(), None).await.ok()?;
        (!got.kvs().is_empty()).then_some(())
    })
    .await
    .unwrap();
    relay
}
