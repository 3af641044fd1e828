//! Mock engines in the prefill and decode roles, registered with their roles, in a
//! real cluster: nats-server, etcd and the router daemon's index. With vLLM's
//! protocol behind `kv-router relay` (engines in vLLM mode, as a real vLLM pair
//! with NixlConnector is run), and with SGLang's in the engines' own NATS mode. In
//! both, the prefill and the decode worker publish the prompt's blocks, so the
//! router indexes the prompt on both, as issue 27 saw real vLLM do.

// Test helpers unwrap: a broken socket or server must fail the test loudly.
#![allow(clippy::unwrap_used)]

use engine_model::EngineModelConfig;
use integration_tests::{TestCluster, eventually, wait_for_overlap};
use kv_cluster::args::{DisaggregationArgs, RoleFlag, TransferFlag};
use kv_events::disaggregation::{KvTransfer, TransferProtocol, WorkerRole};
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, WorkerId, WorkerRank, compute_block_hashes};
use kv_relay::{Relay, RelayArgs, RelayConfig};
use mocker::engine::{EngineArgs, EngineDisaggregationArgs, EngineHttpArgs, EnginesHandle};
use mocker::engine::{FleetArgs, KvEventsArgs};
use router_daemon::Daemon;
use serde_json::{Value, json};
use std::time::Duration;

const BLOCK: u32 = 16;
const WAIT: Duration = Duration::from_secs(20);

/// The flags of worker `id`: one rank of 256 blocks, 50× real time, in `role`.
fn engine_args(cluster: &TestCluster, id: u64, role: DisaggregationArgs) -> EngineArgs {
    let model = EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks: 256,
        ..EngineModelConfig::default()
    };
    let mut args = cluster.engine_args(1, model, 50.0, EngineHttpArgs::default());
    args.fleet = FleetArgs {
        workers: 1,
        first_worker_id: id,
        dp_size: 1,
    };
    args.disaggregation = EngineDisaggregationArgs {
        placement: role,
        ..EngineDisaggregationArgs::default()
    };
    args
}

fn role(role: RoleFlag, protocol: TransferFlag, bootstrap_port: Option<u16>) -> DisaggregationArgs {
    DisaggregationArgs {
        role,
        kv_transfer: Some(protocol),
        bootstrap_port,
    }
}

/// Worker `id`'s registration in etcd, once it is there.
async fn registration(cluster: &TestCluster, id: u64) -> WorkerRegistration {
    let key = cluster.subjects.etcd_worker_key(WorkerId(id));
    eventually("the worker to register", WAIT, || async {
        let mut etcd = cluster.etcd.clone();
        let got = etcd.get(key.as_str(), None).await.ok()?;
        serde_json::from_slice(got.kvs().first()?.value()).ok()
    })
    .await
    .unwrap()
}

/// Waits until the daemon's index holds `blocks` blocks of `tokens` on worker `id`.
async fn indexed(daemon: &Daemon, id: u64, tokens: &[u32], blocks: u32) {
    let hashes = compute_block_hashes(tokens, BLOCK);
    let rank = WorkerRank::new(WorkerId(id), DpRank(0));
    wait_for_overlap(daemon, &hashes, rank, blocks)
        .await
        .unwrap();
}

async fn post(http: &reqwest::Client, engine: &EnginesHandle, body: &Value) -> Value {
    let url = format!("{}/v1/completions", engine.http_urls()[0]);
    let response = http.post(url).json(body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// The external prefix-cache hits on `engine`'s `/metrics`, in tokens.
async fn external_hits(http: &reqwest::Client, engine: &EnginesHandle) -> Option<f64> {
    let url = format!("{}/metrics", engine.http_urls()[0]);
    let page = http.get(url).send().await.unwrap().text().await.unwrap();
    kv_cluster::http::exposition::samples(&page)
        .find(|s| {
            s.name == "vllm:external_prefix_cache_hits_total" && s.label("engine") == Some("0")
        })
        .map(|s| s.value)
}

/// A relay for worker `id` of `engines` (vLLM mode), registering `role`.
async fn relay(cluster: &TestCluster, engines: &EnginesHandle, id: u64, role: &[&str]) -> Relay {
    let sockets = &engines.zmq_endpoints()[0][0];
    let (worker_id, name) = (id.to_string(), format!("engine-{id}"));
    let mut args = vec![
        "--engine-endpoint",
        sockets.publish.as_str(),
        "--replay-endpoint",
        sockets.replay.as_str(),
        "--worker-id",
        worker_id.as_str(),
        "--worker-name",
        name.as_str(),
        "--engine-url",
        engines.http_urls()[0].as_str(),
    ];
    args.extend(role);
    let config = RelayConfig::from_args(&cluster.flags::<RelayArgs>(&args)).unwrap();
    Relay::start(config, &prometheus::Registry::new())
        .await
        .unwrap()
}

/// vLLM's protocol, as its proxy runs it, on engines behind relays: the relays
/// register the roles; the prefill engine's answer carries the parameters; the
/// decode engine loads the prompt with them (counting its tokens as external hits)
/// and publishes the pulled blocks, so the router indexes the prompt on both.
#[tokio::test]
async fn vllm_prefill_and_decode_behind_relays_are_registered_and_indexed_on_both() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let mut engines = Vec::new();
    let mut relays = Vec::new();
    for (id, flag, name) in [
        (1, RoleFlag::Prefill, "prefill"),
        (2, RoleFlag::Decode, "decode"),
    ] {
        let mut args = engine_args(&cluster, id, role(flag, TransferFlag::Vllm, None));
        args.kv_events = KvEventsArgs::vllm_on_free_ports();
        let handle = mocker::engine::spawn_engines(args, Default::default())
            .await
            .unwrap();
        let flags = ["--role", name, "--kv-transfer", "vllm"];
        relays.push(relay(&cluster, &handle, id, &flags).await);
        engines.push(handle);
    }
    let (prefill, decode) = (&engines[0], &engines[1]);
    let vllm = Some(KvTransfer {
        protocol: TransferProtocol::Vllm,
        bootstrap_port: None,
    });
    for (id, role) in [(1, WorkerRole::Prefill), (2, WorkerRole::Decode)] {
        let reg = registration(&cluster, id).await;
        assert_eq!((reg.role, reg.kv_transfer), (role, vllm), "worker {id}");
    }

    let http = kv_cluster::http::client().unwrap();
    let tokens: Vec<u32> = (3000..3100).collect();
    let to_prefill = json!({"prompt": tokens, "max_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
    let answer = post(&http, prefill, &to_prefill).await;
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{answer}");
    indexed(&daemon, 1, &tokens, 6).await;

    let to_decode = json!({"prompt": tokens, "max_tokens": 8, "kv_transfer_params": params});
    let answer = post(&http, decode, &to_decode).await;
    assert_eq!(answer["usage"]["completion_tokens"], 8);
    indexed(&daemon, 2, &tokens, 6).await;
    assert_eq!(external_hits(&http, decode).await, Some(100.0));
    assert_eq!(external_hits(&http, prefill).await, Some(0.0));

    for relay in relays {
        relay.shutdown().await.unwrap();
    }
    for engines in engines {
        engines.shutdown();
        engines.wait().await.unwrap();
    }
}

/// SGLang's protocol on engines in their own NATS mode, which register their roles
/// (the prefill worker with its bootstrap port): both halves sent at once, the
/// decode waits for the room, and both workers' blocks reach the router.
#[tokio::test]
async fn sglang_engines_register_their_roles_and_pair_through_the_bootstrap_room() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let port = testbed::free_port().unwrap();
    let prefill_role = role(RoleFlag::Prefill, TransferFlag::Sglang, Some(port));
    let prefill = engine_args(&cluster, 1, prefill_role);
    let decode = engine_args(
        &cluster,
        2,
        role(RoleFlag::Decode, TransferFlag::Sglang, None),
    );
    let prefill = mocker::engine::spawn_engines(prefill, Default::default())
        .await
        .unwrap();
    let decode = mocker::engine::spawn_engines(decode, Default::default())
        .await
        .unwrap();
    let reg = registration(&cluster, 1).await;
    assert_eq!(reg.role, WorkerRole::Prefill);
    let sglang = |bootstrap_port| {
        Some(KvTransfer {
            protocol: TransferProtocol::Sglang,
            bootstrap_port,
        })
    };
    assert_eq!(reg.kv_transfer, sglang(Some(port)));
    let reg = registration(&cluster, 2).await;
    assert_eq!(
        (reg.role, reg.kv_transfer),
        (WorkerRole::Decode, sglang(None))
    );

    let http = kv_cluster::http::client().unwrap();
    let tokens: Vec<u32> = (7000..7070).collect();
    let body = json!({"prompt": tokens, "max_tokens": 5, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port, "bootstrap_room": 4_611_686_018_427_387_904_u64});
    let (decoded, prefilled) =
        tokio::join!(post(&http, &decode, &body), post(&http, &prefill, &body));
    assert_eq!(decoded["usage"]["completion_tokens"], 5);
    assert_eq!(prefilled["usage"]["completion_tokens"], 1);
    indexed(&daemon, 1, &tokens, 4).await;
    indexed(&daemon, 2, &tokens, 4).await;
    assert_eq!(external_hits(&http, &decode).await, Some(70.0));

    for engines in [prefill, decode] {
        engines.shutdown();
        engines.wait().await.unwrap();
    }
}
